"""The SGLang host's engine pieces on a real in-process SGLang (SmolLM2-135M, fp32, CPU),
checked against transformers + PEFT."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang", reason="needs the SGLang venv (.venv-sglang: bash "
                    "scripts/bootstrap.sh --sglang)")

from deltaserve.core.shape import ExecMode
from tests.hosts.sglang.common import (
    LORA,
    PROMPTS,
    hf_greedy,
    peft_model,
    random_adapter,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
NEW_TOKENS = 8


class Recorder:
    """A capture target: each layer's rows, as the co-server's buffer would receive them."""

    def __init__(self):
        self.layers: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, rows: torch.Tensor) -> None:
        assert layer not in self.layers, "a layer captured twice in one forward"
        self.layers[layer] = rows.clone()


def _train(engine, samples, **kwargs):
    sched = engine.scheduler
    rec = Recorder()
    rows = sched.deltaserve_add_training(samples, sched.deltaserve_lora_id("train"), rec,
                                         **kwargs)
    return rows, rec


class Streamed:
    """Every request id the engine's output messages carry (what would reach clients)."""

    def __init__(self, engine):
        self.ids: list[str] = []
        engine.on_output = self.ids.append


class Steps:
    """Every step the scheduler reports."""

    def __init__(self, engine):
        self.all: list = []
        engine.scheduler.deltaserve_on_step = self.all.append


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_greedy_with_and_without_adapter_equals_transformers_and_peft(engine, smollm2, hf_model,
                                                                      adapter_a1):
    base = engine.generate(PROMPTS, NEW_TOKENS)
    lora = engine.generate(PROMPTS, NEW_TOKENS, lora_name="a1")
    assert base == [hf_greedy(hf_model, p, NEW_TOKENS) for p in PROMPTS]
    ref = peft_model(smollm2[0], adapter_a1)
    assert lora == [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    assert lora != base  # the adapter is live


def test_publish_lands_in_the_slot_and_greedy_equals_peft(engine, smollm2):
    sched = engine.scheduler
    publisher = sched.deltaserve_publisher("train")
    weights = random_adapter(smollm2[1], seed=5)
    publisher.publish(weights)
    assert torch.equal(publisher.read(smollm2[1], LORA).flat, weights.flat)
    got = engine.generate(PROMPTS, NEW_TOKENS, lora_name="train")
    ref = peft_model(smollm2[0], weights)
    assert got == [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    # the host copy SGLang re-slots from after an eviction holds the same weights
    host = sched.tp_worker.model_runner.lora_manager.loras[publisher.lora_id]
    key = "base_model.model.model.layers.7.self_attn.qkv_proj.lora_B.weight"
    want = torch.cat([weights.b(7, p) for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(host.layers[7].weights[key], want)


def test_capture_equals_transformers_hidden_states_and_stays_hidden(engine, smollm2):
    weights = random_adapter(smollm2[1], seed=7)
    engine.scheduler.deltaserve_publisher("train").publish(weights)
    first = [*PROMPTS[2], 2783, 314]
    samples = [first, PROMPTS[0]]
    streamed = Streamed(engine)
    rows, rec = _train(engine, samples)
    engine.run_until_idle()
    assert rows.valid and rows.aborted_at is None
    assert sorted(rec.layers) == list(range(smollm2[1].num_layers))
    ref = peft_model(smollm2[0], weights)
    offset = 0
    for sample in samples:
        with torch.no_grad():
            hs = ref(torch.tensor([sample]), output_hidden_states=True).hidden_states
        for layer, got in rec.layers.items():
            part = got[offset: offset + len(sample)]
            assert _relative(part, hs[layer][0]) < 1e-4, (layer, _relative(part, hs[layer][0]))
        offset += len(sample)
    # the sample is prefilled whole even right after a sample it shares a prefix with
    rows2, rec2 = _train(engine, [[*first, 28, 30]])
    engine.run_until_idle()
    assert rows2.valid and rec2.layers[0].shape[0] == len(first) + 2
    assert streamed.ids == []  # nothing went towards a client
    assert engine.scheduler.deltaserve_hidden.ids == set()  # finished and forgotten


def test_hidden_requests_beside_a_client_change_nothing_it_sees(engine, hf_model):
    sched = engine.scheduler
    streamed = Streamed(engine)
    client = engine.add_request(PROMPTS[1], max_new_tokens=NEW_TOKENS)
    rows, rec = _train(engine, [PROMPTS[0], PROMPTS[2]])
    engine.step()  # one prefill batch: the client's prompt and both samples
    assert rows.valid and not rows.abortable  # a mixed step is never cut short
    assert rec.layers[0].shape[0] == len(PROMPTS[0]) + len(PROMPTS[2])
    engine.run_until_idle()
    out = engine.take(client)
    assert out == hf_greedy(hf_model, PROMPTS[1], NEW_TOKENS)
    assert set(streamed.ids) == {client}
    assert not sched.deltaserve_hidden.live()


def test_every_forward_is_timed_with_its_mode_and_shape(engine):
    recorded = Steps(engine)
    fresh = [[4211, 17, 905, 63], [77, 3120, 8, 16, 5000]]  # no cached prefix, BOS included
    engine.generate(fresh, 2)
    steps = recorded.all
    assert [s.forward_mode for s in steps] == ["EXTEND", "DECODE"]
    assert [s.num_tokens for s in steps] == [len(fresh[0]) + len(fresh[1]), 2]
    for s in steps:
        assert s.forward is not None and s.forward.mode is ExecMode.EAGER
        assert s.forward.num_tokens == s.num_tokens and s.forward.layers_run == 30
        assert 0 < s.forward.seconds <= s.seconds


def test_training_only_step_is_cut_at_a_layer_boundary_and_serving_goes_on(engine, hf_model):
    asked: list[int] = []

    def should_abort() -> bool:  # the co-server's flag, raised once 5 layers ran
        asked.append(len(rec.layers))
        return len(rec.layers) >= 5

    rows, rec = _train(engine, [PROMPTS[0], PROMPTS[1]], should_abort=should_abort)
    engine.run_until_idle()
    assert rows.abortable and rows.aborted_at == 5
    assert sorted(rec.layers) == [0, 1, 2, 3, 4]
    step = engine.scheduler.deltaserve_last_step
    assert step.forward.aborted and step.forward.layers_run == 5
    assert asked == [0, 1, 2, 3, 4, 5]  # asked once per layer boundary, none after
    rows0, rec0 = _train(engine, [PROMPTS[2]], should_abort=lambda: True)  # before layer 0
    engine.run_until_idle()
    assert rows0.aborted_at == 0 and rec0.layers == {}
    assert engine.generate([PROMPTS[2]], NEW_TOKENS) == [hf_greedy(hf_model, PROMPTS[2],
                                                                   NEW_TOKENS)]
