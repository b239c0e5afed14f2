"""A repeat's window splits into inference steps, training steps, the host's own work, the
backward and the unused rest, each summed by hand here; a backward job that straddles the
window's end counts by the share inside it; and the ceiling is 1 exactly for a repeat that left
nothing unused and forwarded every training token at the mixed-step cost (no policy could
train more), above 1 by the closed form otherwise."""

from __future__ import annotations

import gzip
import json

import pytest

from deltaserve.bench.machine_time import (
    RepeatTime,
    analyse_run,
    ceiling,
    main,
    repeat_time,
    system_of,
)
from deltaserve.bench.step_log import step_row
from deltaserve.core.contract import StepRecord
from deltaserve.core.shape import ExecMode, StepShape


def _step(end_s: float, seconds: float, span_s: float, *, prefill: tuple[int, ...] = (),
          decode: int = 0, ft: tuple[int, ...] = (), yielded_s: float = 0.0) -> dict:
    shape = StepShape(prefill, decode, 64 if decode else 0, ft, ExecMode.EAGER)
    return step_row(StepRecord(end_s, shape, seconds, sum(ft), False, yielded_s,
                               span_s=span_s), None)


def _job(end_s: float, wall_s: float, paused_s: float, tokens: int) -> dict:
    return {"event": "OptimizerStep", "at_s": end_s, "wall_s": wall_s, "paused_s": paused_s,
            "num_tokens": tokens}


STEPS = [
    _step(100.5, 0.5, 0.6, prefill=(40,)),  # starts the window at 100.0; host 0.1
    _step(101.0, 0.2, 0.5, ft=(50, 50), yielded_s=0.2),  # training-only: host 0.1
    _step(102.0, 0.4, 0.45, decode=4, ft=(30,)),  # mixed: host 0.05
    _step(103.0, 0.1, 0.1, decode=4),  # host 0
    _step(111.0, 0.3, 0.4, decode=4),  # past the 10-s window: left out
]
TRAIN = [_job(104.0, 2.0, 1.0, 100),  # inside: 1.0 s busy, 100 tokens
         _job(111.0, 2.0, 0.5, 80)]  # [109, 111]: half inside, 0.75 s busy and 40 tokens


def test_a_window_splits_into_what_ran_in_it():
    t = repeat_time(STEPS, TRAIN, window_s=10.0)
    assert t.inference_step_s == pytest.approx(0.6)
    assert t.ft_step_s == pytest.approx(0.6)
    assert t.host_s == pytest.approx(0.25)
    assert t.backward_s == pytest.approx(1.75)
    assert t.backward_tokens == pytest.approx(140)
    assert t.unused_s == pytest.approx(10.0 - 0.6 - 0.6 - 0.25 - 1.75)
    assert t.ft_tokens_forwarded == 130
    assert t.ft_only_tokens_per_s == pytest.approx(100 / 0.2)
    assert t.backward_tokens_per_s == pytest.approx(140 / 1.75)


def _repeat(ft_step_s: float, backward_s: float, unused_s: float, tokens: float) -> RepeatTime:
    return RepeatTime(window_s=10.0, inference_step_s=5.0, ft_step_s=ft_step_s, host_s=1.0,
                      backward_s=backward_s, unused_s=unused_s, ft_tokens_forwarded=int(tokens),
                      backward_tokens=tokens, ft_only_tokens_per_s=None,
                      backward_tokens_per_s=tokens / backward_s)


def test_the_ceiling_is_one_where_no_policy_could_train_more():
    gamma_s, tokens, backward_rate = 1e-3, 1000.0, 400.0
    best = _repeat(tokens * gamma_s, tokens / backward_rate, 0.0, tokens)
    assert ceiling(best, gamma_s) == pytest.approx(1.0)
    # the same tokens forwarded at 2 ms each, and 0.5 s left unused
    worse = _repeat(tokens * 2e-3, tokens / backward_rate, 0.5, tokens)
    assert ceiling(worse, gamma_s) == pytest.approx((2.0 + 2.5 + 0.5) / 3.5)
    assert ceiling(_repeat(1.0, 1.0, 0.0, 0.0), gamma_s) is None  # nothing trained


def _write_run(tmp_path, names):
    for d in ("steps", "train"):
        (tmp_path / d).mkdir()
    for name in names:
        (tmp_path / "steps" / f"{name}.jsonl.gz").write_bytes(
            gzip.compress("".join(json.dumps(r) + "\n" for r in STEPS).encode()))
        (tmp_path / "train" / f"{name}.jsonl.gz").write_bytes(gzip.compress("".join(
            json.dumps(r) + "\n" for r in [*TRAIN, {"event": "CheckpointSaved"}]).encode()))
    (tmp_path / "steps" / "inference-only-1.jsonl.gz").write_bytes(
        gzip.compress(json.dumps(STEPS[0]).encode()))
    (tmp_path / "results.json").write_text(json.dumps({"window_s": 10.0}))


def test_a_committed_run_folder_is_read_per_system(tmp_path, capsys):
    _write_run(tmp_path, ["deltaserve-2-1", "deltaserve-2-2", "llmstation-2-1"])
    report = analyse_run(tmp_path, 10.0)
    assert sorted(report["systems"]) == ["deltaserve", "llmstation"]  # no trainer log: out
    ds = report["systems"]["deltaserve"]
    assert len(ds["repeats"]) == 2 and ds["median"]["backward_s"] == pytest.approx(1.75)
    out = tmp_path / "mt.json"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["window_s"] == 10.0
    assert "deltaserve: inference steps 0.6 s" in capsys.readouterr().out


def test_a_folder_without_training_logs_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no step and trainer logs"):
        analyse_run(tmp_path, 10.0)


@pytest.mark.parametrize(("name", "system"), [
    ("deltaserve-2-3", "deltaserve"), ("deltaserve-pipeline-1.5-1", "deltaserve-pipeline"),
    ("inference-only-2", "inference-only"), ("llmstation-1", "llmstation")])
def test_a_log_name_gives_its_system(name, system):
    assert system_of(name) == system
