"""The simulated bench's inputs: the trace at full scale and the fine-tuning samples."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.bench.sim.config import PRODUCTION_TRACE, PRODUCTION_WINDOW_S, SimBenchConfig
from deltaserve.core.data import DataConfig, DatasetReport, TrainingSample, load_dataset
from deltaserve.hosts.sim.catalogue import resolve_shared
from deltaserve.model.loading import load_tokenizer
from deltaserve.workloads.loaders import load_trace
from deltaserve.workloads.synthetic import SYNTHETIC
from deltaserve.workloads.trace import Trace

ALPACA = "alpaca/alpaca_5000.json"  # under the shared data
# the built-in model's tokenizer sizes the samples (Llama-3's is not available offline)
TOKENIZER = "smollm2"


def sim_trace(cfg: SimBenchConfig, max_total_tokens: int) -> Trace:
    """The trace as recorded or generated (lengths unscaled, each request clipped to the
    model's context), its rate times ``rate_scale``, cut to ``duration``."""
    if cfg.trace == "production":
        path = resolve_shared(PRODUCTION_TRACE, "trace")
        trace = load_trace(str(path)).window(0, cfg.duration_s or PRODUCTION_WINDOW_S)
        trace = Trace("production", trace.requests, trace.duration_s, trace.source)
    else:
        trace = load_trace(cfg.trace, seed=cfg.seed, duration_s=cfg.duration_s)
        if cfg.trace not in SYNTHETIC and cfg.duration_s and trace.duration_s > cfg.duration_s:
            trace = trace.window(0, cfg.duration_s)
    trace = trace.scale_lengths(1.0, max_total=max_total_tokens)
    return trace if cfg.rate_scale == 1.0 else trace.scale_rate(cfg.rate_scale, cfg.seed)


@dataclass(frozen=True)
class SimData:
    path: str
    samples: list[TrainingSample]
    report: DatasetReport


def sim_samples(cfg: SimBenchConfig) -> SimData:
    """Tokenized fine-tuning samples of at most ``max_sample_tokens`` (malformed records are
    skipped and counted in the report: the shared Alpaca set has a few empty outputs)."""
    path = str(resolve_shared(ALPACA, "dataset", cfg.dataset))
    samples, report = load_dataset(DataConfig(path, max_tokens=cfg.max_sample_tokens,
                                              skip_bad_rows=True),
                                   load_tokenizer(TOKENIZER))
    return SimData(path, samples, report)
