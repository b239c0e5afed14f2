"""LoRA adapters and multi-LoRA batching.

``AdapterWeights`` keeps every A and B matrix of one adapter in one flat fp32 tensor: sharing it
between processes is one ``share_memory_()``, publishing an update is one ``copy_``, and an
optimizer over the flat tensor is element-wise identical to one over the separate matrices.

In a batch, every token goes through the base matmul once; each adapter's low-rank update is then
applied to its own rows (:class:`LoRAGroup`), never by gathering a full matrix per token.
LoRA dropout on training rows draws its mask as a hash of (sample seed, layer, module, row in the
sample, column), for every sample at once, so the backward process replays exactly the mask the
forward used.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from deltaserve.core.contract import TrainingRows
from deltaserve.core.errors import require
from deltaserve.model.config import ModelConfig

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class LoRAConfig:
    """PEFT's ``LoraConfig`` knobs that DeltaServe supports (``scaling = alpha / r``)."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        require(self.r > 0, "lora_r", self.r, "must be > 0")
        require(self.alpha > 0, "lora_alpha", self.alpha, "must be > 0")
        require(0.0 <= self.dropout < 1.0, "lora_dropout", self.dropout, "must be in [0, 1)")
        require(len(self.target_modules) > 0, "target_modules", self.target_modules,
                "at least one module")
        bad = [m for m in self.target_modules if m not in ALL_MODULES]
        require(not bad, "target_modules", bad, f"unknown; choose from {', '.join(ALL_MODULES)}")
        require(len(set(self.target_modules)) == len(self.target_modules), "target_modules",
                self.target_modules, "listed twice")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def peft_key(layer: int, module: str, which: str) -> str:
    """The tensor name PEFT uses in ``adapter_model.safetensors``."""
    block = "self_attn" if module in _ATTN else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{module}.lora_{which}.weight"


class AdapterWeights:
    """A and B of every (layer, target module) as views into one flat fp32 tensor."""

    def __init__(self, model: ModelConfig, lora: LoRAConfig, flat: torch.Tensor | None = None,
                 device: torch.device | str = "cpu"):
        self.model_config = model
        self.config = lora
        layout: list[tuple[int, str, int, tuple[int, int], int, tuple[int, int]]] = []
        offset = 0
        for layer in range(model.num_layers):
            for module in lora.target_modules:
                fan_in, fan_out = model.module_dims(module)
                a_shape, b_shape = (lora.r, fan_in), (fan_out, lora.r)
                layout.append((layer, module, offset, a_shape, offset + lora.r * fan_in, b_shape))
                offset += lora.r * fan_in + fan_out * lora.r
        self.numel = offset
        if flat is None:
            flat = torch.zeros(offset, dtype=torch.float32, device=device)
        require(flat.numel() == offset and flat.dtype == torch.float32, "adapter", flat.shape,
                f"expected {offset} fp32 values for this model and LoRA config")
        self.flat = flat
        self._layout = layout
        self._views: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, module, a_off, a_shape, b_off, b_shape in layout:
            a = flat[a_off: a_off + a_shape[0] * a_shape[1]].view(a_shape)
            b = flat[b_off: b_off + b_shape[0] * b_shape[1]].view(b_shape)
            self._views[(layer, module)] = (a, b)

    def has(self, module: str) -> bool:
        return module in self.config.target_modules

    def a(self, layer: int, module: str) -> torch.Tensor:
        return self._views[(layer, module)][0]

    def b(self, layer: int, module: str) -> torch.Tensor:
        return self._views[(layer, module)][1]

    def items(self) -> Iterator[tuple[int, str, torch.Tensor, torch.Tensor]]:
        for (layer, module), (a, b) in self._views.items():
            yield layer, module, a, b

    def init_peft_(self, seed: int = 0) -> AdapterWeights:
        """PEFT's default init: A ~ kaiming-uniform(a=√5), B = 0 (the adapter starts as a no-op)."""
        gen = torch.Generator(device=self.flat.device).manual_seed(seed)
        with torch.no_grad():
            for _, _, a, b in self.items():
                torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
                b.zero_()
        return self

    def share_memory_(self) -> AdapterWeights:
        self.flat.share_memory_()
        return self

    def clone(self, requires_grad: bool = False) -> AdapterWeights:
        out = AdapterWeights(self.model_config, self.config, self.flat.detach().clone())
        return out.make_trainable_() if requires_grad else out

    def make_trainable_(self) -> AdapterWeights:
        """Make every A and B a leaf of its own that shares the flat storage. A view of one
        grad-requiring flat tensor would make each use's gradient a zero-filled tensor of the
        whole adapter (measured: a third of the backward's time); as separate leaves each
        receives only its own, and :meth:`gather_grad_` assembles ``flat.grad``."""
        with torch.no_grad():
            self._views = {key: (a.detach().requires_grad_(True), b.detach().requires_grad_(True))
                           for key, (a, b) in self._views.items()}
        self.flat.requires_grad_(True)
        return self

    def gather_grad_(self) -> torch.Tensor:
        """Move the per-matrix gradients into ``flat.grad`` (in layout order) and return it."""
        grad = self.flat.grad
        if grad is None:
            grad = torch.zeros_like(self.flat, requires_grad=False)
        for layer, module, a_off, a_shape, b_off, b_shape in self._layout:
            a, b = self._views[(layer, module)]
            for t, off, shape in ((a, a_off, a_shape), (b, b_off, b_shape)):
                dst = grad[off: off + shape[0] * shape[1]]
                if t.grad is None:
                    dst.zero_()
                else:
                    dst.copy_(t.grad.reshape(-1))
                    t.grad = None
        self.flat.grad = grad
        return grad

    def to_peft_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for layer, module, a, b in self.items():
            out[peft_key(layer, module, "A")] = a.detach().clone().contiguous()
            out[peft_key(layer, module, "B")] = b.detach().clone().contiguous()
        return out

    def load_peft_state_dict_(self, state: dict[str, torch.Tensor]) -> AdapterWeights:
        missing = [peft_key(lyr, m, w) for lyr, m, _, _ in self.items() for w in "AB"
                   if peft_key(lyr, m, w) not in state]
        require(not missing, "adapter_model.safetensors", missing[:3],
                "tensors missing for this model and LoRA config")
        with torch.no_grad():
            for layer, module, a, b in self.items():
                for which, dst in (("A", a), ("B", b)):
                    src = state[peft_key(layer, module, which)]
                    require(tuple(src.shape) == tuple(dst.shape), peft_key(layer, module, which),
                            tuple(src.shape), f"expected shape {tuple(dst.shape)}")
                    dst.copy_(src.to(torch.float32))
        return self


