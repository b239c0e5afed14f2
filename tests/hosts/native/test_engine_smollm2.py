"""The embedded engine on the real model: greedy outputs equal transformers (and PEFT)."""

import pytest
import torch

from deltaserve.hosts.native import EngineConfig, LLMEngine, SamplingParams
from deltaserve.model import AdapterWeights, LoRAConfig
from deltaserve.model.loading import resolve_model
from deltaserve.model.peft_io import save_adapter

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "List three colors:"]


@pytest.fixture(scope="module")
def setup():
    path = resolve_model("smollm2")
    eng = LLMEngine(EngineConfig(model="smollm2", dtype="float32", max_num_batched_tokens=64,
                                 max_num_seqs=8, kv_cache_tokens=4096, max_model_len=512))
    return path, eng


def reference(model, tok, text, n):
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=n, do_sample=False)
    return out[0, ids["input_ids"].shape[1]:].tolist()


def test_greedy_matches_transformers_with_and_without_adapter(setup, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, eng = setup
    ad = AdapterWeights(eng.model.config, LoRAConfig(r=8, alpha=16)).init_peft_(1)
    with torch.no_grad():
        for _, _, _, b in ad.items():
            b.normal_(0, 0.02, generator=torch.Generator().manual_seed(2))
    adir = save_adapter(tmp_path / "ad", ad, str(path))
    eng.add_lora("ad", adir)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tuned = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adir).eval()
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = eng.generate(PROMPTS, params)
    adapted = eng.generate(PROMPTS, params, adapter="ad")
    differs = 0
    for text, a, b in zip(PROMPTS, plain, adapted, strict=True):
        assert list(a.output_token_ids) == reference(base, eng.tokenizer, text, 16)
        assert list(b.output_token_ids) == reference(tuned, eng.tokenizer, text, 16)
        differs += a.output_token_ids != b.output_token_ids
    assert differs  # the adapter changes what the model says


def test_stop_strings_and_chat(setup):
    _, eng = setup
    text = eng.tokenizer.apply_chat_template([{"role": "user", "content": "Count: 1, 2, 3"}],
                                             tokenize=False, add_generation_prompt=True)
    full = eng.generate([text], SamplingParams(max_tokens=24))[0]
    assert full.text and full.finish_reason in ("eos", "length")
    words = full.text.split()
    assert len(words) > 1
    cut = eng.generate([text], SamplingParams(max_tokens=24, stop=(words[1],)))[0]
    assert cut.finish_reason == "stop" and words[1] not in cut.text
    assert full.text.startswith(cut.text)
