"""The service's :class:`ServingStats` over a real host and its training runner.

Each number is read where it is kept as production state:

=============================  ===============================================================
snapshot field                  source
=============================  ===============================================================
ft_tokens/samples_committed,    the co-servers' counters (``CoServer.stats``), summed over the
ft_tokens_admitted,             jobs since start-up by the runner (:meth:`CoServingRunner.
admission_skips, steps,         totals`); steps are those the latency model had predicted
step_time_predicted/measured_s  before they ran, while a job co-served
backward_busy_ratio             the backward's compute time (``CoServeStats.backward_busy_s``)
                                over the server's uptime
ft_steps_lost                   the co-servers' lost optimizer steps by kind (``CoServeStats.
                                steps_lost``), summed over the jobs like the counters above
latency_model_mape              the latency model's online error (``LatencyModel.
                                online_error``), all modes (and replicas) pooled, over its
                                error window
requests_finished, slo_misses,  the host's request counters (``BaseHost.request_counters``):
requests_slo_missed,            each finished request's TTFT and longest inter-token gap
inference_tokens                against the configured SLO
=============================  ===============================================================
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import fields

from deltaserve.core.admission import Skip
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.request_stats import RequestTotals
from deltaserve.hosts.base import BaseHost
from deltaserve.server.coserving_runner import CoServingRunner
from deltaserve.server.protocols import ServingStatsSnapshot


def online_mape(models: Sequence[LatencyModel | None]) -> float | None:
    """The online MAPE of every mode of every model pooled, weighted by steps (None before
    any). Read while the stepping threads record: at worst one of a window's rows is a step
    behind."""
    errors = [e for m in models if m is not None for e in m.online_error()]
    steps = sum(e.num_steps for e in errors)
    return sum(e.mape * e.num_steps for e in errors) / steps if steps else None


def request_totals(hosts: Sequence[BaseHost]) -> RequestTotals:
    """The hosts' request counters, summed."""
    totals = [h.request_counters.totals() for h in hosts]
    return RequestTotals(*(sum(getattr(t, f.name) for t in totals)
                           for f in fields(RequestTotals)))


class HostServingStats:
    """Over one host, or the replicas of ``serve --replicas`` (their request counters summed,
    their latency models' errors pooled, the backward's busy ratio per replica)."""

    def __init__(self, hosts: Sequence[BaseHost], runner: CoServingRunner):
        self.hosts = tuple(hosts)
        self.runner = runner
        self._start_s = time.monotonic()

    def snapshot(self) -> ServingStatsSnapshot:
        req = request_totals(self.hosts)
        ft = self.runner.totals()
        uptime_s = max(time.monotonic() - self._start_s, 1e-9) * len(self.hosts)
        skips = {reason: ft.skips.get(reason.value, 0) for reason in Skip}
        return ServingStatsSnapshot(
            ft_tokens_committed=ft.tokens_committed, ft_samples_committed=ft.samples_committed,
            ft_tokens_admitted=ft.tokens_admitted, admission_skips=skips,
            steps=ft.steps_timed, step_time_predicted_s=ft.step_time_predicted_s,
            step_time_measured_s=ft.step_time_measured_s,
            latency_model_mape=online_mape([h.latency_model for h in self.hosts]),
            slo_misses={"ttft": req.ttft_misses, "tpot": req.tpot_misses},
            requests_finished=req.finished, requests_slo_missed=req.slo_missed,
            inference_tokens=req.output_tokens,
            backward_busy_ratio=min(1.0, ft.backward_busy_s / uptime_s),
            ft_steps_lost=ft.steps_lost)
