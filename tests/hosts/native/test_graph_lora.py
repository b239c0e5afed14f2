"""Graph decodes with adapters: the static path's slot LoRA against the eager engine's LoRA.

The eager path applies each adapter to its own rows (``model.lora.apply_lora``, itself tested
against PEFT); the static path applies every slot to every row through one index tensor. On CPU
the static path runs eagerly (``capture=False``): the slot buffers, the row index, publishing and
eviction are all checked here. The capture itself needs CUDA (marker ``cuda``).
"""

import argparse
import random

import pytest
import torch

from deltaserve.cli_flags import add_dataclass_flags, from_args
from deltaserve.core import ExecMode
from deltaserve.core.errors import InputError
from deltaserve.core.requests import SamplingParams
from deltaserve.core.shape import StepShape
from deltaserve.hosts.native import EngineConfig, LLMEngine
from deltaserve.hosts.native.adapters import TRAIN_ADAPTER
from deltaserve.hosts.native.request import Request
from deltaserve.hosts.native.scheduler import ScheduledBatch, ScheduledItem
from deltaserve.hosts.probe import probe_step, random_rows
from deltaserve.model import AdapterWeights, LoRAConfig
from deltaserve.model.lora_slots import AdapterSlots
from deltaserve.model.peft_io import save_adapter
from tests.hosts.native.test_engine import prompts
from tests.hosts.spies import StepLog
from tests.tiny import hf_tiny_llama

needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf_tiny_llama(seed=17).save_pretrained(path)
    return path


def engine(path, device="cpu", **kw):
    cfg = dict(model=str(path), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
               block_size=4, kv_cache_tokens=2048, max_model_len=256, device=device,
               graph_lora_slots=3, graph_lora_rank=8)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def random_weights(ad: AdapterWeights, seed: int) -> None:
    """Random A and B in place (B non-zero, so the adapter changes the logits), of the size of
    the tiny model's own weights: an update many times the base projection's would amplify
    fp32 rounding past any fixed tolerance on either path."""
    with torch.no_grad():
        ad.flat.copy_(torch.randn(ad.numel, generator=torch.Generator().manual_seed(seed)) * 0.1)


def random_adapter(eng, r, seed, **lora) -> AdapterWeights:
    ad = AdapterWeights(eng.model.config, LoRAConfig(r=r, alpha=2.0 * r, **lora),
                        device=eng.model.weights.device)
    random_weights(ad, seed)
    return ad


class LogitsSpy:
    """The runner's sampler, keeping the logits each step samples from."""

    def __init__(self, inner):
        self.inner = inner
        self.logits: list[torch.Tensor] = []

    def sample(self, logits, request_ids, params):
        self.logits.append(logits.detach().cpu().clone())
        return self.inner.sample(logits, request_ids, params)

    def forget(self, request_id):
        self.inner.forget(request_id)


def prefilled(eng, adapters, seed=0):
    """One request per entry of ``adapters`` (a name or None), prompts of different lengths,
    prefilled eagerly: each holds its first output token and is ready to decode."""
    rng = random.Random(seed)
    reqs = []
    for i, name in enumerate(adapters):
        n = rng.randrange(3, 30)
        req = Request(f"r{i}", [rng.randrange(3, 97) for _ in range(n)], SamplingParams(),
                      adapter=name)
        eng.blocks.grow(req, n)
        reqs.append(req)
    graphs, eng.runner.graphs = eng.runner.graphs, None
    result = eng.runner.run(ScheduledBatch(tuple(ScheduledItem(r, r.num_tokens) for r in reqs)))
    eng.runner.graphs = graphs
    for r in reqs:
        r.num_computed = r.num_tokens
        r.output_token_ids.append(result.sampled[r.request_id])
        eng.blocks.grow(r, r.num_tokens)  # room for the decode's token
    return reqs


def decode(eng, reqs, graphs):
    """Logits and mode of one decode step of ``reqs`` (``graphs`` None: eager). The cache is
    left as a decode leaves it, so the same step can run again on either path."""
    spy = LogitsSpy(eng.runner.sampler)
    eng.runner.sampler, eng.runner.graphs = spy, graphs
    try:
        result = eng.runner.run(ScheduledBatch(tuple(ScheduledItem(r, 1) for r in reqs)))
    finally:
        eng.runner.sampler = spy.inner
    return spy.logits[-1], result.mode


MIXED = [None, TRAIN_ADAPTER, "a", None, "a", TRAIN_ADAPTER, "b"]


