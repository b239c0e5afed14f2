"""Parts of the vLLM host that need no engine: the version pin, the plugin, the weight views the
backward maps on GPU, and the adapter layout written into vLLM's stacked LoRA tensors."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from deltaserve.hosts.vllm import plugin
from deltaserve.hosts.vllm.publish import PACKED, AdapterPublisher
from deltaserve.hosts.vllm.version import (
    ACTIVE_ENV,
    SUPPORTED_VERSIONS,
    UnsupportedVLLMVersion,
    check_version,
)
from deltaserve.hosts.vllm.weights import views_available, weights_from_vllm
from deltaserve.model import AdapterWeights, LoRAConfig
from deltaserve.model.config import ModelConfig

CFG = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=4, tie_word_embeddings=True)


def test_package_import_does_not_import_vllm():
    code = ("import sys, deltaserve.hosts.vllm as h; h.__all__; "
            "assert 'vllm' not in sys.modules, 'vllm was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_version_pin_names_the_found_version():
    assert check_version(SUPPORTED_VERSIONS[0]) == SUPPORTED_VERSIONS[0]
    with pytest.raises(UnsupportedVLLMVersion, match=r"found vLLM 0\.31\.1") as e:
        check_version("0.31.1")
    assert e.value.found == "0.31.1" and "0.32.0" in str(e.value)


def test_plugin_is_inert_unless_deltaserve_drives_vllm(monkeypatch):
    monkeypatch.delenv(ACTIVE_ENV, raising=False)
    fake = SimpleNamespace(__version__="0.1.0")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    plugin.register()  # not ours to judge: another user's vLLM
    monkeypatch.setenv(ACTIVE_ENV, "1")
    with pytest.raises(UnsupportedVLLMVersion):
        plugin.register()


def _linear(out_f: int, in_f: int, wrapped: bool) -> nn.Module:
    lin = nn.Linear(in_f, out_f, bias=False)
    if wrapped:  # vLLM's LoRA layers keep the base layer as .base_layer
        outer = nn.Module()
        outer.base_layer = lin
        return outer
    return lin


def fake_vllm_llama(cfg: ModelConfig, padded_vocab: int = 64) -> nn.Module:
    """The module tree of vLLM's LlamaForCausalLM: fused qkv and gate_up, padded vocabulary."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    layers = nn.ModuleList()
    for _ in range(cfg.num_layers):
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.qkv_proj = _linear(q + 2 * kv, h, wrapped=True)
        layer.self_attn.o_proj = _linear(h, q, wrapped=True)
        layer.mlp = nn.Module()
        layer.mlp.gate_up_proj = _linear(2 * i, h, wrapped=True)
        layer.mlp.down_proj = _linear(h, i, wrapped=False)
        layer.input_layernorm = nn.LayerNorm(h)
        layer.post_attention_layernorm = nn.LayerNorm(h)
        layers.append(layer)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = layers
    model.model.embed_tokens = nn.Embedding(padded_vocab, h)
    model.model.norm = nn.LayerNorm(h)
    return model


def test_backward_weights_are_views_of_vllms_fused_tensors():
    model = fake_vllm_llama(CFG)
    assert views_available(model)
    w = weights_from_vllm(model, CFG)
    q, kv, i = CFG.q_size, CFG.kv_size, CFG.intermediate_size
    for lw, layer in zip(w.layers, model.model.layers, strict=True):
        qkv = layer.self_attn.qkv_proj.base_layer.weight
        gate_up = layer.mlp.gate_up_proj.base_layer.weight
        assert torch.equal(lw.q, qkv[:q]) and torch.equal(lw.k, qkv[q:q + kv])
        assert torch.equal(lw.v, qkv[q + kv:])
        assert torch.equal(lw.gate, gate_up[:i]) and torch.equal(lw.up, gate_up[i:])
        for view, fused in ((lw.q, qkv), (lw.v, qkv), (lw.up, gate_up)):
            assert view.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        assert lw.down.data_ptr() == layer.mlp.down_proj.weight.data_ptr()
    assert w.embed.shape[0] == CFG.vocab_size and w.lm_head is w.embed
    with torch.no_grad():  # no copy: vLLM's storage is what the backward reads
        model.model.layers[0].self_attn.qkv_proj.base_layer.weight[q + kv, 0] = 123.0
    assert w.layers[0].v[0, 0] == 123.0


