"""The embedded host: a minimal continuous-batching, multi-LoRA engine on a paged KV cache.

One step is ``schedule → (co-server plan) → run → postprocess``, each in its own module, in the
spirit of nano-vllm. It is the smallest engine that gives co-serving everything it needs, and it
runs anywhere torch does.
"""

from deltaserve.core.requests import RequestOutput, SamplingParams
from deltaserve.hosts.native.config import EngineConfig
from deltaserve.hosts.native.engine import LLMEngine

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