def mixed_engine(tiny, device="cpu", **kw):
    eng = engine(tiny, device, **kw)
    eng.adapters.add("a", random_adapter(eng, 4, seed=1))
    eng.adapters.add("b", random_adapter(eng, 8, seed=2, target_modules=("q_proj", "v_proj")))
    eng.install_training_adapter(random_adapter(eng, 8, seed=3))
    return eng


def test_static_decode_with_adapters_in_slots_equals_eager(tiny):
    eng = mixed_engine(tiny)
    static = eng.decode_graphs(capture=False)
    reqs = prefilled(eng, MIXED)
    want, mode = decode(eng, reqs, None)
    assert mode is ExecMode.EAGER
    got, mode = decode(eng, reqs, static)
    assert mode is ExecMode.GRAPH
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the adapters change every adapter row's logits: the comparison is not base vs base
    ref = engine(tiny)
    base, _ = decode(ref, prefilled(ref, [None] * len(MIXED)), None)
    changed = (want - base).abs().amax(-1) > 1e-3
    assert changed.tolist() == [name is not None for name in MIXED]


def test_published_weights_reach_the_slots_without_recapture(tiny):
    eng = mixed_engine(tiny)
    static = eng.decode_graphs(capture=False)
    reqs = prefilled(eng, MIXED)
    before, mode = decode(eng, reqs, static)
    assert mode is ExecMode.GRAPH
    slots = static.adapter_slots
    storage = [slots.a(0, "q_proj").data_ptr(), slots.b(2, "v_proj").data_ptr()]
    train = eng.runner.train_adapter
    random_weights(train, seed=9)  # as the backward does: new weights in the same tensor
    eng.publish_adapter(train)
    got, mode = decode(eng, reqs, static)
    want, _ = decode(eng, reqs, None)
    assert mode is ExecMode.GRAPH
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    moved = (got - before).abs().amax(-1) > 1e-3
    assert moved.tolist() == [name == TRAIN_ADAPTER for name in MIXED]
    assert [slots.a(0, "q_proj").data_ptr(), slots.b(2, "v_proj").data_ptr()] == storage


def test_steps_with_more_adapters_over_time_than_slots_evict_and_stay_exact(tiny):
    eng = mixed_engine(tiny, graph_lora_slots=2)
    eng.adapters.add("c", random_adapter(eng, 2, seed=4))
    static = eng.decode_graphs(capture=False)
    # the last step is base-model rows only, in the rows adapter rows used before
    for step, names in enumerate([["a", None, "b"], ["c", "a"], [TRAIN_ADAPTER, "b", None],
                                  ["c", "a", "c"], [None, None, None]]):
        reqs = prefilled(eng, names, seed=step)
        want, _ = decode(eng, reqs, None)
        got, mode = decode(eng, reqs, static)
        assert mode is ExecMode.GRAPH
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        for r in reqs:
            eng.blocks.free(r)


def batch_of(eng, names):
    reqs = prefilled(eng, names)
    return ScheduledBatch(tuple(ScheduledItem(r, 1) for r in reqs))


def test_mode_for(tiny):
    eng = mixed_engine(tiny)
    eng.adapters.add("wide", random_adapter(eng, 16, seed=5))  # rank above the slots' 8
    eng.adapters.add("mlp", random_adapter(eng, 4, seed=6, target_modules=("down_proj",)))
    eng.adapters.add("c", random_adapter(eng, 2, seed=7))
    eng.runner.graphs = eng.decode_graphs(capture=False)
    mode = eng.runner.mode_for
    assert mode(batch_of(eng, [None, None])) is ExecMode.GRAPH
    assert mode(batch_of(eng, MIXED)) is ExecMode.GRAPH
    assert mode(batch_of(eng, [TRAIN_ADAPTER])) is ExecMode.GRAPH
    shape = StepShape((), 1, 0, ft_lens=(5,))
    training = probe_step(random_rows((5,), 97, random.Random(0)), shape, 0.0,
                          torch.empty(3, 5, 64))
    assert mode(batch_of(eng, [None, "a"]), training) is ExecMode.EAGER
    assert mode(batch_of(eng, [None, "wide"])) is ExecMode.EAGER
    assert mode(batch_of(eng, ["mlp"])) is ExecMode.EAGER  # a module the slots do not cover
    assert mode(batch_of(eng, ["a", "b", TRAIN_ADAPTER, "c"])) is ExecMode.EAGER  # 4 > 3 slots
    # the step's rows then run on the path mode_for names, and the eager one is exact
    wide = prefilled(eng, [None, "wide"])
    got, ran = decode(eng, wide, eng.runner.graphs)
    assert ran is ExecMode.EAGER
    torch.testing.assert_close(got, decode(eng, wide, None)[0], atol=0, rtol=0)
    # without slots, graphs serve base-model decodes only
    eng.runner.graphs = engine(tiny, graph_lora_slots=0).decode_graphs(capture=False)
    assert mode(batch_of(eng, [None, None])) is ExecMode.GRAPH
    assert mode(batch_of(eng, [None, "a"])) is ExecMode.EAGER


