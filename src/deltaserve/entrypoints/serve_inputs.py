"""What ``deltaserve serve --engine vllm|sglang`` checks before its engine starts: the dataset,
row by row, and a checkpoint directory it can write (a fresh one when none is given, so no
training is discarded at shutdown). Each error names the flag and the value."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

from deltaserve.core.data import DataConfig, load_dataset
from deltaserve.core.errors import InputError
from deltaserve.core.tokenizer import Tokenizer
from deltaserve.train.checkpoint_store import CheckpointConfig

DATASET_FLAG = "--finetune-dataset"


def checked_dataset(data: DataConfig, tokenizer: Tokenizer, flag: str = DATASET_FLAG) -> int:
    """Parse and tokenize every row now (an error names the line, and the row's field); report
    what is dropped. Returns the number of usable samples (at least one)."""
    path = data.path or ""
    try:
        samples, report = load_dataset(data, tokenizer)
    except OSError as e:
        raise InputError(flag, path, f"cannot read it: {e}") from e
    except InputError as e:  # the row's line (and record) stay in the message
        reason = e.reason if e.line is None else f"{e.field}={e.value!r}: {e.reason}"
        raise InputError(flag, path, reason, line=e.line, record=e.record) from e
    if not samples:
        raise InputError(flag, path, f"no usable sample: {report.summary()}")
    print(f"deltaserve: dataset {path}: {report.summary()}", file=sys.stderr, flush=True)
    return len(samples)


def writable_checkpoint(checkpoint: CheckpointConfig, flag: str, parent: Path
                        ) -> CheckpointConfig:
    """``checkpoint`` with its directory made, absolute and known writable; without one, a fresh
    directory under ``parent`` (announced, with the flag that resumes from it)."""
    root = checkpoint.root
    if root is None:
        root = str(parent / time.strftime("checkpoints-%Y%m%d-%H%M%S"))
        print(f"deltaserve: WARNING: no {flag} given: training is checkpointed under {root} "
              f"(pass {flag} {root} to resume it)", file=sys.stderr, flush=True)
    path = Path(root).resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".deltaserve-write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise InputError(flag, root, f"not a writable directory: {e}") from e
    return replace(checkpoint, root=str(path))
