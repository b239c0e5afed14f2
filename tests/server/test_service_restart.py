"""``deltaserve serve`` as a process on the real engine, killed (SIGKILL) mid-job and started
again on the same ``--data-dir``: the job resumes from its newest recorded checkpoint, every
sample is committed exactly once per epoch (the training log's ledger), and the final adapter is
the one an uninterrupted run of the same job trains (fp32, dropout 0: to 1e-5)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import openai
import pytest
from safetensors.torch import load_file

from tests.server.live import API_KEY, TERMINAL, upload, wait_for, wait_status
from tests.server.real import LORA, engine_config, serve_config, start_real_server, task_files
from tests.server.test_jobs import all_events
from tests.server.test_restart import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[2]


def serve_argv(model: Path, latency: Path, data_dir: Path, port: int) -> list[str]:
    e = engine_config(model)
    return [sys.executable, "-m", "deltaserve.cli", "serve", str(model), "--data-dir",
            str(data_dir), "--port", str(port), "--latency-model", str(latency),
            "--dtype", e.dtype, "--max-num-seqs", str(e.max_num_seqs),
            "--max-num-batched-tokens", str(e.max_num_batched_tokens), "--block-size",
            str(e.block_size), "--kv-cache-tokens", str(e.kv_cache_tokens), "--max-model-len",
            str(e.max_model_len), "--lora-r", str(LORA.r), "--lora-alpha", str(LORA.alpha),
            "--lora-dropout", "0", "--lora-target-modules", *LORA.target_modules,
            "--checkpoint-every-steps", "2", "--progress-interval-s", "0.2",
            "--job-poll-interval-s", "0.02"]


def launch(model: Path, latency: Path, data_dir: Path, log: Path) -> ServerProcess:
    port = free_port()
    out = open(log, "a")  # noqa: SIM115 (kept open for the process's lifetime)
    proc = subprocess.Popen(serve_argv(model, latency, data_dir, port), cwd=ROOT, stdout=out,
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "DELTASERVE_API_KEY": API_KEY})
    server = ServerProcess(proc, port, log)

    def ready():
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return server.client().models.list()
        except openai.APIConnectionError:
            return None
    wait_for(ready, 180, "deltaserve serve to listen", every_s=0.5)
    return server


@pytest.fixture
def processes():
    started: list[ServerProcess] = []
    yield started
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(30)


def effective_ledger(log: Path) -> dict[int, dict]:
    """Committed steps from the training log: a step trained again after a resume replaces the
    line the killed process wrote for it."""
    steps: dict[int, dict] = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] == "OptimizerStep":
            steps[rec["step"]] = rec
    return steps


def final_adapter(data_dir: Path, job_id: str) -> dict:
    return load_file(str(data_dir / "adapters" / job_id / "final" / "adapter_model.safetensors"))


def test_killed_mid_job_resumes_exactly_once_and_trains_the_same_adapter(
        tiny_service, tmp_path, processes):
    model, latency = tiny_service
    data, log = tmp_path / "data", tmp_path / "server.log"
    first = launch(model, latency, data, log)
    processes.append(first)
    client = first.client()
    train, _ = task_files(24, seed=7)
    f = upload(client, train)
    spec = dict(model=str(model), training_file=f.id, seed=11,
                hyperparameters={"n_epochs": 2, "batch_size": 2})
    job = client.fine_tuning.jobs.create(**spec)
    wait_for(lambda: len(client.fine_tuning.jobs.checkpoints.list(job.id).data) >= 2, 600,
             "two checkpoints", every_s=0.2)
    first.proc.kill()  # SIGKILL: no shutdown code runs
    first.proc.wait(30)
    with sqlite3.connect(f"file:{data / 'state.sqlite3'}?mode=ro", uri=True) as db:
        newest = db.execute("SELECT MAX(step) FROM checkpoints WHERE job_id = ?",
                            (job.id,)).fetchone()[0]
    assert newest >= 4

    second = launch(model, latency, data, log)
    processes.append(second)
    client = second.client()
    done = wait_status(client, job.id, TERMINAL, timeout_s=900)
    assert done.status == "succeeded", done.error
    messages = [e.message for e in all_events(client, job.id)]
    assert any(m.startswith("The server restarted while the job ran. Fine-tuning job resumed "
                            f"from its checkpoint at step {newest}") for m in messages)
    steps = [e.data["step"] for e in all_events(client, job.id) if e.type == "metrics"]
    assert steps == list(range(1, len(steps) + 1))

    # exactly once per epoch, by the training log's ledger of committed samples
    ledger = effective_ledger(data / "jobs" / job.id / "checkpoints" / "train_log.jsonl")
    assert sorted(ledger) == list(range(len(steps)))
    for epoch in (0, 1):
        ids = Counter(i for rec in ledger.values() if rec["epoch"] == epoch
                      for i in rec["sample_ids"])
        assert ids == Counter(range(24)), f"epoch {epoch}: {ids}"

    # the same job, never interrupted, on the same server: the same adapter
    ref = wait_status(client, client.fine_tuning.jobs.create(**spec).id, TERMINAL,
                      timeout_s=900)
    assert ref.status == "succeeded", ref.error
    ours, theirs = final_adapter(data, job.id), final_adapter(data, ref.id)
    assert ours.keys() == theirs.keys()
    worst = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
    print(f"largest difference to the uninterrupted run's adapter: {worst:.2e}")
    assert worst <= 1e-5
    moved = max(float(theirs[k].abs().max()) for k in theirs if "lora_B" in k)
    assert moved > 1e-3  # it trained (B starts at zero)


def test_shutdown_checkpoints_and_pauses_the_running_job(tiny_service, tmp_path):
    """A clean stop (what SIGTERM does) discards nothing: the running job is checkpointed at
    its last step and left paused; after a restart it resumes from there and succeeds."""
    model, latency = tiny_service
    config = serve_config(model, latency, tmp_path / "data")
    server = start_real_server(config)
    client = server.client()
    train, _ = task_files(24, seed=9)
    job = client.fine_tuning.jobs.create(model=str(model), training_file=upload(client, train).id,
                                         hyperparameters={"n_epochs": 2, "batch_size": 2})
    wait_for(lambda: any(e.type == "metrics" for e in all_events(client, job.id)), 600,
             "a first step")
    server.stop()
    server = start_real_server(config)
    try:
        client = server.client()
        assert client.fine_tuning.jobs.retrieve(job.id).status == "paused"
        steps = [e.data["step"] for e in all_events(client, job.id) if e.type == "metrics"]
        assert client.fine_tuning.jobs.checkpoints.list(job.id).data[0].step_number == steps[-1]
        client.fine_tuning.jobs.resume(job.id)
        assert wait_status(client, job.id, TERMINAL, timeout_s=900).status == "succeeded"
        steps = [e.data["step"] for e in all_events(client, job.id) if e.type == "metrics"]
        assert steps == list(range(1, len(steps) + 1))
    finally:
        server.stop()
