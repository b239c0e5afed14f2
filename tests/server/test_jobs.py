"""The Fine-tuning Jobs API through the official client, on the fake runner: the whole life of
a job, its events and checkpoints, the models it leaves behind, and the queue."""

from __future__ import annotations

import math

import openai
import pytest

from deltaserve.server.protocols import FailedEvent, StepEvent, StepMetrics
from tests.server.fakes import BASE_MODEL, FAKE_DEFAULTS, FakeRunner, fake_loss
from tests.server.live import (
    TERMINAL,
    alpaca_records,
    jsonl,
    server_config,
    start_server,
    upload,
    wait_for,
    wait_status,
)

PROMPT = [{"role": "user", "content": "Add 3 and 4"}]


def chat(client: openai.OpenAI, model: str, max_tokens: int = 6) -> str:
    r = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=max_tokens,
                                       temperature=0)
    return r.choices[0].message.content


def prompt_ids(live) -> list[int]:
    tok = live.backend.tokenizer
    text = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def all_events(client, job_id):
    return list(reversed(client.fine_tuning.jobs.list_events(job_id, limit=1000).data))


def test_job_succeeds_and_its_models_serve_by_name(live):
    client = live.client()
    f = upload(client, jsonl(alpaca_records(60)))
    job = client.fine_tuning.jobs.create(model=BASE_MODEL, training_file=f.id, suffix="adder",
                                         hyperparameters={"n_epochs": 2, "batch_size": 4},
                                         seed=7, metadata={"team": "search"})
    assert job.status == "validating_files" and job.id.startswith("ftjob-")
    job = wait_status(client, job.id, TERMINAL)
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model == f"ft:{BASE_MODEL}:adder:{job.id}"
    assert job.finished_at >= job.created_at and job.error is None
    assert (job.seed, job.metadata) == (7, {"team": "search"})

    spec = live.runner.starts[-1]
    mean = math.ceil(sum(s.num_tokens for s in spec.train_samples) / len(spec.train_samples))
    assert spec.hyperparameters.backward_batch_tokens == 4 * mean
    assert spec.hyperparameters.n_epochs == 2
    assert spec.hyperparameters.learning_rate == FAKE_DEFAULTS.learning_rate
    assert len(spec.train_samples) == 60 and spec.resume_from is None
    steps = 2 * len(FakeRunner.batches(spec))
    assert job.trained_tokens == 2 * sum(s.num_tokens for s in spec.train_samples)

    events = all_events(client, job.id)
    metrics = [e for e in events if e.type == "metrics"]
    assert [e.data["step"] for e in metrics] == list(range(1, steps + 1))
    assert [e.data["train_loss"] for e in metrics] == pytest.approx(
        [fake_loss(s) for s in range(1, steps + 1)])
    assert metrics[-1].data["train_loss"] < metrics[0].data["train_loss"]
    assert all("valid_loss" not in e.data for e in metrics)
    messages = [e.message for e in events if e.type == "message"]
    assert messages[0].startswith("Validating training file")
    assert "Files validated, moving job to queued state" in messages
    assert messages[-1] == "The job has successfully completed"

    ckpts = client.fine_tuning.jobs.checkpoints.list(job.id, limit=100).data
    assert [c.step_number for c in ckpts] == list(range(steps - steps % 4, 0, -4))
    for c in ckpts:
        assert c.fine_tuned_model_checkpoint == f"{job.fine_tuned_model}:ckpt-step-{c.step_number}"
        assert c.metrics.train_loss == pytest.approx(fake_loss(c.step_number))

    listed = {m.id for m in client.models.list().data}
    assert listed == {BASE_MODEL, job.fine_tuned_model} | {
        c.fine_tuned_model_checkpoint for c in ckpts}

    # served by name, straight after success, from the adapter store's PEFT copy
    store = live.config.data_dir / "adapters" / job.id
    ids = prompt_ids(live)
    base, tuned = chat(client, BASE_MODEL), chat(client, job.fine_tuned_model)
    assert base == live.backend.expected_text(ids, None, 6)
    assert tuned == live.backend.expected_text(ids, store / "final", 6)
    assert tuned != base
    first = ckpts[-1]
    assert chat(client, first.fine_tuned_model_checkpoint) == live.backend.expected_text(
        ids, store / f"ckpt-step-{first.step_number}", 6)


