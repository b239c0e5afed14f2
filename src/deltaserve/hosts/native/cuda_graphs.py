"""Decode steps as CUDA graphs: one captured graph per (batch bucket, context bucket).

A decode step is padded to the next captured batch size and its block tables to the next captured
width, then replayed: the launch cost of ~10 kernels per layer is paid once at capture instead of
every step. Invariants that make replay exact:

- every input lives in a static buffer the graph reads (token ids, positions, cache slots, block
  tables, context lengths, each row's adapter slot); a step only copies into them;
- padding rows decode a dummy token at position 0 into a scratch block that no request owns, and
  attend to that one slot, so they neither touch a request's cache nor produce NaNs;
- a real row attends exactly its ``context_len`` positions (the mask), so padding the block table
  to the bucket width adds no keys;
- adapters are applied through static slot buffers (:mod:`deltaserve.model.lora_slots`): a row
  names its slot (0: none, as for padding rows), and loading or publishing an adapter copies into
  its slot in place, so the graphs never need re-capturing.

Steps with prefills or fine-tuning rows run eager (chunked prefill and per-sample capture have
data-dependent shapes), and so do decodes whose adapters the slots cannot hold (a rank above the
slots', a module they do not cover, more adapters than slots). Without CUDA the same static
computation runs eagerly (``capture=False``): tests check it against the eager engine on CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from deltaserve.hosts.native.attention import KVCache
from deltaserve.model.attention import additive_mask, attention_kernels, decode_attention
from deltaserve.model.llama import ForwardContext, LlamaModel
from deltaserve.model.lora import AdapterWeights
from deltaserve.model.lora_slots import AdapterSlots


def buckets_up_to(limit: int) -> tuple[int, ...]:
    """1, 2, 4, … below ``limit``, then ``limit`` itself."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return (*out, limit)


class StaticDecodeAttention:
    """Decode attention over fixed-shape block tables, masked to each row's context length."""

    def __init__(self, cache: KVCache, slots: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor):
        self.cache = cache
        self.slots = slots
        self.block_tables = block_tables
        width = block_tables.shape[1] * cache.block_size
        positions = torch.arange(width, device=slots.device)
        self.mask = additive_mask((positions[None, :] < context_lens[:, None])[:, None, None, :],
                                  cache.k.dtype)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor:
        kc, vc = self.cache.layer_flat(layer)
        kc.index_copy_(0, self.slots, k)
        vc.index_copy_(0, self.slots, v)
        keys, vals = self.cache.gather(layer, self.block_tables)  # [b, width, Hkv, D]
        return decode_attention(q, keys, vals, self.mask)


