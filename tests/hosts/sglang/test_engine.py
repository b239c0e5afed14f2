"""The SGLang host as an inference engine (SmolLM2-135M, fp32, CPU), against transformers + PEFT:
greedy outputs with and without a client adapter, and every step reported with its shape."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="needs the SGLang venv (.venv-sglang: bash "
                    "scripts/bootstrap.sh --sglang)")

from deltaserve.core.errors import InputError
from deltaserve.core.requests import SamplingParams
from deltaserve.core.shape import ExecMode, StepShape
from deltaserve.model.peft_io import save_adapter
from tests.hosts.sglang.common import PROMPTS, hf_greedy, peft_model, random_adapter
from tests.hosts.spies import StepLog

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
GREEDY = SamplingParams(max_tokens=8)


def tokens(outs):
    return [list(o.output_token_ids) for o in outs]


def test_greedy_with_and_without_a_client_adapter_equals_transformers_and_peft(
        host, hf_model, tmp_path):
    weights = random_adapter(host.model_config, seed=1)
    host.add_lora("a1", str(save_adapter(tmp_path / "a1", weights, host.model_path)))
    try:
        base = tokens(host.generate(PROMPTS, GREEDY))
        lora = tokens(host.generate(PROMPTS, GREEDY, adapter="a1"))
    finally:
        host.remove_lora("a1")
    assert base == [hf_greedy(hf_model, p, 8) for p in PROMPTS]
    ref = peft_model(host.model_path, weights)
    assert lora == [hf_greedy(ref, p, 8) for p in PROMPTS]
    assert lora != base  # the adapter is live


def test_adapters_sglang_cannot_hold_and_reserved_names_are_refused(host, tmp_path):
    from dataclasses import replace

    from deltaserve.model.lora import AdapterWeights

    big = AdapterWeights(host.model_config, replace(random_adapter(host.model_config, 0).config,
                                                    r=host.config.max_lora_rank * 2))
    with pytest.raises(InputError, match="max_lora_rank"):
        host.add_lora("big", str(save_adapter(tmp_path / "big", big, host.model_path)))
    with pytest.raises(InputError, match="reserved"):
        host.add_lora("deltaserve-train", str(tmp_path / "big"))
    assert host.lora_names() == []


def test_every_step_is_reported_with_the_shape_sglang_ran(host):
    log = StepLog(host)
    fresh = [[4211, 17, 905, 63], [77, 3120, 8, 16, 5000]]  # no cached prefix, BOS included
    host.generate(fresh, SamplingParams(max_tokens=3, ignore_eos=True))
    shapes = [r.shape for r in log.records]
    assert shapes == [StepShape((4, 5)), StepShape(num_decode=2, kv_tokens=4 + 5),
                      StepShape(num_decode=2, kv_tokens=5 + 6)]
    assert all(r.seconds > 0 and r.ft_tokens == 0 and not r.aborted for r in log.records)
    assert all(s.mode is ExecMode.EAGER for s in shapes)


def test_a_cached_prefix_is_reported_as_such(host):
    log = StepLog(host)
    prompt = [1, 9001, 4452, 77, 3004, 18, 221, 93]
    host.generate([prompt], SamplingParams(max_tokens=1))
    host.generate([[*prompt, 55, 66]], SamplingParams(max_tokens=1))
    last = log.records[-1].shape  # SGLang's radix cache holds the first prompt
    assert last.prefill_prefix_lens and last.prefill_prefix_lens[0] >= len(prompt) - 1
    assert last.num_prefill_tokens + last.prefill_prefix_lens[0] == len(prompt) + 2


def test_each_steps_tokens_reach_the_client_in_that_step(host):
    """SGLang's socket hands the scheduler's messages over asynchronously: a host that read it
    without waiting delivered some tokens one step late, after the next step and the yield to
    the backward before it, so a client saw a gap SGLang never made."""
    counts: dict[str, int] = {}

    def on_token(out):
        counts[out.request_id] = len(out.output_token_ids)

    prompts = [[4211, 17, 905, 63], [77, 3120, 8, 16, 5000], [1, 9, 44, 1203]]
    ids = {host.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True),
                            callback=on_token) for p in prompts}
    late, steps = [], 0
    while host.has_unfinished():
        before = dict(counts)
        assert host.step()
        steps += 1
        ran = {r.rid.removesuffix(".") for r in host.scheduler.last_batch.reqs} & ids
        late += [(steps, i) for i in ran if counts.get(i, 0) != before.get(i, 0) + 1]
    assert steps >= 24 and all(counts[i] == 24 for i in ids)
    assert late == []
