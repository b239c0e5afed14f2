"""The step-time oracle: what one engine step of a typed batch costs on the simulated GPU.

Built the way Vidur builds its execution-time predictor: a step is the sum over one decoder
layer's operators, times the layers, plus the operators outside the layers and the tensor-parallel
communication. Per layer:

* token-level operators (norms, QKV/O projections, RoPE, MLP, residual add) by the step's total
  tokens, from the monotone curve of their summed medians (``curves.py``);
* attention: decode by (sequences, Σ KV) and prefill by its chunks (new, prefix) from the
  regressors of ``attention.py``, plus the KV-cache write by tokens;
* at TP > 1, two all-reduces of ``tokens × hidden`` fp16 values (after attention and after the
  MLP), from the network profile;
* modelled (``modelled.py``): the LoRA forward when LoRA rows ride in the step, the activation
  capture copy for training rows.

Outside the layers: the embedding, the final norm and the LM head over the rows that produce
logits (decode rows and inference prefill chunks; training rows produce none in the host).

Execution mode: a decode-only step of base-model requests with at most ``max_graph_batch`` rows
replays a CUDA graph padded to the next captured size, as vLLM does; every other step runs eager
and pays ``launch_overhead_s`` for each kernel it launches. Times are medians; :class:`StepNoise`
adds the profiles' own run-to-run spread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from deltaserve.core.errors import InputError, require
from deltaserve.core.shape import ExecMode
from deltaserve.hosts.sim.catalogue import ModelShape
from deltaserve.hosts.sim.modelled import (
    AdapterShape,
    ModelledParams,
    capture_layer_seconds,
    graph_capture_size,
    lora_layer_seconds,
)
from deltaserve.hosts.sim.profiles import GpuProfiles, TpProfile

# Kernels one eager layer launches besides attention: the nine token-level operators and the
# KV-cache write. Attention adds one kernel per phase present, TP two all-reduces, LoRA two
# (shrink, expand) per input group, capture one copy. Outside the layers: embedding, final
# norm, LM head (and a logits gather at TP > 1).
_TOKEN_KERNELS_PER_LAYER = 10
_HEAD_KERNELS = 3


@dataclass(frozen=True)
class PrefillChunk:
    """``new_tokens`` of one request's prompt processed this step, behind ``prefix_tokens``
    already in its KV cache."""

    new_tokens: int
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        require(self.new_tokens > 0, "new_tokens", self.new_tokens, "must be > 0")
        require(self.prefix_tokens >= 0, "prefix_tokens", self.prefix_tokens, "must be >= 0")


@dataclass(frozen=True)
class SimBatch:
    """One engine step, as the oracle prices it.

    ``prefills``: inference prefill chunks. ``decode_context_lens``: for each decode request, the
    KV tokens it attends (its context so far). ``ft_lens``: fine-tuning samples riding as
    prefill-only rows on the training adapter (prefix 0, no logits). ``lora_inference``: the
    inference rows use LoRA adapters. ``mode``: requested execution mode (graph replay happens
    only where it is possible, see the module doc). ``tp``: tensor-parallel degree.
    """

    prefills: tuple[PrefillChunk, ...] = ()
    decode_context_lens: tuple[int, ...] = ()
    ft_lens: tuple[int, ...] = ()
    lora_inference: bool = False
    mode: ExecMode = ExecMode.EAGER
    tp: int = 1

    def __post_init__(self) -> None:
        require(min(self.decode_context_lens, default=1) > 0, "decode_context_lens",
                self.decode_context_lens, "every decode request attends at least 1 token")
        require(min(self.ft_lens, default=1) > 0, "ft_lens", self.ft_lens, "must be > 0")
        require(isinstance(self.mode, ExecMode), "mode", self.mode, "must be an ExecMode")
        require(not (self.ft_lens and self.mode is ExecMode.GRAPH), "mode", self.mode,
                "a step carrying fine-tuning rows runs eager")
        require(self.tp >= 1, "tp", self.tp, "must be >= 1")
        require(bool(self.prefills or self.decode_context_lens or self.ft_lens), "batch", self,
                "an empty step has no time")

    @property
    def num_decode(self) -> int:
        return len(self.decode_context_lens)

    @property
    def num_tokens(self) -> int:
        return (sum(c.new_tokens for c in self.prefills) + self.num_decode + sum(self.ft_lens))

    @property
    def has_lora(self) -> bool:
        return self.lora_inference or bool(self.ft_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode > 0 and not self.prefills and not self.ft_lens


@runtime_checkable
class StepTimeOracle(Protocol):
    """What the simulated host asks of a step-time source. Implemented here from GPU profiles;
    a second implementation can come from the embedded CPU engine's calibration profiles."""

    @property
    def num_layers(self) -> int: ...

    @property
    def hbm_bytes_per_s(self) -> float:
        """Effective memory bandwidth, for modelled copies (capture, optimizer)."""
        ...

    def step_seconds(self, batch: SimBatch) -> float:
        """Median wall time of one step (no noise)."""
        ...

    def layer_seconds(self, batch: SimBatch) -> float:
        """Median time of one decoder layer of ``batch``, its launches and communication
        included: the unit a layer-by-layer recompute or an abort works in."""
        ...

    def head_seconds(self, rows: int, tp: int) -> float:
        """Final norm and LM head over ``rows`` rows (the loss side of a backward)."""
        ...

    def noise_sigma(self, tp: int) -> float:
        """Relative run-to-run spread of a step (log-space σ)."""
        ...


