"""Fine-tuning data: read Alpaca or chat records, tokenize with the chat template, mask prompts.

Formats:
* Alpaca, as a JSON array or JSONL: ``{"instruction", "input" (optional), "output"}``;
* chat JSONL: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``,
  ending with an assistant turn.

The loss covers assistant tokens only (labels of every other token are ``IGNORE_INDEX``, as in
Hugging Face). The tokenizer is duck-typed (``apply_chat_template``, ``__call__``), so this module
needs no torch. A malformed row raises :class:`InputError` with its line number, or, with
``skip_bad_rows``, is skipped and counted in the :class:`DatasetReport`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from deltaserve.core.errors import InputError, require, require_choice

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]
    line: int  # where the record starts in its file


@dataclass(frozen=True)
class TrainingSample:
    """One tokenized sample. ``labels[i]`` is the target of position i before the causal shift
    (Hugging Face convention): the token itself where it counts for the loss, else -100."""

    sample_id: int
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        """Positions that predict a counted label (labels shifted by one)."""
        return sum(1 for t in self.labels[1:] if t != IGNORE_INDEX)


@dataclass(frozen=True)
class DataConfig:
    """``max_tokens``: longest sample; longer ones are dropped or truncated (``overlength``)."""

    path: str
    format: str = "auto"
    max_tokens: int = 1024
    overlength: str = "drop"
    skip_bad_rows: bool = False
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        require_choice("format", self.format, ("auto", "alpaca", "chat"))
        require_choice("overlength", self.overlength, ("drop", "truncate"))
        require(self.max_tokens >= 2, "max_tokens", self.max_tokens, "must be >= 2")


@dataclass(frozen=True)
class DatasetReport:
    num_rows: int
    num_bad_rows: int
    bad_rows: tuple[int, ...]  # first few: line numbers (JSONL) or record numbers (JSON array)
    num_samples: int
    num_dropped_overlength: int
    num_truncated: int
    num_dropped_no_loss: int
    num_tokens: int


class Tokenizer(Protocol):
    chat_template: Any
    eos_token: Any

    def apply_chat_template(self, conversation: list[dict], **kwargs: Any) -> Any: ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...


# ---- reading ---------------------------------------------------------------------------------
def _iter_json_array(text: str) -> Iterator[tuple[int, int, Any]]:
    """``(line, record, element)`` of a top-level JSON array, keeping each element's line."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    line = text.count("\n", 0, i) + 1
    n = len(text)
    record = 0
    while True:
        while i < n and text[i] in " \t\r\n,":
            line += text[i] == "\n"
            i += 1
        if i >= n:
            raise InputError("json", "<eof>", "the array is not closed", line=line)
        if text[i] == "]":
            return
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise InputError("json", text[i:i + 40], f"not valid JSON: {e.msg}", line=line) from e
        record += 1
        yield line, record, obj
        line += text.count("\n", i, end)
        i = end


def _iter_rows(path: Path) -> Iterator[tuple[int, int | None, Any | InputError]]:
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        yield from _iter_json_array(text)
        return
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            yield lineno, None, json.loads(raw)
        except json.JSONDecodeError as e:
            yield lineno, None, InputError("json", raw[:40], f"not valid JSON: {e.msg}",
                                           line=lineno)


def _to_conversation(obj: Any, fmt: str, line: int, system: str | None) -> Conversation:
    if not isinstance(obj, dict):
        raise InputError("record", obj, "must be a JSON object", line=line)
    if fmt == "auto":
        fmt = "chat" if "messages" in obj else "alpaca"
    msgs: list[Message] = [Message("system", system)] if system else []
    if fmt == "alpaca":
        for key in ("instruction", "output"):
            if not isinstance(obj.get(key), str) or not obj[key].strip():
                raise InputError(key, obj.get(key), "must be a non-empty string", line=line)
        extra = obj.get("input", "")
        if not isinstance(extra, str):
            raise InputError("input", extra, "must be a string", line=line)
        prompt = obj["instruction"] + (f"\n\n{extra}" if extra.strip() else "")
        msgs += [Message("user", prompt), Message("assistant", obj["output"])]
    else:
        raw = obj.get("messages")
        if not isinstance(raw, list) or not raw:
            raise InputError("messages", raw, "must be a non-empty list", line=line)
        for m in raw:
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise InputError("messages.role", m, f"role must be one of {ROLES}", line=line)
            if not isinstance(m.get("content"), str):
                raise InputError("messages.content", m, "content must be a string", line=line)
            msgs.append(Message(m["role"], m["content"]))
        if msgs[-1].role != "assistant":
            raise InputError("messages", msgs[-1].role, "the last turn must be the assistant's",
                             line=line)
    return Conversation(tuple(msgs), line)


