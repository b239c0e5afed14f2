"""Adapters in static, slot-indexed buffers: the LoRA a captured decode graph applies.

A captured graph reads fixed storage with fixed shapes, so the adapters it applies live in
buffers allocated once: for every layer and covered module, the A matrices of ``num_slots``
adapters stacked to ``[num_slots·max_rank, fan_in]`` and their B matrices side by side in
``[fan_out, num_slots·max_rank]``. An adapter of rank r < max_rank fills the first r rows of its
block of A and the first r columns of its block of B; the rest stay zero and add nothing. Each row
of a step names its slot in an index tensor: 0 is no adapter, slot s is index s + 1. A row's
update is

    y += ((x @ A_allᵀ) ⊙ mix) @ B_allᵀ,
    mix[row, block s] = scaling_s if the row's index is s + 1, else 0,

which is exactly its own adapter's ``scaling · B(A x)``: every other slot's term is multiplied by
zero (the buffers hold only finite values). Loading an adapter into a slot, or publishing new
weights of one already there, copies in place: a graph captured earlier keeps reading the same
storage and needs no re-capture.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from deltaserve.model.config import ModelConfig
from deltaserve.model.lora import AdapterWeights


class AdapterSlots:
    """``num_slots`` adapters of rank at most ``max_rank`` on ``modules``, as static buffers.

    Which adapter sits in which slot is decided by :meth:`place` (least recently placed slot
    evicted first); adapters are told apart by identity, so a re-loaded adapter is a new one."""

    def __init__(self, model: ModelConfig, *, num_slots: int, max_rank: int,
                 modules: Sequence[str], dtype: torch.dtype, device: torch.device | str):
        assert num_slots >= 1 and max_rank >= 1, (num_slots, max_rank)  # the config checks
        self.num_slots, self.max_rank = num_slots, max_rank
        self.modules = tuple(modules)
        width = num_slots * max_rank
        self._a: dict[tuple[int, str], torch.Tensor] = {}
        self._b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(model.num_layers):
            for module in self.modules:
                fan_in, fan_out = model.module_dims(module)
                self._a[(layer, module)] = torch.zeros(width, fan_in, dtype=dtype, device=device)
                self._b[(layer, module)] = torch.zeros(fan_out, width, dtype=dtype, device=device)
        self.scales = torch.zeros(num_slots, dtype=dtype, device=device)
        # index of each slot as rows name it (slot s is s + 1): compared, not one-hot encoded,
        # so building a step's mix never reads a value back to the host (capturable)
        self.slot_ids = torch.arange(1, num_slots + 1, device=device)
        self._held: list[AdapterWeights | None] = [None] * num_slots
        self._placed_at = [0] * num_slots  # when each slot was last placed (LRU order)
        self._clock = 0

    # ---- what fits ----------------------------------------------------------------------------
    def fits(self, adapter: AdapterWeights) -> bool:
        """Its rank and target modules fit the buffers."""
        return (adapter.config.r <= self.max_rank
                and all(m in self.modules for m in adapter.config.target_modules))

    def holds(self, adapters: Iterable[AdapterWeights]) -> bool:
        """One step's adapters can all be placed at once."""
        distinct = _distinct(adapters)
        return len(distinct) <= self.num_slots and all(self.fits(a) for a in distinct)

    def slot_of(self, adapter: AdapterWeights) -> int | None:
        return next((s for s, held in enumerate(self._held) if held is adapter), None)

    # ---- placing and publishing -----------------------------------------------------------------
    def place(self, adapters: Iterable[AdapterWeights]) -> dict[int, int]:
        """Put one step's adapters into slots (copying those not there yet, evicting the least
        recently placed adapters the step does not use); returns each adapter's row index
        (slot + 1) by ``id``."""
        distinct = _distinct(adapters)
        if not self.holds(distinct):
            raise ValueError(f"{len(distinct)} adapters (ranks "
                             f"{[a.config.r for a in distinct]}) do not fit {self.num_slots} "
                             f"slots of rank {self.max_rank} on {self.modules}")
        self._clock += 1
        slots: dict[int, int] = {}
        missing = []
        for adapter in distinct:
            s = self.slot_of(adapter)
            if s is None:
                missing.append(adapter)
            else:
                slots[id(adapter)] = s
        for adapter in missing:
            used = set(slots.values())
            s = min((s for s in range(self.num_slots) if s not in used),
                    key=lambda s: (self._held[s] is not None, self._placed_at[s]))
            self.load_(s, adapter)
            slots[id(adapter)] = s
        for s in slots.values():
            self._placed_at[s] = self._clock
        return {key: s + 1 for key, s in slots.items()}

    def load_(self, slot: int, adapter: AdapterWeights) -> None:
        """Copy ``adapter`` into ``slot`` in place (padding its rank and absent modules with
        zeros)."""
        assert self.fits(adapter), "place() checks the fit"
        r, rmax = adapter.config.r, self.max_rank
        block = slice(slot * rmax, slot * rmax + r)
        rest = slice(slot * rmax + r, (slot + 1) * rmax)
        with torch.no_grad():
            for (layer, module), a_all in self._a.items():
                b_all = self._b[(layer, module)]
                if adapter.has(module):
                    a_all[block].copy_(adapter.a(layer, module))
                    b_all[:, block].copy_(adapter.b(layer, module))
                else:
                    a_all[block].zero_()
                    b_all[:, block].zero_()
                a_all[rest].zero_()
                b_all[:, rest].zero_()
            self.scales[slot] = adapter.config.scaling
        self._held[slot] = adapter

    def refresh_(self, adapter: AdapterWeights) -> bool:
        """Copy new weights of ``adapter`` into its slot, if it holds one (``True`` then)."""
        s = self.slot_of(adapter)
        if s is not None:
            self.load_(s, adapter)
        return s is not None

    def release(self, adapter: AdapterWeights) -> None:
        """Forget ``adapter`` (unloaded): its slot is free for the next placement."""
        s = self.slot_of(adapter)
        if s is not None:
            self._held[s] = None

    # ---- the forward's side -------------------------------------------------------------------
    def a(self, layer: int, module: str) -> torch.Tensor:
        return self._a[(layer, module)]

    def b(self, layer: int, module: str) -> torch.Tensor:
        return self._b[(layer, module)]

    def rows(self, index: torch.Tensor) -> SlotLoRA:
        """The LoRA of one forward whose row i uses slot ``index[i] - 1`` (0: none)."""
        return SlotLoRA(self, index)


