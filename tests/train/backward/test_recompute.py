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
from deltaserve.train.backward import recompute
from deltaserve.train.backward.messages import JobSample
from deltaserve.train.backward.recompute import layerwise_backward, shifted_targets
from deltaserve.train.buffer import ActivationBuffer, BufferConfig
from deltaserve.train.capture import forward_training_rows
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


@pytest.fixture
def one_thread():
    """One intra-op thread: how a multi-threaded GEMM splits its reduction depends on the CPU
    and the shape (on a 2-core AMD EPYC the two backwards differed by 1.5e-8 of 0.13 with two
    threads, and not at all with one), and the claim below is about the ops, not the BLAS."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("save", ["residual", "residual+mlp"])
def test_layerwise_gradients_equal_full_backward(model, dropout, save, one_thread):
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


class _OtherDeviceStore:
    """A buffer tensor as it behaves on another device (``meta`` stands in for a GPU on this
    CPU-only machine): it reports that device and, as CUDA does, refuses an index that is not
    on it. Its values stay on the CPU; a meta index carries none, so a gather returns the rows
    the test knows the batch owns (``want_rows``)."""

    def __init__(self, data, want_rows, device="meta"):
        self.data, self.want_rows, self.device = data, want_rows, torch.device(device)
        self.index_devices = []

    def __getitem__(self, layer):
        store = self

        class _Layer:
            def index_select(self, dim, index):
                store.index_devices.append(index.device)
                if index.device != store.device:
                    raise RuntimeError(f"Expected all tensors to be on the same device, but got "
                                       f"index is on {index.device}, different from other "
                                       f"tensors on {store.device}")
                assert dim == 0 and index.dtype == torch.long
                assert tuple(index.shape) == tuple(store.want_rows.shape)
                return store.data[layer].index_select(0, store.want_rows)

        return _Layer()


@pytest.mark.parametrize("save", ["residual", "residual+mlp"])
def test_rows_are_gathered_with_an_index_on_the_buffers_device(model, save):
    """On CUDA every backward job failed: the row index was built on the CPU for a buffer on the
    GPU. With the buffer on another device the recompute indexes it there (and computes where
    the model is), with the gradients of the all-CPU run."""
    samples = make_samples()
    ad = adapter_for(model, 0.3)
    total = sum(js.length for _, js in samples)
    buf = ActivationBuffer(BufferConfig(total + 5, save), model.config, torch.float32)
    forward_training_rows(model, capturing_step(samples, 0.3, buf), ad)
    jobs = [js for _, js in samples]
    want = ad.clone(requires_grad=True)
    want_stats = layerwise_backward(model, want, buf, jobs, 0.3)
    want.gather_grad_()

    rows = torch.cat([torch.arange(js.row_start, js.row_start + js.length) for js in jobs])
    stores = {"residual": _OtherDeviceStore(buf.residual, rows)}
    buf.residual = stores["residual"]
    if buf.config.saves_mlp:
        buf.gate = stores["gate"] = _OtherDeviceStore(buf.gate, rows)
        buf.up = stores["up"] = _OtherDeviceStore(buf.up, rows)
    got = ad.clone(requires_grad=True)
    stats = layerwise_backward(model, got, buf, jobs, 0.3)
    got.gather_grad_()
    for store in stores.values():
        assert store.index_devices and set(store.index_devices) == {torch.device("meta")}
    assert stats.loss == want_stats.loss and stats.num_loss_tokens == want_stats.num_loss_tokens
    assert torch.equal(got.flat.grad, want.flat.grad)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layerwise_backward_on_cuda_matches_cpu(model):
    samples = make_samples()
    ad = adapter_for(model, 0.0)
    total = sum(js.length for _, js in samples)
    jobs = [js for _, js in samples]
    buf = ActivationBuffer(BufferConfig(total), model.config, torch.float32)
    forward_training_rows(model, capturing_step(samples, 0.0, buf), ad)
    want = ad.clone(requires_grad=True)
    want_stats = layerwise_backward(model, want, buf, jobs, 0.0)
    want.gather_grad_()

    cuda_model = LlamaModel(model.config, type(model.weights)(
        model.weights.embed.cuda(), [type(lw)(**{k: (v.cuda() if v is not None else None)
                                                  for k, v in vars(lw).items()})
                                     for lw in model.weights.layers],
        model.weights.norm.cuda(), model.weights.lm_head.cuda()))
    cuda_buf = ActivationBuffer(BufferConfig(total), model.config, torch.float32, "cuda")
    cuda_buf.residual.copy_(buf.residual)
    got = AdapterWeights(model.config, ad.config, ad.flat.detach().clone().cuda())
    got.make_trainable_()
    stats = layerwise_backward(cuda_model, got, cuda_buf, jobs, 0.0)
    grad = got.gather_grad_().cpu()
    assert stats.loss == pytest.approx(want_stats.loss, rel=1e-4)
    torch.testing.assert_close(grad, want.flat.grad, rtol=1e-3, atol=1e-5)


def test_the_last_layer_comes_in_units_a_yield_can_hold(model, monkeypatch):
    """The last layer's recompute, the head over each chunk of loss positions, then every
    layer's backward, each announced before it starts and reported when it ends; chunked, the
    loss and the gradients are the whole head's (to fp32 rounding)."""
    monkeypatch.setattr(recompute, "HEAD_CHUNK_TOKENS", 8)
    samples = make_samples(4, seed=3)
    ad = adapter_for(model, 0.0)
    total = sum(js.length for _, js in samples)
    buf = ActivationBuffer(BufferConfig(total), model.config, torch.float32)
    forward_training_rows(model, capturing_step(samples, 0.0, buf), ad)
    want_loss, want_grad = full_backward(model, ad, samples)
    waits, ends = [], []
    trainable = ad.clone(requires_grad=True)

    def wait(unit):
        waits.append(unit)
        return 0.5  # seconds "waited": the stats add them up

    stats = layerwise_backward(model, trainable, buf, [js for _, js in samples], 0.0,
                               wait_grant=wait, on_layer=ends.append)
    chunks = -(-stats.num_loss_tokens // 8)
    assert chunks >= 3
    layers = model.num_layers
    want = [recompute.LAST_FORWARD, *[recompute.HEAD] * chunks, *reversed(range(layers))]
    assert waits == want and ends == want
    assert stats.paused_s == 0.5 * len(want)
    assert stats.loss == pytest.approx(want_loss, rel=1e-6)
    torch.testing.assert_close(trainable.gather_grad_(), want_grad, rtol=1e-5, atol=1e-7)
