"""One validation pass before anything heavy runs (a model load, a calibration, a server),
shared by ``bench``, ``calibrate``, ``serve`` and ``attach``: each error names the field and the
value. Configs check themselves when they are built; this checks what they point at."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from deltaserve.core.data import DataConfig, DatasetReport, TrainingSample, load_dataset
from deltaserve.core.errors import InputError
from deltaserve.core.latency_model import LatencyModel
from deltaserve.core.tokenizer import Tokenizer

logger = logging.getLogger("deltaserve")


@dataclass(frozen=True)
class Checked:
    """What the pass read: the tokenized dataset and its report, the latency model."""

    samples: list[TrainingSample] | None = None
    report: DatasetReport | None = None
    latency_model: LatencyModel | None = None


def writable_dir(path: str | os.PathLike, field: str) -> Path:
    """``path`` exists as a directory this process can write (created if missing)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InputError(field, str(path), "exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        # per thread: replicas in one process check their shared root concurrently
        probe = p / f".deltaserve-write-check-{os.getpid()}-{threading.get_ident()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise InputError(field, str(path), f"is not writable: {e.strerror or e}") from None
    return p


def writable_file(path: str | os.PathLike, field: str) -> Path:
    """A file this process can create or replace at ``path``."""
    p = Path(path)
    if p.is_dir():
        raise InputError(field, str(path), "is a directory; give a file path")
    writable_dir(p.parent if str(p.parent) else ".", field)
    return p


def preflight(*, dataset: DataConfig | None = None, tokenizer: Tokenizer | None = None,
              latency_model: str | os.PathLike | None = None,
              checkpoint_dir: str | os.PathLike | None = None) -> Checked:
    """Parse and tokenize every dataset row (over-long ones counted and logged), load and check
    the latency-model file, check the checkpoint directory is writable."""
    if checkpoint_dir is not None:
        writable_dir(checkpoint_dir, "checkpoint_dir")
    lm = LatencyModel.load(latency_model) if latency_model is not None else None
    samples = report = None
    if dataset is not None:
        if tokenizer is None:
            raise InputError("dataset", dataset.path, "tokenizing needs the model's tokenizer")
        samples, report = load_dataset(dataset, tokenizer)
        if report.num_dropped_overlength or report.num_bad_rows or report.num_dropped_no_loss:
            logger.warning("dataset %s: %d samples; dropped %d longer than %d tokens, %d with "
                           "no response tokens; skipped %d bad rows", dataset.path,
                           report.num_samples, report.num_dropped_overlength, dataset.max_tokens,
                           report.num_dropped_no_loss, report.num_bad_rows)
    return Checked(samples, report, lm)
