"""The offline profiling plan that seeds the latency model. The plan is data; a host runs it.

Probes, after the paper:
* ``prefill_sweep``: one prefill of growing total length (β and c);
* ``prefill_split``: a fixed total length split across 1..k requests, which keeps ``T_in`` fixed
  while ``Σn²`` falls, so the quadratic term separates from the linear one (α);
* ``chunked_prefill``: a prefill chunk behind an existing context (ε on prefill steps);
* ``decode_grid``: decode batch × per-request KV length (Equation II);
* ``mixed``: prefills beside decodes, for hosts that batch both together;
* ``with_ft``: inference batches plus fine-tuning tokens (γ; always eager).

``StepShape.mode`` on a probe is a request: the host records the mode it actually used.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from deltaserve.core.errors import require
from deltaserve.core.shape import StepShape


class Batching(StrEnum):
    """Whether a host puts prefill and decode tokens in one step."""

    MIXED = "mixed"
    PHASE_SEPARATED = "phase_separated"


@dataclass(frozen=True)
class HostLimits:
    """What one step of a host can hold."""

    max_tokens_per_step: int
    max_seqs_per_step: int
    max_model_len: int
    max_kv_tokens: int
    batching: Batching = Batching.MIXED

    def __post_init__(self) -> None:
        for name in ("max_tokens_per_step", "max_seqs_per_step", "max_model_len", "max_kv_tokens"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        require(self.max_kv_tokens >= self.max_model_len, "max_kv_tokens", self.max_kv_tokens,
                f"cannot hold one sequence of max_model_len={self.max_model_len}")


class ProbeKind(StrEnum):
    PREFILL_SWEEP = "prefill_sweep"
    PREFILL_SPLIT = "prefill_split"
    CHUNKED_PREFILL = "chunked_prefill"
    DECODE_GRID = "decode_grid"
    MIXED = "mixed"
    WITH_FT = "with_ft"


@dataclass(frozen=True)
class CalibrationProbe:
    """One shape to time ``repeats`` times. ``kv_per_decode`` and ``prefix_len`` say how the
    host builds the KV context: decodes each hold ``kv_per_decode`` tokens; each prefill chunk
    follows ``prefix_len`` tokens already in the cache."""

    kind: ProbeKind
    shape: StepShape
    repeats: int
    kv_per_decode: int = 0
    prefix_len: int = 0


@dataclass(frozen=True)
class CalibrationConfig:
    """Sizes of the sweep. ``repeats`` timed runs per probe; hosts add one untimed warm-up."""

    min_prefill: int = 16
    split_total: int = 512
    max_split: int = 8
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    decode_kv_lens: tuple[int, ...] = (64, 256, 1024)
    chunk_prefixes: tuple[int, ...] = (64, 256, 640)
    mixed_decodes: tuple[int, ...] = (2, 8, 24)
    mixed_prefills: tuple[int, ...] = (32, 128, 512)
    mixed_kv_lens: tuple[int, ...] = (64, 256)
    ft_sample_len: int = 128
    ft_totals: tuple[int, ...] = (64, 256, 512, 1024)
    repeats: int = 3

    def __post_init__(self) -> None:
        require(self.min_prefill >= 1, "min_prefill", self.min_prefill, "must be >= 1")
        require(self.split_total >= 2, "split_total", self.split_total, "must be >= 2")
        require(self.max_split >= 2, "max_split", self.max_split, "must be >= 2")
        require(all(b > 0 for b in self.decode_batches), "decode_batches", self.decode_batches,
                "every batch size must be > 0")
        require(all(k > 0 for k in self.decode_kv_lens), "decode_kv_lens", self.decode_kv_lens,
                "every KV length must be > 0")
        require(self.ft_sample_len > 0, "ft_sample_len", self.ft_sample_len, "must be > 0")
        require(all(t > 0 for t in self.ft_totals), "ft_totals", self.ft_totals, "must be > 0")
        require(self.repeats >= 1, "repeats", self.repeats, "must be >= 1")


def _geometric(lo: int, hi: int) -> list[int]:
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= 2
    out.append(hi)
    return sorted(set(out))


def _split(total: int, k: int) -> tuple[int, ...]:
    base, extra = divmod(total, k)
    return tuple(base + (1 if i < extra else 0) for i in range(k))


def build_plan(limits: HostLimits, config: CalibrationConfig | None = None,
               ) -> tuple[CalibrationProbe, ...]:
    """Every probe fits the host's per-step token and sequence limits and its KV capacity."""
    cfg = config or CalibrationConfig()
    t_max = min(limits.max_tokens_per_step, limits.max_model_len)
    s_max = limits.max_seqs_per_step
    r = cfg.repeats
    probes: list[CalibrationProbe] = []

    for n in _geometric(min(cfg.min_prefill, t_max), t_max):
        probes.append(CalibrationProbe(ProbeKind.PREFILL_SWEEP, StepShape((n,)), r))

    total = min(cfg.split_total, limits.max_tokens_per_step)
    for k in range(1, min(cfg.max_split, s_max, total) + 1):
        lens = _split(total, k)
        if max(lens) <= limits.max_model_len:
            probes.append(CalibrationProbe(ProbeKind.PREFILL_SPLIT, StepShape(lens), r))

    for prefix in cfg.chunk_prefixes:
        for chunk in sorted({min(64, t_max), t_max}):
            if prefix + chunk <= limits.max_model_len and prefix + chunk <= limits.max_kv_tokens:
                probes.append(CalibrationProbe(
                    ProbeKind.CHUNKED_PREFILL,
                    StepShape((chunk,), kv_tokens=prefix, prefill_prefix_lens=(prefix,)), r,
                    prefix_len=prefix))

    for b in sorted({min(b, s_max, limits.max_tokens_per_step) for b in cfg.decode_batches}):
        for kv in cfg.decode_kv_lens:
            kv = min(kv, limits.max_model_len - 1)
            if kv >= 1 and b * (kv + 1) <= limits.max_kv_tokens:
                probes.append(CalibrationProbe(
                    ProbeKind.DECODE_GRID, StepShape(num_decode=b, kv_tokens=b * kv), r,
                    kv_per_decode=kv))

    if limits.batching is Batching.MIXED:
        probes += _mixed_probes(limits, cfg, t_max)
    probes += _ft_probes(limits, cfg, t_max)
    return tuple(probes)


