"""What the GPU profiles lack, modelled from stated sources: one typed set of defaults.

Each field of :class:`ModelledParams` carries its unit, its source and a sensitivity range in
its metadata (``docs/sim.md`` shows them as one table; ``python -m deltaserve.hosts.sim.sanity``
prints it). None is fitted to the DeltaServe paper's results: those are what the simulation is
compared against.

Quantities that follow from the profiles themselves are not parameters here: the effective HBM
bandwidth (from the measured decode-attention slope), per-layer forward times (the oracle).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TypeVar

from deltaserve.core.errors import require, require_positive
from deltaserve.hosts.sim.catalogue import ModelShape

FP16_BYTES = 2
# AdamW touches, per trainable fp32 parameter: param, grad, exp_avg, exp_avg_sq read (4 × 4 B) and
# param, exp_avg, exp_avg_sq written (3 × 4 B).
ADAMW_BYTES_PER_PARAM = 28


# Co-location, measured on one H200 with a Llama-3-8B-shaped model (shared/data/h200/README.md,
# "Co-location with the graph decode (B=32, L=1024)"; probe.md §4). Decode inflation is the
# median step time beside a LoRA backward over the step alone; "keeps" is the backward's rate
# beside the decode over its rate alone.
DECODE_INFLATION_STREAMS = 1.11  # one process, two CUDA streams (either priority)
DECODE_INFLATION_PROCESSES = 1.41  # two processes, time-sliced by the driver (no MPS)
BACKWARD_KEEPS_STREAMS = 0.90  # one process, two streams, normal priority (0.95 high)
BACKWARD_KEEPS_PROCESSES = 0.98  # two processes, time-sliced
# The whole eager-PyTorch backward job (recompute, backward, LM head and loss, AdamW) over the
# training rows' forward: 4.83 (1×256 tokens), 4.93 (4×64) (README "LoRA backward alone";
# probe.md §3). The recompute is one forward of those rows, so the backward proper is 4.83 − 1.
BACKWARD_JOB_TO_FORWARD = 4.83
BACKWARD_TO_FORWARD_EAGER = BACKWARD_JOB_TO_FORWARD - 1.0

Num = TypeVar("Num", int, float)


def _param(default: Num, unit: str, source: str, low: float, high: float) -> Num:
    """A dataclass field (typed as its default, as ``dataclasses.field`` is) with its unit,
    source and sensitivity range."""
    return field(default=default, metadata={"unit": unit, "source": source, "range": (low, high)})


@dataclass(frozen=True)
class ModelledParams:
    """Defaults of every modelled (not profiled) effect. See the module doc."""

    launch_overhead_s: float = _param(
        4.7e-6, "s per kernel, eager",
        "vLLM PR #1440 (Llama-2-7B, TP1, batch 1): 100 decode steps take 1.05 s with CUDA graphs "
        "and 1.2 s eager, i.e. 1.5 ms per step = 47 µs per layer over ~10 kernels; 'order of "
        "microseconds per launch' (Modal GPU glossary, CUDA Graph)", 2e-6, 10e-6)
    max_graph_batch: int = _param(
        512, "decode rows",
        "vLLM's default CUDA-graph capture list: 1, 2, 4, then multiples of 8 up to 512; larger "
        "decode batches run eager", 256, 512)
    lora_layer_fixed_s: float = _param(
        36e-6, "s per layer with LoRA rows",
        "Punica (Chen et al., MLSys'24): SGMV LoRA adds ~2 ms per token to a 7B model, i.e. "
        "62.5 µs per layer for LoRA on all 7 projections; × 4/7 for the attention projections "
        "(q, k, v, o) trained here", 18e-6, 62.5e-6)
    backward_to_forward: float = _param(
        BACKWARD_TO_FORWARD_EAGER, "× layer forward",
        "measured, H200 (shared/data/h200/README.md, 'LoRA backward alone'; probe.md §3): a "
        "layer-wise LoRA backward in eager PyTorch (recompute from the saved inputs, backward, "
        "LM head and loss, AdamW) takes 4.83× the training rows' forward (1×256 tokens; 4.93 "
        "at 4×64); the recompute is one forward, so the backward proper is 4.83 − 1 = 3.83×. "
        "Launch-bound (GPU busy 18 %). Low end: LLMStation's 1.07 (He et al., ATC'25, as "
        "quoted in issue #13), a backward that is not launch-bound",
        1.07, 3.93)
    adamw_launches: int = _param(
        4, "kernels per optimizer step",
        "PyTorch AdamW(fused=True): multi-tensor kernels over the adapter's tensors; the time is "
        "bandwidth: 28 B per fp32 parameter at the profile's measured HBM bandwidth", 1, 32)
    decode_slowdown_under_backward: float = _param(
        DECODE_INFLATION_PROCESSES - 1.0, "fraction added to a decode step",
        "measured, H200 (shared/data/h200/README.md, 'Co-location' table; probe.md §4): a "
        "graph decode step (B=32, L=1024) beside a LoRA backward in a second process, "
        "time-sliced by the driver without MPS: median ×1.41 (p99 ×1.60). DeltaServe's backward "
        "is a separate process (train/backward/process.py). Low end: one process, two CUDA "
        "streams (×1.11); high end: the processes' p99", DECODE_INFLATION_STREAMS - 1.0, 0.60)
    backward_share_under_decode: float = _param(
        BACKWARD_KEEPS_PROCESSES, "fraction of standalone backward rate",
        "measured, H200 (same table): the backward keeps 0.98 of its alone rate beside the "
        "decode in a second process (time-sliced, no MPS); 0.90 in the same process on a "
        "second CUDA stream, 0.95 with the decode stream at high priority. A launch-bound "
        "backward (GPU busy 18 %) fills the decode's gaps", BACKWARD_KEEPS_STREAMS, 0.98)
    grant_poll_s: float = _param(
        10e-6, "s per layer boundary",
        "the backward synchronises its stream and reads the shared grant flag between layers: "
        "one host-device round trip, of the order of a kernel launch", 5e-6, 100e-6)

    def __post_init__(self) -> None:
        for f in fields(self):
            low, high = f.metadata["range"]
            value = getattr(self, f.name)
            require(value >= 0, f.name, value, "must be >= 0")
            # a value outside its documented range is allowed (sensitivity sweeps go there) but
            # never negative; the range is what docs/sim.md reports as tested.
            require(low <= high, f.name, (low, high), "range must be ordered")
        require(0 < self.backward_share_under_decode <= 1, "backward_share_under_decode",
                self.backward_share_under_decode, "must be in (0, 1]")
        require_positive("max_graph_batch", self.max_graph_batch)

    @classmethod
    def table(cls) -> list[tuple[str, float, str, tuple[float, float], str]]:
        """(name, default, unit, sensitivity range, source) for every field."""
        return [(f.name, f.default, f.metadata["unit"], f.metadata["range"],
                 f.metadata["source"]) for f in fields(cls)]


def graph_capture_size(num_decode: int, max_graph_batch: int) -> int | None:
    """The captured batch a decode step of ``num_decode`` rows replays (padded up), or None when
    it is larger than every captured size and runs eager."""
    if num_decode > max_graph_batch:
        return None
    if num_decode <= 4:
        return 1 if num_decode <= 1 else (2 if num_decode == 2 else 4)
    return -(-num_decode // 8) * 8


@dataclass(frozen=True)
class AdapterShape:
    """The shape of the trained adapter that the cost model prices: the rank and target
    projections of a :class:`deltaserve.model.lora.LoRAConfig` (same field names; built from
    one by :func:`deltaserve.hosts.sim.hardware.adapter_shape`). Not that config itself: the
    oracle modules stay torch-free (``tests/hosts/sim/test_oracle.py``) and ``model.lora``
    imports torch; and the profiles price LoRA on the attention projections only, so an MLP
    target is refused here. Defaults: the paper's A100 experiment, r16 on q/k/v/o."""

    r: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        require_positive("r", self.r)
        unknown = set(self.target_modules) - {"q_proj", "k_proj", "v_proj", "o_proj"}
        require(not unknown and bool(self.target_modules), "target_modules",
                self.target_modules,
                "the simulator prices a non-empty subset of q_proj, k_proj, v_proj, o_proj")

    def dims(self, shape: ModelShape) -> list[tuple[int, int]]:
        """(in, out) features of each targeted projection."""
        kv = shape.num_kv_heads * shape.head_dim
        table = {"q_proj": (shape.hidden, shape.hidden), "k_proj": (shape.hidden, kv),
                 "v_proj": (shape.hidden, kv), "o_proj": (shape.hidden, shape.hidden)}
        return [table[t] for t in self.target_modules]

    def num_params(self, shape: ModelShape) -> int:
        """Trainable parameters: A (r × in) and B (out × r) per target, every layer."""
        per_layer = sum(self.r * (d_in + d_out) for d_in, d_out in self.dims(shape))
        return per_layer * shape.num_layers

    def activation_bytes_per_token(self, shape: ModelShape, tp: int) -> int:
        """HBM bytes one LoRA row moves per layer in the shrink/expand kernels: the input row read
        once per distinct input (q/k/v share theirs, o has its own) and each target's output
        shard read and written to add the update."""
        targets = self.target_modules
        inputs = (any(t != "o_proj" for t in targets)) + ("o_proj" in targets)
        outputs = sum(d_out for _, d_out in self.dims(shape)) // tp
        return FP16_BYTES * (inputs * shape.hidden + 2 * outputs)


