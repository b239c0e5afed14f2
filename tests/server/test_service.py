"""The service on the real embedded engine (tiny model, real co-serving, real backward
process), driven with the official ``openai`` client: a job's whole life, its events,
checkpoints and models against transformers + PEFT, the queue, pause and resume, bad input."""

from __future__ import annotations

import itertools
import math
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from deltaserve.core.data import DataConfig, load_dataset
from deltaserve.hosts.base import RESERVED_ADAPTER_PREFIX
from deltaserve.server.protocols import InferenceBackend, ServingStats, TrainingRunner
from tests.server.live import API_KEY, TERMINAL, raw_request, upload, wait_for, wait_status
from tests.server.real import serve_config, start_real_server, task_files
from tests.server.test_dashboard import CHROMIUM, chromium
from tests.server.test_jobs import all_events
from tests.train.test_validation import peft_loss

PROMPT = [{"role": "user", "content": "Add 12 and 30. Answer with the number only."}]
RESULTS = Path(__file__).resolve().parents[2] / "results"


@pytest.fixture(scope="module")
def real(tiny_service, tmp_path_factory):
    model, latency = tiny_service
    server = start_real_server(serve_config(model, latency, tmp_path_factory.mktemp("data")))
    yield server
    server.stop()


def chat(client, model: str) -> str:
    r = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=8,
                                       temperature=0)
    return r.choices[0].message.content


def peft_greedy(base_dir, adapter_dir, tokenizer, max_tokens: int = 8) -> str:
    """The adapter's greedy answer to PROMPT in transformers + PEFT (the engine's reference)."""
    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(hf, adapter_dir).eval() if adapter_dir else hf.eval()
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def metrics_of(client, job_id):
    return [e.data for e in all_events(client, job_id) if e.type == "metrics"]


def test_job_trains_validates_and_serves_its_model(real, tmp_path):
    client = real.client()
    train, valid = task_files(32, 6, seed=1)
    f, v = upload(client, train), upload(client, valid, "valid.jsonl")
    job = client.fine_tuning.jobs.create(
        model=real.model, training_file=f.id, validation_file=v.id, suffix="adder", seed=5,
        hyperparameters={"n_epochs": 3, "batch_size": 4, "learning_rate_multiplier": 30})
    job = wait_status(client, job.id, TERMINAL, timeout_s=900)
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model == f"ft:{real.model}:adder:{job.id}"

    tok = real.host.tokenizer
    samples, _ = load_dataset(DataConfig(str(write(tmp_path / "t.jsonl", train))), tok)
    held_out, _ = load_dataset(DataConfig(str(write(tmp_path / "v.jsonl", valid))), tok)
    assert job.trained_tokens == 3 * sum(s.num_tokens for s in samples)
    metrics = metrics_of(client, job.id)
    steps = [m["step"] for m in metrics]
    assert steps == list(range(1, len(steps) + 1))
    losses = [m["train_loss"] for m in metrics]
    print(f"train loss per step: {[round(x, 3) for x in losses]}")
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2  # it learns the task
    validated = [m["step"] for m in metrics if "valid_loss" in m]
    assert validated == [s for s in steps if s % 4 == 0 or s == steps[-1]]

    # the last valid_loss is the final adapter's held-out loss in transformers + PEFT
    final_dir = real.config.server.data_dir / "adapters" / job.id / "final"
    ref_loss, _ = peft_loss(real.config.host.model, final_dir, held_out)
    assert metrics[-1]["valid_loss"] == pytest.approx(ref_loss, rel=1e-5)

    ckpts = client.fine_tuning.jobs.checkpoints.list(job.id, limit=100).data
    assert [c.step_number for c in ckpts] == sorted(set(validated), reverse=True)
    served = {m.id for m in client.models.list().data}
    assert {job.fine_tuned_model, *(c.fine_tuned_model_checkpoint for c in ckpts)} <= served

    # the model serves by name at once, and is the trained adapter (PEFT's greedy answer)
    base, tuned = chat(client, real.model), chat(client, job.fine_tuned_model)
    print(f"base model: {base!r}; fine-tuned: {tuned!r}")
    assert tuned != base
    assert tuned == peft_greedy(real.config.host.model, final_dir, tok)
    assert base == peft_greedy(real.config.host.model, None, tok)

    # /metrics reads the co-servers' and the host's own counters
    scrape = raw_request(real, "GET", "/metrics",
                         headers={"Authorization": f"Bearer {API_KEY}"}).body.decode()
    values = dict(line.rsplit(" ", 1) for line in scrape.splitlines()
                  if line.startswith("deltaserve:") and "{" not in line)
    assert float(values["deltaserve:ft_tokens_committed_total"]) >= job.trained_tokens
    assert float(values["deltaserve:ft_tokens_admitted_total"]) >= job.trained_tokens
    assert float(values["deltaserve:requests_finished_total"]) >= 2
    assert float(values["deltaserve:step_time_measured_seconds_count"]) > 0
    assert 0 < float(values["deltaserve:backward_busy_ratio"]) <= 1


