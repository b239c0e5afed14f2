"""Request and response bodies of ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/models``, with OpenAI's fields.

Unknown fields are ignored (clients send many), but the options this server does not implement
are named here and refused unless left at their neutral value, so none is silently dropped."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

Role = Literal["system", "developer", "user", "assistant"]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Role
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


# (field, neutral values): refused with a 400 naming the field when set otherwise
_UNSUPPORTED: tuple[tuple[str, tuple], ...] = (
    ("logprobs", (None, False)), ("top_logprobs", (None, 0)), ("logit_bias", (None, {})),
    ("presence_penalty", (None, 0, 0.0)), ("frequency_penalty", (None, 0, 0.0)),
    ("tools", (None, [])), ("response_format", (None, {"type": "text"})),
    ("best_of", (None, 1)), ("echo", (None, False)), ("suffix", (None, "")),
)


class SamplingFields(BaseModel):
    """What both endpoints share. Defaults are OpenAI's (``temperature`` 1, ``top_p`` 1)."""

    model: str
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: object) -> object:
        if isinstance(data, dict):
            for name, neutral in _UNSUPPORTED:
                if name in data and data[name] not in neutral:
                    raise ValueError(f"{name}={data[name]!r} is not supported by this server")
        return data

    @model_validator(mode="after")
    def _one_choice(self) -> SamplingFields:
        if self.n != 1:
            raise ValueError(f"n={self.n}: this server returns one choice per request (n=1)")
        return self

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if (isinstance(v, list) and (len(v) > 4 or not all(v))) or v == "":
            raise ValueError("up to 4 non-empty strings")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # None: the rest of the context
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- responses ------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # a Delta without its unset fields
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "deltaserve"
    root: str | None = None  # the base model an adapter is applied to
    parent: str | None = None  # the fine-tuning job that trained it
