"""When the co-server writes its checkpoints and training log (periodically, at the end, and
again after a failed write), over the on-disk format of :mod:`deltaserve.train.checkpoint_store`,
tolerant of a failing disk.

A training-side write that fails (a full disk, an I/O error) must never reach the host's step:
it is counted, reported as a :class:`TrainingIOError` event, and retried later. Until a retry
succeeds the checkpointer is *blocked*: the co-server launches no backward job, so no more
training accumulates than the last durable checkpoint plus what is in flight, and no sample is
lost (uncommitted samples stay in the pool, captured ones wait for the backward).

Data parallel: the replicas share one checkpoint root (a filesystem every rank sees), and only
rank 0 writes checkpoints there, with the group's ledger as the pool state
(:mod:`deltaserve.train.group_ledger`); every rank resumes from them. Each rank writes its own
training log (``train_log.jsonl`` on rank 0, ``train_log.rank-<r>.jsonl`` on the others).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from deltaserve.core.errors import require
from deltaserve.model.config import ModelConfig
from deltaserve.model.lora import AdapterWeights, LoRAConfig
from deltaserve.train.checkpoint_store import (
    Checkpoint,
    CheckpointConfig,
    CheckpointStore,
    Resumed,
    read_checkpoint,
)
from deltaserve.train.events import (
    CheckpointSaved,
    TrainingEvent,
    TrainingIOError,
    log_record,
)
from deltaserve.train.optim import OptimizerState

logger = logging.getLogger("deltaserve")


def log_name(rank: int) -> str:
    return "train_log.jsonl" if rank == 0 else f"train_log.rank-{rank}.jsonl"


class Checkpointer:
    """``rank``: this data-parallel replica's (0 for one replica); only rank 0 writes
    checkpoints, every rank reads them."""

    def __init__(self, config: CheckpointConfig, base_model: str, fingerprint: str,
                 rank: int = 0):
        self.config = config
        self.base_model = base_model
        self.fingerprint = fingerprint
        self.writer = rank == 0
        self.log_path = Path(config.root) / log_name(rank) if config.root else None
        self.store = CheckpointStore(config.root, config.keep) if config.root else None
        if self.store is not None and self.writer:
            self.store.clean_stale()  # what a crash mid-save left behind
        self.io_errors = 0
        self._unwritten: list[str] = []  # log lines the disk refused, oldest first
        self._save_failed = False
        self._retry_at = 0.0

    @property
    def blocked(self) -> bool:
        """A write failed and has not succeeded since: hold the backward."""
        return self._save_failed or bool(self._unwritten)

    def due(self, step: int, finished: bool) -> bool:
        """Periodically, and once the last epoch is trained."""
        return bool(self.config.root) and (step % self.config.every_steps == 0 or finished)

    def save(self, step: int, adapter: AdapterWeights, optimizer: OptimizerState,
             pool_state: dict) -> TrainingEvent | None:
        """Write a checkpoint of the committed state (rank 0 only); a failure becomes an
        event."""
        if self.store is None or not self.writer:
            return None
        try:
            path = self.store.save(step, adapter, optimizer, pool_state, self.base_model,
                                   self.fingerprint)
        except Exception as e:
            # RuntimeError, not OSError; whatever failed, the host's step must not see it
            self._save_failed = True
            return self._failed(f"checkpoint of step {step}", e)
        self._save_failed = False
        return CheckpointSaved(time.monotonic(), step, str(path))

    def log(self, event: TrainingEvent) -> TrainingEvent | None:
        """Append ``event`` to the training log (after any lines still unwritten)."""
        if self.log_path is None:
            return None
        self._unwritten.append(json.dumps(log_record(event)))
        return self._flush_log()

    def retry_due(self) -> bool:
        return self.blocked and time.monotonic() >= self._retry_at

    def flush(self) -> TrainingEvent | None:
        """Retry unwritten log lines (the caller retries a failed checkpoint by saving)."""
        return self._flush_log() if self._unwritten else None

    def resume(self, model: ModelConfig) -> Resumed | None:
        """``resume_from`` when given; else the newest usable checkpoint (``latest``, or the
        newest complete one when ``latest`` is missing or broken, said in ``reason``); None for
        a fresh start."""
        if self.store is None or not self.config.resume:
            return None
        if self.config.resume_from is not None:
            ck = read_checkpoint(self.config.resume_from, model)
            return Resumed(ck, f"resume_from={self.config.resume_from}", ())
        return self.store.resume(model)

    def restore(self, model: ModelConfig, lora: LoRAConfig, adapter: AdapterWeights,
                optimizer: OptimizerState) -> Checkpoint | None:
        """Load the checkpoint :meth:`resume` takes into ``adapter`` and ``optimizer``, once it
        is checked to be of this dataset and LoRA config; it is returned for its pool state and
        step (None: a fresh start, nothing changed)."""
        resumed = self.resume(model)
        if resumed is None:
            return None
        ck = resumed.checkpoint
        if resumed.passed_over:
            logger.warning("resume: %s (passed over: %s)", resumed.reason,
                           "; ".join(resumed.passed_over))
        require(ck.trainer_state["dataset_fingerprint"] == self.fingerprint, "resume",
                str(ck.path), "the checkpoint was made on another dataset or tokenization")
        require(ck.adapter.config == lora, "resume", str(ck.path),
                f"the checkpoint's LoRA config {ck.adapter.config} differs from {lora}")
        with torch.no_grad():
            adapter.flat.copy_(ck.adapter.flat)
        optimizer.load_state_dict_(ck.optimizer)
        return ck

    def _flush_log(self) -> TrainingEvent | None:
        assert self.log_path is not None
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as f:
                f.write("".join(line + "\n" for line in self._unwritten))
                f.flush()
        except OSError as e:
            return self._failed("training log", e)
        self._unwritten.clear()
        return None

    def _failed(self, what: str, error: Exception) -> TrainingIOError:
        self.io_errors += 1
        self._retry_at = time.monotonic() + self.config.retry_s
        return TrainingIOError(time.monotonic(), what, f"{type(error).__name__}: {error}")
