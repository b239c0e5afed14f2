"""One in-process SGLang host (SmolLM2-135M, fp32, CPU) shared by the SGLang host's engine
tests and ``tests/entrypoints/test_serve_sglang.py``, and one calibration of it: a pytest plugin
that ``tests/conftest.py`` registers once, so two test directories never build two hosts.
SGLang's parallel runtime is process-global, so the session builds one host and every test uses
it (attaching and detaching co-servers in turn). Torch runs one thread: on a 2-core machine
shared with other work, OpenMP threads that spin-wait on a busy core make every step orders of
magnitude slower (these tests assert behaviour, never speed)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.hosts.sglang.common import LORA, SMALL_CAL

NEEDS_SGLANG = "needs the SGLang venv (.venv-sglang: bash scripts/bootstrap.sh --sglang)"


@pytest.fixture(scope="session")
def host():
    if importlib.util.find_spec("sglang") is None:
        pytest.skip(NEEDS_SGLANG)
    from deltaserve.hosts.registry import create_host
    from deltaserve.hosts.sglang.config import SGLangConfig

    h = create_host("sglang", SGLangConfig(max_num_batched_tokens=256, max_num_seqs=16,
                                           max_model_len=512, kv_cache_tokens=8192,
                                           dtype="float32", num_threads=1))
    yield h
    h.close()


@pytest.fixture(scope="session")
def latency(host):
    """One calibration through SGLang's scheduler and forward, shared by the session."""
    return host.calibrate(LORA, SMALL_CAL, None, seed=0, progress=False)


@pytest.fixture(scope="session")
def hf_model(host):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(host.model_path, dtype=torch.float32).eval()