def lora_layer_seconds(params: ModelledParams, lora: AdapterShape, shape: ModelShape, tp: int,
                       lora_rows: int, hbm_bytes_per_s: float) -> float:
    """LoRA forward cost of one layer: the kernels' fixed cost plus the rows' HBM traffic."""
    if lora_rows == 0:
        return 0.0
    traffic = lora_rows * lora.activation_bytes_per_token(shape, tp)
    return params.lora_layer_fixed_s + traffic / hbm_bytes_per_s


def capture_layer_seconds(shape: ModelShape, ft_rows: int, hbm_bytes_per_s: float) -> float:
    """Copying the training rows' layer input into the activation buffer: read and write
    ``rows × hidden`` fp16 values at HBM bandwidth (its one launch is counted by the oracle)."""
    return 2 * ft_rows * shape.hidden * FP16_BYTES / hbm_bytes_per_s


def adamw_seconds(params: ModelledParams, lora: AdapterShape, shape: ModelShape,
                  hbm_bytes_per_s: float) -> float:
    """One AdamW step over the adapter: bandwidth-bound, plus its kernel launches."""
    traffic = lora.num_params(shape) * ADAMW_BYTES_PER_PARAM
    return traffic / hbm_bytes_per_s + params.adamw_launches * params.launch_overhead_s


def overlapped_decode_seconds(params: ModelledParams, decode_step_s: float) -> float:
    """A decode step that runs while the backward runs beside it on the same GPU."""
    return decode_step_s * (1.0 + params.decode_slowdown_under_backward)


def backward_progress_seconds(params: ModelledParams, overlap_s: float) -> float:
    """Standalone-backward seconds of work done during ``overlap_s`` of overlap with decode."""
    return overlap_s * params.backward_share_under_decode
