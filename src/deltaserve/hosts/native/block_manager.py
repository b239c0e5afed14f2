"""Paged KV-cache blocks: which physical blocks each request's tokens live in."""

from __future__ import annotations

from deltaserve.hosts.native.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def reserve_block(self) -> int:
        """Take one block out of circulation for good (the scratch block of padded steps)."""
        if not self._free:
            raise RuntimeError("no free block to reserve")
        self.num_blocks -= 1
        return self._free.pop()

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        """New blocks ``req`` needs to hold ``num_tokens`` tokens in total."""
        want = -(-num_tokens // self.block_size)
        return max(0, want - len(req.block_table))

    def can_hold(self, req: Request, num_tokens: int) -> bool:
        return self.blocks_needed(req, num_tokens) <= len(self._free)

    def grow(self, req: Request, num_tokens: int) -> None:
        n = self.blocks_needed(req, num_tokens)
        if n > len(self._free):
            raise RuntimeError(f"{req.request_id}: needs {n} blocks, {len(self._free)} free")
        req.block_table.extend(self._free.pop() for _ in range(n))

    def free(self, req: Request) -> None:
        self._free.extend(reversed(req.block_table))
        req.block_table = []

    def slots(self, req: Request, start: int, stop: int) -> list[int]:
        """Cache slots of token positions ``[start, stop)`` of ``req``."""
        bs, table = self.block_size, req.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]
