"""Two co-servers as data-parallel replicas, each its own backward process in one gloo group,
configured through ``CoServeConfig.data_parallel`` only: on an odd dataset (shards of 4 and 3
samples, one sample a step) the short replica answers its peer's last step of every epoch with
an empty share, both take the same steps, and their (bit-identical) adapter equals, to 1e-5,
one replica's trained on the union of every global step's shares (brute force, in this
process)."""

import functools
import math
import threading
import time
from collections.abc import Callable

import torch

from deltaserve.core.shard import DataShard
from deltaserve.core.slo import SLOConfig
from deltaserve.model import AdapterWeights
from deltaserve.train.backward.messages import BackwardJob, JobSample
from deltaserve.train.backward.worker import SharedState, WorkerSpec, run_job
from deltaserve.train.buffer import ActivationBuffer, BufferConfig
from deltaserve.train.capture import training_only_step
from deltaserve.train.checkpoint_store import CheckpointConfig
from deltaserve.train.config import BackwardConfig, CoServeConfig, DataParallelConfig
from deltaserve.train.events import OptimizerStep
from deltaserve.train.facade import CoServer
from deltaserve.train.optim import OptimizerConfig, OptimizerState, build_adamw
from deltaserve.train.publish import PublishGuard
from deltaserve.train.samples import dropout_seed
from tests.train import fixtures as fx
from tests.train.backward.test_data_parallel import LORA, capture, free_port

SEED = 5
NUM_SAMPLES = 7  # odd: shards of 4 and 3
NUM_EPOCHS = 2
OPTIMIZER = OptimizerConfig()


def dp_config(rank: int = 0, world_size: int = 2, port: int = 29500,
              timeout_s: float = 120.0, root=None) -> CoServeConfig:
    # one sample a step (a batch of one token is full after its first sample), so the shards'
    # step counts differ (4 and 3) in every epoch
    return CoServeConfig(slo=SLOConfig(1.0, 0.5), lora=LORA, optimizer=OPTIMIZER,
                         checkpoint=CheckpointConfig(root=str(root) if root else None),
                         backward=BackwardConfig(batch_tokens=1, threads=1),
                         num_epochs=NUM_EPOCHS, seed=SEED,
                         data_parallel=DataParallelConfig(world_size, rank, master_port=port,
                                                          timeout_s=timeout_s))


def start(base_path, samples, port, timeout_s: float = 120.0, root=None, world_size: int = 2):
    """Every replica's co-server, built concurrently: each backward waits for its peers' to
    form the group (``timeout_s``: the group's, for a peer in a collective too)."""
    cos: list[CoServer | None] = [None] * world_size
    errors: list[BaseException] = []
    models = [fx.model(base_path) for _ in range(world_size)]

    def build(rank: int) -> None:
        try:
            config = dp_config(rank, world_size, port=port, timeout_s=timeout_s, root=root)
            cos[rank] = CoServer.for_model(config, fx.LIMITS,
                                           models[rank], samples,
                                           base_model=str(base_path),
                                           latency_model=fx.latency_model())
        except BaseException as e:  # re-raised on the test thread
            errors.append(e)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    if errors:
        for co in cos:
            if co is not None:
                co.close(drain=False, checkpoint=False, timeout_s=5.0)
        raise errors[0]
    return cos


