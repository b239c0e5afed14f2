"""The OpenAI inference API through the official client, on the fake backend: answers equal the
fake model's own computation, streaming reassembles to the same text, usage counts, stop
strings, unknown models, a client that disconnects, and the training adapter out of reach."""

from __future__ import annotations

import json
import socket

import openai
import pytest

from tests.server.fakes import BASE_MODEL, write_fake_adapter
from tests.server.live import API_KEY, wait_for
from tests.server.test_jobs import PROMPT, prompt_ids


def test_chat_matches_the_model_and_counts_usage(live):
    client = live.client()
    r = client.chat.completions.create(model=BASE_MODEL, messages=PROMPT, max_tokens=7,
                                       temperature=0)
    ids = prompt_ids(live)
    assert r.choices[0].message.content == live.backend.expected_text(ids, None, 7)
    assert r.choices[0].finish_reason == "length" and r.model == BASE_MODEL
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ids), 7, len(ids) + 7)


def test_chat_stream_reassembles_the_same_text(live):
    client = live.client()
    expected = live.backend.expected_text(prompt_ids(live), None, 9)
    chunks = list(client.chat.completions.create(
        model=BASE_MODEL, messages=PROMPT, max_tokens=9, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].choices == []


def test_completions_plain_and_streamed(live):
    client = live.client()
    tok = live.backend.tokenizer
    ids = tok("What is 3 and 4 ?", add_special_tokens=False)["input_ids"]
    expected = live.backend.expected_text(ids, None, 5)
    r = client.completions.create(model=BASE_MODEL, prompt="What is 3 and 4 ?", max_tokens=5)
    assert r.choices[0].text == expected and r.usage.prompt_tokens == len(ids)
    assert client.completions.create(model=BASE_MODEL, prompt=ids, max_tokens=5
                                     ).choices[0].text == expected
    streamed = client.completions.create(model=BASE_MODEL, prompt="What is 3 and 4 ?",
                                         max_tokens=5, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected
    default = client.completions.create(model=BASE_MODEL, prompt=ids)
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens


def test_stop_string_ends_the_output_unsent(live):
    client = live.client()
    full = live.backend.expected_text(prompt_ids(live), None, 12)
    words = full.split(" ")
    stop = " ".join(words[3:5])  # two words in the middle
    expected = full[: full.find(stop)]
    r = client.chat.completions.create(model=BASE_MODEL, messages=PROMPT, max_tokens=12,
                                       stop=[stop])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=BASE_MODEL, messages=PROMPT, max_tokens=12,
                                              stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected


def test_unknown_model_is_a_404_and_the_training_adapter_is_unreachable(live, tmp_path):
    client = live.client()
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=PROMPT)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    # The host holds an adapter under its own internal name (as it holds the one in
    # training); the server's model map has no entry for it, so no client can reach it.
    live.backend.add_lora("__training__", str(write_fake_adapter(tmp_path / "t", 3, 0, "x")))
    for name in ("__training__", ""):
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=name, messages=PROMPT)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=name, prompt="hi")
    assert "__training__" not in {m.id for m in client.models.list().data}


def test_bad_requests_are_400s(live):
    client = live.client()
    for kwargs in ({"n": 2}, {"max_tokens": 1000}, {"logprobs": True},
                   {"messages": []}, {"temperature": 3}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**{"model": BASE_MODEL, "messages": PROMPT,
                                              **kwargs})
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=BASE_MODEL, prompt=" ".join(["hi"] * 300))
    assert err.value.body["code"] == "context_length"


def _stream_then_hang_up(live, body: dict, path: str) -> None:
    """Start a streamed request, read its first event, then close the connection."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                  .encode() + data)
        got = b""
        while b"data: " not in got:
            got += s.recv(4096)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(live, stream):
    live.backend.token_delay_s = 0.05  # 200 tokens: ten seconds unless aborted
    body = {"model": BASE_MODEL, "messages": PROMPT, "max_tokens": 200, "stream": stream}
    if stream:
        _stream_then_hang_up(live, body, "/v1/chat/completions")
    else:
        data = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", live.port), timeout=10) as s:
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      f"{API_KEY}\r\nContent-Type: application/json\r\nContent-Length: "
                      f"{len(data)}\r\n\r\n".encode() + data)
            wait_for(lambda: live.backend.generated_tokens > 0, 10, "generation to start")
    aborted = wait_for(lambda: live.backend.aborted, 10, "the request to be aborted")
    assert len(aborted) == 1 and aborted[0].startswith("chatcmpl-")
    assert live.backend.finished_requests == 0
