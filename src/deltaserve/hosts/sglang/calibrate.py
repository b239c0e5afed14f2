"""Start-up calibration through SGLang's own scheduling and forward path: its prober runs each
probe of the plan (the loop around it is :mod:`deltaserve.core.calibration_loop`).

Each probe becomes real SGLang work: hidden requests (never streamed) queued in SGLang's
waiting queue, batched by its scheduler and run by its model runner, with the co-server's step
protocol in place: a stand-in co-server (:class:`_ProbeCoServer`) hands the scheduler the
probe's training rows (on a stand-in adapter with the co-server's LoRA config, captured into a
scratch buffer of its size) and receives every step's :class:`StepReport`, i.e. the shape SGLang
really ran and its time, exactly as co-serving will. Decode probes hold ``B`` requests sharing
one cached prompt of ``kv`` tokens (SGLang's radix cache, under a key of their own), so setting
up a large decode batch costs one prefill. One untimed run precedes the timed repeats of every
probe.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Sequence
from typing import Protocol

import torch

from deltaserve.core.admission import AdmissionPlan, SchedulingView
from deltaserve.core.calibration import CalibrationProbe, HostLimits, ProbeKind
from deltaserve.core.calibration_loop import ProbeTiming
from deltaserve.core.contract import CoServingHooks, StepReport, TrainingRows
from deltaserve.hosts.base import RESERVED_ADAPTER_PREFIX
from deltaserve.hosts.probe import ProbeStep
from deltaserve.hosts.sglang.scheduler import CoServingScheduler
from deltaserve.model.config import ModelConfig
from deltaserve.model.lora import AdapterWeights, LoRAConfig

CALIBRATION_ADAPTER = f"{RESERVED_ADAPTER_PREFIX}calibration"


class _ProbeCoServer:
    """The co-server's hooks during calibration: the next step carries ``rows``; every report
    is kept."""

    def __init__(self, scratch: torch.Tensor):
        self.scratch = scratch
        self.rows = TrainingRows()
        self.reports: list[StepReport] = []

    def plan(self, view: SchedulingView) -> ProbeStep:
        rows, self.rows = self.rows, TrainingRows()
        return ProbeStep(AdmissionPlan((), view.proposed.with_ft(rows.lengths)
                                       if rows.num_samples else view.proposed,
                                       None, 0.0, None), rows, self.scratch)

    def observe(self, report: StepReport) -> None:
        self.reports.append(report)

    def on_arrival(self) -> None: ...

    def wants_step(self) -> bool:
        return False

    def idle(self, timeout_s: float) -> None: ...

    def yield_budget_s(self, view: SchedulingView) -> float:
        return 0.0

    def yield_to_backward(self, seconds: float, wake: threading.Event) -> float:
        return 0.0


class ProbedPort(Protocol):
    """What a probe needs of the training side over one scheduler (its
    ``SchedulerTrainingHost`` is one; naming these here instead keeps this module below
    ``training.py``, which builds the prober)."""

    scheduler: CoServingScheduler

    @property
    def limits(self) -> HostLimits: ...

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def has_unfinished(self) -> bool: ...

    def load_weights(self, name: str, adapter: AdapterWeights, *, pinned: bool = False
                     ) -> str: ...

    def unload(self, name: str, lora_id: str) -> None: ...


class SGLangProber:
    """Runs probes on an idle scheduler with the stand-in co-server and adapter (PEFT's initial
    weights for ``lora``) in place from ``open`` to ``close``."""

    def __init__(self, port: ProbedPort, lora: LoRAConfig, *, seed: int = 0):
        self.port, self.sched = port, port.scheduler
        self.lora, self.seed = lora, seed
        self.vocab = port.model_config.vocab_size
        self.rng = random.Random(seed)
        self._saved: tuple[CoServingHooks | None, str | None] | None = None
        self.lora_id: str | None = None
        self._co: _ProbeCoServer | None = None

    @property
    def limits(self) -> HostLimits:
        return self.port.limits

    def open(self, plan: Sequence[CalibrationProbe]) -> None:
        if self.port.has_unfinished():
            raise RuntimeError("calibrate an idle SGLang: requests are in flight")
        mc = self.port.model_config
        adapter = AdapterWeights(mc, self.lora).init_peft_(self.seed)
        self._saved = (self.sched.deltaserve_co, self.sched.deltaserve_train_lora_id)
        self.lora_id = self.port.load_weights(CALIBRATION_ADAPTER, adapter)
        self._co = _ProbeCoServer(torch.empty(mc.num_layers, self.limits.max_tokens_per_step,
                                              mc.hidden_size, dtype=self.port.dtype))
        self.sched.deltaserve_co, self.sched.deltaserve_train_lora_id = self._co, self.lora_id

    def close(self) -> None:
        if self._saved is not None:
            self.sched.deltaserve_co, self.sched.deltaserve_train_lora_id = self._saved
        if self.lora_id is not None:
            self.port.unload(CALIBRATION_ADAPTER, self.lora_id)
        self._saved = self.lora_id = self._co = None

    @property
    def co(self) -> _ProbeCoServer:
        """The stand-in co-server (between ``open`` and ``close``)."""
        assert self._co is not None, "open the prober first"
        return self._co

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def _add(self, tokens: list[int], max_new_tokens: int = 1, key: str | None = None) -> None:
        self.sched.deltaserve_hidden.add(tokens, lora_id=None, max_new_tokens=max_new_tokens,
                                         cache_key=key)

    def _step(self) -> StepReport:
        """One step that must run; its report."""
        self.co.reports.clear()
        if not self.sched.deltaserve_step():
            raise RuntimeError("calibration: SGLang ran nothing for a probe")
        report = self.co.reports[-1]
        if report.aborted:
            raise RuntimeError(f"calibration: SGLang did not run the probe's training rows "
                               f"whole ({report.shape})")
        return report

    def _finish(self) -> None:
        idle = 0
        while self.sched.deltaserve_has_unfinished():
            idle = 0 if self.sched.deltaserve_step() else idle + 1
            if idle > 100:  # SGLang holds requests it cannot schedule: a probe too large
                raise RuntimeError("calibration: SGLang cannot run a probe's requests")

    def time(self, probe: CalibrationProbe) -> Sequence[ProbeTiming]:
        """The shape a probe ran as (its first timed step's) and the seconds of its timed
        repeats."""
        if probe.kind is ProbeKind.DECODE_GRID:
            reports = self._decode(probe)
        else:
            reports = self._prefill(probe)
        timed = reports[1:]  # the first run of a shape warms caches and allocators
        return [ProbeTiming(timed[0].shape, tuple(r.seconds for r in timed))]

    def _prefill(self, probe: CalibrationProbe) -> list[StepReport]:
        """Fresh prompts (behind ``prefix_len`` tokens cached under the probe's key) and the
        probe's training rows, one step per run."""
        key = uuid.uuid4().hex
        prefix = self._tokens(probe.prefix_len)
        if prefix:
            self._add(prefix, key=key)
            self._finish()
        reports = []
        for _ in range(probe.repeats + 1):
            for n in probe.shape.prefill_lens:
                self._add(prefix + self._tokens(n), key=key)
            lens = probe.shape.ft_lens
            self.co.rows = TrainingRows(tuple(tuple(self._tokens(n)) for n in lens))
            reports.append(self._step())
            self._finish()
        return reports

    def _decode(self, probe: CalibrationProbe) -> list[StepReport]:
        """``B`` requests on one cached prompt: the first prefills it, the others then find it
        in the radix cache (one new token each), then every timed step decodes all ``B``."""
        b, key, runs = probe.shape.num_decode, uuid.uuid4().hex, probe.repeats + 1
        prompt = self._tokens(probe.kv_per_decode)
        self._add(prompt, runs + 1, key)
        while self.sched.waiting_queue or self.sched.chunked_req is not None:
            self._step()
        for _ in range(b - 1):
            self._add(prompt, runs + 1, key)
        if b > 1:
            self._step()
        reports = [self._step() for _ in range(runs)]
        self._finish()
        if not all(r.shape.num_decode == b for r in reports):
            raise RuntimeError(f"calibration: decode probe of {b} ran as "
                               f"{[r.shape for r in reports]}")
        return reports