def run_replicas(targets: list[Callable[[], None]], errors: list[BaseException],
                 timeout_s: float = 300.0) -> None:
    """Run each replica's ``target`` on a thread of its own, wait for all, and raise the first
    error one of them recorded in ``errors``."""
    threads = [threading.Thread(target=target) for target in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a replica never finished"
    if errors:
        raise errors[0]


def settle(co: CoServer) -> None:
    """Launch what is due (an owed empty share included) and wait until nothing is in flight,
    lending the backward the machine as an idle host does."""
    co.poll()
    while co.trainer.backward.busy:
        co.idle(0.05)


def train_idle(co: CoServer, deadline_s: float = math.inf) -> None:
    """Train as an idle host does until nothing is pending (trained, or training stopped),
    or until ``deadline_s`` on the monotonic clock."""
    while time.monotonic() < deadline_s:
        settle(co)
        step = training_only_step(co, co.model, co.adapter)
        settle(co)
        if step is None and not co.trainer.has_pending:
            return


def drive(co: CoServer, steps: list[OptimizerStep], errors: list[BaseException]) -> None:
    """Train the replica's shards as an idle host would, capturing only while no step is in
    flight: every sample of global step k is captured on the adapter of step k (as the brute
    force captures them), whichever replica's peer is slower."""
    co.subscribe(lambda ev: steps.append(ev) if isinstance(ev, OptimizerStep) else None)
    try:
        train_idle(co)
        co.close(drain=True, checkpoint=False, timeout_s=120.0)
    except BaseException as e:  # re-raised on the test thread
        errors.append(e)
        co.close(drain=False, checkpoint=False, timeout_s=5.0)


def reference(base_path, samples, shares) -> torch.Tensor:
    """One replica, each global step on the union of the replicas' shares of it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = fx.model(base_path)
        adapter = AdapterWeights(model.config, LORA).init_peft_(SEED)  # as the Trainer's
        state = OptimizerState(adapter.numel)
        buffer = ActivationBuffer(BufferConfig(512), model.config, torch.float32)
        shared = SharedState(model.config, model.weights, adapter.flat, state, buffer,
                             PublishGuard(adapter.flat, adapter.numel))
        trainable = AdapterWeights(model.config, LORA,
                                   adapter.flat.detach().clone()).make_trainable_()
        opt = build_adamw(trainable.flat, OPTIMIZER, state)
        for step, (epoch, ids) in enumerate(shares):
            part, start = [], 0
            for sid in ids:
                s = samples[sid]
                part.append((s.input_ids, JobSample(sid, start, s.labels,
                                                    dropout_seed(SEED, epoch, sid))))
                start += s.num_tokens
            jobs = capture(model, adapter, part, buffer)
            run_job(model, trainable, opt, WorkerSpec(LORA, OPTIMIZER), shared,
                    BackwardJob(step, jobs))
        return adapter.flat.detach().clone()
    finally:
        torch.set_num_threads(threads)


def test_replicas_on_an_odd_dataset_take_the_same_steps_and_equal_one_replica(base_path):
    samples = fx.samples(NUM_SAMPLES, seed=3)
    cos = start(base_path, samples, free_port())
    steps: list[list[OptimizerStep]] = [[], []]
    errors: list[BaseException] = []
    run_replicas([functools.partial(drive, co, steps[r], errors) for r, co in enumerate(cos)],
                 errors)
    a, b = cos
    # the same global steps on both: 4 per epoch (the longer shard's), the short replica's
    # last one of every epoch an empty share
    assert [ev.step for ev in steps[0]] == [ev.step for ev in steps[1]] \
        == list(range(4 * NUM_EPOCHS))
    assert [len(ev.sample_ids) for ev in steps[0]] == [1] * 4 * NUM_EPOCHS
    assert [len(ev.sample_ids) for ev in steps[1]] == [1, 1, 1, 0] * NUM_EPOCHS
    assert all(ev.allreduce_s > 0 for r in steps for ev in r)
    # every sample exactly once per epoch across the replicas, each in its own shard
    for epoch in range(NUM_EPOCHS):
        for rank in range(2):
            got = [i for ev in steps[rank] if ev.epoch == epoch for i in ev.sample_ids]
            assert sorted(got) == sorted(DataShard(rank, 2, SEED).ids(NUM_SAMPLES, epoch))
    for co in cos:
        assert co.book.progress().finished
    # one adapter, never exchanged
    assert torch.equal(a.adapter.flat, b.adapter.flat)
    shares = [(ea.epoch, ea.sample_ids + eb.sample_ids)
              for ea, eb in zip(steps[0], steps[1], strict=True)]
    want = reference(base_path, samples, shares)
    start_flat = AdapterWeights(a.model.config, LORA).init_peft_(SEED).flat
    assert (want - start_flat).abs().max() > 1e-3  # training moved it: the check means something
    torch.testing.assert_close(a.adapter.flat, want, rtol=0, atol=1e-5)
