"""The systems the simulated bench compares: the CPU bench's own specs
(:mod:`deltaserve.bench.systems`), so both run the same policies.

Until the bench's ``greedy`` and ``llmstation-pipeline`` specs land on main, the two are defined
here from the same parts (:class:`GreedyScheduler` admits to the step limit, blind to Δ;
``llmstation-pipeline`` is the LLMStation policy with admission overlapping the backward). The
issue's spelling ``deltaserve-nointerrupt`` is accepted for ``deltaserve-no-interrupt``.
"""

from __future__ import annotations

import math

from deltaserve.bench.llmstation import LLMStationScheduler
from deltaserve.bench.systems import SystemSpec, parse_systems
from deltaserve.core.admission import AdmissionPlan, AdmissionScheduler, SchedulingView, Skip
from deltaserve.core.errors import InputError

ALIASES = {"deltaserve-nointerrupt": "deltaserve-no-interrupt"}


class GreedyScheduler(AdmissionScheduler):
    """Algorithm 1's capacity rules (backward, buffer, pool, step limits, the batch being
    filled) without its time rule: samples are added while they fit, whatever Δ is."""

    def yield_budget_s(self, view: SchedulingView) -> float:
        return 0.0

    def plan(self, view: SchedulingView, *, backward_running: bool = False,
             batch_room_tokens: int | None = None) -> AdmissionPlan:
        proposed = view.proposed
        skip = self._precheck(view, backward_running)
        if skip is None and batch_room_tokens is not None and batch_room_tokens <= 0:
            skip = Skip.BUFFER_FULL
        if skip is not None:
            return AdmissionPlan((), proposed, None, math.nan, skip)
        room = min(self.limits.max_tokens_per_step - proposed.num_tokens,
                   self.config.max_ft_tokens_per_step, self.ledger.largest_free_run)
        seqs = self.limits.max_seqs_per_step - proposed.num_seqs
        batch_room = math.inf if batch_room_tokens is None else batch_room_tokens
        lens: list[int] = []
        tok, stop = 0, Skip.POOL_EMPTY
        for n, count in self.pool.iter_buckets():
            k = min(count, (room - tok) // n, seqs - len(lens))
            if batch_room != math.inf:  # a sample may start while the batch is short
                k = min(k, max(0, -(-(batch_room - tok) // n)))
            lens += [n] * max(0, k)
            tok += n * max(0, k)
            if k < count:
                stop = Skip.BUFFER_FULL if tok >= batch_room else Skip.STEP_LIMIT
                break
        if not lens:
            return AdmissionPlan((), proposed, None, math.nan, stop)
        return self._admit(proposed, lens, None, math.nan, stop)


_FALLBACK = {
    "greedy": SystemSpec("greedy", coserve=True, scheduler_cls=GreedyScheduler),
    "llmstation-pipeline": SystemSpec("llmstation-pipeline", coserve=True,
                                      scheduler_cls=LLMStationScheduler, pipeline=True),
}


def sim_systems(text: str) -> tuple[SystemSpec, ...]:
    """The listed systems in order, each once."""
    names = [ALIASES.get(n.strip(), n.strip()) for n in text.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise InputError("systems", text, "list each system once")
    specs = []
    for name in names:
        try:
            specs.append(parse_systems(name)[-1])
        except InputError:
            if name not in _FALLBACK:
                raise
            specs.append(_FALLBACK[name])
    return tuple(specs)
