"""Parts of the vLLM host that need no engine: the version pin, the plugin, the config, the weight
views the backward maps on GPU, the adapter layout written into vLLM's stacked LoRA tensors, the
training adapter's reserved id and name, and the hidden requests' cache salt."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from deltaserve.core.errors import InputError
from deltaserve.hosts.config import HostConfig
from deltaserve.hosts.vllm import plugin
from deltaserve.hosts.vllm.config import (
    VLLM_LORA_RANKS,
    VLLMHostConfig,
    engine_kwargs,
    lora_rank_for,
)
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
    pytest.importorskip("vllm", reason="the publisher imports vLLM's LoRA types")
    from deltaserve.hosts.vllm.publish import PACKED, AdapterPublisher

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
        _adapter_manager=manager)), 42, lora)
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
    # every published weight, read back from vLLM's layout, is the adapter's
    for layer, module, a, b in ad.items():
        packed, s = next((p, parts.index(module)) for p, parts in PACKED if module in parts)
        m = modules[f"model.layers.{layer}.{packed}"]
        assert torch.equal(m.lora_a_stacked[s][1, 0, :4, : a.shape[1]], a)
        assert torch.allclose(m.lora_b_stacked[s][1, 0, : b.shape[0], :4] / 3.0, b)
    other = LoRAConfig(r=8, alpha=16.0, dropout=0.0)
    with pytest.raises(ValueError, match="reserved slot holds"):
        pub.publish(AdapterWeights(CFG, other))  # another config needs another reservation


def test_serving_caps_uninterruptible_training_steps_by_ttft():
    pytest.importorskip("vllm", reason="the engine-process co-server imports vLLM")
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


def test_host_config_adds_only_vllms_knobs_and_derives_the_lora_rank():
    common = HostConfig(model="smollm2", dtype="float32", max_num_batched_tokens=128,
                        kv_cache_tokens=4096)
    cfg = VLLMHostConfig(**{f: getattr(common, f) for f in HostConfig.__dataclass_fields__})
    assert cfg.common() == common
    kw = engine_kwargs(cfg, model_limit=8192)
    # the common knobs reach vLLM as every host reads them
    assert kw["max_model_len"] == common.model_len(8192) == 4096
    assert kw["num_gpu_blocks_override"] * kw["block_size"] == 4096
    assert kw["dtype"] == "float32" and kw["max_num_batched_tokens"] == 128
    assert kw["max_lora_rank"] == lora_rank_for(LoRAConfig().r) == 16
    assert kw["async_scheduling"] is False and kw["enable_lora"] is True
    assert [lora_rank_for(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(InputError, match="lora_r"):
        lora_rank_for(VLLM_LORA_RANKS[-1] + 1)
    with pytest.raises(InputError, match="max_lora_rank"):
        VLLMHostConfig(max_lora_rank=12)
    with pytest.raises(InputError, match="engine"):
        VLLMHostConfig(engine={"scheduler_cls": "x"})
    with pytest.raises(InputError, match="training_lora"):
        VLLMHostConfig(training_lora="peft")


def test_training_adapter_id_is_one_vllms_api_server_never_issues():
    """vLLM's OpenAI server (its real ``OpenAIServingModels``, over a stand-in engine client)
    numbers the adapters it loads from 1, one id per load attempt, failed and repeated ones
    included: after N attempts every id it handed the engine is at most N. The reserved id is
    the largest int64 (vLLM keeps ids in int64 arrays), so it would take 2**63 - 1 loads; and
    requests naming it, or the reserved name, are recognised whatever the other field says."""
    pytest.importorskip("vllm", reason="drives vLLM's own API-server adapter registry")
    import asyncio

    from vllm.entrypoints.openai.models.serving import BaseModelPath, OpenAIServingModels
    from vllm.entrypoints.serve.lora.protocol import (
        LoadLoRAAdapterRequest,
        UnloadLoRAAdapterRequest,
    )
    from vllm.lora.request import LoRARequest

    from deltaserve.hosts.base import RESERVED_ADAPTER_PREFIX
    from deltaserve.hosts.vllm.train_adapter import (
        TRAIN_ADAPTER_ID,
        TRAIN_ADAPTER_NAME,
        names_training_adapter,
    )

    handed: list[int] = []

    async def add_lora(req):
        handed.append(req.lora_int_id)
        if req.lora_name.endswith("-bad"):
            raise RuntimeError("cannot load")

    client = SimpleNamespace(model_config=SimpleNamespace(max_model_len=512), renderer=None,
                             input_processor=None, add_lora=add_lora)
    models = OpenAIServingModels(client, [BaseModelPath("base", "/base")])

    async def churn() -> int:
        attempts = 0
        for i in range(300):
            name = f"a{i % 50}" + ("-bad" if i % 7 == 0 else "")
            await models.load_lora_adapter(LoadLoRAAdapterRequest(
                lora_name=name, lora_path=f"/p/{i}", load_inplace=True))
            attempts += 1
            if i % 5 == 0 and name in models.lora_requests:
                await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
        return attempts

    attempts = asyncio.run(churn())
    assert handed and min(handed) >= 1 and max(handed) <= attempts
    assert TRAIN_ADAPTER_ID == 2**63 - 1 and TRAIN_ADAPTER_ID not in handed
    assert LoRARequest("x", TRAIN_ADAPTER_ID, "/p").lora_int_id == TRAIN_ADAPTER_ID  # accepted
    assert TRAIN_ADAPTER_NAME.startswith(RESERVED_ADAPTER_PREFIX)
    assert names_training_adapter(LoRARequest("client", TRAIN_ADAPTER_ID, "/p"))
    assert names_training_adapter(LoRARequest(TRAIN_ADAPTER_NAME, 5, "/p"))
    assert not names_training_adapter(LoRARequest("client", 5, "/p"))
    assert not names_training_adapter(None)


def test_hidden_requests_cache_salt_is_full_strength():
    pytest.importorskip("vllm", reason="the hidden requests module imports vLLM")
    from deltaserve.hosts.vllm.hidden import SALT_BYTES, new_salt

    salts = [new_salt() for _ in range(2000)]
    assert SALT_BYTES >= 16
    assert all(len(s) == 2 * SALT_BYTES and int(s, 16) >= 0 for s in salts)  # 128-bit hex
    assert len(set(salts)) == len(salts)
    # uniform bits: each of the 128 bit positions is set in about half the salts (a 32-bit
    # salt padded to 128 would leave 96 positions at 0)
    ones = [sum(int(s, 16) >> b & 1 for s in salts) for b in range(8 * SALT_BYTES)]
    assert min(ones) > 800 and max(ones) < 1200
