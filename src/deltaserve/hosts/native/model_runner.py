"""Runs one step: builds the flat batch, calls the model with the co-server's hooks, samples.

Training rows come last, each sample contiguous and starting at position 0, on the reserved
training adapter; the layer hook copies their slice of every layer's input to the co-server and
asks, at every layer boundary, whether a training-only step must stop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deltaserve.core.shape import ExecMode
from deltaserve.hosts.native.adapters import AdapterRegistry
from deltaserve.hosts.native.attention import (
    DecodeGroup,
    KVCache,
    PagedAttention,
    PrefillChunk,
    StepAttentionMeta,
)
from deltaserve.hosts.native.block_manager import BlockManager
from deltaserve.hosts.native.cuda_graphs import DecodeGraphs
from deltaserve.hosts.native.sampler import Sampler
from deltaserve.hosts.native.scheduler import ScheduledBatch
from deltaserve.model.llama import ForwardContext, LlamaModel
from deltaserve.model.lora import LoRAGroup
from deltaserve.train.capture import StepAborted


@dataclass(frozen=True)
class TrainingRows:
    """Fine-tuning samples riding in a step, and the co-server's hooks for them."""

    token_ids: Sequence[Sequence[int]]
    make_group: Callable[[slice], LoRAGroup]
    capture: Callable[[int, torch.Tensor], None]
    capture_mlp: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
    should_abort: Callable[[], bool] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


@dataclass(frozen=True)
class StepResult:
    sampled: dict[str, int]  # request id → next token
    aborted: bool
    layers_run: int
    mode: ExecMode = ExecMode.EAGER


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, blocks: BlockManager,
                 adapters: AdapterRegistry, sampler: Sampler):
        self.model = model
        self.cache = cache
        self.blocks = blocks
        self.adapters = adapters
        self.sampler = sampler
        self.device = model.weights.device
        self.current_layer = -1  # the layer the running step is about to enter (for tests)
        self.graphs: DecodeGraphs | None = None  # set by the engine where graphs are captured

    def mode_for(self, batch: ScheduledBatch) -> ExecMode:
        """How ``batch`` runs without fine-tuning rows: a graph when every item is a decode of a
        base-model request and a captured bucket holds it (rows carrying an adapter, prefills
        and training rows have data-dependent shapes)."""
        g = self.graphs
        if g is None or not batch.items or batch.prefills:
            return ExecMode.EAGER
        if any(i.request.adapter is not None for i in batch.items):
            return ExecMode.EAGER
        longest = max(i.request.num_computed + 1 for i in batch.items)
        return ExecMode.EAGER if g.bucket(len(batch.items), longest) is None else ExecMode.GRAPH

    def run(self, batch: ScheduledBatch, training: TrainingRows | None = None) -> StepResult:
        """One step, finished on the device when it returns (so a caller's clock times it)."""
        if training is None and self.mode_for(batch) is ExecMode.GRAPH:
            result = self._run_graph(batch)
        else:
            result = self._run_eager(batch, training)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return result

    def _run_eager(self, batch: ScheduledBatch, training: TrainingRows | None) -> StepResult:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        by_adapter: dict[str, list[int]] = {}
        sample_rows: list[int] = []
        sample_reqs = []
        decode_ctx: list[tuple[int, int, list[int]]] = []  # (row, context, blocks)
        prefills: list[tuple[slice, int, list[int]]] = []
        bs = self.blocks.block_size
        for item in batch.items:
            req, n = item.request, item.num_tokens
            start, row0 = req.num_computed, len(ids)
            ids += req.all_token_ids[start:start + n]
            positions += range(start, start + n)
            slots += self.blocks.slots(req, start, start + n)
            if req.adapter is not None:
                by_adapter.setdefault(req.adapter, []).extend(range(row0, row0 + n))
            if item.is_decode:
                decode_ctx.append((row0, start + 1, req.block_table))
            else:
                prefills.append((slice(row0, row0 + n), start,
                                 req.block_table[: -(-(start + n) // bs)] if start else []))
            if item.completes_prompt:
                sample_rows.append(row0 + n - 1)
                sample_reqs.append(req)
        n_inf = len(ids)
        train_lengths: tuple[int, ...] = ()
        if training is not None:
            train_lengths = tuple(len(t) for t in training.token_ids)
            for t in training.token_ids:
                ids += t
                positions += range(len(t))

        dev = self.device
        meta = StepAttentionMeta(
            num_inference_rows=n_inf,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decodes=_decode_groups(decode_ctx, bs, dev),
            prefills=tuple(PrefillChunk(rows, prefix, torch.tensor(ctx, dtype=torch.long,
                                                                   device=dev))
                           for rows, prefix, ctx in prefills),
            training_lengths=train_lengths)

        groups = [LoRAGroup(self.adapters.get(name), _rows(r, dev))
                  for name, r in by_adapter.items()]
        if training is not None:
            groups.append(training.make_group(slice(n_inf, len(ids))))
        mlp_hook = None
        if training is not None and training.capture_mlp is not None:
            def mlp_hook(layer: int, gate: torch.Tensor, up: torch.Tensor) -> None:
                training.capture_mlp(layer, gate[n_inf:], up[n_inf:])
        ctx = ForwardContext(torch.tensor(positions, dtype=torch.long, device=dev),
                             PagedAttention(self.cache, meta), tuple(groups), mlp_hook=mlp_hook)

        def hook(layer: int, h: torch.Tensor) -> None:
            self.current_layer = layer
            if training is None:
                return
            if training.should_abort is not None and training.should_abort():
                raise StepAborted(layer)
            training.capture(layer, h[n_inf:])

        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        try:
            with torch.no_grad():
                h = self.model.forward(input_ids, ctx, hook)
                sampled: dict[str, int] = {}
                if sample_rows:
                    logits = self.model.logits(h[torch.tensor(sample_rows, device=dev)])
                    tokens = self.sampler.sample(logits, [r.request_id for r in sample_reqs],
                                                 [r.params for r in sample_reqs])
                    sampled = {r.request_id: t for r, t in zip(sample_reqs, tokens, strict=True)}
        except StepAborted as e:
            return StepResult({}, True, e.layers_run)
        finally:
            self.current_layer = -1
        return StepResult(sampled, False, self.model.num_layers)


    def _run_graph(self, batch: ScheduledBatch) -> StepResult:
        assert self.graphs is not None
        reqs = [i.request for i in batch.items]
        positions = [r.num_computed for r in reqs]
        logits = self.graphs.run(
            [r.all_token_ids[p] for r, p in zip(reqs, positions, strict=True)], positions,
            [self.blocks.slots(r, p, p + 1)[0] for r, p in zip(reqs, positions, strict=True)],
            [r.block_table for r in reqs], [p + 1 for p in positions])
        tokens = self.sampler.sample(logits, [r.request_id for r in reqs],
                                     [r.params for r in reqs])
        sampled = {r.request_id: t for r, t in zip(reqs, tokens, strict=True)}
        return StepResult(sampled, False, self.model.num_layers, ExecMode.GRAPH)


def _decode_groups(decodes: list[tuple[int, int, list[int]]], block_size: int,
                   device: torch.device, slack: float = 1.25) -> tuple[DecodeGroup, ...]:
    """Decodes sorted by context length, cut where padding to the group's longest would
    exceed ``slack`` × the shortest: the gathered KV then tracks Σ context, not B × max."""
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
                                  mask[:, None, None, :].to(device)))
        i = j
    return tuple(groups)


def _rows(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.long, device=device)
