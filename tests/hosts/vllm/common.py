"""Shared by the vLLM host's engine tests. They observe the host through the contract only: the
steps it records (:class:`~tests.hosts.spies.StepLog`), the steps and reports that cross
``plan``/``observe`` (:func:`~tests.hosts.spies.spy_steps`) and the co-server's events
(:class:`~tests.train.fixtures.Recorder`)."""

from __future__ import annotations

import threading
import time

import torch

from deltaserve.core import CalibrationConfig, SLOConfig
from deltaserve.core.admission import AdmissionConfig
from deltaserve.core.data import IGNORE_INDEX, TrainingSample
from deltaserve.model import AdapterWeights, LoRAConfig
from deltaserve.model.llama import LlamaModel
from deltaserve.model.loading import resolve_model
from deltaserve.model.lora import peft_key
from deltaserve.train.backward.messages import JobSample
from deltaserve.train.backward.recompute import layerwise_backward
from deltaserve.train.buffer import ActivationBuffer, BufferConfig
from deltaserve.train.config import BackwardConfig, CoServeConfig
from tests.hosts.spies import SpyStep, spy_steps

LORA = LoRAConfig(r=8, alpha=16, dropout=0.0)
SMALL_CAL = CalibrationConfig(min_prefill=16, split_total=64, max_split=2, decode_batches=(1, 4),
                              decode_kv_lens=(16, 64), ft_totals=(32, 64), repeats=1)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "The three primary colors are", "Once upon a time", "import numpy as np\n",
           "The largest planet in the solar system is", "Translate to French: good morning"]
# an engine small enough for this shared machine: 8192 KV tokens, 256 tokens a step
ENGINE = dict(dtype="float32", max_num_batched_tokens=256, max_model_len=512, max_num_seqs=16,
              kv_cache_tokens=8192)


def samples(tokenizer, n: int = 12) -> list[TrainingSample]:
    """Short instruction/response pairs, loss on the response only."""
    out = []
    for i in range(n):
        prompt = tokenizer(f"Question {i}: what is {i} plus {i + 1}? Answer:",
                           add_special_tokens=False)["input_ids"]
        answer = tokenizer(f" {2 * i + 1}. That is all.", add_special_tokens=False)["input_ids"]
        ids = tuple(prompt + answer)
        out.append(TrainingSample(i, ids, tuple([IGNORE_INDEX] * len(prompt) + answer)))
    return out


def replay(host, prompts, params, gap_s=0.05):
    """Open loop: requests at fixed intervals while the host's loop runs in a thread."""
    stop = threading.Event()
    loop = threading.Thread(target=host.run_loop, args=(stop,), daemon=True)
    loop.start()
    ids = []
    try:
        for p in prompts:
            ids.append(host.add_request(p, params))
            time.sleep(gap_s)
        deadline = time.monotonic() + 300
        while host.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        loop.join()
    return [host.pop_finished(i) for i in ids]


class EngineOutputs:
    """Every output vLLM's engine hands the host (``llm_engine.step()``), by request id: what
    reached the client side, independently of the host's own bookkeeping."""

    def __init__(self, host):
        self.ids: list[str] = []
        self.finished: list[str] = []
        step = host.engine.step

        def spy():
            outs = step()
            for o in outs:
                self.ids.append(o.request_id)
                if o.finished:
                    self.finished.append(o.request_id)
            return outs

        host.engine.step = spy
        self._host, self._step = host, step

    def close(self) -> None:
        self._host.engine.step = self._step


def read_slot(host, lora: LoRAConfig) -> AdapterWeights:
    """The reserved slot's weights as vLLM's forward reads them (B unscaled), straight from
    vLLM's stacked LoRA tensors."""
    from deltaserve.hosts.vllm.publish import PACKED

    pub = host.link.publisher
    mc = host.model_config
    out = AdapterWeights(mc, lora)
    slot, r = pub.slot, lora.r
    with torch.no_grad():
        for layer in range(mc.num_layers):
            for packed, parts in PACKED:
                module = pub.manager.modules[f"model.layers.{layer}.{packed}"]
                for s, proj in enumerate(parts):
                    if out.has(proj):
                        a, b = out.a(layer, proj), out.b(layer, proj)
                        a.copy_(module.lora_a_stacked[s][slot, 0, :r, : a.shape[1]])
                        b.copy_(module.lora_b_stacked[s][slot, 0, : b.shape[0], :r]
                                / lora.scaling)
    return out


