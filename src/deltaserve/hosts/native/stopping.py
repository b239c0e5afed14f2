"""When a request's output ends: EOS, a stop token, a stop string, or its length."""

from __future__ import annotations

from collections.abc import Set

from deltaserve.core.tokenizer import Tokenizer
from deltaserve.hosts.native.request import Request


def finish_reason(req: Request, token: int, eos_token_ids: Set[int], max_model_len: int,
                  tokenizer: Tokenizer | None) -> tuple[str | None, str | None]:
    """``(reason, text)`` after ``token`` was appended: reason ``eos``, ``stop`` or ``length``
    (None: go on); ``text`` is the output cut before a stop string, when one matched."""
    p = req.params
    if not p.ignore_eos and token in eos_token_ids:
        return "eos", None
    if token in p.stop_token_ids:
        return "stop", None
    if p.stop and tokenizer is not None:  # stop strings: decode what we have, look for them
        text = tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        for s in p.stop:
            cut = text.find(s)
            if cut >= 0:
                return "stop", text[:cut]
    if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= max_model_len:
        return "length", None
    return None, None
