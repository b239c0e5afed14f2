"""Prompts to token ids, with the served model's tokenizer.

A chat is rendered by the tokenizer's chat template with the assistant's generation prompt,
exactly as ``core.data`` renders the prompt part of a training conversation, so a fine-tuned
adapter sees at serving time the format it was trained on."""

from __future__ import annotations

from collections.abc import Sequence

from deltaserve.core.tokenizer import Tokenizer
from deltaserve.server.errors import APIError
from deltaserve.server.schemas_inference import ChatMessage


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    out = tokenizer(text, add_special_tokens=False)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def _non_empty(ids: list[int], param: str) -> list[int]:
    if not ids:
        raise APIError(400, "the prompt is empty", param=param, code="invalid_value")
    return ids


def completion_prompt_ids(tokenizer: Tokenizer,
                          prompt: str | list[str] | list[int] | list[list[int]]) -> list[int]:
    """One prompt per request: a string or a token list (or a list holding one of them)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(400, f"{len(prompt)} prompts: this server takes one per request",
                           param="prompt", code="invalid_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _non_empty(_encode(tokenizer, prompt), "prompt")
    return _non_empty([int(t) for t in prompt], "prompt")


def chat_prompt_ids(tokenizer: Tokenizer, messages: Sequence[ChatMessage]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions",
                       param="messages", code="no_chat_template")
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
             for m in messages]
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return _non_empty(_encode(tokenizer, text), "messages")
