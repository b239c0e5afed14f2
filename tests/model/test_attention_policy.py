"""The SDPA kernel policy: what it allows per device, that every attention entry point runs
under it, and that it leaves torch's process-wide flags as it found them."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from deltaserve.hosts.native import SamplingParams
from deltaserve.model import attention
from deltaserve.model.attention import attention_kernels, sdpa_backends
from deltaserve.model.llama import LlamaModel
from deltaserve.model.loading import load_weights
from deltaserve.train.backward.evaluate import validation_loss
from deltaserve.train.backward.messages import EvalJob
from deltaserve.train.backward.recompute import layerwise_backward
from deltaserve.train.buffer import ActivationBuffer, BufferConfig
from deltaserve.train.capture import forward_training_rows
from tests.hosts.native.test_cuda_graphs import engine, with_static_graphs
from tests.hosts.native.test_engine import prompts
from tests.tiny import hf_tiny_llama
from tests.train.backward.test_recompute import adapter_for, capturing_step, make_samples

CUDA = torch.backends.cuda


def flags() -> tuple[bool, bool, bool, bool]:
    return (CUDA.flash_sdp_enabled(), CUDA.mem_efficient_sdp_enabled(),
            CUDA.math_sdp_enabled(), CUDA.cudnn_sdp_enabled())


def test_the_policy_per_device():
    """CUDA: flash, memory-efficient, math as the fallback, never cuDNN (a plan per shape);
    elsewhere torch's own choice."""
    want = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
    assert sdpa_backends("cuda") == want
    assert sdpa_backends(torch.device("cuda", 1)) == want
    assert SDPBackend.CUDNN_ATTENTION not in sdpa_backends("cuda")
    assert sdpa_backends("cpu") is None and sdpa_backends(torch.device("meta")) is None


def test_the_scope_sets_the_policy_and_restores_the_flags():
    before = flags()
    with attention_kernels("cpu"):
        assert flags() == before  # the CPU keeps torch's defaults
    with attention_kernels("cuda"):  # the flags are plain process state: settable without CUDA
        assert flags() == (True, True, True, False)
    assert flags() == before


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf_tiny_llama(seed=17).save_pretrained(path)
    return path


@pytest.fixture
def math_only(monkeypatch):
    """The policy says "math only" on every device, and every SDPA call records the flags it
    ran under: a call outside the policy's scope sees torch's defaults instead."""
    monkeypatch.setattr(attention, "sdpa_backends", lambda device: (SDPBackend.MATH,))
    seen: list[tuple[bool, bool, bool, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(flags())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


MATH_ONLY = (False, False, True, False)


def test_engine_steps_run_under_the_policy(tiny, math_only):
    """Prefills and decodes, eager and through the static (graph) path."""
    before = flags()
    eng = engine(tiny)
    with_static_graphs(eng)
    outs = eng.generate(prompts(3, seed=2), SamplingParams(max_tokens=4))
    assert all(len(o.output_token_ids) == 4 for o in outs)
    assert len(math_only) > 0 and set(math_only) == {MATH_ONLY}
    assert flags() == before


def test_training_forward_backward_and_validation_run_under_the_policy(tiny, math_only):
    model = LlamaModel(*load_weights(tiny))
    samples = make_samples()
    ad = adapter_for(model, 0.0)
    buf = ActivationBuffer(BufferConfig(sum(js.length for _, js in samples)), model.config,
                           torch.float32)
    forward_training_rows(model, capturing_step(samples, 0.0, buf), ad)
    n_forward = len(math_only)
    layerwise_backward(model, ad.clone(requires_grad=True), buf, [js for _, js in samples], 0.0)
    n_backward = len(math_only) - n_forward
    validation_loss(model, ad, EvalJob(0, tuple(s for s, _ in samples),
                                       tuple(js.labels for _, js in samples)))
    assert n_forward > 0 and n_backward > 0 and len(math_only) > n_forward + n_backward
    assert set(math_only) == {MATH_ONLY}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_policy_runs_every_attention_shape_on_cuda():
    """Causal with grouped KV heads (flash), and a boolean mask with grouped KV heads (neither
    fused kernel takes it: math) both run under the policy, with cuDNN off."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, 37, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 2, 37, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = torch.ones(37, 37, dtype=torch.bool, device="cuda").tril()
    with attention_kernels("cuda"):
        assert not CUDA.cudnn_sdp_enabled()
        causal = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        masked = F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(causal, masked, rtol=2e-2, atol=2e-2)
