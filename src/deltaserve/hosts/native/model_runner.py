"""Runs one step: builds the flat batch, calls the model with the co-server's hooks, samples.

Training rows come last, each sample contiguous and starting at position 0, on the reserved
training adapter; the layer hook asks, at every layer boundary, whether a training-only step
must stop, then hands the training rows' slice of the layer's input to the step's capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.core.contract import TrainingStep
from deltaserve.core.shape import ExecMode
from deltaserve.hosts.native.adapters import TRAIN_ADAPTER, AdapterRegistry
from deltaserve.hosts.native.attention import (
    DecodeGroup,
    KVCache,
    PagedAttention,
    PrefillChunk,
    StepAttentionMeta,
)
from deltaserve.hosts.native.block_manager import BlockManager
from deltaserve.hosts.native.cuda_graphs import DecodeGraphs
from deltaserve.hosts.native.request import Request
from deltaserve.hosts.native.sampler import Sampler
from deltaserve.hosts.native.scheduler import ScheduledBatch
from deltaserve.model.attention import PaddedSegments, additive_mask, attention_kernels
from deltaserve.model.llama import ForwardContext, LlamaModel, MlpHook
from deltaserve.model.lora import AdapterWeights, LoRAGroup, training_group
from deltaserve.train.capture import StepAborted


@dataclass(frozen=True)
class StepResult:
    sampled: dict[str, int]  # request id → next token
    aborted: bool
    layers_run: int
    mode: ExecMode = ExecMode.EAGER


@dataclass
class _FlatBatch:
    """The step's rows: decodes, then prefill chunks, then training rows."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    by_adapter: dict[str, list[int]] = field(default_factory=dict)
    sample_rows: list[int] = field(default_factory=list)  # rows whose next token is sampled
    sample_reqs: list[Request] = field(default_factory=list)
    decodes: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (row, ctx, blocks)
    prefills: list[tuple[slice, int, list[int]]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, blocks: BlockManager,
                 adapters: AdapterRegistry, sampler: Sampler):
        self.model = model
        self.cache = cache
        self.blocks = blocks
        self.adapters = adapters
        self.sampler = sampler
        self.device = model.weights.device
        self.graphs: DecodeGraphs | None = None  # set by the engine where graphs are captured
        self.train_adapter: AdapterWeights | None = None  # the co-server's, once installed

    def mode_for(self, batch: ScheduledBatch, training: TrainingStep | None = None) -> ExecMode:
        """How ``batch`` (plus ``training``'s rows, if any) runs: a graph when every item is a
        decode, a captured bucket holds them and the graphs' adapter slots hold their adapters
        (base model, the training adapter or a client's); eager with prefills or fine-tuning
        rows (data-dependent shapes) or adapters the slots cannot hold."""
        g = self.graphs
        if g is None or not batch.items or batch.prefills:
            return ExecMode.EAGER
        if training is not None and training.rows.num_samples:
            return ExecMode.EAGER
        longest = max(i.request.num_computed + 1 for i in batch.items)
        if g.bucket(len(batch.items), longest) is None:
            return ExecMode.EAGER
        names = {i.request.adapter for i in batch.items} - {None}
        return ExecMode.GRAPH if g.holds(self.adapter(n) for n in names) else ExecMode.EAGER

    def adapter(self, name: str) -> AdapterWeights:
        """The adapter rows named ``name`` run on: a client's, or the installed training
        adapter (:data:`TRAIN_ADAPTER`)."""
        if name == TRAIN_ADAPTER and self.train_adapter is not None:
            return self.train_adapter
        return self.adapters.get(name)

    def publish_adapter(self, adapter: AdapterWeights) -> None:
        """New weights of ``adapter``: eager steps read it directly; the graphs' slot holding
        it, if any, takes a copy in place (captured graphs keep reading the same storage)."""
        if self.graphs is not None and self.graphs.adapter_slots is not None:
            self.graphs.adapter_slots.refresh_(adapter)

    def release_adapter(self, adapter: AdapterWeights) -> None:
        """``adapter`` is unloaded: its graph slot, if any, is free again."""
        if self.graphs is not None and self.graphs.adapter_slots is not None:
            self.graphs.adapter_slots.release(adapter)

    def run(self, batch: ScheduledBatch, training: TrainingStep | None = None,
            train_adapter: AdapterWeights | None = None) -> StepResult:
        """One step, finished on the device when it returns (so a caller's clock times it).
        ``training``: the co-server's step when it carries rows; ``train_adapter``: the adapter
        they run on (default: the installed training adapter)."""
        if training is not None and not training.rows.num_samples:
            training = None
        with attention_kernels(self.device):
            if self.mode_for(batch, training) is ExecMode.GRAPH:
                result = self._run_graph(batch)
            else:
                adapter = train_adapter or self.train_adapter
                assert training is None or adapter is not None, "no training adapter installed"
                result = self._run_eager(batch, training, adapter)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return result

    def _flatten(self, batch: ScheduledBatch) -> _FlatBatch:
        flat = _FlatBatch()
        bs = self.blocks.block_size
        for item in batch.items:
            req, n = item.request, item.num_tokens
            start, row0 = req.num_computed, len(flat.ids)
            flat.ids += req.all_token_ids[start:start + n]
            flat.positions += range(start, start + n)
            flat.slots += self.blocks.slots(req, start, start + n)
            if req.adapter is not None:
                flat.by_adapter.setdefault(req.adapter, []).extend(range(row0, row0 + n))
            if item.is_decode:
                flat.decodes.append((row0, start + 1, req.block_table))
            else:
                flat.prefills.append((slice(row0, row0 + n), start,
                                      req.block_table[: -(-(start + n) // bs)] if start else []))
            if item.completes_prompt:
                flat.sample_rows.append(row0 + n - 1)
                flat.sample_reqs.append(req)
        return flat

    def _context(self, flat: _FlatBatch, n_inf: int, training: TrainingStep | None,
                 adapter: AdapterWeights | None) -> ForwardContext:
        dev = self.device
        meta = StepAttentionMeta(
            num_inference_rows=n_inf,
            slot_mapping=torch.tensor(flat.slots, dtype=torch.long, device=dev),
            decodes=_decode_groups(flat.decodes, self.blocks.block_size, dev,
                                   self.model.weights.dtype),
            prefills=tuple(_chunk(rows, prefix, ctx, dev) for rows, prefix, ctx in flat.prefills),
            training=PaddedSegments(training.rows.lengths, dev, _starts(
                n_inf, training.rows.lengths)) if training is not None else None)
        groups = [LoRAGroup(self.adapter(name), _rows(r, dev))
                  for name, r in flat.by_adapter.items()]
        mlp_hook: MlpHook | None = None
        if training is not None:
            assert adapter is not None
            groups.append(training_group(adapter, slice(n_inf, len(flat.ids)), training.rows))
            if training.saves_mlp:
                def mlp_hook(layer: int, gate: torch.Tensor, up: torch.Tensor) -> None:
                    training.capture_mlp(layer, gate[n_inf:], up[n_inf:])
        return ForwardContext(torch.tensor(flat.positions, dtype=torch.long, device=dev),
                              PagedAttention(self.cache, meta), tuple(groups), mlp_hook=mlp_hook)

    def _run_eager(self, batch: ScheduledBatch, training: TrainingStep | None,
                   adapter: AdapterWeights | None) -> StepResult:
        flat = self._flatten(batch)
        n_inf = len(flat.ids)
        if training is not None:
            flat.ids += training.rows.flat_token_ids()
            flat.positions += training.rows.positions()
        ctx = self._context(flat, n_inf, training, adapter)

        def hook(layer: int, h: torch.Tensor) -> None:
            if training is None:
                return
            if training.should_abort():
                raise StepAborted(layer)
            training.capture(layer, h[n_inf:])

        # every index the step reads is on the device before its first kernel: nothing in the
        # step copies to the device or reads back until the sampler's tokens
        input_ids = torch.tensor(flat.ids, dtype=torch.long, device=self.device)
        sample_rows = torch.tensor(flat.sample_rows, dtype=torch.long, device=self.device)
        try:
            with torch.no_grad():
                h = self.model.forward(input_ids, ctx, hook)
                sampled = self._sample(h, sample_rows, flat.sample_reqs)
        except StepAborted as e:
            return StepResult({}, True, e.layers_run)
        return StepResult(sampled, False, self.model.num_layers)

    def _sample(self, h: torch.Tensor, rows: torch.Tensor, reqs: list[Request]
                ) -> dict[str, int]:
        if not reqs:
            return {}
        logits = self.model.logits(h.index_select(0, rows))
        tokens = self.sampler.sample(logits, [r.request_id for r in reqs],
                                     [r.params for r in reqs])
        return {r.request_id: t for r, t in zip(reqs, tokens, strict=True)}

    def _run_graph(self, batch: ScheduledBatch) -> StepResult:
        assert self.graphs is not None
        reqs = [i.request for i in batch.items]
        positions = [r.num_computed for r in reqs]
        logits = self.graphs.run(
            [r.all_token_ids[p] for r, p in zip(reqs, positions, strict=True)], positions,
            [self.blocks.slots(r, p, p + 1)[0] for r, p in zip(reqs, positions, strict=True)],
            [r.block_table for r in reqs], [p + 1 for p in positions],
            self._adapter_index(reqs))
        tokens = self.sampler.sample(logits, [r.request_id for r in reqs],
                                     [r.params for r in reqs])
        sampled = {r.request_id: t for r, t in zip(reqs, tokens, strict=True)}
        return StepResult(sampled, False, self.model.num_layers, ExecMode.GRAPH)

    def _adapter_index(self, reqs: list[Request]) -> list[int] | None:
        """Each row's adapter slot + 1 (0: base model), its adapters placed in the slots."""
        named = [self.adapter(r.adapter) if r.adapter is not None else None for r in reqs]
        used = [a for a in named if a is not None]
        if not used:
            return None
        assert self.graphs is not None and self.graphs.adapter_slots is not None
        index = self.graphs.adapter_slots.place(used)
        return [index[id(a)] if a is not None else 0 for a in named]


def _decode_groups(decodes: list[tuple[int, int, list[int]]], block_size: int,
                   device: torch.device, dtype: torch.dtype, slack: float = 1.25
                   ) -> tuple[DecodeGroup, ...]:
    """Decodes sorted by context length, cut where padding to the group's longest would
    exceed ``slack`` × the shortest: the gathered KV then tracks Σ context, not B × max.
    Each group's mask is additive in the activations' ``dtype`` (:func:`additive_mask`)."""
    groups: list[DecodeGroup] = []
    ordered = sorted(decodes, key=lambda d: d[1])
    i = 0
    while i < len(ordered):
        j = i + 1
        limit = ordered[i][1] * slack + block_size
        while j < len(ordered) and ordered[j][1] <= limit:
            j += 1
        part = ordered[i:j]
        width = -(-part[-1][1] // block_size)
        blocks = torch.zeros(len(part), width, dtype=torch.long)
        mask = torch.zeros(len(part), width * block_size, dtype=torch.bool)
        for r, (_, n, table) in enumerate(part):
            used = -(-n // block_size)
            blocks[r, :used] = torch.tensor(table[:used])
            mask[r, :n] = True
        rows = torch.tensor([row for row, _, _ in part], dtype=torch.long)
        groups.append(DecodeGroup(rows.to(device), blocks.to(device),
                                  additive_mask(mask[:, None, None, :], dtype).to(device)))
        i = j
    return tuple(groups)


def _chunk(rows: slice, prefix: int, blocks: list[int], device: torch.device) -> PrefillChunk:
    """A prompt's chunk of ``rows``; behind ``prefix`` cached tokens, it sees the prefix and,
    causally, itself."""
    if not prefix:
        return PrefillChunk(rows, 0, None, None)
    n = rows.stop - rows.start
    mask = torch.ones(n, prefix + n, dtype=torch.bool).tril(prefix)
    return PrefillChunk(rows, prefix, torch.tensor(blocks, dtype=torch.long, device=device),
                        mask.to(device))


def _starts(first_row: int, lengths: tuple[int, ...]) -> list[int]:
    """The first row of each of ``lengths``' sequences, laid end to end from ``first_row``."""
    out, row = [], first_row
    for n in lengths:
        out.append(row)
        row += n
    return out


def _rows(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.long, device=device)
