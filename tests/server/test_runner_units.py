"""The real runner's pure parts: co-server events to job events (against hand-built
sequences) and the co-serving counters summed over jobs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from deltaserve.server.coserving_runner import FineTuningTotals
from deltaserve.server.protocols import CheckpointEvent, NoticeEvent, StepEvent, StepMetrics
from deltaserve.server.runner_events import EventTranslator
from deltaserve.train.events import (
    CheckpointSaved,
    CoServeStats,
    OptimizerStep,
    StepLost,
    TrainingIOError,
    ValidationLoss,
)


def opt(step, tokens=10, loss=2.0, validating=False):
    return OptimizerStep(0.0, step, 0, (step,), tokens, tokens // 2, loss, 0.5, 1.0, 1e-3, 0.1,
                         0.0, validating)


def test_steps_wait_for_their_validation_loss_and_keep_their_order():
    t = EventTranslator(trained_tokens=100, resumed=None)
    t.feed(opt(0, loss=3.0))
    t.feed(opt(1, loss=2.5, validating=True))
    t.feed(CheckpointSaved(0.0, 2, "/ck/checkpoint-000002"))
    assert t.take() == [StepEvent(StepMetrics(1, 3.0, 0.5, 110))]  # step 2 waits
    t.feed(ValidationLoss(0.0, 1, 2.25, 40, 0.6))
    m2 = StepMetrics(2, 2.5, 0.5, 120, valid_loss=2.25)
    assert t.take() == [StepEvent(m2), CheckpointEvent(Path("/ck/checkpoint-000002"), m2)]
    t.feed(CheckpointSaved(0.0, 2, "/ck/checkpoint-000002"))  # saved again as it closed
    assert t.take() == []
    t.feed(opt(2, validating=True))
    t.feed(ValidationLoss(0.0, 2, None, 0, None, "Traceback ...\nIndexError: out of range"))
    t.feed(StepLost(0.0, 3, 4, "backward process died (exit code -9)"))
    t.feed(TrainingIOError(0.0, "training log", "OSError: [Errno 28] No space left"))
    step, note, lost, io = t.take()
    assert step == StepEvent(StepMetrics(3, 2.0, 0.5, 130, None))
    assert isinstance(note, NoticeEvent) and "IndexError: out of range" in note.message
    assert "Step 4" in lost.message and "4 samples train again" in lost.message
    assert "No space left" in io.message and t.take() == []


def test_a_checkpoint_without_a_step_of_its_own():
    """Step 0 (nothing trained) is no checkpoint to list; a resumed step keeps its metrics."""
    t = EventTranslator(trained_tokens=0, resumed=None)
    t.feed(CheckpointSaved(0.0, 0, "/ck/checkpoint-000000"))
    assert t.take() == []
    resumed = StepMetrics(8, 1.5, 0.7, 800, 1.6)
    t = EventTranslator(trained_tokens=800, resumed=resumed)
    t.feed(CheckpointSaved(0.0, 8, "/ck/checkpoint-000008"))
    assert t.take() == [CheckpointEvent(Path("/ck/checkpoint-000008"), resumed)]


def stats(tokens, skips, busy):
    return CoServeStats(tokens, tokens // 10, 0, 0, 0, 0, 0, 0, 0, 0, None, skips,
                        ft_tokens_admitted=tokens + 5, steps_timed=tokens // 100,
                        step_time_predicted_s=0.5, step_time_measured_s=0.25,
                        backward_busy_s=busy)


def test_totals_count_only_what_each_job_trained_here():
    """A resumed job's co-server starts from its checkpoint's counts: only the difference
    since it was attached is this server's."""
    job1 = FineTuningTotals().plus(stats(1000, {"pool_empty": 3}, 2.0), stats(0, {}, 0.0))
    job2 = job1.plus(stats(1500, {"pool_empty": 4, "over_budget": 2}, 3.0),
                     stats(800, {"pool_empty": 1}, 0.5))  # resumed at 800 tokens
    assert job2.tokens_committed == 1000 + 700 and job2.samples_committed == 100 + 70
    assert job2.skips == {"pool_empty": 6, "over_budget": 2}
    assert job2.backward_busy_s == pytest.approx(2.0 + 2.5)
    assert job2.tokens_admitted == (1005 - 5) + (1505 - 805)
    lost = FineTuningTotals().plus(replace(stats(10, {}, 0.0), steps_lost={"RuntimeError": 3}),
                                   replace(stats(0, {}, 0.0), steps_lost={"RuntimeError": 1}))
    assert lost.steps_lost == {"RuntimeError": 2}


class _FailingJobHost:
    """A host whose co-server gives up training right after the job starts."""

    def __init__(self):
        self.detached: list[tuple[bool, bool]] = []
        self.listeners = []

    def attach(self, **kw):
        host = self

        class _Co:
            def subscribe(self, listener):
                host.listeners.append(listener)

            def stats(self):
                return stats(0, {}, 0.0)

        return _Co()

    def detach(self, *, drain, checkpoint):
        self.detached.append((drain, checkpoint))


@pytest.mark.parametrize("cause", [None, "the data-parallel group lost a member"])
def test_a_job_whose_training_gave_up_fails_with_the_reason(tmp_path, cause):
    from deltaserve.core.slo import SLOConfig
    from deltaserve.server.coserving_runner import CoServingRunner
    from deltaserve.server.protocols import (
        FailedEvent,
        TrainingHyperparameters,
        TrainingJobSpec,
    )
    from deltaserve.train.config import CoServeConfig
    from deltaserve.train.events import TrainingStopped
    from tests.train import fixtures as fx

    host = _FailingJobHost()
    runner = CoServingRunner(host, CoServeConfig(slo=SLOConfig(1.0, 0.5)), None, 64)
    runner.start(TrainingJobSpec("job-1", "tiny", tuple(fx.samples(4)), (),
                                 TrainingHyperparameters(1, 1e-3, 64), 0, tmp_path, 10))
    reason = "ValueError: the batch has no response tokens to learn from"
    for listener in host.listeners:
        listener(StepLost(0.0, 0, 4, "Traceback ...\n" + reason))
        listener(TrainingStopped(0.0, reason, 5 if cause is None else 1, cause))
    events = runner.poll()
    assert isinstance(events[0], NoticeEvent)  # the lost step
    assert isinstance(events[-1], FailedEvent) and events[-1].code == "training_failed"
    assert reason in events[-1].message
    if cause is None:
        assert "5 optimizer steps in a row" in events[-1].message
    else:  # a group that lost a member stops at its first lost step: no run of them
        assert cause in events[-1].message and "in a row" not in events[-1].message
    assert host.detached == [(False, True)]  # detached: the host serves inference alone
    assert runner.poll() == []