def test_validation_file_gives_valid_loss_and_auto_is_resolved(live):
    client = live.client()
    train = upload(client, jsonl(alpaca_records(30)))
    valid = upload(client, jsonl(alpaca_records(5)), "valid.jsonl")
    job = client.fine_tuning.jobs.create(
        model=BASE_MODEL, training_file=train.id, validation_file=valid.id,
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "learning_rate_multiplier": 0.5}}})
    job = wait_status(client, job.id, TERMINAL)
    assert job.status == "succeeded"
    spec = live.runner.starts[-1]
    assert len(spec.valid_samples) == 5
    assert spec.hyperparameters.learning_rate == pytest.approx(0.5 * FAKE_DEFAULTS.learning_rate)
    assert spec.hyperparameters.backward_batch_tokens == FAKE_DEFAULTS.backward_batch_tokens
    hp = job.hyperparameters
    assert hp.n_epochs == 1 and hp.learning_rate_multiplier == 0.5
    assert isinstance(hp.batch_size, int) and hp.batch_size >= 1
    metrics = [e for e in all_events(client, job.id) if e.type == "metrics"]
    assert metrics and all("valid_loss" in e.data for e in metrics)


def test_missing_file_is_404_and_unknown_model_400(live):
    client = live.client()
    f = upload(client, jsonl(alpaca_records(5)))
    with pytest.raises(openai.NotFoundError) as err:
        client.fine_tuning.jobs.create(model=BASE_MODEL, training_file="file-" + "1" * 24)
    assert err.value.body["param"] == "training_file"
    with pytest.raises(openai.NotFoundError) as err:
        client.fine_tuning.jobs.create(model=BASE_MODEL, training_file=f.id,
                                       validation_file="nope")
    assert err.value.body["param"] == "validation_file"
    with pytest.raises(openai.BadRequestError) as err:
        client.fine_tuning.jobs.create(model="gpt-4o-mini", training_file=f.id)
    assert err.value.body["param"] == "model"
    for bad in ({"n_epochs": 0}, {"batch_size": 2.5}, {"learning_rate_multiplier": -1}):
        with pytest.raises(openai.BadRequestError):
            client.fine_tuning.jobs.create(model=BASE_MODEL, training_file=f.id,
                                           hyperparameters=bad)
    with pytest.raises(openai.BadRequestError):
        client.fine_tuning.jobs.create(model=BASE_MODEL, training_file=f.id, suffix="a:b")
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("ftjob-" + "0" * 24)
    assert client.fine_tuning.jobs.list().data == []


def test_a_file_that_tokenizes_to_nothing_fails_the_job(live):
    client = live.client()
    long = [{"instruction": " ".join(["hi"] * 400), "output": "hello"}]
    f = upload(client, jsonl(long))  # parses fine; longer than the context once tokenized
    job = wait_status(client, client.fine_tuning.jobs.create(
        model=BASE_MODEL, training_file=f.id).id, TERMINAL)
    assert job.status == "failed"
    assert job.error.code == "invalid_training_file" and job.error.param == "training_file"
    assert f.id in job.error.message and job.finished_at is not None


