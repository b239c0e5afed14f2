"""LoRA against PEFT, multi-LoRA batching against one-adapter runs, dropout replay."""

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from deltaserve.core import InputError
from deltaserve.model import AdapterWeights, CausalSegments, ForwardContext, LlamaModel, LoRAConfig
from deltaserve.model.loading import load_weights
from deltaserve.model.lora import (
    ALL_MODULES,
    DropoutKeys,
    DropoutSegment,
    LoRAGroup,
    _fold32,
    _hash32,
    _hash32_,
    _mix32_,
    dropout_,
)
from deltaserve.model.peft_io import load_adapter, save_adapter
from tests.tiny import hf_tiny_llama

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf_tiny_llama(seed=3).save_pretrained(path)
    config, weights = load_weights(path)
    return path, LlamaModel(config, weights)


def random_adapter(model, seed, targets=TARGETS):
    ad = AdapterWeights(model.config, LoRAConfig(r=4, alpha=8, dropout=0.0,
                                                 target_modules=targets))
    with torch.no_grad():
        ad.flat.copy_(torch.randn(ad.numel, generator=torch.Generator().manual_seed(seed)) * 0.1)
    return ad


def forward(model, seqs, groups):
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad():
        return model.logits(model.forward(ids, ForwardContext(pos, CausalSegments(
            [len(s) for s in seqs]), tuple(groups))))


def test_adapter_matches_peft_and_round_trips_through_disk(base, tmp_path):
    path, model = base
    adapter = random_adapter(model, seed=1)
    save_adapter(tmp_path / "ad", adapter, str(path))
    from transformers import AutoModelForCausalLM

    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), tmp_path / "ad")
    ref.eval()
    seq = torch.arange(50) % 97
    with torch.no_grad():
        want = ref(seq[None]).logits[0]
    got = forward(model, [seq], [LoRAGroup(adapter, slice(0, 50))])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    base_only = forward(model, [seq], [])
    assert (got - base_only).abs().max() > 1e-3  # the adapter does something
    loaded = load_adapter(tmp_path / "ad", model.config)
    assert torch.equal(loaded.flat, adapter.flat)
    assert loaded.config == adapter.config


def test_peft_init_matches_peft_distribution(base):
    _, model = base
    ad = AdapterWeights(model.config, LoRAConfig(r=8)).init_peft_(seed=0)
    assert torch.count_nonzero(ad.b(0, "q_proj")) == 0
    a = ad.a(0, "q_proj")
    bound = 1 / model.config.hidden_size ** 0.5  # kaiming-uniform(a=√5) on fan_in
    assert a.abs().max() <= bound and a.abs().max() > 0.8 * bound


def test_multi_lora_batch_equals_separate_runs(base):
    _, model = base
    x, y = random_adapter(model, 1), random_adapter(model, 2, targets=("q_proj", "v_proj"))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 97, (n,), generator=g) for n in (7, 20, 11, 5)]
    # adapters X, none, Y, X: X's rows are not contiguous -> index rows
    rows_x = torch.cat([torch.arange(0, 7), torch.arange(38, 43)])
    batch = forward(model, seqs, [LoRAGroup(x, rows_x), LoRAGroup(y, slice(27, 38))])
    alone = [forward(model, [seqs[0]], [LoRAGroup(x, slice(0, 7))]),
             forward(model, [seqs[1]], []),
             forward(model, [seqs[2]], [LoRAGroup(y, slice(0, 11))]),
             forward(model, [seqs[3]], [LoRAGroup(x, slice(0, 5))])]
    torch.testing.assert_close(batch, torch.cat(alone), rtol=1e-5, atol=1e-5)


def test_dropout_mask_replays_by_seed_and_differs_between_samples(base):
    _, model = base
    ad = random_adapter(model, 4)
    seq = torch.arange(30) % 97
    seqs = [seq, seq]
    segs = (DropoutSegment(0, 30, seed=11), DropoutSegment(30, 30, seed=12))
    group = LoRAGroup(ad, slice(0, 60), dropout=0.3, segments=segs)
    a = forward(model, seqs, [group])
    b = forward(model, seqs, [group])
    assert torch.equal(a, b)  # same seeds, same masks
    assert not torch.allclose(a[:30], a[30:])  # same tokens, different samples' masks
    swapped = LoRAGroup(ad, slice(0, 60), 0.3, (DropoutSegment(0, 30, 12),
                                                  DropoutSegment(30, 30, 11)))
    c = forward(model, seqs, [swapped])
    torch.testing.assert_close(c[:30], a[30:])


