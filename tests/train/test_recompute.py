"""Layer-by-layer recompute gives the gradients of a normal backward (dropout replayed)."""

import threading

import pytest
import torch
import torch.nn.functional as F

from deltaserve.core.admission import AdmissionPlan
from deltaserve.core.contract import TrainingRows
from deltaserve.core.data import IGNORE_INDEX
from deltaserve.core.shape import StepShape
from deltaserve.model import AdapterWeights, CausalSegments, ForwardContext, LlamaModel, LoRAConfig
from deltaserve.model.loading import load_weights
from deltaserve.model.lora import DropoutSegment, LoRAGroup
from deltaserve.train.buffer import ActivationBuffer, BufferConfig
from deltaserve.train.capture import forward_training_rows
from deltaserve.train.messages import JobSample
from deltaserve.train.recompute import layerwise_backward, shifted_targets
from deltaserve.train.step import CapturingStep
from tests.tiny import hf_tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf_tiny_llama(seed=5).save_pretrained(path)
    return LlamaModel(*load_weights(path))


def make_samples(n_samples=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    out, start = [], 0
    for i in range(n_samples):
        n = int(torch.randint(6, 30, (1,), generator=g))
        ids = torch.randint(0, 97, (n,), generator=g).tolist()
        prompt = n // 2
        labels = tuple([IGNORE_INDEX] * prompt + ids[prompt:])
        out.append((tuple(ids), JobSample(i, start, labels, dropout_seed=100 + i)))
        start += n
    return out


def adapter_for(model, dropout, targets=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj")):
    cfg = LoRAConfig(r=4, alpha=8, dropout=dropout, target_modules=targets)
    ad = AdapterWeights(model.config, cfg).init_peft_(1)
    with torch.no_grad():  # non-zero B so that every gradient path is live
        ad.flat.add_(torch.randn(ad.numel, generator=torch.Generator().manual_seed(2)) * 0.05)
    return ad


def group(ad, samples, rows):
    segs, off = [], 0
    for _, js in samples:
        segs.append(DropoutSegment(off, js.length, js.dropout_seed))
        off += js.length
    return LoRAGroup(ad, rows, ad.config.dropout, tuple(segs))


def capturing_step(samples, dropout, buf):
    """The co-server's step object for ``samples``, capturing from buffer row 0."""
    ids = tuple(js.sample_id for _, js in samples)
    shape = StepShape(ft_lens=tuple(js.length for _, js in samples))
    plan = AdmissionPlan(ids, shape, None, 0.0, None, row_start=0)
    rows = TrainingRows(tuple(s for s, _ in samples), dropout,
                        tuple(js.dropout_seed for _, js in samples))
    return CapturingStep(plan, rows, False, buf, threading.Event())


def full_backward(model, ad, samples):
    ids = torch.tensor([t for s, _ in samples for t in s])
    lengths = [len(s) for s, _ in samples]
    pos = torch.cat([torch.arange(n) for n in lengths])
    trainable = ad.clone(requires_grad=True)
    ctx = ForwardContext(pos, CausalSegments(lengths), (group(trainable, samples, slice(None)),))
    logits = model.logits(model.forward(ids, ctx))
    targets = shifted_targets([js for _, js in samples])
    n = int((targets != IGNORE_INDEX).sum())
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum") / n
    loss.backward()
    return float(loss.detach()), trainable.gather_grad_()


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("save", ["residual", "residual+mlp"])
def test_layerwise_gradients_equal_full_backward(model, dropout, save):
    samples = make_samples()
    ad = adapter_for(model, dropout)
    total = sum(js.length for _, js in samples)
    buf = ActivationBuffer(BufferConfig(total + 5, save), model.config, torch.float32)
    forward_training_rows(model, capturing_step(samples, dropout, buf), ad)
    want_loss, want_grad = full_backward(model, ad, samples)
    trainable = ad.clone(requires_grad=True)
    stats = layerwise_backward(model, trainable, buf, [js for _, js in samples], dropout)
    trainable.gather_grad_()
    assert stats.loss == pytest.approx(want_loss, rel=1e-6)
    assert stats.num_loss_tokens == sum(js.length - js.length // 2 for _, js in samples)
    # same ops on the same inputs in the same order: bit-identical, not merely close
    assert torch.equal(trainable.flat.grad, want_grad)
    assert want_grad.abs().sum() > 0


def test_dropout_changes_gradients(model):
    samples = make_samples()
    _, g0 = full_backward(model, adapter_for(model, 0.0), samples)
    _, g1 = full_backward(model, adapter_for(model, 0.3), samples)
    assert not torch.allclose(g0, g1)
