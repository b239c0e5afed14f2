"""Shared fixtures. ``shared_data`` is the project's read-only real data:
``$DELTASERVE_SHARED_DATA``, else ``../shared/data`` beside the checkout, else the workplace's
``/work/shared/data`` (so a clone made elsewhere still finds it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The SGLang session's host (process-global), registered once for every directory that uses it
pytest_plugins = ("tests.hosts.sglang.session",)

_CANDIDATES = [Path(p) for p in (os.environ.get("DELTASERVE_SHARED_DATA"),) if p] + [
    Path(__file__).resolve().parents[1].parent / "shared" / "data",
    Path("/work/shared/data"),
]
SHARED_DATA = next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[0])

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found (looked in {', '.join(map(str, _CANDIDATES))})")
    return SHARED_DATA


def make_word_tokenizer(words: list[str], chat_template: str | None = CHATML):
    """A whitespace word-level tokenizer with ChatML specials: an independent, tiny stand-in
    for a model's tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials + sorted(set(words)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                                   additional_special_tokens=specials[1:3])
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="session")
def word_tokenizer():
    words = ("user assistant system Add two numbers . 2 3 5 Say hi hello there reverse abc cba "
             "What is ? ### User: Response: Instruction").split()
    return make_word_tokenizer(words)
