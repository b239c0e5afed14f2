"""The OpenAI inference API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

``model`` is the base model or a fine-tuned model's name; the name is looked up in the server's
model map only (an unknown name is a 404 in OpenAI's format). Streaming answers are
Server-Sent Events ending with ``data: [DONE]``; a client that disconnects aborts its
request on the host."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from deltaserve.core.errors import InputError
from deltaserve.core.requests import RequestOutput, SamplingParams
from deltaserve.server.context import Services, Svc
from deltaserve.server.db_records import new_id
from deltaserve.server.errors import APIError, from_input_error
from deltaserve.server.model_registry import ServedModel
from deltaserve.server.prompts import chat_prompt_ids, completion_prompt_ids
from deltaserve.server.schemas_ft import ListObject
from deltaserve.server.schemas_inference import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    ModelCard,
    SamplingFields,
    Usage,
)
from deltaserve.server.streaming import (
    ClientGone,
    GenerationStream,
    TextDelta,
    final_text,
    finish_reason,
)

router = APIRouter(prefix="/v1")


def _card(m: ServedModel, base: str) -> ModelCard:
    return ModelCard(id=m.id, created=m.created_at, root=None if m.adapter is None else base,
                     parent=m.parent)


@router.get("/models")
async def list_models(svc: Svc) -> ListObject[ModelCard]:
    base = svc.backend.model_name
    return ListObject(data=[_card(m, base) for m in svc.models.all()])


@router.get("/models/{model:path}")
async def retrieve_model(svc: Svc, model: str) -> ModelCard:
    return _card(_served(svc, model), svc.backend.model_name)


def _served(svc: Services, name: str) -> ServedModel:
    served = svc.models.get(name)
    if served is None:
        raise APIError(404, f"The model `{name}` does not exist", param="model",
                       code="model_not_found")
    return served


def _params(svc: Services, req: SamplingFields, prompt_len: int, limit: int | None
            ) -> SamplingParams:
    room = svc.backend.max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                       f"{svc.backend.max_model_len}", param="messages", code="context_length")
    if limit is not None and limit > room:
        raise APIError(400, f"max_tokens={limit} with a {prompt_len}-token prompt exceeds the "
                       f"context of {svc.backend.max_model_len} tokens", param="max_tokens",
                       code="context_length")
    try:
        return SamplingParams(max_tokens=limit or room, temperature=req.temperature,
                              top_p=req.top_p, seed=req.seed, stop=req.stop_strings())
    except InputError as e:
        raise from_input_error(e) from None


def _submit(svc: Services, ids: Sequence[int], params: SamplingParams, served: ServedModel,
            prefix: str) -> GenerationStream:
    stream = GenerationStream(svc.backend, new_id(prefix))
    try:
        svc.backend.add_request(ids, params, adapter=served.adapter, callback=stream.callback,
                                request_id=stream.request_id)
    except InputError as e:
        raise from_input_error(e) from None
    return stream


def _start(svc: Services, body: SamplingFields, served: ServedModel, ids: Sequence[int],
           limit: int | None, prefix: str) -> tuple[GenerationStream, int]:
    """The request submitted (its sampling checked against the prompt) and its creation time."""
    stream = _submit(svc, ids, _params(svc, body, len(ids), limit), served, prefix)
    return stream, int(time.time())


async def _final(stream: GenerationStream, request: Request) -> RequestOutput:
    """The finished output; a client that went away is answered 499 (its request aborted)."""
    try:
        return await stream.final(request)
    except ClientGone:
        raise APIError(499, "client closed the request") from None


def _usage(prompt_len: int, completion_len: int) -> Usage:
    return Usage(prompt_tokens=prompt_len, completion_tokens=completion_len,
                 total_tokens=prompt_len + completion_len)


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _event_stream(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# ---- completions ----------------------------------------------------------------------------
@router.post("/completions", response_model=None)
async def completions(svc: Svc, body: CompletionRequest, request: Request
                      ) -> Completion | StreamingResponse:
    served = _served(svc, body.model)
    ids = completion_prompt_ids(svc.backend.tokenizer, body.prompt)
    stream, created = _start(svc, body, served, ids, body.max_tokens, "cmpl-")
    if body.stream:
        return _event_stream(_completion_chunks(svc, body, stream, len(ids), created))
    out = await _final(stream, request)
    choice = CompletionChoice(text=final_text(svc.backend.tokenizer, out),
                              finish_reason=finish_reason(out))
    return Completion(id=stream.request_id, created=created, model=body.model,
                      choices=[choice], usage=_usage(len(ids), len(out.output_token_ids)))


async def _completion_chunks(svc: Services, body: CompletionRequest, stream: GenerationStream,
                             prompt_len: int, created: int) -> AsyncIterator[str]:
    delta = TextDelta(svc.backend.tokenizer, body.stop_strings())
    base = {"id": stream.request_id, "object": "text_completion", "created": created,
            "model": body.model}
    async for out in stream.outputs():
        if out.finished:
            text = delta.finish(final_text(svc.backend.tokenizer, out))
            reason: str | None = finish_reason(out)
        else:
            text, reason = delta.update(out.output_token_ids), None
        if text or reason:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
            yield _sse({**base, "choices": [choice]})
        if out.finished and body.include_usage:
            usage = _usage(prompt_len, len(out.output_token_ids)).model_dump()
            yield _sse({**base, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


# ---- chat -----------------------------------------------------------------------------------
@router.post("/chat/completions", response_model=None)
async def chat_completions(svc: Svc, body: ChatCompletionRequest, request: Request
                           ) -> ChatCompletion | StreamingResponse:
    served = _served(svc, body.model)
    ids = chat_prompt_ids(svc.backend.tokenizer, body.messages)
    stream, created = _start(svc, body, served, ids, body.output_limit, "chatcmpl-")
    if body.stream:
        return _event_stream(_chat_chunks(svc, body, stream, len(ids), created))
    out = await _final(stream, request)
    message = AssistantMessage(content=final_text(svc.backend.tokenizer, out))
    return ChatCompletion(id=stream.request_id, created=created, model=body.model,
                          choices=[ChatChoice(message=message, finish_reason=finish_reason(out))],
                          usage=_usage(len(ids), len(out.output_token_ids)))


async def _chat_chunks(svc: Services, body: ChatCompletionRequest, stream: GenerationStream,
                       prompt_len: int, created: int) -> AsyncIterator[str]:
    delta = TextDelta(svc.backend.tokenizer, body.stop_strings())

    def chunk(d: Delta, reason: str | None = None, usage: Usage | None = None) -> str:
        choices = [] if usage else [ChunkChoice(delta=d.model_dump(exclude_none=True),
                                                finish_reason=reason)]
        return _sse(ChatCompletionChunk(id=stream.request_id, created=created, model=body.model,
                                        choices=choices, usage=usage).model_dump())

    yield chunk(Delta(role="assistant", content=""))
    async for out in stream.outputs():
        if out.finished:
            text = delta.finish(final_text(svc.backend.tokenizer, out))
            if text:
                yield chunk(Delta(content=text))
            yield chunk(Delta(), finish_reason(out))
            if body.include_usage:
                yield chunk(Delta(), usage=_usage(prompt_len, len(out.output_token_ids)))
        elif text := delta.update(out.output_token_ids):
            yield chunk(Delta(content=text))
    yield "data: [DONE]\n\n"
