"""What DeltaServe uses of a tokenizer (a Hugging Face tokenizer satisfies it), so the core
needs neither transformers nor torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Tokenizer(Protocol):
    chat_template: str | None
    eos_token: str | None
    eos_token_id: int | None

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any:
        """``tokenize=False`` gives the rendered text (the only use here)."""
        ...

    def __call__(self, text: str, **kwargs: Any) -> Any:
        """Encodes ``text``; the result maps ``input_ids`` to the token ids."""
        ...

    def decode(self, token_ids: Sequence[int], **kwargs: Any) -> str: ...