def test_queue_is_fifo_and_a_queued_job_cancels(live):
    client = live.client()
    live.runner.gate.clear()  # the first job runs but makes no progress until released
    f = upload(client, jsonl(alpaca_records(40)))
    jobs = [client.fine_tuning.jobs.create(model=BASE_MODEL, training_file=f.id,
                                           hyperparameters={"batch_size": 2}) for _ in range(3)]
    wait_status(client, jobs[0].id, ("running",))
    wait_status(client, jobs[1].id, ("queued",))  # validated, waiting behind the first
    cancelled = client.fine_tuning.jobs.cancel(jobs[1].id)
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    live.runner.gate.set()
    for j in (jobs[0], jobs[2]):
        assert wait_status(client, j.id, TERMINAL).status == "succeeded"
    assert [s.job_id for s in live.runner.starts] == [jobs[0].id, jobs[2].id]
    assert client.fine_tuning.jobs.retrieve(jobs[1].id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.fine_tuning.jobs.cancel(jobs[0].id)  # already finished
    listed = client.fine_tuning.jobs.list(limit=2)
    assert [j.id for j in listed.data] == [jobs[2].id, jobs[1].id] and listed.has_more
    rest = client.fine_tuning.jobs.list(after=jobs[1].id, limit=2)
    assert [j.id for j in rest.data] == [jobs[0].id] and not rest.has_more


def test_cancel_a_running_job(live):
    client = live.client()
    live.runner.step_delay_s = 0.05
    f = upload(client, jsonl(alpaca_records(60)))
    job = client.fine_tuning.jobs.create(model=BASE_MODEL, training_file=f.id,
                                         hyperparameters={"batch_size": 1})
    wait_status(client, job.id, ("running",))
    wait_for(lambda: client.fine_tuning.jobs.checkpoints.list(job.id).data, 30, "a checkpoint")
    live.runner.gate.clear()  # hold it mid-job, whatever the machine's pace
    job = client.fine_tuning.jobs.cancel(job.id)
    assert job.status == "cancelled" and job.fine_tuned_model is None
    assert job.fine_tuned_model is None
    models = {m.id for m in client.models.list().data}
    assert not any(m.endswith(job.id) for m in models)  # no final model for a cancelled job


def test_pause_and_resume_a_running_job(live):
    client = live.client()
    live.runner.step_delay_s = 0.05
    f = upload(client, jsonl(alpaca_records(50)))
    job = client.fine_tuning.jobs.create(model=BASE_MODEL, training_file=f.id,
                                         hyperparameters={"batch_size": 1})
    wait_for(lambda: [e for e in all_events(client, job.id) if e.type == "metrics"], 30,
             "a first step")
    live.runner.gate.clear()  # hold it mid-job, whatever the machine's pace
    paused = client.fine_tuning.jobs.pause(job.id)
    assert paused.status == "paused"
    newest = client.fine_tuning.jobs.checkpoints.list(job.id).data[0]
    steps_at_pause = [e.data["step"] for e in all_events(client, job.id)
                      if e.type == "metrics"]
    assert newest.step_number == steps_at_pause[-1]
    with pytest.raises(openai.BadRequestError):
        client.fine_tuning.jobs.pause(job.id)  # already paused
    live.runner.gate.set()
    resumed = client.fine_tuning.jobs.resume(job.id)
    assert resumed.status in ("queued", "running")
    done = wait_status(client, job.id, TERMINAL)
    assert done.status == "succeeded"
    first, second = live.runner.starts[-2:]
    assert first.resume_from is None and second.resume_from == newest_runner_dir(live, job.id,
                                                                                 newest)
    steps = [e.data["step"] for e in all_events(client, job.id) if e.type == "metrics"]
    assert steps == list(range(1, len(steps) + 1))  # continued, nothing trained twice
    assert steps[-1] == len(FakeRunner.batches(second))
    messages = [e.message for e in all_events(client, job.id)]
    assert any(m.startswith("Job paused at step") for m in messages)
    assert any(m.startswith("Fine-tuning job resumed from its checkpoint") for m in messages)


def newest_runner_dir(live, job_id, ckpt):
    return live.config.data_dir / "jobs" / job_id / "checkpoints" / \
        f"checkpoint-{ckpt.step_number:06d}"


class FailingRunner(FakeRunner):
    """Fails its first job after two steps, as a backward that raised would."""

    def _train(self, spec):
        if len(self.starts) == 1:
            for step in (1, 2):
                self._events.put(StepEvent(StepMetrics(step, fake_loss(step), 0.5, step)))
            self._events.put(FailedEvent("backward_failed", "the backward raised: boom"))
            return
        super()._train(spec)


def test_a_failed_job_leaves_inference_and_the_queue_running(tmp_path):
    server = start_server(server_config(tmp_path / "data"), runner=FailingRunner())
    try:
        client = server.client()
        f = upload(client, jsonl(alpaca_records(20)))
        first, second = (client.fine_tuning.jobs.create(model=BASE_MODEL, training_file=f.id)
                         for _ in range(2))
        failed = wait_status(client, first.id, TERMINAL)
        assert failed.status == "failed" and failed.fine_tuned_model is None
        assert (failed.error.code, failed.error.message) == ("backward_failed",
                                                             "the backward raised: boom")
        assert wait_status(client, second.id, TERMINAL).status == "succeeded"
        assert chat(client, BASE_MODEL)  # inference went on throughout
        assert any(e.level == "error" for e in all_events(client, first.id))
    finally:
        server.stop()
        server.backend.close()
