"""The split-pool baseline's standalone trainer."""

import itertools
import os
import random
import time

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from deltaserve.bench.split_pool import StandaloneTrainer, _batches, pool_order
from deltaserve.core.data import IGNORE_INDEX, TrainingSample
from deltaserve.core.pool import SamplePool
from deltaserve.model.lora import LoRAConfig
from deltaserve.train.optim import OptimizerConfig
from tests.tiny import hf_tiny_llama
from tests.train import fixtures as fx


def _of_lengths(lengths):
    return [TrainingSample(i, tuple(range(1, n + 1)), tuple(range(1, n + 1)))
            for i, n in enumerate(lengths)]


LENGTHS = [12, 8, 20, 8, 12, 8, 30, 20, 8, 12, 8, 16]


def test_trainer_takes_samples_in_the_order_the_coservers_admission_claims_them():
    """The reference: a co-server's pool as admission uses it (claim_first of a few samples
    per step, committed once trained), over three epochs."""
    pool = SamplePool(LENGTHS, num_epochs=None, seed=7)
    rng = random.Random(0)
    claimed: list[int] = []
    while len(claimed) < 3 * len(LENGTHS):
        ids = pool.claim_first(rng.randint(1, 3))
        pool.commit(ids)
        claimed += ids
    got = list(itertools.islice(pool_order(LENGTHS, seed=7), len(claimed)))
    assert got == claimed
    # in increasing length per epoch; equal lengths reshuffled by the next epoch's seed
    first, second = got[:len(LENGTHS)], got[len(LENGTHS):2 * len(LENGTHS)]
    assert [LENGTHS[i] for i in first] == sorted(LENGTHS)
    assert first != second and sorted(first) == sorted(second) == list(range(len(LENGTHS)))


def test_batches_take_whole_samples_until_the_budget():
    samples = _of_lengths(LENGTHS)
    order = pool_order(LENGTHS, seed=3)
    for batch in itertools.islice(_batches(samples, 40, seed=3), 12):
        tokens = [s.num_tokens for s in batch]
        # each batch closes with the sample that reaches the budget (which may overshoot)
        assert sum(tokens[:-1]) < 40 <= sum(tokens)
        assert [s.sample_id for s in batch] == list(itertools.islice(order, len(batch)))


def _loss(model, batch):
    n = max(s.num_tokens for s in batch)
    rows = [(s, n - s.num_tokens) for s in batch]
    with torch.no_grad():
        return float(model(
            input_ids=torch.tensor([list(s.input_ids) + [0] * p for s, p in rows]),
            attention_mask=torch.tensor([[1] * s.num_tokens + [0] * p for s, p in rows]),
            labels=torch.tensor([list(s.labels) + [IGNORE_INDEX] * p for s, p in rows])).loss)


def test_trainer_reports_each_step_and_starts_from_the_base_model(tmp_path):
    hf_tiny_llama(seed=3).save_pretrained(tmp_path)
    samples = fx.samples(12)
    trainer = StandaloneTrainer(str(tmp_path), samples, LoRAConfig(r=4, alpha=8, dropout=0.0),
                                OptimizerConfig(lr=1e-2), batch_tokens=64, threads=1)
    trainer.start()
    deadline = time.monotonic() + 60
    while len(trainer.collect()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    steps = trainer.stop()
    assert len(steps) >= 3 and not trainer._proc.is_alive()
    want = list(itertools.islice(_batches(samples, 64), len(steps)))
    assert [s.num_tokens for s in steps] == [sum(x.num_tokens for x in b) for b in want]
    assert [s.num_samples for s in steps] == [len(b) for b in want]
    assert [s.num_padded_tokens for s in steps] == [
        len(b) * max(x.num_tokens for x in b) for b in want]
    assert all(a.at_s <= b.at_s for a, b in itertools.pairwise(steps))
    # LoRA B starts at zero: the first step's loss is the base model's
    base = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert steps[0].loss == pytest.approx(_loss(base, want[0]), rel=1e-5)


def test_trainer_that_cannot_start_is_an_error(tmp_path):
    trainer = StandaloneTrainer(str(tmp_path / "missing"), fx.samples(2), LoRAConfig(r=4),
                                OptimizerConfig(), batch_tokens=64, threads=1)
    with pytest.raises(RuntimeError, match="exited during start-up"):
        trainer.start(timeout_s=120)


def _start_and_die(model_dir: str, pid) -> None:
    """A bench that is killed: it starts a trainer and exits without stopping it."""
    trainer = StandaloneTrainer(model_dir, fx.samples(12), LoRAConfig(r=4, alpha=8),
                                OptimizerConfig(), batch_tokens=64, threads=1)
    trainer.start()
    pid.value = trainer._proc.pid  # shared memory: written before the exit below
    os._exit(0)  # no atexit, no stop: as after SIGKILL


def test_trainer_of_a_killed_bench_exits_instead_of_training_on(tmp_path):
    hf_tiny_llama(seed=3).save_pretrained(tmp_path)
    ctx = mp.get_context("spawn")
    shared_pid = ctx.Value("i", 0)
    bench = ctx.Process(target=_start_and_die, args=(str(tmp_path), shared_pid))
    bench.start()
    bench.join(timeout=180)
    pid = shared_pid.value
    assert bench.exitcode == 0 and pid
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"  # a zombie has exited
