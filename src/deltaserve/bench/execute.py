"""One system's replay of the trace: its host, its training, and what it left behind."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deltaserve.bench.config import BenchConfig
from deltaserve.bench.coserve_config import BenchTraining, coserve_config, system_grant
from deltaserve.bench.gc_heap import frozen_heap
from deltaserve.bench.latency_holdout import (
    HoldoutLatencyModel,
    errors_by_kind,
    errors_by_mode,
    errors_by_yield,
    step_predictions,
)
from deltaserve.bench.outcome import Commit, HardwareShare, SystemRun
from deltaserve.bench.prepare import BenchData, log, make_host
from deltaserve.bench.replay import PromptSource, replay
from deltaserve.bench.split_pool import StandaloneTrainer
from deltaserve.bench.step_log import write_steps
from deltaserve.bench.systems import SystemSpec
from deltaserve.core.requests import SamplingParams
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.base import BaseHost
from deltaserve.model.loading import resolve_model
from deltaserve.train.checkpoint_store import CheckpointConfig, find_latest
from deltaserve.train.config import GrantPolicy
from deltaserve.train.events import OptimizerStep, TrainingEvent
from deltaserve.train.facade import CoServer
from deltaserve.workloads.trace import Trace


def host_grant(cfg: BenchConfig) -> GrantPolicy:
    """The host's grant for a system that names none (``auto``: ``prefill`` on a GPU, the
    co-server's own on a CPU, ``exclusive``): every co-serving host keeps the whole machine, as
    the pilot that set the SLO had it, and trains in its idle time and in the slack it lends.
    (``partition``, the backward on a core of its own, leaves inference one core of two on
    this machine: no system meets a two-core pilot's SLO on one, split-pool included; see the
    README.)"""
    return GrantPolicy.PREFILL if cfg.engine.device_type == "cuda" else GrantPolicy.AUTO


def grant_policy(cfg: BenchConfig, spec: SystemSpec) -> GrantPolicy:
    """``spec``'s grant: the bench's ``--backward-grant-policy``, else the system's, else the
    host's (:func:`~deltaserve.bench.coserve_config.system_grant`)."""
    return system_grant(spec, cfg.backward.grant_policy, host_grant(cfg))


def hardware_share(cfg: BenchConfig, spec: SystemSpec, threads: int) -> HardwareShare:
    """A standalone trainer (``spec.trainer_replicas``: split-pool's), and a co-serving
    backward on partitioned cores, get their own threads (the backward's ``threads``, default
    1, per replica) and the host the rest; everything else gives the host every core."""
    partitioned = spec.coserve and grant_policy(cfg, spec) is GrantPolicy.PARTITION
    replicas = max(spec.trainer_replicas, int(partitioned))
    if replicas:
        host = max(1, threads - replicas * (cfg.backward.threads or 1))
        return HardwareShare(threads, host, threads - host)
    return HardwareShare(threads, threads, 0)


def host_threads(cfg: BenchConfig, spec: SystemSpec, threads: int) -> int:
    return hardware_share(cfg, spec, threads).host


def bench_training(cfg: BenchConfig, slo: SLOConfig, root: Path) -> BenchTraining:
    """What the CPU bench gives every co-serving system: its checkpoints under ``root``
    (never written during the run; the bench saves one at detach)."""
    return BenchTraining(slo=slo, lora=cfg.lora, optimizer=cfg.optimizer, backward=cfg.backward,
                         max_step_tokens=cfg.engine.max_num_batched_tokens, seed=cfg.seed,
                         pipeline=cfg.pipeline, host_grant=host_grant(cfg),
                         checkpoint=CheckpointConfig(root=str(root), every_steps=10**9,
                                                     resume=False))


def record_commits(co: CoServer) -> tuple[list[Commit], list[float]]:
    """Every optimizer step the co-server commits from now on (packed rows: no padding), and
    the seconds each spent in the gradient all-reduce (0 with one replica)."""
    commits: list[Commit] = []
    allreduce_s: list[float] = []

    def on_event(ev: TrainingEvent) -> None:
        if isinstance(ev, OptimizerStep):
            commits.append(Commit(ev.at_s, ev.num_tokens, len(ev.sample_ids), ev.num_tokens))
            allreduce_s.append(ev.allreduce_s)

    co.subscribe(on_event)
    return commits, allreduce_s


