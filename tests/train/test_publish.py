"""Publishing a step so that a lost backward process leaves the last committed state."""

import os
import signal

import torch

from deltaserve.train.backward.messages import LayerDone
from deltaserve.train.optim import OptimizerConfig, OptimizerState, build_adamw, export_state
from deltaserve.train.publish import PublishGuard, publish, roll_back
from tests.train import fixtures as fx


def _shared(numel=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    live = torch.randn(numel, generator=g)
    opt_state = OptimizerState(numel)
    opt_state.exp_avg.copy_(torch.randn(numel, generator=g))
    opt_state.exp_avg_sq.copy_(torch.rand(numel, generator=g))
    opt_state.step.fill_(4)
    return live, opt_state, PublishGuard(live, numel)


def _one_step(live, opt_state):
    param = live.clone().requires_grad_(True)
    opt = build_adamw(param, OptimizerConfig(lr=0.1), opt_state)
    param.grad = torch.ones_like(param)
    opt.step()
    return param, opt


def test_publish_keeps_the_overwritten_state_and_marks_its_step():
    live, opt_state, guard = _shared()
    before = (live.clone(), opt_state.state_dict())
    param, opt = _one_step(live, opt_state)
    publish(7, param, opt, live, opt_state, guard)
    assert int(guard.publishing_step) == 7
    assert torch.equal(guard.adapter_flat, before[0])
    for k, v in before[1].items():
        assert torch.equal(getattr(guard.optimizer, k), v)
    assert torch.equal(live, param.detach())
    want = OptimizerState(live.numel())
    export_state(opt, param, want)
    assert torch.equal(opt_state.exp_avg, want.exp_avg) and int(opt_state.step) == 5


def test_roll_back_restores_a_torn_publish_only_for_its_own_step():
    live, opt_state, guard = _shared()
    before = (live.clone(), opt_state.state_dict())
    param, opt = _one_step(live, opt_state)
    publish(7, param, opt, live, opt_state, guard)
    live[:10] = 123.0  # as if the process died halfway through writing
    assert not roll_back(6, live, opt_state, guard)  # another step: not this publish's business
    assert live[0] == 123.0
    assert roll_back(7, live, opt_state, guard)
    assert torch.equal(live, before[0])
    for k, v in before[1].items():
        assert torch.equal(getattr(opt_state, k), v)


def test_roll_back_before_any_publish_touches_nothing():
    live, opt_state, guard = _shared()
    before = live.clone()
    assert not roll_back(0, live, opt_state, guard)
    assert torch.equal(live, before)


def test_process_lost_before_its_report_arrived_leaves_the_committed_state(base_path):
    # The process publishes step 0, reports it, and dies; the report never reaches the parent
    # (as when a process dies with the message still in its queue's feeder thread). The
    # samples return to the pool, so the update must be undone, or they would train twice.
    co = fx.coserver(base_path, fx.samples(10), batch_tokens=10_000)
    model = fx.model(base_path)
    init = co.adapter.flat.clone()
    proc = fx.process(co)
    try:
        fx.capture_all(co, model)
        proc.grant.set()
        co.poll()  # submits the job
        assert proc.busy
        report = proc._results.get(timeout=60)  # taken before the parent sees it
        while isinstance(report, LayerDone):
            report = proc._results.get(timeout=60)
        assert report.step == 0 and int(proc.shared.guard.publishing_step) == 0
        assert not torch.equal(co.adapter.flat, init)  # published
        os.kill(proc.process.pid, signal.SIGKILL)
        proc.process.join(5)
        co.poll()
        assert co.stats().worker_restarts == 1 and co.stats().ft_samples_committed == 0
        assert len(co.book.pool) == 10
        state = co.trainer.optimizer_state
        assert torch.equal(co.adapter.flat, init) and int(state.step) == 0
        proc.wait_ready()
        fx.capture_all(co, model)
        co.drain()
        assert co.stats().ft_samples_committed == 10 and co.book.progress().finished
        assert int(state.step) == co.trainer.optimizer_steps == 1
    finally:
        co.close(drain=False, checkpoint=False)