class SlotLoRA:
    """Slot LoRA applied to the rows of one forward (the ``slot_lora`` of a ForwardContext).
    Its per-row mix is computed on first use, inside the forward, so a captured graph holds it:
    a replay with new indices or new slot weights recomputes it."""

    def __init__(self, slots: AdapterSlots, index: torch.Tensor):
        self.slots = slots
        self.index = index
        self._mix: torch.Tensor | None = None

    def _row_mix(self, dtype: torch.dtype) -> torch.Tensor:
        """[n, num_slots, 1]: the row's adapter scaling in its slot's column, 0 elsewhere."""
        if self._mix is None:
            s = self.slots
            chosen = (self.index[:, None] == s.slot_ids[None, :]).to(dtype)
            self._mix = (chosen * s.scales.to(dtype)[None, :]).unsqueeze(-1)
        return self._mix

    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        """``y`` (base output of ``module`` on ``x``) plus each row's adapter update."""
        s = self.slots
        if module not in s.modules:
            return y
        n = x.shape[0]
        u = (x @ s.a(layer, module).t()).view(n, s.num_slots, s.max_rank)
        u = (u * self._row_mix(x.dtype)).view(n, s.num_slots * s.max_rank)
        return torch.addmm(y, u, s.b(layer, module).t())


def _distinct(adapters: Iterable[AdapterWeights]) -> list[AdapterWeights]:
    return list({id(a): a for a in adapters}.values())