@dataclass(frozen=True)
class DropoutSegment:
    """Rows ``[offset, offset + length)`` of a group share one sample's dropout seed."""

    offset: int
    length: int
    seed: int


# A 32-bit integer hash (Wellons' "lowbias32" shape, with multipliers below 2^31 so that every
# product of a 32-bit value stays inside int64): the dropout mask is a function of (sample seed,
# layer, module, row in the sample, column), computed for all rows at once on any device with
# no generator per sample, and replayed bit for bit by the backward.
_MASK32 = 0xFFFFFFFF
_MUL = (0x7FEB352D, 0x2C1B3C6D)


def _hash32(x: torch.Tensor | int) -> torch.Tensor | int:
    """``x`` in [0, 2³²) (int64 tensor or int) → a hash in the same range."""
    x = x ^ (x >> 16)
    x = (x * _MUL[0]) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL[1]) & _MASK32
    return x ^ (x >> 16)


def _hash32_(x: torch.Tensor) -> torch.Tensor:
    """:func:`_hash32` of an int64 tensor in place, bit for bit (half the memory traffic of the
    out-of-place form)."""
    x ^= x >> 16
    x.mul_(_MUL[0]).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(_MUL[1]).bitwise_and_(_MASK32)
    x ^= x >> 16
    return x


def _mix32_(x: torch.Tensor | int) -> torch.Tensor | int:
    """An entry's value from its row's and column's hashes xor-ed (``x`` in [0, 2³²), int64,
    mixed in place): bits 16-47 of one product, where every bit of ``x`` reaches (the row and
    column hashes are full hashes already; a second full hash per entry would double the cost of
    every mask, which a step draws for every projection of every layer)."""
    if isinstance(x, int):
        return ((x * _MUL[0]) >> 16) & _MASK32
    x.mul_(_MUL[0]).bitwise_right_shift_(16).bitwise_and_(_MASK32)
    return x


def _fold32(value: int) -> int:
    """An int of any size (a seed) → [0, 2³²), every bit of it mixed in."""
    out, value = 0, value % (1 << 64)
    for shift in (0, 32):
        out = int(_hash32(out ^ ((value >> shift) & _MASK32)))
    return out


