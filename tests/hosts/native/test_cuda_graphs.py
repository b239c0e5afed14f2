"""Graph-mode decode: the static, padded path equals the eager engine and transformers.

On CPU the static path runs eagerly (``capture=False``): bucketing, padding rows in the scratch
block and masked block tables are all checked here. The capture itself needs CUDA (marker
``cuda``; run by ``scripts/device_bench.sh`` on a GPU machine).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from deltaserve.core import ExecMode
from deltaserve.hosts.native import EngineConfig, LLMEngine, SamplingParams
from deltaserve.hosts.native.cuda_graphs import DecodeGraphs, buckets_up_to
from deltaserve.model import AdapterWeights, LoRAConfig
from deltaserve.model.peft_io import save_adapter
from tests.hosts.native.test_engine import hf_greedy, prompts
from tests.hosts.spies import StepLog
from tests.tiny import hf_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf_tiny_llama(seed=11).save_pretrained(path)
    return path


def engine(path, device="cpu", **kw):
    cfg = dict(model=str(path), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
               block_size=4, kv_cache_tokens=2048, max_model_len=256, device=device)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def with_static_graphs(eng: LLMEngine) -> DecodeGraphs:
    graphs = eng.runner.graphs = eng.decode_graphs(capture=False)
    return graphs


def test_buckets():
    assert buckets_up_to(64) == (1, 2, 4, 8, 16, 32, 64)
    assert buckets_up_to(48) == (1, 2, 4, 8, 16, 32, 48)
    assert buckets_up_to(1) == (1,)


def test_bucket_choice(tiny):
    eng = engine(tiny)
    g = with_static_graphs(eng)
    assert g.widths == (1, 2, 4, 8, 16, 32, 64)  # 256 tokens / block 4
    assert g.bucket(5, 17) == (8, 8)  # 17 tokens need 5 blocks of 4 → width 8
    assert g.bucket(1, 1) == (1, 1)
    assert g.bucket(9, 10) is None  # more decodes than max_num_seqs
    assert g.bucket(2, 257) is None


def test_static_decode_equals_eager_and_transformers(tiny):
    ref = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    ps = prompts(7, seed=5)  # 3..50 tokens: several batch and width buckets as requests finish
    eager = engine(tiny)
    want = [list(o.output_token_ids) for o in eager.generate(ps, SamplingParams(max_tokens=20))]

    eng = engine(tiny)
    log = StepLog(eng)
    scratch_before = eng.cache.k.clone()
    g = with_static_graphs(eng)
    got = [list(o.output_token_ids) for o in eng.generate(ps, SamplingParams(max_tokens=20))]
    assert got == want
    for p, o in zip(ps, got, strict=True):
        assert o == hf_greedy(ref, p, 20)[: len(o)]
    modes = [r.shape.mode for r in log.records]
    decode_only = [r.shape.is_decode_only for r in log.records]
    assert modes == [ExecMode.GRAPH if d else ExecMode.EAGER for d in decode_only]
    assert modes.count(ExecMode.GRAPH) >= 10
    # padding rows wrote only the scratch block, which no request was given
    changed = (eng.cache.k != scratch_before).flatten(2).any(-1).any(0)  # per block
    assert changed[g.scratch_block]
    assert eng.blocks.num_blocks == eng.config.num_blocks - 1


def test_adapters_above_the_slot_rank_run_eager(tiny, tmp_path):
    """Decodes whose adapter the graphs' slots cannot hold (rank 8 > 4) run eager, exactly;
    adapters that fit replay graphs (``test_graph_lora``)."""
    eng = engine(tiny, graph_lora_rank=4)
    log = StepLog(eng)
    with_static_graphs(eng)
    ad = AdapterWeights(eng.model.config, LoRAConfig(r=8, alpha=16))
    with torch.no_grad():
        ad.flat.copy_(torch.randn(ad.numel, generator=torch.Generator().manual_seed(0)) * 0.3)
    adir = str(save_adapter(tmp_path / "a", ad, str(tiny)))
    eng.add_lora("a", adir)
    ref = engine(tiny)
    ref.add_lora("a", adir)
    ps = prompts(3, seed=2)
    want = [list(o.output_token_ids)
            for o in ref.generate(ps, SamplingParams(max_tokens=6), adapter="a")]
    got = [list(o.output_token_ids)
           for o in eng.generate(ps, SamplingParams(max_tokens=6), adapter="a")]
    assert got == want
    assert all(r.shape.mode is ExecMode.EAGER for r in log.records)
