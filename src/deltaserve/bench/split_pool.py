"""The split-pool baseline's trainer, and the standalone training throughput of a machine.

A standalone PEFT + torch AdamW trainer in its own process on its own share of the machine
(here: its own CPU threads), training the same samples in the same batch size, with no
coordination with inference. It reports each optimizer step as it lands.

Its sample order and packing are DeltaServe's, so that a ratio of the two measures scheduling:
samples in increasing length, equal lengths in the co-server's pool's seeded order for the
epoch (the order comes from a :class:`~deltaserve.core.pool.SamplePool` itself), whole samples
to each batch until it reaches ``batch_tokens`` (the last one may overshoot, as the co-server's
backward batch does). What remains different is padding: the trainer pads a batch to its
longest sample, where DeltaServe's backward runs packed rows; each step reports its padded
tokens so the bench can state the trainer's padded-token efficiency.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from deltaserve.core.data import IGNORE_INDEX, TrainingSample
from deltaserve.core.pool import SamplePool
from deltaserve.model.loading import is_random_model_dir, resolve_dtype
from deltaserve.model.lora import LoRAConfig
from deltaserve.train.optim import OptimizerConfig


@dataclass(frozen=True)
class TrainerStep:
    at_s: float  # time.monotonic(): shared by the processes of one machine
    num_tokens: int
    num_samples: int
    loss: float
    num_padded_tokens: int = 0  # rows × the batch's longest sample: what the trainer computed


def pool_order(lengths: Sequence[int], seed: int) -> Iterator[int]:
    """Sample indices in the order a co-server's pool with ``seed`` offers them, epoch after
    epoch, endlessly."""
    pool = SamplePool(list(lengths), num_epochs=None, seed=seed)
    while True:
        ids = [sid for sid, _ in pool.iter_available()]
        yield from ids
        pool.claim(ids)
        pool.commit(ids)  # the last commit starts the next epoch (a new seeded order)


def _batches(samples: Sequence[TrainingSample], batch_tokens: int, seed: int = 0
             ) -> Iterator[list[TrainingSample]]:
    """Batches of whole samples in pool order, each closed once it reaches ``batch_tokens``."""
    batch: list[TrainingSample] = []
    n = 0
    for i in pool_order([s.num_tokens for s in samples], seed):
        batch.append(samples[i])
        n += samples[i].num_tokens
        if n >= batch_tokens:
            yield batch
            batch, n = [], 0


def base_model(model_path: str, dtype: str, device: str, seed: int) -> PreTrainedModel:
    """The transformers model of ``model_path`` on ``device``; a random model's is built from
    its config (transformers' own initialization, seeded) directly on the device."""
    torch_dtype = resolve_dtype(dtype, device)
    if is_random_model_dir(Path(model_path)):
        torch.manual_seed(seed)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path),
                                                    dtype=torch_dtype)
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(device)


def trainer_main(model_path: str, samples: Sequence[TrainingSample], lora: LoRAConfig,
                 optimizer: OptimizerConfig, batch_tokens: int, threads: int, dtype: str,
                 seed: int, device: str, steps, stop, ready) -> None:
    torch.set_num_threads(threads)
    model = get_peft_model(
        base_model(model_path, dtype, device, seed),
        LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                   target_modules=list(lora.target_modules)))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=optimizer.lr, weight_decay=optimizer.weight_decay,
                            betas=(optimizer.beta1, optimizer.beta2), eps=optimizer.eps)
    ready.value = 1
    parent = mp.parent_process()

    def tensor(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, device=device)

    for batch in _batches(samples, batch_tokens, seed):
        # a killed bench never sets stop (daemon children are reaped only on a clean exit):
        # an orphan would train on, taking a core from whatever runs next
        if stop.value or (parent is not None and not parent.is_alive()):
            return
        n = max(s.num_tokens for s in batch)
        pad = [n - s.num_tokens for s in batch]
        rows = list(zip(batch, pad, strict=True))
        out = model(input_ids=tensor([list(s.input_ids) + [0] * p for s, p in rows]),
                    attention_mask=tensor([[1] * s.num_tokens + [0] * p for s, p in rows]),
                    labels=tensor([list(s.labels) + [IGNORE_INDEX] * p for s, p in rows]))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, optimizer.max_grad_norm)
        opt.step()
        opt.zero_grad()
        steps.put(TrainerStep(time.monotonic(), sum(s.num_tokens for s in batch), len(batch),
                              float(out.loss.detach()), n * len(batch)))


class StandaloneTrainer:
    """A trainer process; ``start`` returns once its model is loaded. ``device``: where it
    trains (on a GPU it shares the device with inference, as the GPU's own scheduler lets
    it)."""

    def __init__(self, model_path: str, samples: Sequence[TrainingSample], lora: LoRAConfig,
                 optimizer: OptimizerConfig, batch_tokens: int, threads: int,
                 dtype: str = "float32", seed: int = 0, device: str = "cpu"):
        ctx = mp.get_context("spawn")
        self._steps = ctx.Queue()
        # bare shared bytes, not Events: a killed process cannot leave a lock held behind
        self._stop = ctx.Value("b", 0, lock=False)
        self._ready = ctx.Value("b", 0, lock=False)
        self._proc = ctx.Process(target=trainer_main, daemon=True, name="split-pool-trainer",
                                 args=(model_path, list(samples), lora, optimizer, batch_tokens,
                                       threads, dtype, seed, device, self._steps, self._stop,
                                       self._ready))
        self.steps: list[TrainerStep] = []

    def start(self, timeout_s: float = 300.0) -> None:
        self._proc.start()
        deadline = time.monotonic() + timeout_s
        while not self._ready.value:
            time.sleep(0.05)
            if not self._proc.is_alive():
                raise RuntimeError(f"the standalone trainer exited during start-up "
                                   f"(exit code {self._proc.exitcode})")
            if time.monotonic() >= deadline:
                self._proc.kill()
                raise RuntimeError(f"the standalone trainer did not start in {timeout_s:.0f} s")

    def collect(self) -> list[TrainerStep]:
        while True:
            try:
                self.steps.append(self._steps.get_nowait())
            except queue.Empty:
                return self.steps

    def stop(self) -> list[TrainerStep]:
        self._stop.value = 1
        # read the queue while waiting: a child whose queue pipe is full cannot exit
        deadline = time.monotonic() + 120
        while self._proc.is_alive() and time.monotonic() < deadline:
            self.collect()
            self._proc.join(0.1)
        if self._proc.is_alive():
            self._proc.kill()
        return self.collect()


def standalone_tokens_per_s(model_path: str, samples: Sequence[TrainingSample],
                            lora: LoRAConfig, optimizer: OptimizerConfig, batch_tokens: int,
                            threads: int, seconds: float, dtype: str = "float32",
                            seed: int = 0, device: str = "cpu") -> float:
    """Training tokens/s of a trainer that has ``threads`` to itself, measured over
    ``seconds`` after its first step (which pays one-time costs)."""
    trainer = StandaloneTrainer(model_path, samples, lora, optimizer, batch_tokens, threads,
                                dtype, seed, device)
    trainer.start()
    deadline = time.monotonic() + seconds + 120
    while len(trainer.collect()) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = trainer.steps[0].at_s if trainer.steps else time.monotonic()
    while time.monotonic() < t0 + seconds:
        time.sleep(0.1)
    steps = [s for s in trainer.stop() if s.at_s > t0]
    if not steps:
        return 0.0
    return sum(s.num_tokens for s in steps) / (steps[-1].at_s - t0)
