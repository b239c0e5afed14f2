"""One inference request, from the host's thread to the client's coroutine.

The host calls a request's callback on its own loop thread; :class:`GenerationStream` moves
each ``RequestOutput`` onto the event loop with ``call_soon_threadsafe``, never blocking the
host. :class:`TextDelta` turns the growing token list into the text not yet sent, holding back
what could still change (an incomplete UTF-8 character, the start of a stop string)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from starlette.requests import Request

from deltaserve.core.requests import RequestOutput
from deltaserve.core.tokenizer import Tokenizer
from deltaserve.server.protocols import InferenceBackend

DISCONNECT_CHECK_S = 0.25  # how often a waiting non-streaming request looks for its client


class ClientGone(Exception):
    """The client disconnected; its request was aborted."""


class GenerationStream:
    def __init__(self, backend: InferenceBackend, request_id: str):
        self.backend = backend
        self.request_id = request_id
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False

    def callback(self, out: RequestOutput) -> None:
        """On the host's thread: hand over and return at once."""
        # RuntimeError: the event loop is closed, the server is shutting down
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, out)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Every output up to the finished one; the request is aborted if the consumer stops
        early (a client disconnect cancels the streaming coroutine)."""
        try:
            while not self.finished:
                out = await self._queue.get()
                self.finished = out.finished
                yield out
        finally:
            if not self.finished:
                self.backend.abort_request(self.request_id)

    async def final(self, request: Request) -> RequestOutput:
        """Wait for the finished output, aborting the request if the client goes away."""
        check_at = self._loop.time() + DISCONNECT_CHECK_S
        try:
            while True:
                try:
                    wait_s = max(0.0, check_at - self._loop.time())
                    out = await asyncio.wait_for(self._queue.get(), wait_s)
                    if out.finished:
                        self.finished = True
                        return out
                except TimeoutError:
                    pass
                if self._loop.time() >= check_at:  # on a clock: tokens may never pause
                    if await request.is_disconnected():
                        raise ClientGone(self.request_id)
                    check_at = self._loop.time() + DISCONNECT_CHECK_S
        finally:
            if not self.finished:
                self.backend.abort_request(self.request_id)


class TextDelta:
    """The text of the output so far, minus what was already sent."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]):
        self.tokenizer = tokenizer
        self.hold_chars = max((len(s) for s in stops), default=1) - 1
        self.sent = ""

    def update(self, token_ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        end = len(text) - self.hold_chars
        while end > len(self.sent) and text[end - 1] == "\ufffd":
            end -= 1  # an incomplete multi-byte character: wait for its next token
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent):end], text[:end]
        return new

    def finish(self, final_text: str) -> str:
        """The rest of the final text (the host has already cut a stop string off it)."""
        rest = final_text[len(self.sent):] if final_text.startswith(self.sent) else ""
        self.sent = final_text
        return rest


def finish_reason(out: RequestOutput) -> str:
    """OpenAI's reasons: an end-of-sequence token is a ``stop`` like a stop string."""
    return "length" if out.finish_reason == "length" else "stop"


def final_text(tokenizer: Tokenizer, out: RequestOutput) -> str:
    if out.text is not None:
        return out.text
    return tokenizer.decode(list(out.output_token_ids), skip_special_tokens=True)