def read_conversations(cfg: DataConfig) -> tuple[list[Conversation], list[int]]:
    """All well-formed records, and the line numbers of skipped bad ones."""
    path = Path(cfg.path)
    if not path.is_file():
        raise InputError("dataset", str(path), "no such file")
    good: list[Conversation] = []
    bad: list[int] = []
    for line, record, obj in _iter_rows(path):
        try:
            if isinstance(obj, InputError):
                raise obj
            good.append(_to_conversation(obj, cfg.format, line, cfg.system_prompt))
        except InputError as e:
            if not cfg.skip_bad_rows:
                raise InputError(e.field, e.value, e.reason + " (use skip_bad_rows to skip it)",
                                 line=e.line, record=record) from None
            bad.append(line if record is None else record)
    if not good:
        raise InputError("dataset", str(path), "holds no usable records"
                         + (f" ({len(bad)} bad rows skipped)" if bad else ""))
    return good, bad


# ---- tokenizing ------------------------------------------------------------------------------
def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    out = tokenizer(text, add_special_tokens=False)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def _render(tokenizer: Tokenizer, msgs: Sequence[Message], generation_prompt: bool) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in msgs],
            tokenize=False, add_generation_prompt=generation_prompt)
    # No chat template: the plain Alpaca prompt, responses closed by EOS.
    parts = []
    for m in msgs:
        if m.role == "assistant":
            parts.append(f"### Response:\n{m.content}{tokenizer.eos_token or ''}\n\n")
        else:
            parts.append(f"### {m.role.capitalize()}:\n{m.content}\n\n")
    if generation_prompt:
        parts.append("### Response:\n")
    return "".join(parts)


def tokenize_conversation(tokenizer: Tokenizer, conv: Conversation,
                          ) -> tuple[list[int], list[int]]:
    """Token ids and labels; every assistant turn counts, every other token is masked."""
    ids: list[int] = []
    labels: list[int] = []
    for k, m in enumerate(conv.messages):
        if m.role != "assistant":
            continue
        prompt = _ids(tokenizer, _render(tokenizer, conv.messages[:k], True))
        full = _ids(tokenizer, _render(tokenizer, conv.messages[: k + 1], False))
        if full[: len(prompt)] != prompt or full[: len(ids)] != ids:
            raise InputError("chat_template", "<template>",
                             "rendering a conversation turn by turn does not give a common "
                             "prefix, so prompt tokens cannot be masked", line=conv.line)
        labels += [IGNORE_INDEX] * (len(prompt) - len(ids)) + full[len(prompt):]
        ids = full
    return ids, labels


def tokenize(conversations: Sequence[Conversation], tokenizer: Tokenizer, cfg: DataConfig,
             num_bad_rows: int = 0, bad_rows: Sequence[int] = ()) -> tuple[
                 list[TrainingSample], DatasetReport]:
    samples: list[TrainingSample] = []
    dropped = truncated = no_loss = 0
    for conv in conversations:
        ids, labels = tokenize_conversation(tokenizer, conv)
        if len(ids) > cfg.max_tokens:
            if cfg.overlength == "drop":
                dropped += 1
                continue
            ids, labels = ids[: cfg.max_tokens], labels[: cfg.max_tokens]
            truncated += 1
        if all(t == IGNORE_INDEX for t in labels[1:]):
            no_loss += 1  # nothing to learn: the response was cut away entirely
            continue
        samples.append(TrainingSample(len(samples), tuple(ids), tuple(labels)))
    if not samples:
        raise InputError("dataset", cfg.path,
                         f"no sample fits max_tokens={cfg.max_tokens} "
                         f"({dropped} dropped as too long, {no_loss} with no response tokens)")
    report = DatasetReport(len(conversations) + num_bad_rows, num_bad_rows, tuple(bad_rows[:10]),
                           len(samples), dropped, truncated, no_loss,
                           sum(s.num_tokens for s in samples))
    return samples, report


def load_dataset(cfg: DataConfig, tokenizer: Tokenizer) -> tuple[list[TrainingSample],
                                                                 DatasetReport]:
    """Read, validate and tokenize ``cfg.path``."""
    conversations, bad = read_conversations(cfg)
    return tokenize(conversations, tokenizer, cfg, len(bad), bad)
