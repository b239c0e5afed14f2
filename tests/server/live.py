"""A live uvicorn server on 127.0.0.1 (a free port) in a thread of the test process, with the
fakes behind it, and helpers to drive it with the official ``openai`` client."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import openai
import uvicorn
from fastapi import FastAPI

from deltaserve.server import ServerConfig, create_app
from tests.server.fakes import FakeBackend, FakeRunner, FakeStats, fake_tokenizer

API_KEY = "test-key-123"
TERMINAL = ("succeeded", "failed", "cancelled")


def server_config(data_dir: Path, **overrides) -> ServerConfig:
    """Small intervals so a job checkpoints and the dashboard samples within a test."""
    base = ServerConfig(data_dir=data_dir, port=0, api_key=API_KEY, checkpoint_every_steps=4,
                        progress_interval_s=0.5, dashboard_interval_s=0.2,
                        shutdown_pause_timeout_s=20.0, job_poll_interval_s=0.01)
    return replace(base, **overrides)


@dataclass
class LiveServer:
    config: ServerConfig
    app: FastAPI
    backend: FakeBackend
    runner: FakeRunner
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0,
                             timeout=30)

    def stop(self) -> None:
        """A clean shutdown (what SIGTERM does): the running job is checkpointed and paused."""
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "the server did not stop"


def start_server(config: ServerConfig, backend: FakeBackend | None = None,
                 runner: FakeRunner | None = None) -> LiveServer:
    backend = backend or FakeBackend(fake_tokenizer())
    runner = runner or FakeRunner()
    app = create_app(config, backend, runner, FakeStats(backend, runner))
    server = uvicorn.Server(uvicorn.Config(app, host=config.bind, port=config.port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "the server to start")
    return LiveServer(config, app, backend, runner, server, thread)


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str,
             every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def wait_status(client: openai.OpenAI, job_id: str, statuses: tuple[str, ...],
                timeout_s: float = 60):
    def done():
        job = client.fine_tuning.jobs.retrieve(job_id)
        return job if job.status in statuses else None
    return wait_for(done, timeout_s, f"job {job_id} to reach {statuses}")


def alpaca_records(n: int) -> list[dict[str, str]]:
    """A tiny arithmetic task in the fake tokenizer's vocabulary."""
    return [{"instruction": f"Add {i % 20} and {(3 * i) % 20}", "input": "",
             "output": str(i % 20 + (3 * i) % 20)} for i in range(n)]


def jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def upload(client: openai.OpenAI, content: bytes, name: str = "train.jsonl"):
    return client.files.create(file=(name, content), purpose="fine-tune")


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


def raw_request(server: LiveServer, method: str, path: str, *, body=None,
                headers: dict[str, str] | None = None, chunked: bool = False) -> RawResponse:
    """One HTTP request with the standard library (for what the openai client cannot send)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
        r = conn.getresponse()
        return RawResponse(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()