def test_client_adapter_decodes_replay_graphs_in_the_engine(tiny, tmp_path):
    """Through the engine: a client's adapter decodes on the static path and generates what
    the eager engine generates; the steps' recorded mode (the latency model's) is GRAPH."""
    ref = engine(tiny)
    ad = random_adapter(ref, 4, seed=8)
    adir = str(save_adapter(tmp_path / "a", ad, str(tiny)))
    ref.add_lora("a", adir)
    ps = prompts(4, seed=3)
    params = SamplingParams(max_tokens=8)
    want = [list(o.output_token_ids) for o in ref.generate(ps, params, adapter="a")]
    eng = engine(tiny)
    eng.runner.graphs = eng.decode_graphs(capture=False)
    eng.add_lora("a", adir)
    log = StepLog(eng)
    got = [list(o.output_token_ids) for o in eng.generate(ps, params, adapter="a")]
    assert got == want
    modes = [r.shape.mode for r in log.records]
    assert modes == [ExecMode.GRAPH if r.shape.is_decode_only else ExecMode.EAGER
                     for r in log.records]
    assert modes.count(ExecMode.GRAPH) >= 5


def test_slot_placement_prefers_free_then_least_recent(tiny):
    eng = engine(tiny)
    slots = AdapterSlots(eng.model.config, num_slots=2, max_rank=8, modules=("q_proj",),
                         dtype=torch.float32, device="cpu")
    a, b, c = (random_adapter(eng, 4, seed=s, target_modules=("q_proj",)) for s in (1, 2, 3))
    assert slots.place([a]) == {id(a): 1}
    assert slots.place([b, a]) == {id(a): 1, id(b): 2}
    assert slots.place([b]) == {id(b): 2}
    assert slots.place([c]) == {id(c): 1}  # a was placed least recently
    assert slots.slot_of(a) is None and slots.slot_of(b) == 1
    # rank 4 in a rank-8 slot: the rest of the block is zero, the block holds A exactly
    torch.testing.assert_close(slots.a(1, "q_proj")[:4], c.a(1, "q_proj"), atol=0, rtol=0)
    assert not slots.a(1, "q_proj")[4:8].any() and not slots.b(1, "q_proj")[:, 4:8].any()
    slots.release(c)
    assert slots.place([a, b]) == {id(a): 1, id(b): 2}
    with pytest.raises(ValueError, match="do not fit"):
        slots.place([a, b, c])


@pytest.mark.parametrize("field, value", [("graph_lora_slots", -1), ("graph_lora_rank", 0),
                                          ("graph_lora_modules", ("qproj",)),
                                          ("graph_lora_modules", ())])
def test_config_rejects(field, value):
    with pytest.raises(InputError, match=field):
        EngineConfig(**{field: value})


def test_config_flags():
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, EngineConfig)
    ns = parser.parse_args(["--graph-lora-slots", "2", "--graph-lora-rank", "32",
                            "--graph-lora-modules", "q_proj,down_proj"])
    cfg = from_args(EngineConfig, ns)
    assert (cfg.graph_lora_slots, cfg.graph_lora_rank, cfg.graph_lora_modules) == (
        2, 32, ("q_proj", "down_proj"))


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
def test_captured_graphs_with_adapters_equal_eager_and_follow_publishes(tiny, device):
    eng = mixed_engine(tiny, device)  # on CUDA the engine captures its graphs at start-up
    graphs = eng.runner.graphs
    assert graphs is not None and graphs.capture_graphs and graphs.num_captured > 0
    captured = graphs.num_captured
    reqs = prefilled(eng, MIXED)
    want, _ = decode(eng, reqs, None)
    got, mode = decode(eng, reqs, graphs)
    assert mode is ExecMode.GRAPH
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    train = eng.runner.train_adapter
    random_weights(train, seed=9)
    eng.publish_adapter(train)
    got, mode = decode(eng, reqs, graphs)
    want, _ = decode(eng, reqs, None)
    assert mode is ExecMode.GRAPH and graphs.num_captured == captured
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
