"""Watching a host and its co-server through the contract only: the steps a host records, and
the ``TrainingStep`` objects the co-server hands out (wrapped, so a test sees every hook call)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deltaserve.core.contract import StepRecord, StepReport, TrainingStep


class StepLog:
    """Every step a host runs, as :class:`StepRecord`."""

    def __init__(self, host):
        self.records: list[StepRecord] = []
        host.subscribe_steps(self.records.append)


@dataclass(eq=False)
class SpyStep:
    """A :class:`TrainingStep` that records its hook calls and delegates to the real one."""

    inner: TrainingStep
    backward_busy: bool
    after_capture: Callable[[SpyStep, int], None] | None = None
    verdicts: list[bool] = field(default_factory=list)
    captured: list[int] = field(default_factory=list)
    keep_hidden: bool = False
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> rows (keep_hidden)

    @property
    def plan(self):
        return self.inner.plan

    @property
    def rows(self):
        return self.inner.rows

    @property
    def abortable(self):
        return self.inner.abortable

    @property
    def saves_mlp(self):
        return self.inner.saves_mlp

    def capture(self, layer, hidden):
        self.inner.capture(layer, hidden)
        self.captured.append(layer)
        if self.keep_hidden:
            self.hidden[layer] = hidden.detach().clone()
        if self.after_capture is not None:
            self.after_capture(self, layer)

    def capture_mlp(self, layer, gate, up):
        self.inner.capture_mlp(layer, gate, up)

    def should_abort(self):
        verdict = self.inner.should_abort()
        self.verdicts.append(verdict)
        return verdict


class StepSpies:
    """Wraps ``co.plan``/``co.observe`` on one co-server: ``steps`` holds every step handed to
    the host that carried training rows, ``reports`` what the host reported for them;
    ``num_plans``/``num_reports`` count every step, with rows or not. ``keep_hidden``: each
    spy keeps the rows the host captured, per layer."""

    def __init__(self, co, after_capture=None, keep_hidden=False):
        self.steps: list[SpyStep] = []
        self.reports: list[StepReport] = []
        self.num_plans = self.num_reports = 0
        self.after_capture = after_capture
        plan, observe = co.plan, co.observe

        def spy_plan(view):
            busy = co.backward_busy
            step = plan(view)
            self.num_plans += 1
            if not step.rows.num_samples:
                return step
            spy = SpyStep(step, busy, self._after_capture, keep_hidden=keep_hidden)
            self.steps.append(spy)
            return spy

        def spy_observe(report):
            self.num_reports += 1
            if isinstance(report.step, SpyStep):
                self.reports.append(report)
                report = StepReport(report.step.inner, report.shape, report.seconds,
                                    report.aborted, report.layers_run)
            observe(report)

        co.plan, co.observe = spy_plan, spy_observe

    def _after_capture(self, spy, layer):
        if self.after_capture is not None:
            self.after_capture(spy, layer)


def spy_steps(co, after_capture=None, keep_hidden=False) -> StepSpies:
    return StepSpies(co, after_capture, keep_hidden)