class DropoutKeys:
    """Per row of a group: its sample's seed (folded) and its position in the sample (hashed),
    on the device, built once before the step so that no layer copies anything to the device;
    with them each (layer, module) site's row hashes for ``num_layers`` layers (one batched
    hash, not one per site: a step draws a mask at every projection of every layer)."""

    def __init__(self, segments: tuple[DropoutSegment, ...], device: torch.device | str,
                 num_layers: int):
        seeds: list[int] = []
        positions: list[int] = []
        for seg in segments:
            seeds += [_fold32(seg.seed)] * seg.length
            positions += range(seg.length)
        self.seed = torch.tensor(seeds, dtype=torch.long, device=device)
        self.position = _hash32(torch.tensor(positions, dtype=torch.long) ^ 0x5BD1E995).to(device)
        self.sites = torch.tensor([_site(layer, m) for layer in range(num_layers)
                                   for m in ALL_MODULES], dtype=torch.long, device=device)
        # [sites, rows]: each row's hash at each site
        self.rows = _hash32_(_hash32_(self.seed[None, :] ^ self.sites[:, None])
                             ^ self.position[None, :])
        self._cols: dict[int, torch.Tensor] = {}

    def _col(self, cols: int) -> torch.Tensor:
        """[sites, cols]: each column's hash at each site (once per width per step)."""
        col = self._cols.get(cols)
        if col is None:
            arange = torch.arange(cols, dtype=torch.long, device=self.seed.device)
            col = self._cols[cols] = _hash32_(arange[None, :] ^ self.sites[:, None])
        return col

    def keep(self, cols: int, p: float, layer: int, module: str) -> torch.Tensor:
        """[rows, cols] bool: True where an entry is kept (probability 1 − ``p``)."""
        return self.keep_packed(cols, p, layer, (module,))[0]

    def keep_packed(self, cols: int, p: float, layer: int, modules: tuple[str, ...]
                    ) -> torch.Tensor:
        """[len(modules), rows, cols]: :meth:`keep` of modules adjacent in ``ALL_MODULES`` (a
        packed projection's: q, k, v or gate, up), hashed together."""
        first = layer * len(ALL_MODULES) + ALL_MODULES.index(modules[0])
        require(ALL_MODULES[first % len(ALL_MODULES):][:len(modules)] == modules, "modules",
                modules, "must be adjacent in ALL_MODULES")
        span = slice(first, first + len(modules))
        return _mix32_(self.rows[span, :, None] ^ self._col(cols)[span, None, :]) \
            < round((1.0 - p) * 2**32)


def _site(layer: int, module: str) -> int:
    """The hash key of a (layer, module) site."""
    return int(_fold32(layer * len(ALL_MODULES) + ALL_MODULES.index(module) + 1))


@dataclass(frozen=True)
class LoRAGroup:
    """Rows of a batch that use ``adapter``; ``rows`` is a slice (contiguous rows) or an index
    tensor. ``dropout`` > 0 only on training rows, with one seeded segment per sample; the rows'
    dropout keys are built on the adapter's device with the group, before any layer runs."""

    adapter: AdapterWeights
    rows: slice | torch.Tensor
    dropout: float = 0.0
    segments: tuple[DropoutSegment, ...] = ()
    keys: DropoutKeys | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dropout > 0.0:
            object.__setattr__(self, "keys", DropoutKeys(self.segments, self.adapter.flat.device,
                                                         self.adapter.model_config.num_layers))


def training_group(adapter: AdapterWeights, rows: slice | torch.Tensor,
                   training: TrainingRows) -> LoRAGroup:
    """The training adapter on a step's training rows, each sample's dropout seeded by its own
    seed (so the backward replays the forward's masks)."""
    return LoRAGroup(adapter, rows, training.dropout, dropout_segments(training))


def dropout_segments(training: TrainingRows) -> tuple[DropoutSegment, ...]:
    """One segment per sample of a step's training rows, in order, seeded by its own seed."""
    segments, offset = [], 0
    for n, seed in zip(training.lengths, training.dropout_seeds, strict=True):
        segments.append(DropoutSegment(offset, n, seed))
        offset += n
    return tuple(segments)


def dropout_(x: torch.Tensor, p: float, segments: tuple[DropoutSegment, ...], layer: int,
             module: str, keys: DropoutKeys | None = None) -> torch.Tensor:
    """Inverted dropout whose mask is a function of (sample seed, layer, module, row in the
    sample, column): a sample draws the same mask wherever it sits in a batch. ``keys``: the
    segments' keys, built beforehand (here when not given)."""
    if keys is None:
        keys = DropoutKeys(segments, x.device, layer + 1)
    require(keys.seed.shape[0] == x.shape[0], "dropout segments", [s.length for s in segments],
            f"cover {keys.seed.shape[0]} rows, the group has {x.shape[0]}")
    return x * keys.keep(x.shape[1], p, layer, module) / (1.0 - p)


def apply_lora(y: torch.Tensor, x: torch.Tensor, groups: tuple[LoRAGroup, ...], layer: int,
               module: str) -> torch.Tensor:
    """``y`` (base output) plus each group's ``scaling · B(A(dropout(x)))`` on its rows."""
    for g in groups:
        if not g.adapter.has(module):
            continue
        a = g.adapter.a(layer, module).to(x.dtype)
        b = g.adapter.b(layer, module).to(x.dtype)
        xs = x[g.rows]
        if g.dropout > 0.0:
            xs = dropout_(xs, g.dropout, g.segments, layer, module, g.keys)
        delta = (xs @ a.t()) @ b.t() * g.adapter.config.scaling
        if isinstance(g.rows, slice):
            if g.rows == slice(None) or (g.rows.start in (0, None) and g.rows.stop == len(y)):
                y = y + delta  # all rows: out of place, so autograd sees a plain add
            else:  # in place on the rows' view (``y[rows] += d`` also copies it back)
                y = y.clone() if y.requires_grad else y
                y[g.rows].add_(delta)
        else:
            y = y.index_add(0, g.rows, delta)
    return y
