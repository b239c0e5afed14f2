"""The shared calibration loop against a closed form: a fake prober whose repeats take a known
linear function of the planned shape (Equations I and II, one set of coefficients per mode) must
be fitted back to those coefficients, probe by probe in the plan's order, whether it times on
the spot or waits for host steps."""

from __future__ import annotations

import ast
from collections.abc import Generator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

import deltaserve
from deltaserve.core.calibration import (
    Batching,
    CalibrationConfig,
    CalibrationProbe,
    HostLimits,
    build_plan,
)
from deltaserve.core.calibration_loop import (
    ProbeTiming,
    calibration_steps,
    run_calibration,
)
from deltaserve.core.errors import InputError
from deltaserve.core.latency_model import Equation, LatencyModel
from deltaserve.core.shape import ExecMode, StepShape

LIMITS = HostLimits(max_tokens_per_step=256, max_seqs_per_step=16, max_model_len=256,
                    max_kv_tokens=4096, batching=Batching.MIXED)
CONFIG = CalibrationConfig(repeats=3)
# Equation I (α Σ(n² + 2np) over inference chunks and fine-tuning samples + β rows + γ T_ft
# + ε K + c + ζ rows·[T_ft > 0]) and Equation II (β' B_d + ε' K + c'), in seconds; decodes
# replayed as graphs cost less than eager ones
MIXED = dict(alpha=3e-7, beta=2e-5, gamma=6e-5, epsilon=5e-7, c=1.5e-3, zeta=2e-5)
DECODE = {ExecMode.EAGER: dict(beta=3e-4, epsilon=1e-6, c=1e-3),
          ExecMode.GRAPH: dict(beta=1e-4, epsilon=1e-6, c=4e-4)}
# each probe's repeats: the closed form, one slow run and one fast one. Their median is the
# closed form; their mean is not (it is 7 % over), so a loop fitting the mean misses.
SPREAD = (1.3, 1.0, 0.91)


def closed_form_s(s: StepShape) -> float:
    if s.is_decode_only:
        k = DECODE[s.mode]
        return k["beta"] * s.num_decode + k["epsilon"] * s.kv_tokens + k["c"]
    prefixes = s.prefill_prefix_lens or (0,) * len(s.prefill_lens)
    quadratic = sum(n * n + 2 * n * p for n, p in zip(s.prefill_lens, prefixes, strict=True))
    quadratic += sum(m * m for m in s.ft_lens)  # a fine-tuning sample is a prefill of its own
    rows = sum(s.prefill_lens) + s.num_decode
    ft = sum(s.ft_lens)
    return (MIXED["alpha"] * quadratic + MIXED["beta"] * rows + MIXED["gamma"] * ft
            + MIXED["epsilon"] * s.kv_tokens + MIXED["c"] + (MIXED["zeta"] * rows if ft else 0.0))


def ways(probe: CalibrationProbe) -> list[StepShape]:
    """As on a graph host: a decode-only probe runs replayed and eager."""
    if probe.shape.is_decode_only:
        return [replace(probe.shape, mode=ExecMode.GRAPH), probe.shape]
    return [probe.shape]


class FakeProber:
    """Times on the spot; records what the loop asked of it."""

    limits = LIMITS

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.timed: list[CalibrationProbe] = []
        self.events: list[str] = []

    def open(self, plan: Sequence[CalibrationProbe]) -> None:
        self.events.append(f"open {len(plan)}")

    def time(self, probe: CalibrationProbe) -> Sequence[ProbeTiming]:
        if len(self.timed) == self.fail_at:
            raise RuntimeError("the host failed a probe")
        self.timed.append(probe)
        assert probe.repeats == CONFIG.repeats
        return [ProbeTiming(s, tuple(closed_form_s(s) * f for f in SPREAD)) for s in ways(probe)]

    def close(self) -> None:
        self.events.append("close")


class SteppedFakeProber(FakeProber):
    """Waits for one host step per repeat; the host sends the step's seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: StepShape | None = None  # what the host's next step runs

    def time(self, probe: CalibrationProbe) -> Generator[None, float, Sequence[ProbeTiming]]:
        self.timed.append(probe)
        timings = []
        for shape in ways(probe):
            seconds = []
            for _ in SPREAD:
                self.pending = shape
                seconds.append((yield))
            timings.append(ProbeTiming(shape, tuple(seconds)))
        return timings


def assert_recovers_the_closed_form(lm: LatencyModel) -> None:
    keys = {(q.equation, q.mode) for q in lm.quality()}
    assert keys == {(Equation.MIXED, ExecMode.EAGER), (Equation.DECODE, ExecMode.EAGER),
                    (Equation.DECODE, ExecMode.GRAPH)}
    for name, want in MIXED.items():
        assert lm.coefficients(Equation.MIXED, ExecMode.EAGER)[name] == pytest.approx(
            want, rel=1e-6), name
    for mode, coefs in DECODE.items():
        for name, want in coefs.items():
            assert lm.coefficients(Equation.DECODE, mode)[name] == pytest.approx(
                want, rel=1e-6), (mode, name)


def test_the_loop_fits_the_median_of_each_timing_back_to_the_closed_form():
    prober = FakeProber()
    lm = run_calibration(prober, CONFIG, progress=False)
    assert prober.timed == list(build_plan(LIMITS, CONFIG))  # every probe once, in plan order
    assert prober.events == [f"open {len(prober.timed)}", "close"]
    assert_recovers_the_closed_form(lm)


def test_a_prober_that_waits_for_host_steps_runs_the_same_loop():
    prober = SteppedFakeProber()
    steps = calibration_steps(prober, CONFIG, progress=False)
    next(steps)
    host_steps = 0
    with pytest.raises(StopIteration) as done:
        while True:
            assert prober.pending is not None
            host_steps += 1
            factor = SPREAD[(host_steps - 1) % len(SPREAD)]
            steps.send(closed_form_s(prober.pending) * factor)
    lm = done.value.value
    plan = build_plan(LIMITS, CONFIG)
    assert prober.timed == list(plan)
    assert host_steps == len(SPREAD) * sum(len(ways(p)) for p in plan)
    assert prober.events[-1] == "close"
    assert_recovers_the_closed_form(lm)
    synchronous = run_calibration(FakeProber(), CONFIG, progress=False)
    for key in ((Equation.MIXED, ExecMode.EAGER), (Equation.DECODE, ExecMode.GRAPH)):
        assert lm.coefficients(*key) == synchronous.coefficients(*key)


def test_the_prober_is_closed_when_a_probe_fails():
    prober = FakeProber(fail_at=3)
    with pytest.raises(RuntimeError, match="failed a probe"):
        run_calibration(prober, CONFIG, progress=False)
    assert prober.events[-1] == "close" and len(prober.timed) == 3


def test_an_abandoned_stepped_run_closes_its_prober():
    prober = SteppedFakeProber()
    steps = calibration_steps(prober, CONFIG, progress=False)
    next(steps)
    steps.close()  # the host went away mid-probe
    assert prober.events[-1] == "close"


def test_a_timing_needs_a_timed_run():
    with pytest.raises(InputError, match="seconds"):
        ProbeTiming(StepShape((8,)), ())


def test_no_host_runs_the_plan_itself():
    """The loop is written once: hosts supply a prober and never build the plan (issue 22)."""
    hosts = Path(deltaserve.__file__).parent / "hosts"
    callers = []
    for path in sorted(hosts.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else \
                    func.attr if isinstance(func, ast.Attribute) else None
                if name == "build_plan":
                    callers.append(str(path.relative_to(hosts)))
    assert not callers