def test_repacked_cpu_weights_are_not_viewable():
    model = fake_vllm_llama(CFG)
    model.model.layers[0].self_attn.qkv_proj.base_layer.weight = nn.Parameter(torch.empty(0))
    assert not views_available(model)
    with pytest.raises(ValueError, match="repacked"):
        weights_from_vllm(model, CFG)


class _FakeLoRALayer:
    def __init__(self, slots: int, max_rank: int, ins: list[int], outs: list[int]):
        self.lora_a_stacked = tuple(torch.zeros(slots, 1, max_rank, n) for n in ins)
        self.lora_b_stacked = tuple(torch.zeros(slots, 1, m, max_rank) for m in outs)


def test_publish_writes_vllm_layout_with_scaling_folded_into_b():
    lora = LoRAConfig(r=4, alpha=12.0, dropout=0.0,
                      target_modules=("q_proj", "v_proj", "o_proj", "up_proj"))
    h, q, kv, i = CFG.hidden_size, CFG.q_size, CFG.kv_size, CFG.intermediate_size
    shapes = {"self_attn.qkv_proj": ([h] * 3, [q, kv, kv]), "self_attn.o_proj": ([q], [h]),
              "mlp.gate_up_proj": ([h] * 2, [i, i]), "mlp.down_proj": ([i], [h])}
    modules = {f"model.layers.{n}.{p}": _FakeLoRALayer(2, 8, *shapes[p])
               for n in range(CFG.num_layers) for p, _ in PACKED}
    cpu = {name: SimpleNamespace(
        lora_a=[torch.zeros(4, x) for x in shapes[name.split(".", 3)[3]][0]],
        lora_b=[torch.zeros(y, 4) for y in shapes[name.split(".", 3)[3]][1]])
        for name in modules}
    manager = SimpleNamespace(lora_index_to_id=[None, 42], modules=modules,
                              get_adapter=lambda _id: SimpleNamespace(get_lora=cpu.get))
    pub = AdapterPublisher(SimpleNamespace(lora_manager=SimpleNamespace(
        _adapter_manager=manager)), 42)
    ad = AdapterWeights(CFG, lora)
    with torch.no_grad():
        ad.flat.copy_(torch.randn(ad.numel))
    pub.publish(ad)
    assert pub.slot == 1
    qkv = modules["model.layers.1.self_attn.qkv_proj"]
    assert torch.equal(qkv.lora_a_stacked[0][1, 0, :4], ad.a(1, "q_proj"))
    assert torch.allclose(qkv.lora_b_stacked[2][1, 0, :, :4], ad.b(1, "v_proj") * 3.0)
    assert not qkv.lora_a_stacked[1].any()  # k_proj is not targeted: vLLM's zeros stay
    assert not qkv.lora_a_stacked[0][0].any()  # other slots untouched
    up = modules["model.layers.0.mlp.gate_up_proj"]
    assert torch.allclose(up.lora_b_stacked[1][1, 0, :, :4], ad.b(0, "up_proj") * 3.0)
    assert torch.allclose(cpu["model.layers.0.self_attn.o_proj"].lora_b[0],
                          ad.b(0, "o_proj") * 3.0)
    back = pub.read(CFG, lora)
    torch.testing.assert_close(back.flat, ad.flat)


def test_serving_caps_uninterruptible_training_steps_by_ttft():
    from deltaserve.core import StepShape
    from deltaserve.hosts.vllm.remote import UNINTERRUPTIBLE_TTFT_SHARE, uninterruptible_cap
    from tests.train import fixtures as fx

    lm = fx.latency_model()
    ttft = 0.02
    cap = uninterruptible_cap(lm, ttft, 4096)
    assert 1 < cap < 4096
    limit = UNINTERRUPTIBLE_TTFT_SHARE * ttft
    assert lm.predict_upper(StepShape(ft_lens=(cap,))) <= limit
    assert lm.predict_upper(StepShape(ft_lens=(cap + 1,))) > limit
    assert uninterruptible_cap(lm, 100.0, 256) == 256
