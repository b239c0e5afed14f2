"""Shared by the SGLang host's engine tests: the LoRA config, prompts and the transformers + PEFT
reference."""

from __future__ import annotations

import torch

from deltaserve.model.lora import AdapterWeights, LoRAConfig

LORA = LoRAConfig(r=8, alpha=16, dropout=0.0)
PROMPTS = [[1, 504, 3575, 282, 4649, 314], [1, 1004, 2493, 416, 253, 655, 28],
           [1, 378, 3255, 282, 1015, 5264, 30, 378]]


def random_adapter(model_config, seed: int, scale: float = 0.05) -> AdapterWeights:
    """PEFT's A init and a random B: an adapter that changes the model's outputs."""
    ad = AdapterWeights(model_config, LORA).init_peft_(seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for _, _, _, b in ad.items():
            b.copy_(torch.randn(b.shape, generator=g) * scale)
    return ad



def peft_model(path, adapter: AdapterWeights):
    """A fresh transformers SmolLM2 (fp32) wrapped by PEFT with ``adapter``'s weights: the
    independent reference."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    pm = get_peft_model(base, LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=0.0,
                                             target_modules=list(LORA.target_modules)))
    named = dict(pm.named_parameters())
    with torch.no_grad():
        for key, value in adapter.to_peft_state_dict().items():
            named[key.replace(".weight", ".default.weight")].copy_(value)
    return pm.eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()