def _mixed_probes(limits: HostLimits, cfg: CalibrationConfig, t_max: int
                  ) -> list[CalibrationProbe]:
    """Prefill chunks beside decodes: decode rows cost differently from prefill rows (attention
    over their context), so Equation I needs both in one step to fit them."""
    probes = []
    for b in sorted({min(b, limits.max_seqs_per_step - 1) for b in cfg.mixed_decodes}):
        for n in sorted({min(n, t_max - b) for n in cfg.mixed_prefills}):
            for kv in sorted({min(k, limits.max_model_len - 1) for k in cfg.mixed_kv_lens}):
                if b < 1 or n < 1 or b * (kv + 1) + n > limits.max_kv_tokens:
                    continue
                shape = StepShape((n,), num_decode=b, kv_tokens=b * kv)
                probes.append(CalibrationProbe(ProbeKind.MIXED, shape, cfg.repeats,
                                               kv_per_decode=kv))
    return probes


def _ft_probes(limits: HostLimits, cfg: CalibrationConfig, t_max: int
               ) -> list[CalibrationProbe]:
    """Fine-tuning tokens beside nothing, a prefill, decodes, and (mixed hosts) both."""
    kv_dec = min(256, limits.max_model_len - 1)
    s_max = limits.max_seqs_per_step
    inference_batches: list[tuple[StepShape, int]] = [(StepShape(), 0),
                                                      (StepShape((min(128, t_max),)), 0)]
    b = min(8, s_max - 1)
    if limits.batching is Batching.MIXED and b >= 1 \
            and b * (kv_dec + 1) + 32 <= limits.max_kv_tokens:
        inference_batches.append((StepShape(num_decode=b, kv_tokens=b * kv_dec), kv_dec))
        inference_batches.append((StepShape((min(32, t_max - b),), num_decode=b,
                                            kv_tokens=b * kv_dec), kv_dec))
    probes = []
    for base, kv in inference_batches:
        room_tokens = limits.max_tokens_per_step - base.num_tokens
        room_seqs = s_max - base.num_seqs
        for ft_total in cfg.ft_totals:
            if ft_total > room_tokens or room_seqs < 1:
                continue
            n_samples = min(max(1, round(ft_total / cfg.ft_sample_len)), room_seqs)
            lens = _split(ft_total, n_samples)
            if max(lens) <= limits.max_model_len:
                probes.append(CalibrationProbe(ProbeKind.WITH_FT, base.with_ft(lens),
                                               cfg.repeats, kv_per_decode=kv))
    return probes