@dataclass(frozen=True)
class RunInputs:
    """What every system's run shares. ``lm_paths``: the calibration per host thread count."""

    cfg: BenchConfig
    trace: Trace
    data: BenchData
    lm_paths: dict[int, Path]
    work: Path
    threads: int


WARMUP_PROMPT_TOKENS = 32
WARMUP_OUTPUT_TOKENS = 4


def warm_up(host: BaseHost, prompts: PromptSource) -> None:
    """One short request before the replay, from the thread that will run the engine loop:
    one-time costs (first kernels, allocations, thread pools) then land on no measured request.
    Every system gets the same; it runs before the latency model is attached, so no model
    learns from it."""
    assert host.latency_model is None and host.coserver is None
    host.generate([prompts.prompt(0, WARMUP_PROMPT_TOKENS)],
                  SamplingParams(max_tokens=WARMUP_OUTPUT_TOKENS, ignore_eos=True))


def _start_split_pool(inputs: RunInputs, threads: int) -> StandaloneTrainer:
    """split-pool's standalone trainer, started on its reserved ``threads``."""
    cfg = inputs.cfg
    trainer = StandaloneTrainer(str(resolve_model(cfg.engine.model)), inputs.data.samples,
                                cfg.lora, cfg.optimizer, cfg.backward.batch_tokens,
                                threads=threads, dtype=cfg.engine.dtype, seed=cfg.seed,
                                device=cfg.engine.device)
    trainer.start()
    return trainer


def run_system(inputs: RunInputs, spec: SystemSpec, slo: SLOConfig | None,
               slo_scale: float | None, *, label: str | None = None, tag: str = ""
               ) -> SystemRun:
    """Replay the trace against ``spec``; a co-serving system admits under ``slo``
    (``slo_scale``: its scale, recorded; None for a system that ignores the SLO). The replay
    runs, and trains, until the scoring window (the trace's duration plus ``drain_s``) closes.
    ``label``: the run's name in logs and checkpoints (default: the system's and its scale);
    ``tag``: appended to it (a repeat's number)."""
    cfg, threads = inputs.cfg, inputs.threads
    share = hardware_share(cfg, spec, threads)
    host = make_host(cfg, share.host)
    warm_up(host, inputs.data.prompts)
    lm = HoldoutLatencyModel.load(inputs.lm_paths[share.host])  # all start from one calibration
    lm.every = cfg.latency_holdout_every
    host.latency_model = lm
    label = (label or (spec.name if slo_scale is None else f"{spec.name} @{slo_scale:g}")) + tag
    root = inputs.work / "checkpoints" / label.replace(" @", "-").replace(" #", "-")
    trainer: StandaloneTrainer | None = None
    try:
        commits: list[Commit] = []
        co: CoServer | None = None
        if spec.coserve:
            assert slo is not None, "a co-serving system needs an SLO"
            co = host.attach(dataset=inputs.data.samples,
                             config=coserve_config(spec, bench_training(cfg, slo, root)),
                             latency_model=lm,
                             scheduler_cls=spec.scheduler_cls, progress=False)
            commits, _ = record_commits(co)
        if spec.trainer_replicas:  # split-pool: the standalone trainer on its reserved share
            trainer = _start_split_pool(inputs, share.reserved)
        with frozen_heap() as heap:
            log(cfg, f"{label}: {heap.text}")
            result = replay(host, inputs.trace, inputs.data.prompts, label=label,
                            min_wall_s=cfg.window_s(inputs.trace.duration_s),
                            progress=cfg.progress)
        if co is not None:  # a run whose backward lost every step is an error, not 0 tokens/s
            co.raise_if_failed()
        if trainer is not None:
            commits = [Commit(s.at_s, s.num_tokens, s.num_samples, s.num_padded_tokens)
                       for s in trainer.stop()]
            trainer = None
        min_s = cfg.latency_error_min_ms / 1e3
        predicted = step_predictions(lm)
        write_steps(inputs.work / "steps" / f"{root.name}.jsonl", result.steps, predicted)
        run = SystemRun(spec, result, commits, errors_by_mode(lm, min_s), share, slo_scale,
                        latency_kinds=errors_by_kind(lm, min_s),
                        step_predictions=predicted,
                        latency_yields=errors_by_yield(result.steps, predicted, min_s))
        if spec.coserve:
            host.detach(drain=False, checkpoint=True)
            latest = find_latest(root)
            run.adapter_dir = str(latest) if latest else None
            run.train_log = str(root / "train_log.jsonl")
        return run
    finally:
        if trainer is not None:
            trainer.stop()
        host.close()