class DecodeGraphs:
    """Static buffers, the captured graphs and their replay.

    ``scratch_block``: a cache block reserved for padding rows. ``capture``: record CUDA graphs
    (needs a CUDA device); ``False`` runs the static path eagerly. ``adapter_slots``: the
    adapters decodes may carry (``None``: base-model decodes only).
    """

    def __init__(self, model: LlamaModel, cache: KVCache, *, batch_sizes: Sequence[int],
                 max_blocks: int, scratch_block: int, capture: bool,
                 adapter_slots: AdapterSlots | None = None):
        device = model.weights.device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {device}")
        self.model = model
        self.cache = cache
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.widths = buckets_up_to(max_blocks)
        self.capture_graphs = capture
        self.scratch_slot = scratch_block * cache.block_size
        b, w = self.batch_sizes[-1], self.widths[-1]
        self.scratch_block = scratch_block
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slots = torch.full((b,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((b, w), scratch_block, dtype=torch.long, device=device)
        self.context_lens = torch.ones(b, dtype=torch.long, device=device)
        self.adapter_slots = adapter_slots
        self.adapter_index = torch.zeros(b, dtype=torch.long, device=device)  # slot + 1; 0: none
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._pool = None

    # ---- buckets ----------------------------------------------------------------------------
    def bucket(self, batch_size: int, max_context: int) -> tuple[int, int] | None:
        """The captured (batch, width in blocks) a step pads to; ``None``: too large."""
        blocks = -(-max_context // self.cache.block_size)
        b = next((s for s in self.batch_sizes if s >= batch_size), None)
        w = next((s for s in self.widths if s >= blocks), None)
        return None if b is None or w is None else (b, w)

    def holds(self, adapters: Iterable[AdapterWeights]) -> bool:
        """The adapters of one step fit the slots (no adapters always do)."""
        adapters = list(adapters)
        if not adapters:
            return True
        return self.adapter_slots is not None and self.adapter_slots.holds(adapters)

    # ---- capture ----------------------------------------------------------------------------
    def _forward(self, b: int, w: int) -> torch.Tensor:
        attention = StaticDecodeAttention(self.cache, self.slots[:b], self.block_tables[:b, :w],
                                          self.context_lens[:b])
        lora = self.adapter_slots
        ctx = ForwardContext(self.positions[:b], attention, (),
                             slot_lora=lora.rows(self.adapter_index[:b]) if lora else None)
        return self.model.logits(self.model.forward(self.input_ids[:b], ctx))

    def capture_all(self) -> int:
        """Capture every bucket, largest batch first so smaller graphs reuse its memory pool.
        The static buffers hold padding while capturing: captures write only the scratch block."""
        if not self.capture_graphs:
            return 0
        self._reset_padding(0)
        self._pool = torch.cuda.graph_pool_handle()
        # a graph replays the kernels chosen at capture: capture under the attention policy
        with attention_kernels(self.input_ids.device):
            for b in reversed(self.batch_sizes):
                for w in reversed(self.widths):
                    self._capture(b, w)
        return len(self._graphs)

    def _capture(self, b: int, w: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):  # warm-up allocates workspaces outside the graph
                self._forward(b, w)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(b, w)
        self._graphs[(b, w)] = graph
        self._outputs[(b, w)] = out

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    # ---- replay -----------------------------------------------------------------------------
    def run(self, token_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
            block_tables: Sequence[Sequence[int]], context_lens: Sequence[int],
            adapter_index: Sequence[int] | None = None) -> torch.Tensor:
        """Logits [n, vocab] of one decode row per request (rows in the given order).
        ``adapter_index``: each row's adapter slot + 1 (0: none), from
        :meth:`AdapterSlots.place`; ``None``: no row has an adapter."""
        n = len(token_ids)
        key = self.bucket(n, max(context_lens))
        if key is None:
            raise ValueError(f"no captured bucket for {n} decodes of context {max(context_lens)}")
        b, w = key
        dev = self.input_ids.device
        self._reset_padding(n)
        self.input_ids[:n].copy_(torch.tensor(token_ids), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions), non_blocking=True)
        self.slots[:n].copy_(torch.tensor(slots), non_blocking=True)
        self.context_lens[:n].copy_(torch.tensor(context_lens), non_blocking=True)
        index = list(adapter_index) if adapter_index is not None else [0] * n
        assert self.adapter_slots is not None or not any(index), "adapters without slots"
        self.adapter_index[:n].copy_(torch.tensor(index, dtype=torch.long), non_blocking=True)
        tables = torch.full((n, w), self.scratch_block, dtype=torch.long)
        for r, table in enumerate(block_tables):
            used = -(-context_lens[r] // self.cache.block_size)
            tables[r, :used] = torch.tensor(table[:used])
        self.block_tables[:n, :w].copy_(tables.to(dev), non_blocking=True)
        graph = self._graphs.get(key)
        if graph is None:
            if self.capture_graphs:
                raise RuntimeError(f"bucket {key} was not captured (call capture_all first)")
            with torch.no_grad(), attention_kernels(dev):
                return self._forward(b, w)[:n]
        graph.replay()
        return self._outputs[key][:n]

    def _reset_padding(self, n: int) -> None:
        """Rows from ``n`` on decode a dummy token into the scratch block."""
        self.input_ids[n:] = 0
        self.positions[n:] = 0
        self.slots[n:] = self.scratch_slot
        self.context_lens[n:] = 1
        self.adapter_index[n:] = 0
        self.block_tables[n:] = self.scratch_block
