"""State that survives: the server as a process, killed (SIGKILL) or stopped (SIGTERM) mid-job
and started again on the same ``--data-dir``."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.server.fakes import BASE_MODEL, FakeBackend, fake_tokenizer
from tests.server.live import (
    API_KEY,
    TERMINAL,
    alpaca_records,
    jsonl,
    upload,
    wait_for,
    wait_status,
)
from tests.server.test_jobs import PROMPT, all_events

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=API_KEY,
                             max_retries=0, timeout=30)

    def stop(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(60)


def launch(data_dir: Path, log: Path, step_delay_s: float) -> ServerProcess:
    port = free_port()
    out = open(log, "a")  # noqa: SIM115 (kept open for the process's lifetime)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.server.fake_server", "--data-dir", str(data_dir),
         "--port", str(port), "--checkpoint-every-steps", "4", "--progress-interval-s", "0.2",
         "--step-delay-s", str(step_delay_s)],
        cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        env={**os.environ, "DELTASERVE_API_KEY": API_KEY})
    server = ServerProcess(proc, port, log)

    def ready():
        assert proc.poll() is None, log.read_text()
        try:
            return server.client().models.list()
        except openai.APIConnectionError:
            return None
    wait_for(ready, 90, "the server process to serve", every_s=0.2)
    return server


@pytest.fixture
def processes():
    started: list[ServerProcess] = []
    yield started
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(30)


def metric_steps(client, job_id) -> list[int]:
    return [e.data["step"] for e in all_events(client, job_id) if e.type == "metrics"]


def test_killed_mid_job_resumes_and_keeps_queue_and_models(tmp_path, processes):
    data, log = tmp_path / "data", tmp_path / "server.log"
    first = launch(data, log, step_delay_s=0.05)
    processes.append(first)
    client = first.client()
    small = upload(client, jsonl(alpaca_records(20)))
    done = wait_status(client, client.fine_tuning.jobs.create(
        model=BASE_MODEL, training_file=small.id, suffix="done").id, TERMINAL)
    assert done.status == "succeeded"
    f = upload(client, jsonl(alpaca_records(60)))
    running = client.fine_tuning.jobs.create(model=BASE_MODEL, training_file=f.id,
                                             hyperparameters={"batch_size": 1})
    queued = client.fine_tuning.jobs.create(model=BASE_MODEL, training_file=small.id)
    wait_for(lambda: len(client.fine_tuning.jobs.checkpoints.list(running.id).data) >= 2, 60,
             "two checkpoints")
    first.proc.kill()  # SIGKILL: no shutdown code runs
    first.proc.wait(30)
    with sqlite3.connect(f"file:{data / 'state.sqlite3'}?mode=ro", uri=True) as db:
        newest = db.execute("SELECT MAX(step) FROM checkpoints WHERE job_id = ?",
                            (running.id,)).fetchone()[0]
    assert newest >= 8

    second = launch(data, log, step_delay_s=0.01)
    processes.append(second)
    client = second.client()
    assert client.fine_tuning.jobs.retrieve(queued.id).status in ("queued", "running",
                                                                  "succeeded")
    # the models of the job that succeeded before the kill serve at once, by name
    backend = FakeBackend(fake_tokenizer())
    try:
        tok = backend.tokenizer
        ids = tok(tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"]
        expected = backend.expected_text(ids, data / "adapters" / done.id / "final", 5)
    finally:
        backend.close()
    answer = client.chat.completions.create(model=done.fine_tuned_model, messages=PROMPT,
                                            max_tokens=5)
    assert answer.choices[0].message.content == expected
    # the interrupted job resumes from its newest checkpoint and finishes, then the queue runs
    job = wait_status(client, running.id, TERMINAL, timeout_s=120)
    assert job.status == "succeeded"
    steps = metric_steps(client, running.id)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > newest
    messages = [e.message for e in all_events(client, running.id)]
    assert any(m.startswith("The server restarted while the job ran. Fine-tuning job resumed "
                            f"from its checkpoint at step {newest}") for m in messages)
    assert wait_status(client, queued.id, TERMINAL).status == "succeeded"
    assert {done.fine_tuned_model, job.fine_tuned_model} <= {
        m.id for m in client.models.list().data}


def test_sigterm_checkpoints_and_pauses_the_running_job(tmp_path, processes):
    data, log = tmp_path / "data", tmp_path / "server.log"
    first = launch(data, log, step_delay_s=0.05)
    processes.append(first)
    client = first.client()
    f = upload(client, jsonl(alpaca_records(60)))
    job = client.fine_tuning.jobs.create(model=BASE_MODEL, training_file=f.id,
                                         hyperparameters={"batch_size": 1})
    wait_for(lambda: metric_steps(client, job.id), 60, "a first step")
    first.stop(signal.SIGTERM)
    # uvicorn re-raises the signal once its shutdown (ours included) has completed
    assert first.proc.returncode in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in log.read_text()

    second = launch(data, log, step_delay_s=0.01)
    processes.append(second)
    client = second.client()
    paused = client.fine_tuning.jobs.retrieve(job.id)
    assert paused.status == "paused"  # left paused at shutdown, and stays so
    steps = metric_steps(client, job.id)
    newest = client.fine_tuning.jobs.checkpoints.list(job.id).data[0]
    assert newest.step_number == steps[-1]  # the shutdown checkpoint holds every step
    client.fine_tuning.jobs.resume(job.id)
    assert wait_status(client, job.id, TERMINAL, timeout_s=120).status == "succeeded"
    steps = metric_steps(client, job.id)
    assert steps == list(range(1, len(steps) + 1))
    assert f"job {job.id}: Job paused at step" in log.read_text()
