"""Gradients from activations captured inside *mixed* engine steps equal PEFT's.

The embedded engine runs its own batches with a co-server attached (its public step path), so
the training rows ride beside (a) a fresh prefill, (b) decodes, (c) a prefill chunk behind its
cached prefix, and (d) all of these at once. The backward's layer-by-layer recompute over the
captured buffer must then give the LoRA gradients transformers + PEFT compute on the same
samples and adapter (fp32, relative error ≤ 1e-4). A capture that took the wrong rows of the
step, or a dropout mask not aligned with its sample, fails it.

With dropout > 0, PEFT's own masks are random draws the co-server cannot know; the reference
replaces each PEFT ``lora_dropout`` module by one applying the masks the co-server drew for the
sample (seeded by sample, layer and module, :func:`deltaserve.model.lora.dropout_`), so both
sides drop the same inputs and PEFT does the rest of the LoRA math.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from deltaserve.core import SLOConfig, StepShape
from deltaserve.core.admission import AdmissionConfig
from deltaserve.core.data import IGNORE_INDEX, TrainingSample
from deltaserve.hosts.native import EngineConfig, LLMEngine, SamplingParams
from deltaserve.model import AdapterWeights, LoRAConfig
from deltaserve.model.lora import ALL_MODULES, DropoutSegment, dropout_, peft_key
from deltaserve.train.backward.messages import JobSample
from deltaserve.train.backward.recompute import layerwise_backward
from deltaserve.train.config import BackwardConfig, CoServeConfig
from tests.tiny import hf_tiny_llama
from tests.train import fixtures as fx

STEP_TOKENS = 128  # the engine's token budget per step, training rows included
KINDS = ("prefill", "decode", "prefix", "all")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf_tiny_llama(seed=21, num_hidden_layers=4).save_pretrained(path)
    return path


def kind_of(shape: StepShape) -> str | None:
    """Which inference rows a step carried beside its training rows."""
    prefixes = shape.prefill_prefix_lens or (0,) * len(shape.prefill_lens)
    fresh, behind = any(p == 0 for p in prefixes), any(p > 0 for p in prefixes)
    decode = shape.num_decode > 0
    if fresh and not behind and not decode:
        return "prefill"
    if decode and not shape.prefill_lens:
        return "decode"
    if behind and not fresh and not decode:
        return "prefix"
    if decode and fresh and behind:
        return "all"
    return None


@dataclass(frozen=True)
class Captured:
    """A sample the co-server admitted, where its rows went and the dropout seed it drew."""

    kind: str | None
    job: JobSample


def drive_mixed_steps(eng: LLMEngine) -> None:
    """Requests timed so the engine's own scheduler builds each kind of mixed step."""
    g = torch.Generator().manual_seed(3)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, 97, (n,), generator=g).tolist()

    # (c) a chunk behind its cached prefix: 140 tokens = a full first chunk (no room for
    # training) + 12 tokens behind 128 cached ones
    eng.add_request(prompt(STEP_TOKENS + 12), SamplingParams(max_tokens=1))
    eng.step()
    eng.step()
    assert not eng.has_unfinished()
    # (a) a fresh prefill, then (b) its decodes
    eng.add_request(prompt(30), SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()
    eng.step()
    # (d) the decode, a continuation chunk behind its prefix and a fresh prefill in one step
    eng.add_request(prompt(STEP_TOKENS + 12), SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()  # the decode + a 127-token first chunk: a full step
    eng.add_request(prompt(20), SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()


def capture_in_mixed_steps(path, dropout: float) -> tuple[list[Captured], AdapterWeights,
                                                          list[TrainingSample], LLMEngine]:
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=8,
                                 max_num_batched_tokens=STEP_TOKENS, block_size=8,
                                 kv_cache_tokens=2048, max_model_len=256))
    data = fx.samples(40)
    # the batch never fills (4096 tokens) and the pool never empties: the backward process
    # never runs, so the buffer and the adapter stay as the forward left them
    config = CoServeConfig(
        SLOConfig(1000.0, 1000.0),
        lora=LoRAConfig(r=4, alpha=8, dropout=dropout, target_modules=ALL_MODULES),
        backward=BackwardConfig(batch_tokens=4096),
        admission=AdmissionConfig(max_ft_tokens_per_step=64))
    co = eng.attach(config, dataset=data, latency_model=fx.latency_model(), progress=False)
    captured: list[Captured] = []
    plan = co.plan

    def record(view):
        step = plan(view)
        kind = kind_of(view.proposed)
        for s, seed in zip(step.plan.samples, step.rows.dropout_seeds, strict=True):
            captured.append(Captured(kind, JobSample(
                s.sample_id, s.rows.start, data[s.sample_id].labels, seed)))
        return step

    co.plan = record
    try:
        with torch.no_grad():  # a non-trivial adapter: every gradient path is live
            co.adapter.flat.copy_(torch.randn(co.adapter.numel,
                                              generator=torch.Generator().manual_seed(4)) * 0.05)
        drive_mixed_steps(eng)
        assert not co.backward_busy and co.stats().optimizer_steps == 0
        weights = AdapterWeights(co.model.config, co.config.lora, co.adapter.flat.clone())
    except BaseException:
        eng.detach(drain=False, checkpoint=False)
        raise
    return captured, weights, data, eng


@pytest.fixture(scope="module", params=[0.0, 0.25], ids=["dropout0", "dropout0.25"])
def mixed(request, tiny):
    captured, weights, data, eng = capture_in_mixed_steps(tiny, request.param)
    yield request.param, captured, weights, data, eng
    eng.detach(drain=False, checkpoint=False)


class ReplayedDropout(torch.nn.Module):
    """PEFT's LoRA dropout on one (layer, module), drawing each sample's mask as the co-server
    did. ``batch``: (length, dropout seed) of each row of the padded batch."""

    def __init__(self, p: float, layer: int, module: str, batch: list[tuple[int, int]]):
        super().__init__()
        self.p, self.layer, self.module, self.batch = p, layer, module, batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = []
        for b, (n, seed) in enumerate(self.batch):
            kept = dropout_(x[b, :n], self.p, (DropoutSegment(0, n, seed),), self.layer,
                            self.module)
            out.append(torch.cat([kept, x[b, n:]]))  # padding: masked out of the loss
        return torch.stack(out)


def peft_grads(path, weights: AdapterWeights, samples: list[TrainingSample],
               seeds: list[int]) -> torch.Tensor:
    """LoRA gradients of the mean response-token loss from transformers + PEFT, laid out like
    :meth:`AdapterWeights.gather_grad_`."""
    lora = weights.config
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    pm = get_peft_model(hf, LoraConfig(r=lora.r, lora_alpha=lora.alpha,
                                       lora_dropout=lora.dropout,
                                       target_modules=list(lora.target_modules))).eval()
    named = dict(pm.named_parameters())
    with torch.no_grad():
        for key, value in weights.to_peft_state_dict().items():
            named[key.replace(".weight", ".default.weight")].copy_(value)
    if lora.dropout > 0:
        batch = [(s.num_tokens, seed) for s, seed in zip(samples, seeds, strict=True)]
        replaced = 0
        for name, mod in pm.named_modules():
            m = re.search(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$", name)
            if m and hasattr(mod, "lora_dropout"):
                mod.lora_dropout["default"] = ReplayedDropout(lora.dropout, int(m[1]), m[2],
                                                              batch)
                replaced += 1
        assert replaced == weights.model_config.num_layers * len(lora.target_modules)
    n = max(s.num_tokens for s in samples)

    def pad(seq, value):
        return list(seq) + [value] * (n - len(seq))

    pm(input_ids=torch.tensor([pad(s.input_ids, 0) for s in samples]),
       attention_mask=torch.tensor([pad([1] * s.num_tokens, 0) for s in samples]),
       labels=torch.tensor([pad(s.labels, IGNORE_INDEX) for s in samples])).loss.backward()
    want = torch.zeros(weights.numel)
    ref = AdapterWeights(weights.model_config, lora, want)
    for layer, module, a, b in ref.items():
        for which, dst in (("A", a), ("B", b)):
            key = peft_key(layer, module, which).replace(".weight", ".default.weight")
            dst.copy_(named[key].grad)
    return want


def test_every_kind_of_mixed_step_carried_training_rows(mixed):
    _, captured, _, _, _ = mixed
    kinds = {c.kind for c in captured}
    assert set(KINDS) <= kinds, f"the scenario built {kinds}"
    ids = [c.job.sample_id for c in captured]
    assert len(ids) == len(set(ids))  # nothing admitted twice


@pytest.mark.parametrize("kind", [*KINDS, "every step"])
def test_captured_gradients_equal_peft(mixed, tiny, kind):
    """Per kind of step, and every captured sample in one backward batch (as the co-server
    would launch it: samples of several steps, each at its own rows)."""
    dropout, captured, weights, data, eng = mixed
    jobs = [c.job for c in captured if kind in (c.kind, "every step")]
    assert jobs
    trainable = weights.clone(requires_grad=True)
    layerwise_backward(eng.model, trainable, eng.coserver.trainer.buffer, jobs, dropout)
    ours = trainable.gather_grad_()
    want = peft_grads(tiny, weights, [data[j.sample_id] for j in jobs],
                      [j.dropout_seed for j in jobs])
    rel = float((ours - want).norm() / want.norm())
    print(f"{kind}, dropout {dropout}: {len(jobs)} samples, relative difference {rel:.2e}")
    assert want.abs().sum() > 0
    assert rel <= 1e-4