def write(path, content: bytes):
    path.write_bytes(content)
    return path


def test_cancel_a_queued_job_pause_and_resume_a_running_one(real):
    client = real.client()
    big, _ = task_files(48, seed=2)
    small, _ = task_files(8, seed=3)
    a = client.fine_tuning.jobs.create(model=real.model, training_file=upload(client, big).id,
                                       hyperparameters={"n_epochs": 2, "batch_size": 2})
    b = client.fine_tuning.jobs.create(model=real.model,
                                       training_file=upload(client, small).id)
    wait_for(lambda: len(metrics_of(client, a.id)) >= 2, 600, "job A to train two steps")
    assert client.fine_tuning.jobs.retrieve(b.id).status == "queued"  # one job at a time
    assert client.fine_tuning.jobs.cancel(b.id).status == "cancelled"

    paused = client.fine_tuning.jobs.pause(a.id)
    assert paused.status == "paused"
    steps = [m["step"] for m in metrics_of(client, a.id)]
    newest = client.fine_tuning.jobs.checkpoints.list(a.id).data[0]
    assert newest.step_number == steps[-1]  # the pause checkpoint holds every step trained
    assert real.host.coserver is None  # nothing trains while paused
    client.fine_tuning.jobs.resume(a.id)
    done = wait_status(client, a.id, TERMINAL, timeout_s=900)
    assert done.status == "succeeded", done.error
    steps = [m["step"] for m in metrics_of(client, a.id)]
    assert steps == list(range(1, len(steps) + 1))  # resumed where it paused, no step twice
    messages = [e.message for e in all_events(client, a.id)]
    assert any(m.startswith(f"Fine-tuning job resumed from its checkpoint at step "
                            f"{newest.step_number}") for m in messages)
    assert client.fine_tuning.jobs.retrieve(b.id).status == "cancelled"


def test_bad_input_is_refused_with_the_reason(real):
    client = real.client()
    bad = b'{"instruction": "Add 1 and 2", "output": "3"}\n{"instruction": oops}\n'
    with pytest.raises(openai.BadRequestError) as e:
        upload(client, bad, "bad.jsonl")
    assert "line 2" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.create(model=real.model, training_file="file-" + "0" * 24)
    with pytest.raises(openai.AuthenticationError):
        real.client(api_key="wrong").models.list()
    assert raw_request(real, "GET", "/v1/models").status == 401  # no key at all
    with pytest.raises(openai.NotFoundError):  # the training adapter has no client name
        client.chat.completions.create(model=f"{RESERVED_ADAPTER_PREFIX}train",
                                       messages=PROMPT, max_tokens=2)


def test_the_real_parts_satisfy_the_service_protocols(real):
    s = real.service
    assert isinstance(s.backend, InferenceBackend) and isinstance(s.runner, TrainingRunner)
    assert isinstance(s.stats, ServingStats)


QUESTIONS = [f"Add {a} and {b}. Answer with the number only." for a, b in
             ((3, 4), (10, 20), (7, 7), (41, 2), (9, 90), (5, 55))]


def stream_chat(client, model: str, question: str) -> tuple[str, float, float]:
    """(text, TTFT, longest gap between chunks) as a client measures them."""
    t0 = time.monotonic()
    times, text = [], ""
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=12,
            temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.monotonic())
            text += chunk.choices[0].delta.content
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return text, (times[0] - t0) if times else math.nan, max(gaps, default=0.0)


