"""The step log round-trips every step, and the term analysis finds a term the model lacks: on
steps timed by a closed form with a per-decode cost, the fit with ``+decodes`` is exact under
cross-validation while the model's own terms are not, and the online error is the recorded
predictions'."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from deltaserve.bench.latency_terms import analyse, late_steps, main, noise_floor, step_gaps
from deltaserve.bench.step_log import read_steps, shape_of, step_row, write_steps
from deltaserve.core.contract import StepRecord
from deltaserve.core.latency_terms import features
from deltaserve.core.shape import ExecMode, StepShape


def test_a_step_log_round_trips_shape_seconds_and_prediction(tmp_path):
    a = StepShape((7, 3), 4, 120, (16,), ExecMode.EAGER, (0, 5), after_yield=True)
    b = StepShape((), 2, 40, (), ExecMode.GRAPH)
    steps = [StepRecord(1.0, a, 0.25, 16, False, 0.1), StepRecord(2.0, b, 0.05, 0, True)]
    path = write_steps(tmp_path / "s" / "x.jsonl", steps, {(a, 0.25): 0.2})
    rows = read_steps(path)
    assert [shape_of(r) for r in rows] == [a, b]
    assert shape_of(rows[0]).after_yield and not shape_of(rows[1]).after_yield
    assert [r["predicted_s"] for r in rows] == [0.2, None]
    assert rows[0]["yielded_s"] == 0.1 and rows[0]["ft_tokens"] == 16 and rows[1]["aborted"]
    packed = tmp_path / "x.jsonl.gz"  # as committed beside a run's results
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert read_steps(packed) == rows


def _closed_form_steps(per_decode_s: float, n: int = 120) -> list[dict]:
    """Mixed steps timed by fixed coefficients on the model's terms plus ``per_decode_s`` per
    decode; each recorded prediction is 10 % low."""
    rng = np.random.default_rng(1)
    coef = np.array([1e-6, 2e-4, 3e-4, 1e-6, 0.02, 1e-4])
    rows = []
    for _ in range(n):
        shape = StepShape((int(rng.integers(8, 128)),), int(rng.integers(0, 30)),
                          int(rng.integers(0, 2000)),
                          (int(rng.integers(8, 64)),) if rng.random() < 0.5 else ())
        seconds = float(np.dot(features(shape), coef) + per_decode_s * shape.num_decode)
        rows.append(step_row(StepRecord(0.0, shape, seconds, sum(shape.ft_lens), False),
                             seconds / 1.1))
    return rows


def test_the_analysis_finds_the_per_decode_cost_the_model_lacks():
    eq = analyse(_closed_form_steps(0.004), min_s=0.0, folds=5, seed=0)["mixed"]
    assert eq["+decodes"]["all"]["mape"] < 1e-6
    assert eq["model_terms"]["all"]["mape"] > 0.01
    assert eq["online"]["all"]["bias"] == pytest.approx(0.1)
    assert eq["online"]["all"]["mape"] == pytest.approx(1 / 11)
    # without the per-decode cost the model's own terms are exact already
    assert analyse(_closed_form_steps(0.0), 0.0, 5, 0)["mixed"]["model_terms"]["all"]["mape"] \
        < 1e-6


def test_the_fitted_costs_are_the_closed_form_ones():
    eq = analyse(_closed_form_steps(0.0), min_s=0.0, folds=5, seed=0)["mixed"]
    want = dict(alpha=1e-6, beta=2e-4, gamma=3e-4, epsilon=1e-6, c=0.02, zeta=1e-4)
    assert eq["coefficients"] == pytest.approx(want, rel=1e-6)
    alone = StepShape((), 0, 0, (40, 24))  # 64 training tokens and nothing else
    seconds = float(np.dot(features(alone), list(want.values())))
    rows = [step_row(StepRecord(0.0, alone, seconds, 64, False), None)] * 10
    eq = analyse(_closed_form_steps(0.0) + rows, 0.0, 5, 0)["mixed"]
    assert eq["ft_only_tokens_per_s"] == pytest.approx(64 / seconds)


def test_the_command_writes_its_report(tmp_path, capsys):
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _closed_form_steps(0.0)))
    assert main([str(path), "--min-ms", "0", "--out", str(tmp_path / "r.json")]) == 0
    assert "equation mixed" in capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["late"]["steps.jsonl"]["late"] == 0  # every prediction is 10 % low, no more


def test_late_steps_are_the_ones_at_or_past_the_ratio_with_their_time_and_yield():
    decode = StepShape((), 4, 100, ())
    steps = [(10.0, 0.0625, 0.0625, 0.0), (10.5, 0.2, 0.0625, 0.0), (11.0, 0.1875, 0.0625, 0.02),
             (11.5, 0.30, None, 0.0), (12.0, 0.001, 0.0005, 0.0)]
    rows = [step_row(StepRecord(t, decode, s, 0, False, y), p) for t, s, p, y in steps]
    late = late_steps(rows, ratio=3.0, min_s=0.01)
    # the unpredicted step and the one under min_s are not counted; 3.0x exactly is late
    assert late["steps"] == 3 and late["late"] == 2
    assert [(x["at_s"], x["ratio"], x["after_yield"]) for x in late["late_steps"]] == [
        (0.5, 3.2, False), (1.0, 3.0, True)]


def test_step_gaps_are_the_time_no_step_and_no_yield_holds_before_steps_with_decodes():
    decode, prefill = StepShape((), 4, 100, ()), StepShape((30,))
    # (end, seconds, yielded before it, shape): starts at 0.9, 1.3, 1.95, 2.5
    steps = [(1.0, 0.1, 0.0, prefill), (1.5, 0.2, 0.1, decode), (2.0, 0.05, 0.0, decode),
             (2.6, 0.1, 0.0, prefill)]
    # the garbage collector held the process 30 ms before the last decode step's record
    rows = [step_row(StepRecord(t, sh, s, 0, False, y, hooks_s=0.05, gc_s=0.03 * (t == 2.0)),
                     None) for t, s, y, sh in steps]
    g = step_gaps(rows)
    assert g["hooks_p50_ms"] == pytest.approx(50.0)
    assert g["long_gaps_ms"] == [{"gap_ms": 200.0, "hooks_ms": 50.0, "gc_ms": 0.0},
                                 {"gap_ms": 450.0, "hooks_ms": 50.0, "gc_ms": 30.0}]
    # logs written before the collector's time was recorded hold none
    old = [{k: v for k, v in r.items() if k != "gc_s"} for r in rows]
    assert [x.keys() for x in step_gaps(old)["long_gaps_ms"]] == [{"gap_ms", "hooks_ms"}] * 2
    # before the first decode step: 1.3 - 1.0 - 0.1 yielded = 0.2; before the second: 0.45;
    # the gap before the prefill-only step has no request decoding through it
    assert g["gaps"] == 2 and g["over_100ms"] == 2
    assert g["max_ms"] == pytest.approx(450.0) and g["p50_ms"] == pytest.approx(325.0)
    assert step_gaps(rows[:1]) == {"gaps": 0}


def test_step_gaps_split_a_gap_into_the_hosts_step_and_the_time_outside_it():
    decode = StepShape((), 4, 100, ())
    # the second step: planned at 1.6 (span 0.4), yielded 0.1, ran 0.05 from 1.95 to 2.0; the
    # first step ended at 1.5, so 0.1 of the gap before it passed outside the host's step
    rows = [step_row(StepRecord(1.5, decode, 0.2, 0, False), None),
            step_row(StepRecord(2.0, decode, 0.05, 0, False, 0.1, span_s=0.4), None)]
    gap = step_gaps(rows)["long_gaps_ms"]
    assert gap == [{"gap_ms": 350.0, "hooks_ms": 0.0, "host_ms": 250.0, "outside_ms": 100.0,
                    "gc_ms": 0.0}]


def test_the_noise_floor_is_each_decode_step_against_its_same_shape_neighbours():
    # seven decode steps of one shape (KV growing 4 a step), the middle one an outlier at 2x,
    # then a prefill and a decode of another size, which are no one's neighbours
    def d(i: int) -> StepShape:
        return StepShape((), 4, 1000 + 4 * i, ())

    times = [0.05, 0.05, 0.05, 0.10, 0.05, 0.05, 0.05]
    steps = [(d(i), t) for i, t in enumerate(times)] + [(StepShape((30,)), 0.2),
                                                        (StepShape((), 9, 300, ()), 0.07)]
    rows = [step_row(StepRecord(float(i), s, t, 0, False), 0.05)
            for i, (s, t) in enumerate(steps)]
    # three either side: every one of the seven has >= 3 same-shape neighbours, whose median
    # is 0.05; only the outlier is off it (by 0.05 of its 0.10); the last step has none
    floor = noise_floor(rows, min_s=0.01, neighbours=3)
    assert floor["steps"] == 7
    assert floor["neighbour_mape"] == pytest.approx(0.5 / 7)
    assert floor["model_mape"] == pytest.approx(0.5 / 7)  # the prediction is 0.05 throughout
    # one either side: the ends have a single neighbour (left out); steps 2 and 4 have the
    # outlier beside them (median 0.075, 0.5 off), and it has two 0.05s (0.5 off)
    narrow = noise_floor(rows, min_s=0.01, neighbours=1)
    assert narrow["steps"] == 5 and narrow["neighbour_mape"] == pytest.approx(1.5 / 5)
    assert noise_floor(rows, min_s=0.2, neighbours=3) == {"steps": 0}
