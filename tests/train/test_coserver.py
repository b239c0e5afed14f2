"""The backward process through the co-server: PEFT equivalence, checkpoints, grant, crashes,
resume."""

import json
import os
import signal
import time

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from deltaserve.core.data import IGNORE_INDEX
from deltaserve.model.peft_io import load_adapter
from deltaserve.train.backward.messages import BackwardDone, LayerDone
from deltaserve.train.backward.process import BackwardProcess
from deltaserve.train.backward.worker import WorkerSpec
from deltaserve.train.capture import training_only_step
from deltaserve.train.checkpoint_store import find_latest
from tests.tiny import hf_tiny_llama
from tests.train import fixtures as fx


def run_until(co, model, steps, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while co.trainer.optimizer_steps < steps and time.monotonic() < deadline:
        if training_only_step(co, model, co.adapter) is None:
            co.idle(timeout_s=0.05)
    assert co.trainer.optimizer_steps >= steps


def units_done(events):
    """Every unit's report: decoder layers, the last layer's recompute and its head chunks."""
    return [e for e in events if isinstance(e, LayerDone)]


def layers_done(events):
    """The decoder layers' reports (the last layer's recompute and head chunks, reported as
    units of their own, left out)."""
    return [e for e in events if isinstance(e, LayerDone) and e.layer >= 0]


def log_steps(root):
    lines = (root / "train_log.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if "sample_ids" in json.loads(x)]


def peft_reference(base_path, samples, batches, init_state, cfg):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    lora = cfg.lora
    pm = get_peft_model(hf, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0,
                                       target_modules=list(lora.target_modules)))
    named = dict(pm.named_parameters())
    with torch.no_grad():
        for key, value in init_state.items():
            named[key.replace(".weight", ".default.weight")].copy_(value)
    params = [p for p in pm.parameters() if p.requires_grad]
    o = cfg.optimizer
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    pm.train()
    for ids in batches:
        batch = [samples[i] for i in ids]
        n = max(s.num_tokens for s in batch)
        input_ids = torch.tensor([list(s.input_ids) + [0] * (n - s.num_tokens) for s in batch])
        mask = torch.tensor([[1] * s.num_tokens + [0] * (n - s.num_tokens) for s in batch])
        labels = torch.tensor([list(s.labels) + [IGNORE_INDEX] * (n - s.num_tokens)
                               for s in batch])
        pm(input_ids=input_ids, attention_mask=mask, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.max_grad_norm)
        opt.step()
        opt.zero_grad()
    return pm


def test_backward_process_equals_peft_and_checkpoint_loads_in_peft(base_path, tmp_path):
    samples = fx.samples(24)
    co = fx.coserver(base_path, samples, root=tmp_path / "ck", every=2)
    model = fx.model(base_path)
    init = co.adapter.to_peft_state_dict()
    try:
        run_until(co, model, 4)
    finally:
        co.close(drain=False)
    steps = log_steps(tmp_path / "ck")
    assert [s["step"] for s in steps] == list(range(len(steps)))
    batches = [s["sample_ids"] for s in steps]
    assert all(sum(samples[i].num_tokens for i in b) >= 64 for b in batches[:-1])
    ref = peft_reference(base_path, samples, batches, init, co.config)
    ours = co.adapter.to_peft_state_dict()
    ref_sd = {k.replace(".default", ""): v for k, v in ref.state_dict().items() if "lora_" in k}
    num = sum(float((ours[k] - ref_sd[k]).norm() ** 2) for k in ours) ** 0.5
    den = sum(float(ref_sd[k].norm() ** 2) for k in ours) ** 0.5
    print(f"relative difference to PEFT: {num / den:.2e}")
    assert num / den <= 1e-4, f"relative difference {num / den:.2e}"
    moved = sum(float((ours[k] - init[k]).norm()) for k in ours)
    assert moved > 0.01  # it trained

    # the checkpoint is a PEFT adapter: peft loads it and gives the same logits
    latest = find_latest(tmp_path / "ck")
    assert latest is not None and latest.name == f"checkpoint-{len(steps):06d}"
    hf = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(hf, latest).eval()
    seq = torch.tensor([list(samples[0].input_ids)])
    with torch.no_grad():
        want = ref.eval()(seq).logits
        got = loaded(seq).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(load_adapter(latest, co.model.config).flat, co.adapter.flat)


def test_grant_pauses_backward_within_one_layer(tmp_path):
    """The process's own reports (one per layer) show where it stands: nothing before the grant
    is given; once it is taken back the process parks at the next layer boundary (it checks the
    grant before every layer) and computes nothing until it is given again."""
    deep = tmp_path / "deep"
    hf_tiny_llama(seed=7, num_hidden_layers=24).save_pretrained(deep)
    co = fx.coserver(deep, fx.samples(8), batch_tokens=10_000)
    model = fx.model(deep)
    proc = fx.process(co)
    try:
        proc.grant.clear()  # inference holds the grant
        fx.capture_all(co, model)  # the pool runs dry: the captured samples become a job
        assert proc.busy
        time.sleep(1.5)
        assert units_done(proc.poll()) == []  # waited before its first layer
        proc.grant.set()
        seen = []
        while not seen:
            seen = layers_done(proc.poll(timeout_s=0.05))
        proc.grant.clear()  # the layer in progress completes, then the process parks
        deadline = time.monotonic() + 30
        while not proc.parked.value and time.monotonic() < deadline:
            time.sleep(0.001)
        assert proc.parked.value and proc.busy
        held = len(seen) + len(layers_done(proc.poll(timeout_s=0.2)))
        time.sleep(1.0)  # parked: nothing runs while inference holds the grant
        assert units_done(proc.poll()) == [] and held < model.num_layers
        proc.grant.set()
        events = proc.wait(60)
        assert held + len(layers_done(events)) == model.num_layers
        assert [type(e) for e in events if not isinstance(e, LayerDone)] == [BackwardDone]
    finally:
        co.close(drain=False, checkpoint=False)


def test_a_yield_starts_only_the_layers_that_end_by_its_deadline(tmp_path):
    """A grant lent until a deadline (a yield before a host step) admits a layer only if the
    layer, as long as it took when the process timed it, ends by then: the backward does not
    overrun the yield into the step. A deadline already past admits nothing; one far off
    admits every layer."""
    deep = tmp_path / "deep"
    hf_tiny_llama(seed=7, num_hidden_layers=12).save_pretrained(deep)
    co = fx.coserver(deep, fx.samples(8), batch_tokens=10_000)
    model = fx.model(deep)
    proc = fx.process(co)
    try:
        proc.grant.set(until_s=time.monotonic())  # a yield that has just ended
        fx.capture_all(co, model)
        assert proc.busy
        time.sleep(1.0)
        assert units_done(proc.poll()) == [] and proc.parked.value  # no layer would fit
        proc.grant.set(until_s=time.monotonic() + 600)  # a yield every layer fits in
        deadline = time.monotonic() + 60
        seen: list = []
        while len(seen) < model.num_layers and time.monotonic() < deadline:
            seen += layers_done(proc.poll(timeout_s=0.05))
        assert len(seen) == model.num_layers
    finally:
        co.close(drain=False, checkpoint=False)


def test_killed_backward_loses_no_sample(base_path):
    samples = fx.samples(10)
    co = fx.coserver(base_path, samples, batch_tokens=10_000)
    rec = fx.Recorder(co)
    proc = fx.process(co)
    assert proc.ready  # the co-server waits for the process before serving
    model = fx.model(base_path)
    try:
        fx.capture_all(co, model)
        proc.grant.clear()
        co.poll()  # the pool is empty: the captured samples are flushed into a job
        assert proc.busy
        time.sleep(1.0)  # the process has taken the job and sits paused on the grant
        assert proc.parked.value == 1 and units_done(proc.poll()) == []
        lost_pid = proc.process.pid
        os.kill(lost_pid, signal.SIGKILL)
        proc.process.join(5)
        co.poll()  # notices the death: samples back in the pool, a new process started
        assert co.stats().worker_restarts == 1 and not proc.busy
        assert [type(e).__name__ for e in rec.events] == ["StepLost"]
        assert len(co.book.pool) == 10 and proc.process.pid != lost_pid
        proc.wait_ready()  # the restarted process reports in like the first
        proc.grant.set()
        fx.capture_all(co, model)
        co.drain()
        assert co.stats().ft_samples_committed == 10 and co.book.progress().finished
        assert sorted(rec.committed_ids) == list(range(10))
    finally:
        co.close(drain=False, checkpoint=False)


def test_backward_that_cannot_start_is_an_error(base_path):
    co = fx.coserver(base_path, fx.samples(2))
    try:
        broken = BackwardProcess(WorkerSpec(co.config.lora, co.config.optimizer, num_threads=0),
                                 fx.process(co).shared)  # torch.set_num_threads(0) raises
        with pytest.raises(RuntimeError, match="exited during start-up"):
            broken.wait_ready(timeout_s=60)
    finally:
        co.close(drain=False, checkpoint=False)


def test_resume_continues_without_repeating_or_skipping(base_path, tmp_path):
    samples = fx.samples(30)
    root = tmp_path / "ck"
    co = fx.coserver(base_path, samples, root=root, every=1)
    model = fx.model(base_path)
    try:
        run_until(co, model, 3)
    finally:
        # a crash: stop without draining; captured-but-untrained samples are lost with it
        fx.process(co).process.kill()
        fx.process(co).process.join(5)
    first = log_steps(root)
    ck_step = int(find_latest(root).name.split("-")[1])
    assert ck_step == co.trainer.optimizer_steps
    adapter_at_ck = load_adapter(find_latest(root), co.model.config).flat.clone()

    co2 = fx.coserver(base_path, samples, root=root, every=1)
    try:
        assert co2.trainer.resumed_from is not None and co2.trainer.optimizer_steps == ck_step
        assert torch.equal(co2.adapter.flat, adapter_at_ck)
        while not co2.book.progress().finished:
            if training_only_step(co2, model, co2.adapter) is None:
                co2.idle(timeout_s=0.05)
                if not co2.backward_busy:
                    co2.drain()
    finally:
        co2.close()
    steps = [s for s in log_steps(root)]
    ids = [i for s in steps for i in s["sample_ids"]]
    assert len(ids) == len(set(ids)) == 30  # every sample once, none repeated
    assert [s["step"] for s in steps] == list(range(len(steps)))
    assert steps[: len(first)] == first