def captured_rows(spy: SpyStep, data: list[TrainingSample], model_config, dtype
                  ) -> tuple[ActivationBuffer, list[JobSample]]:
    """The rows the host captured for ``spy``'s samples, in a buffer of their own (row order:
    ``step.rows``), and the backward jobs that read them."""
    ids = spy.plan.sample_ids
    total = sum(data[i].num_tokens for i in ids)
    buf = ActivationBuffer(BufferConfig(total), model_config, dtype, "cpu")
    for layer, rows in spy.hidden.items():
        buf.write_residual(layer, 0, rows.to(dtype))
    jobs, start = [], 0
    for i, seed in zip(ids, spy.rows.dropout_seeds, strict=True):
        jobs.append(JobSample(i, start, data[i].labels, seed))
        start += data[i].num_tokens
    return buf, jobs


def vllm_captured_grads(host, latency, data: list[TrainingSample], seed: int = 3,
                        lora: LoRAConfig = LORA
                        ) -> tuple[torch.Tensor, AdapterWeights, dict[int, int]]:
    """LoRA gradients of ``data`` by the backward's recompute from activations captured inside
    vLLM (one training-only step), at a random non-trivial adapter published into the reserved
    slot (every gradient path live); that adapter; each sample's dropout seed, by sample id."""
    config = CoServeConfig(SLOConfig(30.0, 30.0), lora=lora, interrupt=False,
                           backward=BackwardConfig(batch_tokens=4096),
                           admission=AdmissionConfig(max_ft_tokens_per_step=256))
    co = host.attach(config, dataset=data, latency_model=latency, progress=False)
    try:
        spies = spy_steps(co, keep_hidden=True)
        g = torch.Generator().manual_seed(seed)
        weights = AdapterWeights(host.model_config, lora)
        with torch.no_grad():
            weights.flat.copy_(torch.randn(weights.numel, generator=g) * 0.02)
        host.publish_adapter(weights)
        assert host.step()  # an idle engine: one training-only step captures every sample
        (spy,) = spies.steps
        assert sorted(spy.plan.sample_ids) == [s.sample_id for s in data]
        assert spy.captured == list(range(host.model_config.num_layers))
        assert not spies.reports[0].aborted
        model = LlamaModel(host.model_config, host.backward_weights())
        buf, jobs = captured_rows(spy, data, host.model_config, model.weights.dtype)
        trainable = weights.clone(requires_grad=True)
        layerwise_backward(model, trainable, buf, jobs, host.training_dropout(lora))
        return trainable.gather_grad_().float(), weights, {j.sample_id: j.dropout_seed
                                                           for j in jobs}
    finally:
        host.detach(drain=False, checkpoint=False)


def peft_grads(weights: AdapterWeights, data: list[TrainingSample], dtype: torch.dtype
               ) -> torch.Tensor:
    """The same gradients from transformers + peft (the independent reference), with smollm2
    loaded in ``dtype``; laid out like :meth:`AdapterWeights.gather_grad_`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2"), dtype=dtype)
    lora = weights.config  # without its dropout: the reference computes none
    pm = get_peft_model(hf, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0,
                                       target_modules=list(lora.target_modules)))
    named = dict(pm.named_parameters())
    with torch.no_grad():
        for key, value in weights.to_peft_state_dict().items():
            named[key.replace(".weight", ".default.weight")].copy_(value)
    n = max(s.num_tokens for s in data)
    pad = lambda seq, v: list(seq) + [v] * (n - len(seq))  # noqa: E731
    batch = dict(input_ids=torch.tensor([pad(s.input_ids, 0) for s in data]),
                 attention_mask=torch.tensor([pad([1] * s.num_tokens, 0) for s in data]),
                 labels=torch.tensor([pad(s.labels, IGNORE_INDEX) for s in data]))
    pm(**batch).loss.backward()
    want = torch.zeros(weights.numel)
    ref = AdapterWeights(weights.model_config, weights.config, want)
    for layer, module, a, b in ref.items():
        for which, dst in (("A", a), ("B", b)):
            key = peft_key(layer, module, which).replace(".weight", ".default.weight")
            dst.copy_(named[key].grad.float())
    return want


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())