@dataclass(frozen=True)
class StepBreakdown:
    """Where one step's time goes, seconds (sums to ``total_s``)."""

    layers_s: float
    attention_s: float
    communication_s: float
    lora_s: float
    capture_s: float
    outside_layers_s: float
    launch_s: float
    graph: bool
    total_s: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_s", self.layers_s + self.outside_layers_s
                           + self.launch_s)


class ProfileOracle:
    """:class:`StepTimeOracle` from measured GPU profiles (see the module doc)."""

    def __init__(self, profiles: GpuProfiles, params: ModelledParams | None = None,
                 lora: AdapterShape | None = None):
        self.profiles = profiles
        self.params = params or ModelledParams()
        self.lora = lora or AdapterShape()
        self.shape: ModelShape = profiles.entry.shape

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.profiles.hbm_bytes_per_s

    def noise_sigma(self, tp: int) -> float:
        return self.profiles.tp(tp).noise_sigma

    def graph_rows(self, batch: SimBatch) -> int | None:
        """The captured batch size ``batch`` replays, or None when it runs eager."""
        if batch.mode is not ExecMode.GRAPH or not batch.is_decode_only or batch.lora_inference:
            return None
        return graph_capture_size(batch.num_decode, self.params.max_graph_batch)

    def _all_reduce_ms(self, prof: TpProfile, elems: float) -> float:
        return 0.0 if prof.all_reduce_elems is None else prof.all_reduce_elems(elems)

    def _layer_parts_ms(self, batch: SimBatch, prof: TpProfile, token_rows: int
                        ) -> tuple[float, float, float, float, float]:
        """(token ops + KV write, attention, communication, LoRA, capture) of one layer, ms."""
        chunks = [(c.new_tokens, c.prefix_tokens) for c in batch.prefills]
        chunks += [(m, 0) for m in batch.ft_lens]
        prefill_tokens = sum(n for n, _ in chunks)
        token_ops = (prof.layer_token_ops(token_rows) + prof.kv_save_prefill(prefill_tokens)
                     + prof.kv_save_decode(batch.num_decode))
        attention = (prof.decode_attention(batch.num_decode, sum(batch.decode_context_lens))
                     + prof.prefill_attention(chunks))
        comm = 2 * self._all_reduce_ms(prof, token_rows * self.shape.hidden)
        lora_rows = (batch.num_tokens if batch.lora_inference else sum(batch.ft_lens))
        lora = 1e3 * lora_layer_seconds(self.params, self.lora, self.shape, batch.tp, lora_rows,
                                        self.hbm_bytes_per_s)
        capture = 1e3 * capture_layer_seconds(self.shape, sum(batch.ft_lens),
                                              self.hbm_bytes_per_s)
        return token_ops, attention, comm, lora, capture

    def layer_kernels(self, batch: SimBatch) -> int:
        """Kernels one eager layer of ``batch`` launches (see ``_TOKEN_KERNELS_PER_LAYER``)."""
        phases = (batch.num_decode > 0) + bool(batch.prefills or batch.ft_lens)
        targets = self.lora.target_modules
        lora = 2 * (("o_proj" in targets) + any(t != "o_proj" for t in targets))
        return (_TOKEN_KERNELS_PER_LAYER + phases + (2 if batch.tp > 1 else 0)
                + (lora if batch.has_lora else 0) + (1 if batch.ft_lens else 0))

    def breakdown(self, batch: SimBatch) -> StepBreakdown:
        prof = self.profiles.tp(batch.tp)
        graph_rows = self.graph_rows(batch)
        # a replayed graph computes its padding rows too
        token_rows = batch.num_tokens if graph_rows is None else graph_rows
        token_ops, attention, comm, lora, capture = self._layer_parts_ms(batch, prof, token_rows)
        layer_ms = token_ops + attention + comm + lora + capture
        logit_rows = batch.num_decode + len(batch.prefills)
        head_ms = self._head_ms(prof, logit_rows) + prof.embedding(token_rows)
        if graph_rows is None:
            kernels = (self.num_layers * self.layer_kernels(batch) + _HEAD_KERNELS
                       + (1 if batch.tp > 1 else 0))
            launch_s = kernels * self.params.launch_overhead_s
        else:
            launch_s = 0.0
        n = self.num_layers
        return StepBreakdown(
            layers_s=n * layer_ms * 1e-3, attention_s=n * attention * 1e-3,
            communication_s=n * comm * 1e-3, lora_s=n * lora * 1e-3,
            capture_s=n * capture * 1e-3, outside_layers_s=head_ms * 1e-3, launch_s=launch_s,
            graph=graph_rows is not None)

    def _head_ms(self, prof: TpProfile, rows: int) -> float:
        """Final norm + vocab-parallel LM head; at TP > 1 the logits are gathered to one rank,
        priced as an all-reduce of half their size (a gather moves half an all-reduce's bytes)."""
        if rows == 0:
            return 0.0
        gather = self._all_reduce_ms(prof, rows * self.shape.vocab / 2)
        return prof.final_norm(rows) + prof.lm_head_rows(rows) + gather

    def step_seconds(self, batch: SimBatch) -> float:
        return self.breakdown(batch).total_s

    def layer_seconds(self, batch: SimBatch) -> float:
        prof = self.profiles.tp(batch.tp)
        layer_ms = sum(self._layer_parts_ms(batch, prof, batch.num_tokens))
        return layer_ms * 1e-3 + self.layer_kernels(batch) * self.params.launch_overhead_s

    def head_seconds(self, rows: int, tp: int) -> float:
        if rows < 0:
            raise InputError("rows", rows, "must be >= 0")
        kernels = _HEAD_KERNELS - 1 + (1 if tp > 1 else 0)
        return (self._head_ms(self.profiles.tp(tp), rows) * 1e-3
                + (kernels * self.params.launch_overhead_s if rows else 0.0))


class StepNoise:
    """Multiplicative per-step noise: log-normal with mean 1 and log-space σ from the profiles'
    own std/median, drawn from a seeded generator (the same seed gives the same sequence)."""

    def __init__(self, sigma: float, seed: int):
        require(sigma >= 0 and math.isfinite(sigma), "sigma", sigma, "must be finite and >= 0")
        self.sigma = sigma
        self._rng = np.random.default_rng(seed)

    def factor(self) -> float:
        z = float(self._rng.standard_normal())
        return math.exp(self.sigma * z - 0.5 * self.sigma * self.sigma)

    def apply(self, seconds: float) -> float:
        return seconds * self.factor()

