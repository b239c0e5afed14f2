"""Next-token choice: greedy, or temperature + top-p with a per-request seeded generator."""

from __future__ import annotations

import zlib

import torch

from deltaserve.core.requests import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0):
        self._seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            seed = params.seed if params.seed is not None else \
                zlib.crc32(f"{self._seed}/{request_id}".encode())
            gen = self._generators[request_id] = torch.Generator().manual_seed(seed)
        return gen

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> list[int]:
        """``logits`` [N, V] fp32, one row per request that gets a token this step."""
        out = logits.argmax(-1).tolist()
        for i, (rid, p) in enumerate(zip(request_ids, params, strict=True)):
            if p.temperature == 0:
                continue
            probs = torch.softmax(logits[i] / p.temperature, dim=-1)
            if p.top_p < 1.0:
                sorted_p, order = probs.sort(descending=True)
                keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # the smallest nucleus ≥ top_p
                probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
            out[i] = int(torch.multinomial(probs.cpu(), 1, generator=self._generator(rid, p)))
        return out
