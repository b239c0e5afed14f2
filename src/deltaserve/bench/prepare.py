"""What every system of a bench run shares: the data, the trace, the host's calibration."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from deltaserve.bench.config import BenchConfig
from deltaserve.bench.replay import PromptSource
from deltaserve.core import synthetic_task
from deltaserve.core.calibration import Batching, CalibrationConfig, HostLimits
from deltaserve.core.data import (
    DataConfig,
    DatasetReport,
    TrainingSample,
    load_dataset,
    read_conversations,
)
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.synthetic_task import TaskExample
from deltaserve.core.tokenizer import Tokenizer
from deltaserve.hosts.base import BaseHost
from deltaserve.hosts.registry import create_host
from deltaserve.model.loading import read_config
from deltaserve.workloads.loaders import load_trace
from deltaserve.workloads.scaling import auto_scale
from deltaserve.workloads.trace import Trace

NUM_TASK_SAMPLES = 2000  # the generated task's training split


def log(cfg: BenchConfig, msg: str) -> None:
    if cfg.progress:
        print(f"[bench] {msg}", flush=True)


def make_host(cfg: BenchConfig, threads: int) -> BaseHost:
    return create_host(cfg.host, replace(cfg.engine, num_threads=threads, seed=cfg.seed))


@dataclass(frozen=True)
class BenchData:
    path: str
    samples: list[TrainingSample]
    report: DatasetReport
    prompts: PromptSource
    heldout: list[TaskExample]


def load_data(cfg: BenchConfig, work: Path, tokenizer: Tokenizer) -> BenchData:
    """The fine-tuning data (the generated task unless ``--dataset``) and prompt text."""
    heldout: list[TaskExample] = []
    if cfg.dataset:
        data_path = cfg.dataset
    else:
        train, heldout = synthetic_task.generate(NUM_TASK_SAMPLES, cfg.heldout, cfg.seed)
        data_path = str(synthetic_task.write_jsonl(train, work / "data" / "train.jsonl"))
    data_cfg = DataConfig(data_path, max_tokens=cfg.engine.max_num_batched_tokens,
                          skip_bad_rows=cfg.skip_bad_rows)
    samples, report = load_dataset(data_cfg, tokenizer)
    convs, _ = read_conversations(replace(data_cfg, skip_bad_rows=True))
    prompts = PromptSource.from_texts(tokenizer, [m.content for c in convs[:3000]
                                                  for m in c.messages])
    log(cfg, f"dataset {data_path}: {report.num_samples} samples, {report.num_tokens} "
             f"tokens; skipped {report.num_bad_rows} bad rows, dropped "
             f"{report.num_dropped_overlength} longer than {data_cfg.max_tokens} tokens")
    return BenchData(data_path, samples, report, prompts, heldout)


@dataclass(frozen=True)
class FittedTrace:
    """The trace as replayed; ``capacity_rps`` None when ``--rate-scale`` fixed the factor."""

    trace: Trace
    rate_factor: float
    capacity_rps: float | None


def build_trace(cfg: BenchConfig, lm: LatencyModel, limits: HostLimits,
                replicas: int = 1) -> FittedTrace:
    """The trace, its lengths fitted to the model and its rate to the host's capacity
    (``replicas``: ``lm``'s host is one of that many replicas sharing the trace evenly, whose
    capacity is that many times one's)."""
    raw = load_trace(cfg.trace, seed=cfg.seed, duration_s=cfg.duration_s)
    if cfg.duration_s and raw.duration_s > cfg.duration_s:
        raw = raw.window(0, cfg.duration_s)
    sized = raw.scale_lengths(cfg.length_scale, max_prompt=cfg.max_prompt_tokens,
                              max_output=cfg.max_output_tokens, max_total=limits.max_model_len)
    if cfg.rate_scale is not None:
        trace, factor, capacity = sized.scale_rate(cfg.rate_scale, cfg.seed), cfg.rate_scale, None
    else:
        trace, factor, capacity = auto_scale(sized, lm, limits, peak_fraction=cfg.peak_fraction,
                                             seed=cfg.seed)
        if replicas > 1:
            factor, capacity = factor * replicas, capacity * replicas
            trace = sized.scale_rate(factor, cfg.seed)
    log(cfg, f"trace {trace.name}: {len(trace)} requests over {trace.duration_s:.0f} s, "
             f"peak {trace.peak_rate():.2f} req/s (rate x{factor:.4f}"
             + (f", capacity {capacity:.2f} req/s)" if capacity else ")"))
    return FittedTrace(trace, factor, capacity)


def host_limits(cfg: BenchConfig, model_path: Path) -> HostLimits:
    e = cfg.engine
    max_len = e.model_len(read_config(model_path).max_position_embeddings)
    return HostLimits(e.max_num_batched_tokens, e.max_num_seqs, max_len, e.kv_cache_tokens,
                      Batching.MIXED)


def calibration_config(cfg: BenchConfig) -> CalibrationConfig:
    """Probe the region the trace will use: decode contexts up to a long prompt plus output."""
    longest = cfg.max_prompt_tokens + cfg.max_output_tokens
    kv = tuple(sorted({min(k, longest) for k in (32, 128, 384, longest)}))
    return CalibrationConfig(decode_kv_lens=kv, decode_batches=(1, 2, 4, 8, 16, 24, 32),
                             ft_totals=(32, 64, 128, 256))


def calibrate(cfg: BenchConfig, work: Path, threads: int) -> Path:
    """The latency model of a host running on ``threads`` CPU threads, saved under ``work``
    (``--calibration-file`` instead, its ``{threads}`` filled in: a previous run's
    ``work/latency_model_{threads}t.json`` skips calibrating again)."""
    path = work / f"latency_model_{threads}t.json"
    if cfg.calibration_file:
        LatencyModel.load(cfg.calibration_file.format(threads=threads)).save(path)
        return path
    host = make_host(cfg, threads)
    try:
        lm = host.calibrate(cfg.lora, calibration_config(cfg), None, seed=cfg.seed,
                            progress=cfg.progress)
        lm.save(path)
    finally:
        host.close()
    return path
