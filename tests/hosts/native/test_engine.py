"""The embedded engine against transformers' generation (greedy, adapters via PEFT)."""

import gc
import itertools
import time

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from deltaserve.core import InputError
from deltaserve.hosts.native import EngineConfig, LLMEngine, SamplingParams
from deltaserve.model import AdapterWeights, LoRAConfig
from deltaserve.model.peft_io import save_adapter
from tests.tiny import hf_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf_tiny_llama(seed=11).save_pretrained(path)
    return path


def engine(path, **kw):
    cfg = dict(model=str(path), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
               block_size=4, kv_cache_tokens=2048)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (int(torch.randint(3, 50, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def hf_greedy(model, prompt, max_new):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kw", [
    {},  # continuous batching, chunked prefill (budget 64 < sum of prompts)
    {"max_num_batched_tokens": 7},  # every prompt chunked across steps
    {"kv_cache_tokens": 96, "max_num_seqs": 8},  # too few blocks: preemption and recompute
])
def test_greedy_equals_transformers(tiny, kw):
    ref = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    eng = engine(tiny, **kw)
    ps = prompts()
    outs = eng.generate(ps, SamplingParams(max_tokens=12))
    for p, o in zip(ps, outs, strict=True):
        # whole outputs: an engine that stops early (or late) fails, not only one that differs
        want = hf_greedy(ref, p, 12)
        assert list(o.output_token_ids) == want
        assert o.finished
        assert o.finish_reason == ("eos" if want[-1] in eng.eos_token_ids else "length")
        assert len(want) == 12 or o.finish_reason == "eos"
        assert len(o.token_times_s) == len(o.output_token_ids)


def test_preemption_happens_and_outputs_still_match(tiny):
    ref = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    eng = engine(tiny, kv_cache_tokens=96, max_num_batched_tokens=128)
    ps = prompts(6, seed=3)
    ids = [eng.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in ps]
    preempted = 0
    while eng.has_unfinished():
        eng.step()
        preempted = max(preempted, sum(r.num_preemptions for r in eng._requests.values()))
    assert preempted > 0
    for p, rid in zip(ps, ids, strict=True):
        out = eng.pop_finished(rid)
        want = ref.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False,
                            min_new_tokens=20)[0, len(p):].tolist()
        assert list(out.output_token_ids) == want


def test_multi_lora_batch_equals_peft(tiny, tmp_path):
    ref_base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    eng = engine(tiny)
    dirs = {}
    for i, targets in enumerate([("q_proj", "v_proj"), ("k_proj", "o_proj", "down_proj")]):
        ad = AdapterWeights(eng.model.config, LoRAConfig(r=4, alpha=8, target_modules=targets))
        with torch.no_grad():
            ad.flat.copy_(torch.randn(ad.numel, generator=torch.Generator().manual_seed(i)) * 0.3)
        dirs[f"a{i}"] = save_adapter(tmp_path / f"a{i}", ad, str(tiny))
        eng.add_lora(f"a{i}", dirs[f"a{i}"])
    ps = prompts(6, seed=1)
    names = ["a0", None, "a1", "a0", "a1", None]
    rids = [eng.add_request(p, SamplingParams(max_tokens=8), adapter=n)
            for p, n in zip(ps, names, strict=True)]
    while eng.has_unfinished():
        eng.step()
    for p, n, rid in zip(ps, names, rids, strict=True):
        model = ref_base if n is None else PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), dirs[n])
        got = list(eng.pop_finished(rid).output_token_ids)
        assert got == hf_greedy(model.eval(), p, 8)


def test_seeded_sampling_is_reproducible_and_streams(tiny):
    eng = engine(tiny)
    seen = []
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=123,
                            ignore_eos=True)
    eng.add_request([5, 6, 7], params, callback=seen.append)
    while eng.has_unfinished():
        eng.step()
    first = seen[-1]  # a request with a callback gets its outputs there, none kept to pop
    assert [len(o.output_token_ids) for o in seen] == list(range(1, 11))
    assert seen[-1].finished and not seen[0].finished
    again = engine(tiny).generate([[5, 6, 7]], params)[0]
    assert again.output_token_ids == first.output_token_ids
    other = engine(tiny).generate([[5, 6, 7]], SamplingParams(
        max_tokens=10, temperature=0.8, top_p=0.9, seed=124, ignore_eos=True))[0]
    assert other.output_token_ids != first.output_token_ids


def test_bad_requests(tiny):
    eng = engine(tiny, max_model_len=32)
    with pytest.raises(InputError, match="max_model_len"):
        eng.add_request(list(range(40)))
    with pytest.raises(InputError, match="empty"):
        eng.add_request([])
    with pytest.raises(InputError, match="not loaded"):
        eng.add_request([1, 2], adapter="nope")
    with pytest.raises(InputError, match="tokenizer"):
        eng.add_request("text without a tokenizer")
    with pytest.raises(InputError):
        SamplingParams(top_p=0)
    with pytest.raises(InputError):
        EngineConfig(max_model_len=10_000, kv_cache_tokens=4096)


def test_step_from_two_threads_at_once_is_refused(tiny):
    """One thread drives a host; a second concurrent ``step()`` (say ``generate()`` while
    ``run_loop`` runs) raises instead of corrupting the engine's state."""
    import threading

    eng = engine(tiny)
    inside = threading.Event()
    release = threading.Event()
    real = eng._engine_step

    def slow_step():
        inside.set()
        release.wait(10)
        return real()

    eng._engine_step = slow_step
    t = threading.Thread(target=eng.step)
    t.start()
    assert inside.wait(10)
    with pytest.raises(RuntimeError, match="another thread"):
        eng.step()
    release.set()
    t.join()


def test_a_collection_between_steps_is_in_the_next_steps_record(tiny):
    """``StepRecord.gc_s``: a full collection between two steps is in the second's record."""
    eng = engine(tiny)
    records = []
    eng.subscribe_steps(records.append)
    for p in prompts(2, seed=5):
        eng.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
    assert eng.step()
    t0 = time.perf_counter()
    gc.collect()
    outside_s = time.perf_counter() - t0
    assert eng.step()
    assert records[-1].gc_s >= 0.5 * outside_s > 0


def test_each_step_records_its_span_and_time_outside_it_is_left_out(tiny):
    """``StepRecord.span_s`` runs from the step's scheduling to its record: it holds the
    forward and not the time the caller spends between steps (here a sleep)."""
    eng = engine(tiny)
    records = []
    eng.subscribe_steps(records.append)
    for p in prompts(3, seed=4):
        eng.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
    outside_s = 0.03
    while eng.step():
        time.sleep(outside_s)
    assert len(records) >= 4
    assert all(r.seconds <= r.span_s for r in records)
    for a, b in itertools.pairwise(records):
        assert b.span_s <= b.t_s - a.t_s - outside_s
