"""The benchmark's configuration (every field is a ``deltaserve bench`` flag)."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.core.errors import require, require_choice


@dataclass(frozen=True)
class BenchConfig:
    """SLOs default to values that a 2-core CPU serving SmolLM2-135M can meet at the default
    load; ``peak_fraction`` sets the auto-scaled trace's peak as a share of the host's measured
    capacity (``rate_scale`` fixes the factor instead). ``length_scale`` shrinks the trace's
    token counts to the model and machine (prompts and outputs are then clipped to fit).
    ``skip_bad_rows``: skip (and count) malformed dataset rows instead of stopping at the first.
    ``pipeline``: admit the next backward batch while the backward runs (Algorithm 1 waits;
    this overlaps them, at one optimizer step of staleness in the captured activations)."""

    trace: str = "burst-light"
    systems: str = ("inference-only,deltaserve,deltaserve-pipeline,llmstation,split-pool,"
                    "deltaserve-temp")
    duration_s: float | None = None
    model: str = "smollm2"
    dtype: str = "auto"
    dataset: str | None = None
    skip_bad_rows: bool = False
    ttft_slo_ms: float = 3000.0
    tpot_slo_ms: float = 400.0
    out: str = "runs/bench"
    seed: int = 0
    host: str = "native"
    peak_fraction: float = 0.8
    rate_scale: float | None = None
    length_scale: float = 0.125
    max_prompt_tokens: int = 512
    max_output_tokens: int = 64
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 32
    kv_cache_tokens: int = 32_768
    max_model_len: int = 1024
    backward_batch_tokens: int = 256
    lr: float = 1e-3
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.05
    grant_policy: str = "auto"
    backward_threads: int | None = None
    pipeline: bool = False
    calibration_file: str | None = None
    standalone_seconds: float = 20.0
    heldout: int = 60
    progress: bool = True

    def __post_init__(self) -> None:
        require(self.ttft_slo_ms > 0, "ttft_slo_ms", self.ttft_slo_ms, "must be > 0")
        require(self.tpot_slo_ms > 0, "tpot_slo_ms", self.tpot_slo_ms, "must be > 0")
        require_choice("host", self.host, ("native", "vllm"))
        require(self.duration_s is None or self.duration_s > 0, "duration", self.duration_s,
                "must be > 0")
        require(0 < self.peak_fraction <= 2, "peak_fraction", self.peak_fraction,
                "must be in (0, 2]")
        require(self.rate_scale is None or self.rate_scale > 0, "rate_scale", self.rate_scale,
                "must be > 0")
        require(self.length_scale > 0, "length_scale", self.length_scale, "must be > 0")
        require(self.max_prompt_tokens + self.max_output_tokens <= self.max_model_len,
                "max_prompt_tokens", self.max_prompt_tokens,
                f"prompt + output ({self.max_output_tokens}) must fit max_model_len="
                f"{self.max_model_len}")
        require(self.standalone_seconds > 0, "standalone_seconds", self.standalone_seconds,
                "must be > 0")
        require(self.heldout >= 0, "heldout", self.heldout, "must be >= 0")
