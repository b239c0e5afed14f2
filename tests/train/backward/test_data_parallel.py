"""Data-parallel backward: two replicas' backward processes (gloo, each its own spawned process),
each on its half of every batch, end each step with the adapter and optimizer state that one
replica gets on the whole batch (the issue's equivalence check), and a bad group config fails
before anything starts."""

import argparse
import socket
import threading
import time

import pytest
import torch

from deltaserve.cli_flags import add_dataclass_flags, checked_from_args
from deltaserve.core.admission import AdmissionPlan
from deltaserve.core.contract import TrainingRows
from deltaserve.core.data import IGNORE_INDEX
from deltaserve.core.errors import InputError
from deltaserve.core.shape import StepShape
from deltaserve.model import AdapterWeights, LlamaModel, LoRAConfig
from deltaserve.model.loading import load_weights
from deltaserve.train.backward.allreduce import join_group
from deltaserve.train.backward.messages import (
    BackwardDone,
    BackwardFailed,
    BackwardJob,
    JobSample,
    LayerDone,
)
from deltaserve.train.backward.process import BackwardProcess
from deltaserve.train.backward.worker import SharedState, WorkerSpec, run_job
from deltaserve.train.buffer import ActivationBuffer, BufferConfig
from deltaserve.train.capture import forward_training_rows
from deltaserve.train.config import DataParallelBackend, DataParallelConfig
from deltaserve.train.optim import OptimizerConfig, OptimizerState, build_adamw
from deltaserve.train.publish import PublishGuard
from deltaserve.train.step import CapturingStep

LORA = LoRAConfig(r=4, alpha=8, dropout=0.1)
# lr 1e-3 and clipping at norm 1 as the defaults. eps 1e-6 rather than 1e-8: where an element's
# gradient cancels to ~0, AdamW's update is lr * g / eps, so fp32 rounding of g (~1e-10 absolute,
# summed in another order on two replicas) moves it by up to lr/eps * 1e-10: 1e-5 at eps 1e-8
# (CI measured 1.05e-5 on one element), 100x less here. The test is about the gradient
# combination, not eps.
OPTIMIZER = OptimizerConfig(eps=1e-6)
BUFFER_TOKENS = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batches(num_steps: int, per_step: int = 4, seed: int = 0):
    """``num_steps`` batches of ``(token ids, JobSample)``, rows from 0; lengths and prompt
    shares differ, so the two halves of a batch have different numbers of loss tokens."""
    g = torch.Generator().manual_seed(seed)
    out, sid = [], 0
    for _ in range(num_steps):
        batch, start = [], 0
        for _ in range(per_step):
            n = int(torch.randint(6, 30, (1,), generator=g))
            ids = torch.randint(0, 97, (n,), generator=g).tolist()
            prompt = int(torch.randint(1, n - 1, (1,), generator=g))
            labels = tuple([IGNORE_INDEX] * prompt + ids[prompt:])
            batch.append((tuple(ids), JobSample(sid, start, labels, dropout_seed=1000 + sid)))
            start, sid = start + n, sid + 1
        out.append(batch)
    return out


def rebased(part):
    """A batch's share with its buffer rows starting at 0 (each replica has its own buffer)."""
    out, start = [], 0
    for ids, js in part:
        out.append((ids, JobSample(js.sample_id, start, js.labels, js.dropout_seed)))
        start += js.length
    return out


def capture(model, adapter, part, buffer) -> tuple[JobSample, ...]:
    """Forward ``part`` on ``adapter`` into ``buffer`` (as the co-server's capturing step does)."""
    ids = tuple(js.sample_id for _, js in part)
    shape = StepShape(ft_lens=tuple(js.length for _, js in part))
    plan = AdmissionPlan(ids, shape, None, 0.0, None, row_start=0)
    rows = TrainingRows(tuple(s for s, _ in part), LORA.dropout,
                        tuple(js.dropout_seed for _, js in part))
    forward_training_rows(model, CapturingStep(plan, rows, False, buffer, threading.Event()),
                          adapter)
    return tuple(js for _, js in part)


