"""Building a host for one system of a benchmark, and its attach/detach functions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deltaserve.bench.config import BenchConfig
from deltaserve.bench.host import ServingHost


@dataclass(frozen=True)
class HostKit:
    host: ServingHost
    attach: Callable[..., object]
    detach: Callable[..., object]
    close: Callable[[], None]


def make_host(cfg: BenchConfig, threads: int) -> HostKit:
    if cfg.host == "native":
        from deltaserve.hosts.native import EngineConfig, LLMEngine
        from deltaserve.hosts.native.coserve import attach, detach

        engine = LLMEngine(EngineConfig(
            model=cfg.model, dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            kv_cache_tokens=cfg.kv_cache_tokens, max_model_len=cfg.max_model_len,
            num_threads=threads, seed=cfg.seed))
        return HostKit(engine, attach, detach, lambda: None)
    from deltaserve.hosts.vllm.bench import make_vllm_host  # lazy: vLLM is optional

    return make_vllm_host(cfg, threads)
