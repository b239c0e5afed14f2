"""The ``greedy`` controls: co-serving that admits up to the step limit, blind to Δ.

``greedy`` keeps every rule of Algorithm 1 that is about capacity (nothing while the backward
runs unless pipelined, a full buffer, an empty pool, the host's per-step token and sequence
limits, ``max_ft_tokens_per_step``, the backward batch being filled) and drops the one about
time: the latency model and the requests' slack play no part in what it admits (nor the reserve
a yield kept). Everything else is DeltaServe's, the yields to the backward included: on a host
that lends the machine to the backward between steps (the ``exclusive`` grant), each yield is
priced against the requests' slack less the measured reserve (:mod:`deltaserve.core.yield_reserve`)
as ``deltaserve``'s are. So ``greedy`` / ``deltaserve`` differ in admission alone, and where
``greedy`` misses the SLO, Δ-blind admission is what it costs.

``greedy-fixed-yield`` (:class:`GreedyFixedYieldScheduler`) is ``greedy`` with its yields blind
to Δ too: while the backward has work, every step is preceded by the longest yield the
co-server allows (``max_yield_s``, the cap of the priced yields), whatever the requests' slack;
paired with ``greedy``, it differs in the yields alone. Nothing it does depends on the SLO, so one
run of it can be scored against every SLO of a sweep.

Their purpose is to prove an SLO binds: if ``greedy`` meets the SLO as well as ``deltaserve``,
the SLO is too loose to tell a policy that prices its admission from one that does not.
"""

from __future__ import annotations

import math

from deltaserve.core.admission import AdmissionPlan, AdmissionScheduler, SchedulingView, Skip
from deltaserve.core.slo import NO_LOOKAHEAD, Lookahead


class GreedyScheduler(AdmissionScheduler):
    """Admission blind to Δ; the yields priced as Algorithm 1's scheduler prices them."""

    def plan(self, view: SchedulingView, *, backward_running: bool = False,
             batch_room_tokens: int | None = None, reserve_s: float = 0.0,
             ahead: Lookahead = NO_LOOKAHEAD) -> AdmissionPlan:
        # blind to Δ, and so to the reserve a yield kept (reserve_s, ahead)
        proposed = view.proposed
        skip = self._gate(view, backward_running, batch_room_tokens)
        if skip is not None:
            return AdmissionPlan((), proposed, None, math.nan, skip)
        room_tokens, room_seqs, batch_room = self._room(proposed, batch_room_tokens)
        lens: list[int] = []
        tok, stop = 0, Skip.POOL_EMPTY
        for _, n in self.pool.iter_available():
            if tok >= batch_room:  # a sample may start only while the batch is short
                stop = Skip.BUFFER_FULL
                break
            if tok + n > room_tokens or len(lens) >= room_seqs:
                stop = Skip.BUFFER_FULL if tok + n > self.ledger.largest_free_run \
                    else Skip.STEP_LIMIT
                break
            lens.append(n)
            tok += n
        if not lens:
            return AdmissionPlan((), proposed, None, math.nan, stop)
        return self._admit(proposed, lens, None, self.model.predict(proposed.with_ft(
            tuple(lens))), stop)


class GreedyFixedYieldScheduler(GreedyScheduler):
    """:class:`GreedyScheduler` whose yields are blind to Δ too: the longest one allowed."""

    def yield_budget_s(self, view: SchedulingView, *, ahead: Lookahead = NO_LOOKAHEAD) -> float:
        return math.inf  # the co-server caps it at max_yield_s