@pytest.mark.parametrize("p", [0.05, 0.3, 0.6])
def test_dropout_keeps_one_minus_p_and_preserves_the_mean(p):
    # inverted dropout: each entry kept with probability 1-p and scaled by 1/(1-p), so a kept
    # entry of ones reads 1/(1-p) and the mean stays 1. The kept share is Binomial(N, 1-p)/N,
    # std sqrt(p(1-p)/N); the mean of the output has std sqrt(p/((1-p)N)) (each entry's
    # variance is p/(1-p)). Fixed seeds: 5 std bounds, never flaky, far tighter than the
    # 1-p bias a missing rescale would leave.
    rows, cols = 400, 64
    segs = (DropoutSegment(0, 150, seed=5), DropoutSegment(150, 250, seed=6))
    y = dropout_(torch.ones(rows, cols, dtype=torch.float64), p, segs, layer=2, module="q_proj")
    n = rows * cols
    kept = y != 0
    assert abs(kept.double().mean().item() - (1 - p)) <= 5 * (p * (1 - p) / n) ** 0.5
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / (1 - p)))
    assert abs(y.mean().item() - 1.0) <= 5 * (p / ((1 - p) * n)) ** 0.5


def test_the_in_place_hash_is_the_hash_bit_for_bit():
    x = torch.cat([torch.randint(0, 2**32, (10_000,), dtype=torch.long,
                                 generator=torch.Generator().manual_seed(0)),
                   torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1])])
    want = torch.tensor([_hash32(int(v)) for v in x])  # the int form: Python's exact arithmetic
    assert torch.equal(_hash32_(x.clone()), want)
    assert torch.equal(_hash32(x), want)


def test_masks_are_the_hash_of_seed_layer_module_row_and_column():
    """Brute force, one entry at a time in Python's exact integers, against the batched keys
    (every site's rows hashed at once, packed projections together)."""
    segs = (DropoutSegment(0, 3, seed=2**40 + 7), DropoutSegment(3, 2, seed=5))
    keys = DropoutKeys(segs, "cpu", num_layers=3)
    p, cols = 0.4, 6
    thr = round((1 - p) * 2**32)

    def kept(layer: int, module: str, row: int, col: int) -> bool:
        seg = next(s for s in segs if s.offset <= row < s.offset + s.length)
        site = _fold32(layer * len(ALL_MODULES) + ALL_MODULES.index(module) + 1)
        r = _hash32(_hash32(_fold32(seg.seed) ^ site) ^ _hash32((row - seg.offset) ^ 0x5BD1E995))
        return _mix32_(r ^ _hash32(col ^ site)) < thr

    for layer in range(3):
        for module in ALL_MODULES:
            want = torch.tensor([[kept(layer, module, i, c) for c in range(cols)]
                                 for i in range(5)])
            assert torch.equal(keys.keep(cols, p, layer, module), want), (layer, module)
        qkv = keys.keep_packed(cols, p, layer, ("q_proj", "k_proj", "v_proj"))
        assert torch.equal(qkv[2], keys.keep(cols, p, layer, "v_proj"))
    with pytest.raises(InputError, match="modules"):
        keys.keep_packed(cols, p, 0, ("q_proj", "v_proj"))


def test_lora_config_validation():
    from deltaserve.core import InputError

    with pytest.raises(InputError) as e:
        LoRAConfig(target_modules=("qkv",))
    assert e.value.field == "target_modules"
    with pytest.raises(InputError):
        LoRAConfig(dropout=1.0)
    with pytest.raises(InputError):
        LoRAConfig(r=0)


def test_peft_get_peft_model_keys_match_ours(base, tmp_path):
    path, model = base
    from transformers import AutoModelForCausalLM

    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                         LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS)))
    ref.save_pretrained(tmp_path / "p")
    ours_ad = load_adapter(tmp_path / "p", model.config)
    assert ours_ad.config.target_modules == TARGETS and ours_ad.config.r == 4
