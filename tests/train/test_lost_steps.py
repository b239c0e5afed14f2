"""Lost optimizer steps: kinds, the log's cadence, the give-up rule, and the bench's exit."""

import logging

import pytest

from deltaserve import cli
from deltaserve.train.lost_steps import LostSteps, TrainingFailed, reason_kind, reason_summary

TRACE = ("Traceback (most recent call last):\n  File \"recompute.py\", line 83, in f\n"
         "    h = buffer.residual[layer].index_select(0, rows)\n"
         "RuntimeError: Expected all tensors to be on the same device, but got index is on cpu\n")


def test_kinds_are_bounded_labels():
    assert reason_kind(TRACE, process_died=False) == "RuntimeError"
    assert reason_kind("torch.OutOfMemoryError: CUDA out of memory", False) == "OutOfMemoryError"
    assert reason_kind("backward process died (exit code -9)", True) == "worker_died"
    assert reason_kind("something odd happened", False) == "error"
    assert reason_summary(TRACE).startswith("RuntimeError: Expected all tensors")


def test_each_reason_logs_once_then_at_running_counts(caplog):
    lost = LostSteps(stop_after=100)
    with caplog.at_level(logging.WARNING, logger="deltaserve"):
        for step in range(9):
            assert lost.lost(step, TRACE, process_died=False) is None
        lost.lost(9, "backward process died (exit code -9)", process_died=True)
    lines = [r.getMessage() for r in caplog.records]
    assert all(r.levelname == "WARNING" for r in caplog.records)
    # first of each reason in full; repeats at 2, 4, 8 on one line each (9 losses: 4 lines)
    assert len(lines) == 5
    assert "index_select" in lines[0]
    assert ["2 times" in lines[1], "4 times" in lines[2], "8 times" in lines[3]] == [True] * 3
    assert "exit code -9" in lines[4]
    assert lost.by_kind == {"RuntimeError": 9, "worker_died": 1}


def test_training_fails_after_consecutive_losses_only():
    lost = LostSteps(stop_after=3)
    assert lost.lost(0, TRACE, False) is None and lost.lost(1, TRACE, False) is None
    lost.committed()  # a step reached the adapter: the run trains
    assert lost.lost(2, TRACE, False) is None and lost.lost(3, TRACE, False) is None
    err = lost.lost(4, TRACE, False)
    assert isinstance(err, TrainingFailed) and err.lost_steps == 3
    assert err.reason.startswith("RuntimeError: Expected all tensors") and err.reason in str(err)


def test_a_bench_whose_training_failed_exits_non_zero_with_the_reason(monkeypatch, capsys):
    def failing_bench(cfg):
        raise TrainingFailed("ValueError: the batch has no response tokens to learn from", 5)

    monkeypatch.setattr(cli, "run_bench", failing_bench)
    assert cli.main(["bench"]) == 1
    err = capsys.readouterr().err
    assert "deltaserve: error: fine-tuning stopped" in err and "no response tokens" in err


def test_the_limit_is_checked():
    from deltaserve.core.errors import InputError
    from deltaserve.train.config import BackwardConfig

    with pytest.raises(InputError, match="stop_after_lost_steps"):
        BackwardConfig(stop_after_lost_steps=0)
