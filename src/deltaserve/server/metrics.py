"""``/metrics`` in Prometheus' text format, names in vLLM's style under ``deltaserve:``.

Each scrape reads one :class:`ServingStatsSnapshot` from the co-server and the job counts from
the store, so the numbers are the co-server's own (nothing is counted twice here). The registry
is the app's own, not prometheus-client's global one: two servers in one process (the tests)
never share a metric.

=============================================  =======  ======================================
name                                           type     meaning
=============================================  =======  ======================================
deltaserve:ft_tokens_committed_total           counter  fine-tuning tokens in the adapter
deltaserve:ft_samples_committed_total          counter  fine-tuning samples in the adapter
deltaserve:ft_tokens_admitted_total            counter  tokens admitted into host steps
deltaserve:admission_skips_total{reason}       counter  steps that admitted nothing (more)
deltaserve:ft_steps_lost_total{reason}         counter  optimizer steps lost (exception class,
                                                        or worker_died); samples train again
deltaserve:step_time_predicted_seconds         summary  the latency model's step predictions
deltaserve:step_time_measured_seconds          summary  measured step times
deltaserve:latency_model_mape                  gauge    online per-step error (refit window)
deltaserve:slo_misses_total{kind}              counter  requests over their TTFT / TPOT SLO
deltaserve:requests_finished_total             counter  inference requests finished
deltaserve:requests_slo_missed_total           counter  ... that missed either SLO
deltaserve:generation_tokens_total             counter  output tokens generated for clients
deltaserve:backward_busy_ratio                 gauge    share of time the backward computed
deltaserve:fine_tuning_jobs{status}            gauge    jobs in each state
=============================================  =======  ======================================
"""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from deltaserve.core.admission import Skip
from deltaserve.server.context import Svc
from deltaserve.server.protocols import ServingStats
from deltaserve.server.store import Store

PREFIX = "deltaserve:"
SLO_KINDS = ("ttft", "tpot")


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


class ServingCollector(Collector):
    def __init__(self, stats: ServingStats, store: Store):
        self.stats = stats
        self.store = store

    def collect(self) -> Iterator[Metric]:
        s = self.stats.snapshot()
        yield _counter("ft_tokens_committed", "Fine-tuning tokens committed to the adapter",
                       s.ft_tokens_committed)
        yield _counter("ft_samples_committed", "Fine-tuning samples committed to the adapter",
                       s.ft_samples_committed)
        yield _counter("ft_tokens_admitted", "Fine-tuning tokens admitted into host steps",
                       s.ft_tokens_admitted)
        skips = CounterMetricFamily(PREFIX + "admission_skips",
                                    "Host steps where admission stopped, by reason",
                                    labels=["reason"])
        for reason in Skip:
            skips.add_metric([reason.value], s.admission_skips.get(reason, 0))
        yield skips
        lost = CounterMetricFamily(PREFIX + "ft_steps_lost",
                                   "Optimizer steps lost (their samples train again), by reason",
                                   labels=["reason"])
        for reason, n in sorted(s.ft_steps_lost.items()):
            lost.add_metric([reason], n)
        yield lost
        for which, total in (("predicted", s.step_time_predicted_s),
                             ("measured", s.step_time_measured_s)):
            yield SummaryMetricFamily(PREFIX + f"step_time_{which}_seconds",
                                      f"Host step time, {which}", count_value=s.steps,
                                      sum_value=total)
        if s.latency_model_mape is not None:
            yield GaugeMetricFamily(PREFIX + "latency_model_mape",
                                    "Latency model's online per-step MAPE over its refit window",
                                    value=s.latency_model_mape)
        misses = CounterMetricFamily(PREFIX + "slo_misses", "Requests that missed an SLO",
                                     labels=["kind"])
        for kind in SLO_KINDS:
            misses.add_metric([kind], s.slo_misses.get(kind, 0))
        yield misses
        yield _counter("requests_finished", "Inference requests finished", s.requests_finished)
        yield _counter("requests_slo_missed", "Inference requests that missed TTFT or TPOT",
                       s.requests_slo_missed)
        yield _counter("generation_tokens", "Output tokens generated for clients",
                       s.inference_tokens)
        yield GaugeMetricFamily(PREFIX + "backward_busy_ratio",
                                "Share of wall time the backward process computed",
                                value=s.backward_busy_ratio)
        jobs = GaugeMetricFamily(PREFIX + "fine_tuning_jobs", "Fine-tuning jobs by status",
                                 labels=["status"])
        for status, n in self.store.job_status_counts().items():
            jobs.add_metric([status.value], n)
        yield jobs


def build_registry(stats: ServingStats, store: Store) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServingCollector(stats, store))
    return registry


router = APIRouter()


@router.get("/metrics")
async def metrics(svc: Svc) -> Response:
    return Response(generate_latest(svc.registry), media_type=CONTENT_TYPE_LATEST)