def record_decisions(co) -> list:
    """Wrap the live co-server's ``plan`` to keep (view, plan) of every step it plans."""
    decisions, plan = [], co.plan

    def recorded(view):
        step = plan(view)
        decisions.append((view, step.plan))
        return step

    co.plan = recorded
    return decisions


def test_requests_during_a_job_keep_their_greedy_outputs(real):
    """Inference is not disturbed: the same greedy answers with and without a job training, and
    every step that carried samples beside requests was admitted inside their SLO slack as the
    latency model priced it (Algorithm 1's decision, asserted instead of wall-clock latencies:
    this machine's clock measures its other tenants too; the measured ones are printed)."""
    client = real.client()
    assert real.host.coserver is None
    base = [stream_chat(client, real.model, q)[0] for q in QUESTIONS]
    big, _ = task_files(64, seed=4)
    job = client.fine_tuning.jobs.create(model=real.model, training_file=upload(client, big).id,
                                         hyperparameters={"n_epochs": 2, "batch_size": 2})
    co = wait_for(lambda: real.host.coserver, 300, "the job's co-server")
    decisions = record_decisions(co)
    slo = real.config.coserve.slo
    measured = []
    try:
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            for _ in range(8):
                outs = list(pool.map(lambda q: stream_chat(client, real.model, q), QUESTIONS))
                assert [o[0] for o in outs] == base
                measured += outs
                if any(p.sample_ids and v.proposed.has_inference for v, p in decisions):
                    break
        assert client.fine_tuning.jobs.retrieve(job.id).status == "running"
    finally:
        client.fine_tuning.jobs.cancel(job.id)
    ttfts, tpots = sorted(m[1] for m in measured), sorted(m[2] for m in measured)
    print(f"{len(measured)} requests during the job: TTFT p50 {ttfts[len(ttfts) // 2]:.3f} s, "
          f"max {ttfts[-1]:.3f} s; longest token gap p50 {tpots[len(tpots) // 2]:.3f} s, max "
          f"{tpots[-1]:.3f} s (SLO {slo.ttft_s} s / {slo.tpot_s} s)")
    mixed = [(v, p) for v, p in decisions if p.sample_ids and v.proposed.has_inference]
    assert mixed, "no step carried samples beside requests"
    for view, p in mixed:
        slack_s = min([slo.ttft_s - (view.now_s - w.arrival_s) for w in view.waiting]
                      + ([slo.tpot_s - (view.now_s - view.oldest_decode_token_s)]
                         if view.oldest_decode_token_s is not None else []))
        assert p.predicted_s <= p.budget.delta_s <= slack_s + 1e-9
    print(f"{len(mixed)} steps carried samples beside requests, each predicted within Δ")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_dashboard_draws_a_real_job(real, tmp_path):
    """Headless Chromium loads /dashboard while a job trains beside client traffic; the chart has
    data points of both bands. The screenshot is kept in results/ (one is committed)."""
    client = real.client()
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            stream_chat(client, real.model, QUESTIONS[0])

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    big, _ = task_files(64, seed=6)
    job = client.fine_tuning.jobs.create(model=real.model, training_file=upload(client, big).id,
                                         hyperparameters={"n_epochs": 2, "batch_size": 2})
    timeline = real.app.state.services.timeline
    try:
        wait_for(lambda: sum(p.ft_tokens_per_s > 0 and p.inference_tokens_per_s > 0
                             for p in timeline.points()) >= 3, 600, "busy dashboard samples",
                 every_s=0.5)
        url = f"{real.base_url}/dashboard#key={API_KEY}"
        dom = chromium(url, tmp_path, "--dump-dom")
        RESULTS.mkdir(exist_ok=True)
        shot = RESULTS / "dashboard.png"
        chromium(url, tmp_path, f"--screenshot={shot}", "--window-size=1040,560")
    finally:
        stop.set()
        sender.join(60)
        client.fine_tuning.jobs.cancel(job.id)
    assert dom.returncode == 0, dom.stderr[-2000:]
    points = int(re.search(r'id="chart"[^>]*data-points="(\d+)"', dom.stdout).group(1))
    assert points >= 3 and dom.stdout.count('class="point"') == points
    assert 'class="finetune"' in dom.stdout and 'class="slo"' in dom.stdout
    assert shot.is_file() and shot.stat().st_size > 10_000
