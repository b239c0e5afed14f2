"""``deltaserve serve --replicas 2`` on the real embedded engine: one job queue whose job trains
data-parallel across both replicas (every sample once per epoch across their logs, the job's
``trained_tokens`` counting both), and the fine-tuned model served by every replica (the
greedy answer transformers + PEFT give with the final adapter, from both)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest
import torch

from deltaserve.core.data import DataConfig, load_dataset
from tests.server.live import TERMINAL, upload, wait_for, wait_status
from tests.server.real import serve_config, start_real_server, task_files
from tests.server.test_service import chat, metrics_of, peft_greedy, write

NUM_EPOCHS = 2


@pytest.fixture(scope="module")
def replicas(tiny_service, tmp_path_factory):
    model, latency = tiny_service
    config = serve_config(model, latency, tmp_path_factory.mktemp("data"))
    threads = torch.get_num_threads()  # each replica's engine sets the process's to its share
    server = start_real_server(replace(config, replicas=2))
    try:
        yield server
    finally:
        server.stop()
        torch.set_num_threads(threads)


def committed(log) -> list[dict]:
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return [r for r in rows if r["event"] == "OptimizerStep"]


def test_one_job_trains_across_the_replicas_and_every_replica_serves_it(replicas, tmp_path):
    client = replicas.client()
    assert len(replicas.service.hosts) == 2
    train, _ = task_files(16, seed=2)
    job = client.fine_tuning.jobs.create(
        model=replicas.model, training_file=upload(client, train).id, suffix="dp", seed=5,
        hyperparameters={"n_epochs": NUM_EPOCHS, "batch_size": 4,
                         "learning_rate_multiplier": 30})
    job = wait_status(client, job.id, TERMINAL, timeout_s=900)
    assert job.status == "succeeded", job.error

    tok = replicas.host.tokenizer
    samples, _ = load_dataset(DataConfig(str(write(tmp_path / "t.jsonl", train))), tok)
    assert job.trained_tokens == NUM_EPOCHS * sum(s.num_tokens for s in samples)
    steps = [m["step"] for m in metrics_of(client, job.id)]
    assert steps == list(range(1, len(steps) + 1))

    # rank 0's checkpoints and log and rank 1's log, in the job's one directory; across the
    # two logs every sample is committed once per epoch, and both replicas trained
    data_dir = replicas.config.server.data_dir
    ckpt_dir = data_dir / "jobs" / job.id / "checkpoints"
    logs = [committed(ckpt_dir / name) for name in ("train_log.jsonl", "train_log.rank-1.jsonl")]
    assert [r["step"] for r in logs[0]] == [r["step"] for r in logs[1]]
    trained = Counter((r["epoch"], sid) for log in logs for r in log for sid in r["sample_ids"])
    assert trained == Counter({(e, i): 1 for e in range(NUM_EPOCHS)
                               for i in range(len(samples))})
    assert all(any(r["sample_ids"] for r in log) for log in logs)

    # round-robin: four requests, two on each replica, each the final adapter's answer
    before = [h.request_counters.totals().finished for h in replicas.service.hosts]
    answers = {chat(client, job.fine_tuned_model) for _ in range(4)}
    after = [h.request_counters.totals().finished for h in replicas.service.hosts]
    assert [b - a for a, b in zip(before, after, strict=True)] == [2, 2]
    final = data_dir / "adapters" / job.id / "final"
    assert answers == {peft_greedy(replicas.config.host.model, final, tok)}


def test_a_replica_whose_engine_fails_leaves_the_other_serving(replicas):
    """Fault: replica 0's engine raises in its next step (its loop stops, as an engine bug
    stops it); new requests all go to replica 1 and are answered. Last in the module: the
    server keeps one replica from here on."""
    client = replicas.client()
    broken = replicas.service.hosts[0]

    def fail() -> bool:
        raise RuntimeError("injected engine fault")

    broken.step = fail  # its loop calls it within milliseconds, idle or not
    wait_for(lambda: not replicas.service.backend.router.is_live(0), 60, "replica 0 down")
    survivor = replicas.service.hosts[1]
    before = survivor.request_counters.totals().finished
    answers = [chat(client, replicas.model) for _ in range(3)]
    assert all(isinstance(a, str) for a in answers)
    assert survivor.request_counters.totals().finished - before == 3
