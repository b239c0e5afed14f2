"""Attention over many sequences in one call (:class:`PaddedSegments`) against each sequence
attended on its own, values and gradients; and a forward whose launches do not grow with the
samples it carries and that reads nothing back from, or copies nothing into, the device."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from deltaserve.hosts.native import SamplingParams
from deltaserve.model import AdapterWeights, CausalSegments, ForwardContext, LlamaModel, LoRAConfig
from deltaserve.model.attention import PaddedSegments, segments_attention
from deltaserve.model.loading import load_weights
from deltaserve.model.lora import DropoutSegment, LoRAGroup
from tests.hosts.native.test_engine import engine, prompts
from tests.tiny import hf_tiny_llama, save_tiny


def one_by_one(q, k, v, lengths, starts):
    """The reference: each sequence alone, SDPA's own causal mask, KV heads repeated by hand."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for n, s in zip(lengths, starts, strict=True):
        qs, ks, vs = (t[s:s + n].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        outs.append(o.transpose(0, 1).reshape(n, -1))
    return torch.cat(outs)


@pytest.mark.parametrize("lengths,starts", [
    ((7,), None), ((1, 9, 4, 9, 2), None), ((5, 3, 1), (2, 12, 20)), ((16, 1), (0, 30))])
def test_one_call_equals_each_sequence_alone(lengths, starts):
    """Values and gradients to q, k and v (padding repeats a row: its gradient must not leak),
    for sequences end to end or at given rows among others (GQA: 4 query heads, 2 KV)."""
    g = torch.Generator().manual_seed(len(lengths))
    first = starts or tuple(sum(lengths[:i]) for i in range(len(lengths)))
    total = max(s + n for s, n in zip(first, lengths, strict=True)) + 3
    q = torch.randn(total, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    seg = PaddedSegments(lengths, "cpu", starts)
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(first, lengths, strict=True)])
    assert torch.equal(seg.rows, rows)
    got = segments_attention(q, k, v, seg)
    want = one_by_one(q, k, v, lengths, first)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    w = torch.randn(got.shape, generator=g, dtype=torch.float64)
    got_grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


class Dispatched(TorchDispatchMode):
    """Every aten op a block of code dispatches."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


# Ops that read a device value back to the host (a CUDA sync) or copy host data in mid-step
HOST_ROUND_TRIPS = ("_local_scalar_dense", "nonzero", "lift_fresh", "item", "masked_select")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("m"), seed=3, num_key_value_heads=2)
    return LlamaModel(*load_weights(path))


def training_forward_ops(model: LlamaModel, lengths: list[int], dropout: float) -> list[str]:
    """The ops of one forward over samples of ``lengths`` on a LoRA adapter (what a host runs
    for a step's training rows), its context built first as a host builds it."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    adapter = AdapterWeights(model.config, LoRAConfig(r=4, dropout=dropout)).init_peft_(1)
    segs, offset = [], 0
    for i, n in enumerate(lengths):
        segs.append(DropoutSegment(offset, n, seed=100 + i))
        offset += n
    ctx = ForwardContext(pos, CausalSegments(lengths),
                         (LoRAGroup(adapter, slice(None), dropout, tuple(segs)),))
    with torch.no_grad(), Dispatched() as mode:
        model.forward(ids, ctx)
    return mode.ops


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_forward_launches_the_same_ops_for_two_samples_or_seven(tiny, dropout):
    """No loop over samples in any layer (attention, LoRA dropout): the op sequence of a forward
    over 2 samples and over 7 is the same, and it holds no host round trip."""
    two = training_forward_ops(tiny, [20, 12], dropout)
    seven = training_forward_ops(tiny, [5, 4, 5, 3, 5, 5, 5], dropout)
    assert two == seven
    assert not [op for op in two if op.split(".")[0] in HOST_ROUND_TRIPS]


def test_engine_steps_make_no_host_round_trip(tmp_path, monkeypatch):
    """Every eager forward of the embedded engine (first chunks, chunked continuations behind a
    cached prefix, decodes) runs without reading the device back or copying host data in;
    its outputs stay transformers' greedy tokens (the engine's own tests), so this watches only
    the forward."""

    hf_tiny_llama(seed=11).save_pretrained(tmp_path)
    eng = engine(tmp_path, max_num_batched_tokens=24)
    seen: list[list[str]] = []
    forward = LlamaModel.forward

    def watched(self, *args, **kwargs):
        with Dispatched() as mode:
            out = forward(self, *args, **kwargs)
        seen.append(mode.ops)
        return out

    monkeypatch.setattr(LlamaModel, "forward", watched)
    outs = eng.generate(prompts(5, seed=4), SamplingParams(max_tokens=6))
    assert all(len(o.output_token_ids) == 6 or o.finished for o in outs)
    assert len(seen) > 6
    trips = {op for ops in seen for op in ops if op.split(".")[0] in HOST_ROUND_TRIPS}
    assert not trips
