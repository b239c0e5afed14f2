"""What crosses between vLLM's API server and its engine process for the fine-tuning service
(:mod:`deltaserve.hosts.vllm.wire`): through JSON and back, every object is the one sent.
Needs no vLLM (the wire module imports none)."""

from __future__ import annotations

import json

import pytest

from deltaserve.core.config_io import from_dict, to_dict
from deltaserve.core.data import IGNORE_INDEX, TrainingSample
from deltaserve.core.errors import InputError
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.vllm.wire import (
    CalibrateSpec,
    JobPoll,
    JobStart,
    RemoteStatus,
    State,
    WireEvent,
    decode_event,
    encode_event,
)
from deltaserve.model.lora import LoRAConfig
from deltaserve.train.checkpoint_store import CheckpointConfig
from deltaserve.train.config import CoServeConfig
from deltaserve.train.events import (
    CheckpointSaved,
    CoServeStats,
    OptimizerStep,
    StepLost,
    TrainingIOError,
    ValidationLoss,
)

EVENTS = [
    OptimizerStep(at_s=1.5, step=3, epoch=1, sample_ids=(4, 0, 7), num_tokens=96,
                  num_loss_tokens=40, loss=1.25, mean_token_accuracy=0.5, grad_norm=0.75,
                  lr=1e-4, wall_s=0.5, paused_s=0.125, validating=True),
    ValidationLoss(at_s=2.0, step=3, loss=None, num_tokens=0, mean_token_accuracy=None,
                   error="the backward restarted"),
    StepLost(at_s=2.5, step=4, num_samples=2, reason="aborted"),
    CheckpointSaved(at_s=3.0, step=4, path="/data/jobs/ftjob-1/checkpoints/checkpoint-4"),
    TrainingIOError(at_s=3.5, what="checkpoint", error="No space left on device"),
]


def _through_json(obj: object) -> dict:
    return json.loads(json.dumps(to_dict(obj)))


def test_each_training_event_crosses_unchanged():
    for event in EVENTS:
        wire = from_dict(WireEvent, _through_json(encode_event(event)))
        assert decode_event(wire) == event


def test_a_poll_carries_status_counters_and_events_in_order():
    stats = CoServeStats(ft_tokens_committed=96, ft_samples_committed=3, ft_tokens_forwarded=120,
                         optimizer_steps=1, steps_with_ft=5, aborted_steps=1,
                         backward_failures=0, worker_restarts=0, io_errors=1, epoch=0,
                         last_loss=1.25, skips={"backward_running": 7}, ft_tokens_admitted=130,
                         steps_timed=5, step_time_predicted_s=0.25, step_time_measured_s=0.5,
                         backward_busy_s=2.0)
    poll = JobPoll(RemoteStatus(State.COSERVING, samples=16, max_ft_tokens_per_step=64),
                   stats, tuple(encode_event(e) for e in EVENTS))
    back = from_dict(JobPoll, _through_json(poll))
    assert back == poll
    assert [decode_event(w) for w in back.events] == EVENTS
    idle = from_dict(JobPoll, _through_json(JobPoll(RemoteStatus(State.READY), None)))
    assert idle.stats is None and idle.status.state is State.READY


def test_a_job_and_the_calibration_cross_with_their_checks():
    config = CoServeConfig(slo=SLOConfig(ttft_s=2.0, tpot_s=0.2), num_epochs=3,
                           lora=LoRAConfig(r=8, alpha=16.0, dropout=0.0,
                                           target_modules=("q_proj", "v_proj")),
                           checkpoint=CheckpointConfig(root="/data/ck", resume=True,
                                                       resume_from="/data/ck/checkpoint-4"))
    samples = tuple(TrainingSample(i, (1, 2, 3 + i), (IGNORE_INDEX, 2, 3 + i)) for i in range(3))
    job = JobStart(config, samples, samples[:1])
    assert from_dict(JobStart, _through_json(job)) == job
    spec = CalibrateSpec(config, "full", None)
    assert from_dict(CalibrateSpec, _through_json(spec)) == spec
    with pytest.raises(InputError, match="finetune_calibration"):
        from_dict(CalibrateSpec, {**_through_json(spec), "calibration": "slow"})


def test_an_unknown_event_kind_is_refused():
    with pytest.raises(InputError, match="not a training event"):
        decode_event(WireEvent("Reboot", {}))