class Replica:
    """What a trainer shares with its backward process: adapter, optimizer state, buffer."""

    def __init__(self, model: LlamaModel):
        self.adapter = AdapterWeights(model.config, LORA).init_peft_(3)
        with torch.no_grad():  # non-zero B so that every gradient path is live
            self.adapter.flat.add_(torch.randn(self.adapter.numel,
                                               generator=torch.Generator().manual_seed(4)) * 0.05)
        self.adapter.share_memory_()
        self.optimizer = OptimizerState(self.adapter.numel).share_memory_()
        self.buffer = ActivationBuffer(BufferConfig(BUFFER_TOKENS), model.config, torch.float32)
        guard = PublishGuard(self.adapter.flat, self.adapter.numel).share_memory_()
        self.shared = SharedState(model.config, model.weights, self.adapter.flat, self.optimizer,
                                  self.buffer, guard)


@pytest.fixture(scope="module")
def model(base_path):
    m = LlamaModel(*load_weights(base_path))
    m.weights.share_memory_()
    return m


def reference(model, steps) -> tuple[Replica, list[BackwardDone]]:
    """One replica, the whole batch each step, in this process (as the worker runs a job, on
    one thread like the replicas' backward processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(model, steps)
    finally:
        torch.set_num_threads(threads)


def _reference(model, steps) -> tuple[Replica, list[BackwardDone]]:
    rep = Replica(model)
    spec = WorkerSpec(LORA, OPTIMIZER)
    trainable = AdapterWeights(model.config, LORA, rep.adapter.flat.detach().clone())
    trainable.make_trainable_()
    opt = build_adamw(trainable.flat, OPTIMIZER, rep.optimizer)
    done = []
    for step, batch in enumerate(steps):
        jobs = capture(model, rep.adapter, batch, rep.buffer)
        done.append(run_job(model, trainable, opt, spec, rep.shared, BackwardJob(step, jobs)))
    return rep, done


def start_replicas(model, world_size=2, timeout_s=60.0, odd_rank=None):
    """``odd_rank``: that replica starts from another adapter."""
    port = free_port()
    reps, procs = [], []
    for rank in range(world_size):
        rep = Replica(model)
        if rank == odd_rank:
            with torch.no_grad():
                rep.adapter.flat[0] += 1.0
        dp = DataParallelConfig(world_size=world_size, rank=rank, master_port=port,
                                timeout_s=timeout_s)
        reps.append(rep)
        procs.append(BackwardProcess(WorkerSpec(LORA, OPTIMIZER, 1, dp), rep.shared))
    return reps, procs


def test_two_replicas_on_halves_equal_one_replica_on_the_whole_batch(model):
    steps = batches(num_steps=3)
    want, want_done = reference(model, steps)

    reps, procs = start_replicas(model)
    try:
        for p in procs:
            p.wait_ready()
        for step, batch in enumerate(steps):
            halves = (rebased(batch[:1]), rebased(batch[1:]))  # 1 sample vs 3: unequal tokens
            for rep, p, half in zip(reps, procs, halves, strict=True):
                p.submit(BackwardJob(step, capture(model, rep.adapter, half, rep.buffer)))
            done = [next(ev for ev in p.wait(120.0) if isinstance(ev, BackwardDone))
                    for p in procs]
            assert sum(d.num_loss_tokens for d in done) == want_done[step].num_loss_tokens
            for d in done:
                # the norm of the all-reduced gradient: scale-sensitive, unlike Adam's update
                assert d.grad_norm == pytest.approx(want_done[step].grad_norm, rel=1e-5)
                assert d.allreduce_s > 0
            assert done[0].grad_norm == done[1].grad_norm
    finally:
        for p in procs:
            p.stop()

    a, b = reps
    # the replicas hold one adapter: bit-identical, never exchanged
    assert torch.equal(a.adapter.flat, b.adapter.flat)
    assert torch.equal(a.optimizer.exp_avg_sq, b.optimizer.exp_avg_sq)
    assert a.optimizer.num_steps == len(steps) == want.optimizer.num_steps
    moved = (want.adapter.flat - Replica(model).adapter.flat).abs().max()
    assert moved > 1e-3  # training changed the adapter, so the comparison means something
    # The gradients agree to fp32 rounding (~1e-6 relative, as reordering one batch gives); at
    # eps 1e-6 the worst element moved 2.9e-7 here (7e-6 at eps 1e-8; see OPTIMIZER): the
    # issue's 1e-5 holds with a 30x margin.
    torch.testing.assert_close(a.adapter.flat, want.adapter.flat, rtol=0, atol=1e-5)
    torch.testing.assert_close(a.optimizer.exp_avg, want.optimizer.exp_avg, rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(a.optimizer.exp_avg_sq, want.optimizer.exp_avg_sq, rtol=1e-4,
                               atol=1e-12)


def test_a_replica_starting_from_another_adapter_fails_start_up(model):
    _, procs = start_replicas(model, timeout_s=30.0, odd_rank=1)
    try:
        with pytest.raises(RuntimeError, match="exited during start-up"):
            procs[1].wait_ready()
    finally:
        for p in procs:
            p.stop(timeout_s=5.0)


def test_one_replica_forms_no_group():
    assert join_group(DataParallelConfig(), torch.device("cpu")) is None
    assert WorkerSpec(LORA, OPTIMIZER).data_parallel == DataParallelConfig()


@pytest.mark.parametrize("kwargs, field", [
    (dict(world_size=0), "world_size"),
    (dict(world_size=2, rank=2), "rank"),
    (dict(rank=-1), "rank"),
    (dict(master_port=70000), "master_port"),
    (dict(master_addr=""), "master_addr"),
    (dict(backend="mpi"), "backend"),
    (dict(timeout_s=0.0), "timeout_s"),
])
def test_bad_group_config_names_the_field(kwargs, field):
    with pytest.raises(InputError) as e:
        DataParallelConfig(**kwargs)
    assert e.value.field == field


def test_rendezvous_from_torchrun_env():
    env = {"WORLD_SIZE": "4", "RANK": "3", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29511"}
    assert DataParallelConfig.from_env(env) == DataParallelConfig(4, 3, "10.0.0.2", 29511)
    assert DataParallelConfig.from_env({}) == DataParallelConfig()
    with pytest.raises(InputError) as e:
        DataParallelConfig.from_env({"WORLD_SIZE": "two"})
    assert e.value.field == "WORLD_SIZE"
    with pytest.raises(InputError) as e:
        DataParallelConfig.from_env({"WORLD_SIZE": "2", "RANK": "2"})
    assert e.value.field == "rank"


def test_group_config_generates_flags_that_name_a_bad_value():
    parser = argparse.ArgumentParser()
    flags = add_dataclass_flags(parser, DataParallelConfig, prefix="dp-")
    ns = parser.parse_args(["--dp-world-size", "2", "--dp-rank", "1", "--dp-backend", "gloo"])
    assert checked_from_args(DataParallelConfig, ns, flags) == DataParallelConfig(
        world_size=2, rank=1, backend=DataParallelBackend.GLOO)
    assert checked_from_args(DataParallelConfig, parser.parse_args([]), flags) \
        == DataParallelConfig()
    with pytest.raises(InputError) as e:
        checked_from_args(DataParallelConfig,
                          parser.parse_args(["--dp-world-size", "2", "--dp-rank", "2"]), flags)
    assert e.value.field == "--dp-rank"


def test_a_replica_whose_step_fails_fails_its_peers_step_within_the_timeout(model):
    """Rank 0's job raises before the all-reduce (no response tokens); rank 1 waits for it in
    the collective only until ``timeout_s``, then reports the step lost too. Neither publishes:
    each shared adapter stays at its last committed state."""
    reps, procs = start_replicas(model, timeout_s=3.0)
    before = reps[0].adapter.flat.clone()
    try:
        for p in procs:
            p.wait_ready()
        batch = batches(num_steps=1)[0]
        prompt_only = [(ids, JobSample(js.sample_id, js.row_start,
                                       (IGNORE_INDEX,) * js.length, js.dropout_seed))
                       for ids, js in rebased(batch[:1])]
        for rep, p, part in zip(reps, procs, (prompt_only, rebased(batch[1:])), strict=True):
            p.submit(BackwardJob(0, capture(model, rep.adapter, part, rep.buffer)))
        events = [p.wait(60.0) for p in procs]
    finally:
        for p in procs:
            p.stop(timeout_s=5.0)
    for evs in events:
        assert [type(ev) for ev in evs if not isinstance(ev, LayerDone)] == [BackwardFailed]
    assert "no response tokens" in next(ev for ev in events[0]
                                         if isinstance(ev, BackwardFailed)).error
    for rep in reps:
        assert torch.equal(rep.adapter.flat, before) and rep.optimizer.num_steps == 0


def test_a_replica_waiting_for_a_slow_peer_counts_as_parked(model):
    """Waiting in the all-reduce computes nothing: a host step must not wait for it (under the
    exclusive grant it would wait up to ``park_timeout_s`` every step). The late peer's step
    then completes both."""
    reps, procs = start_replicas(model, timeout_s=60.0)
    try:
        for p in procs:
            p.wait_ready()
        batch = batches(num_steps=1)[0]
        halves = (rebased(batch[:2]), rebased(batch[2:]))
        jobs = [BackwardJob(0, capture(model, rep.adapter, half, rep.buffer))
                for rep, half in zip(reps, halves, strict=True)]
        procs[1].submit(jobs[1])
        seen: list = []
        deadline = time.monotonic() + 60.0
        while not any(isinstance(ev, LayerDone) and ev.layer == 0 for ev in seen):
            assert time.monotonic() < deadline and procs[1].process.is_alive()
            seen += procs[1].poll(timeout_s=0.1)  # until its recompute is done
        time.sleep(0.5)
        assert procs[1].busy and procs[1].parked.value == 1
        procs[0].submit(jobs[0])
        done = [[ev for ev in p.wait(60.0) if isinstance(ev, BackwardDone)] for p in procs]
    finally:
        for p in procs:
            p.stop(timeout_s=5.0)
    assert [len(d) for d in done] == [1, 1] and done[1][0].allreduce_s >= 0.5
    assert torch.equal(reps[0].adapter.flat, reps[1].adapter.flat)


def test_a_step_of_empty_shares_takes_no_step_and_one_empty_share_takes_the_peers(model):
    """Step 0: both shares empty (both replicas out of samples): no optimizer step anywhere,
    nothing published. Step 1: rank 0's share is empty, rank 1's the whole batch: both take
    the step one replica takes on that batch. The votes come back summed."""
    steps = batches(num_steps=1)
    _, want_done = reference(model, steps)
    reps, procs = start_replicas(model)
    before = reps[0].adapter.flat.clone()
    try:
        for p in procs:
            p.wait_ready()
        for p, votes in zip(procs, ((False, True), (False, False)), strict=True):
            p.submit(BackwardJob(0, (), *votes))
        empty = [next(ev for ev in p.wait(120.0) if isinstance(ev, BackwardDone)) for p in procs]
        shares = ((), capture(model, reps[1].adapter, rebased(steps[0]), reps[1].buffer))
        for p, share in zip(procs, shares, strict=True):
            p.submit(BackwardJob(0, share, epoch_open=bool(share), staying=True))
        done = [next(ev for ev in p.wait(120.0) if isinstance(ev, BackwardDone)) for p in procs]
    finally:
        for p in procs:
            p.stop()
    for d in empty:
        assert not d.stepped and (d.group_epoch_open, d.group_staying) == (0, 1)
    for d in done:
        assert d.stepped and (d.group_epoch_open, d.group_staying) == (1, 2)
        assert d.grad_norm == pytest.approx(want_done[0].grad_norm, rel=1e-5)
    assert done[0].sample_ids == () and done[0].num_loss_tokens == 0
    assert done[1].num_loss_tokens == want_done[0].num_loss_tokens
    assert torch.equal(reps[0].adapter.flat, reps[1].adapter.flat)
    assert not torch.equal(reps[0].adapter.flat, before)
    assert reps[0].optimizer.num_steps == reps[1].optimizer.num_steps == 1


def test_an_empty_job_without_a_group_is_an_error(model):
    rep = Replica(model)
    trainable = AdapterWeights(model.config, LORA, rep.adapter.flat.detach().clone())
    trainable.make_trainable_()
    opt = build_adamw(trainable.flat, OPTIMIZER, rep.optimizer)
    with pytest.raises(ValueError, match="empty backward job"):
        run_job(model, trainable, opt, WorkerSpec(LORA, OPTIMIZER), rep.shared,
                BackwardJob(0, ()))
