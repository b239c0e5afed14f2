"""Checkpoints: the adapter in PEFT's format, the optimizer state and the data-loader progress.

Layout under the checkpoint root::

    checkpoint-000050/adapter_config.json        PEFT: loads in peft, transformers, vLLM
    checkpoint-000050/adapter_model.safetensors
    checkpoint-000050/optimizer.pt               AdamW moments and step
    checkpoint-000050/trainer_state.json         step, pool progress, dataset fingerprint
    latest                                       name of the checkpoint to resume from
    train_log.jsonl                              one line per optimizer step

Invariants of :class:`CheckpointStore`, so that a crash at any instant loses no step a complete
checkpoint held:

* a checkpoint is written into ``.tmp-checkpoint-*``, every file and the directory fsynced, then
  renamed into place; ``latest`` is replaced last (temp file, fsync, ``os.replace``, fsync of the
  root), so it only ever names a complete checkpoint;
* saving a step that exists never removes it first: an equal checkpoint is kept, a different or
  broken one is moved aside (to a ``.tmp-`` name) only once the new one is complete;
* "newest" is the most recently written (``written_at``, then step), not the highest step (an
  earlier run may have left higher ones); pruning keeps the newest ``keep``, always the new one;
* resume takes ``latest`` when usable, else the newest usable checkpoint, and says which and why;
  with none usable it is an :class:`InputError`, never a raw exception or a silent fresh start;
* ``clean_stale`` removes the ``.tmp-*`` leftovers of a crash at start-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from safetensors.torch import load_file

from deltaserve.core.data import TrainingSample
from deltaserve.core.durable import fsync_dir, fsync_file
from deltaserve.core.errors import InputError, require
from deltaserve.core.jsontypes import JsonObject
from deltaserve.core.pool import SamplePool
from deltaserve.model.config import ModelConfig
from deltaserve.model.lora import AdapterWeights
from deltaserve.model.peft_io import CONFIG_NAME, WEIGHTS_NAME, load_adapter, save_adapter
from deltaserve.train.optim import OptimizerState

FORMAT = "deltaserve.checkpoint/1"
OPTIMIZER_NAME = "optimizer.pt"
STATE_NAME = "trainer_state.json"
LATEST = "latest"
FILES = (CONFIG_NAME, WEIGHTS_NAME, OPTIMIZER_NAME, STATE_NAME)
TMP_PREFIX = ".tmp-"  # every temporary name in the root starts so; clean_stale removes them
_NAME = re.compile(r"checkpoint-\d{6,}")
_T = TypeVar("_T")
logger = logging.getLogger("deltaserve.checkpoint")


@dataclass(frozen=True)
class CheckpointConfig:
    """``root`` None disables checkpoints. ``every_steps``: optimizer steps between two.
    ``retry_s``: after a failed write (a full disk), seconds before the next attempt; training
    waits meanwhile. ``resume_from``: resume from exactly this checkpoint directory, whatever
    else ``root`` holds (a caller that recorded which checkpoints it saw; newer ones are written
    over as training reaches their steps again). A damaged one is an :class:`InputError`."""

    root: str | None = field(default=None, metadata={"flag": "dir"})
    every_steps: int = 50
    keep: int = 2
    resume: bool = True
    retry_s: float = 5.0
    resume_from: str | None = None

    def __post_init__(self) -> None:
        require(self.every_steps >= 1, "checkpoint_every", self.every_steps, "must be >= 1")
        require(self.keep >= 1, "keep_checkpoints", self.keep, "must be >= 1")
        require(self.retry_s > 0, "checkpoint_retry_s", self.retry_s, "must be > 0")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    adapter: AdapterWeights
    optimizer: dict[str, torch.Tensor]
    trainer_state: JsonObject


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a resume took, and why that one (``reason``: "latest", or what was wrong
    with ``latest`` and which one was taken instead). ``passed_over``: each newer checkpoint
    not taken, with what was wrong with it."""

    checkpoint: Checkpoint
    reason: str
    passed_over: tuple[str, ...]


def dataset_fingerprint(samples: Sequence[TrainingSample]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(len(s.input_ids).to_bytes(4, "little"))
        h.update(bytes(str(s.input_ids[:8] + s.labels[-8:]), "ascii"))
    return h.hexdigest()[:16]


class CheckpointStore:
    """The checkpoints under ``root`` (one writer at a time); see the module docstring."""

    def __init__(self, root: str | os.PathLike, keep: int = 2):
        require(keep >= 1, "keep_checkpoints", keep, "must be >= 1")
        self.root = Path(root)
        self.keep = keep

    # ---- writing ----------------------------------------------------------------------------
    def save(self, step: int, adapter: AdapterWeights, optimizer: OptimizerState,
             pool_state: dict, base_model: str, fingerprint: str) -> Path:
        """Write the state as of optimizer step ``step``; returns its directory."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"checkpoint-{step:06d}"
        tmp = self.root / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)  # this process's own failed attempt
        state = {"format": FORMAT, "step": step, "pool": pool_state, "base_model": base_model,
                 "dataset_fingerprint": fingerprint, "written_at": time.time()}
        try:
            _write_files(tmp, adapter, optimizer, state, base_model)
            self._move_into_place(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone once moved; frees a full disk if not
        self._point_latest(final)
        self._prune(final)
        return final

    def _move_into_place(self, tmp: Path, final: Path) -> None:
        if not final.exists():
            os.rename(tmp, final)
            fsync_dir(self.root)
        elif _same_state(final, tmp):  # the same step again (shutdown after a periodic save)
            # it already holds this committed state, complete: keep it, refreshed so that it
            # counts as the newest (one atomic replace of its trainer_state)
            os.replace(tmp / STATE_NAME, final / STATE_NAME)
            fsync_dir(final)
        else:  # an earlier run's, or broken: moved aside only now that tmp is complete
            aside = self.root / f"{TMP_PREFIX}{final.name}-{os.getpid()}-replaced"
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(final, aside)
            os.rename(tmp, final)
            fsync_dir(self.root)
            shutil.rmtree(aside, ignore_errors=True)

    def _point_latest(self, final: Path) -> None:
        tmp = self.root / f"{TMP_PREFIX}{LATEST}"
        with open(tmp, "w") as f:
            f.write(final.name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / LATEST)
        fsync_dir(self.root)

    def _prune(self, just_written: Path) -> None:
        older = [p for p in self.newest_first() if p != just_written]
        for old in older[self.keep - 1:]:
            shutil.rmtree(old, ignore_errors=True)
        fsync_dir(self.root)

    def clean_stale(self) -> list[Path]:
        """Remove what a crash mid-save left (``.tmp-*``); call at start-up, before saving."""
        if not self.root.is_dir():
            return []
        stale = sorted(p for p in self.root.iterdir() if p.name.startswith(TMP_PREFIX))
        for p in stale:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        if stale:
            fsync_dir(self.root)
        return stale

    # ---- reading ----------------------------------------------------------------------------
    def newest_first(self) -> list[Path]:
        """Checkpoint directories, most recently written first; incomplete ones (a file
        missing, trainer_state unreadable) last, so pruning removes them first."""
        if not self.root.exists():
            return []
        try:
            dirs = [p for p in self.root.iterdir() if _NAME.fullmatch(p.name) and p.is_dir()]
        except OSError as e:
            raise InputError("checkpoint_dir", str(self.root), f"cannot be listed: {e}") from e
        return sorted(dirs, key=_written_key, reverse=True)

    def _named(self) -> tuple[Path | None, str]:
        """The existing directory ``latest`` names (not yet checked), or None and why not."""
        try:
            name = (self.root / LATEST).read_text().strip()
        except FileNotFoundError:
            return None, "latest is missing"
        except (OSError, UnicodeDecodeError) as e:
            return None, f"latest is unreadable ({e})"
        if not _NAME.fullmatch(name):
            return None, f"latest is corrupt (it holds {name[:40]!r})"
        if not (self.root / name).is_dir():
            return None, f"latest names {name}, which does not exist"
        return self.root / name, "latest"

    def _candidates(self) -> tuple[list[Path], Path | None, str]:
        """Checkpoints in the order a resume tries them: ``latest``'s first, then newest first."""
        named, why = self._named()
        rest = [p for p in self.newest_first() if p != named]
        return ([named] if named else []) + rest, named, why

    def find_latest(self) -> Path | None:
        """The checkpoint a resume would try first, checking files but not loading tensors."""
        for path in self._candidates()[0]:
            try:
                _check_complete(path)
                return path
            except InputError:
                continue
        return None

    def resume(self, model: ModelConfig) -> Resumed | None:
        """The newest usable checkpoint (``latest`` first); None when the root holds no
        checkpoint at all (a fresh start). Raises :class:`InputError` naming the root when
        there are checkpoints but none is usable."""
        require(not self.root.exists() or self.root.is_dir(), "checkpoint_dir", str(self.root),
                "is not a directory")
        candidates, named, why = self._candidates()
        if not candidates and why == "latest is missing":
            return None
        passed: list[str] = []
        for path in candidates:
            try:
                ck = read_checkpoint(path, model)
            except InputError as e:
                passed.append(f"{path.name}: {e.reason}")
                if path == named:
                    why = f"latest names {path.name}, which is unusable ({e.reason})"
                continue
            reason = "latest" if path == named else f"{why}; took {path.name}"
            if reason != "latest":
                logger.warning("resuming from %s: %s%s", path, reason,
                               "".join(f"; passed over {p}" for p in passed))
            return Resumed(ck, reason, tuple(passed))
        problems = passed if named is not None else [why, *passed]  # why repeats passed[0]
        raise InputError("checkpoint_dir", str(self.root),
                         f"holds no usable checkpoint ({'; '.join(problems)}): move it away, "
                         "or start afresh with resume off")


def find_latest(root: str | os.PathLike) -> Path | None:
    """The checkpoint under ``root`` that a resume would take first (files checked)."""
    return CheckpointStore(root).find_latest()


def read_checkpoint(path: str | os.PathLike, model: ModelConfig) -> Checkpoint:
    """Load and check one checkpoint: any damage (a missing or truncated file, a trainer_state
    without a step, an optimizer state that disagrees with it) is an :class:`InputError`
    naming the directory."""
    path = Path(path)
    state = _check_complete(path)
    adapter = _guarded(path, WEIGHTS_NAME, lambda: load_adapter(path, model))
    opt = _guarded(path, OPTIMIZER_NAME, lambda: torch.load(
        path / OPTIMIZER_NAME, map_location="cpu", weights_only=True))
    _check_optimizer(path, opt, adapter.numel, state["step"])
    return Checkpoint(path, state["step"], adapter, opt, state)


# ---- internals -------------------------------------------------------------------------------
def _write_files(tmp: Path, adapter: AdapterWeights, optimizer: OptimizerState,
                 state: JsonObject, base_model: str) -> None:
    tmp.mkdir()
    save_adapter(tmp, adapter, base_model)
    torch.save(optimizer.state_dict(), tmp / OPTIMIZER_NAME)
    (tmp / STATE_NAME).write_text(json.dumps(state))
    for name in FILES:
        fsync_file(tmp / name)
    fsync_dir(tmp)


def _read_state(path: Path) -> JsonObject:
    try:
        state = json.loads((path / STATE_NAME).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError("checkpoint", str(path), f"unreadable {STATE_NAME}: {e}") from e
    require(isinstance(state, dict) and state.get("format") == FORMAT, "checkpoint", str(path),
            f"{STATE_NAME} is not a DeltaServe checkpoint's (format {FORMAT})")
    step = state.get("step")
    require(isinstance(step, int) and not isinstance(step, bool) and step >= 0, "checkpoint",
            str(path), f"{STATE_NAME} holds no valid step ({step!r})")
    require(isinstance(state.get("dataset_fingerprint"), str), "checkpoint", str(path),
            f"{STATE_NAME} holds no dataset_fingerprint")
    try:
        SamplePool.check_state(state.get("pool"))
    except InputError as e:
        raise InputError("checkpoint", str(path), f"{STATE_NAME}: {e}") from e
    return state


def _check_complete(path: Path) -> JsonObject:
    """Every file present and the trainer_state valid; returns the trainer_state."""
    missing = [name for name in FILES if not (path / name).is_file()]
    require(not missing, "checkpoint", str(path), f"incomplete: no {', '.join(missing)}")
    return _read_state(path)


def _written_key(path: Path) -> tuple[float, int]:
    """(written_at, step); written_at is -inf for an incomplete checkpoint. Cheap: no tensor is
    read."""
    step = int(path.name.split("-")[1])
    try:
        written = _check_complete(path).get("written_at")
    except InputError:
        written = None
    ok = isinstance(written, int | float) and math.isfinite(written)
    return (float(written) if ok else -math.inf), step


def _guarded(path: Path, what: str, load: Callable[[], _T]) -> _T:
    """``load()``, with any failure an :class:`InputError` naming the directory: a truncated
    or garbled file makes the parsers (safetensors, torch's unpickler and zip reader) raise
    exceptions of many types."""
    try:
        return load()
    except InputError as e:
        raise InputError("checkpoint", str(path), f"{what}: {e}") from e
    except Exception as e:  # see the docstring
        first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
        raise InputError("checkpoint", str(path), f"unreadable {what} (truncated or corrupt): "
                         f"{type(e).__name__}: {first[:100]}") from e


def _check_optimizer(path: Path, opt: object, numel: int, step: int) -> None:
    """The optimizer state fits the adapter and agrees with the trainer_state's step (AdamW
    counts one step per committed optimizer step): a mismatch means the files were written at
    different moments, so the checkpoint would train some samples twice."""
    ok = isinstance(opt, dict) and all(
        isinstance(opt.get(k), torch.Tensor) and opt[k].numel() == n
        for k, n in (("exp_avg", numel), ("exp_avg_sq", numel), ("step", 1)))
    require(ok, "checkpoint", str(path), f"{OPTIMIZER_NAME} does not hold AdamW moments of "
            f"{numel} values and a step")
    adam_step = int(opt["step"].item())
    require(adam_step == step, "checkpoint", str(path), f"{OPTIMIZER_NAME} is at step "
            f"{adam_step} but {STATE_NAME} at step {step}: written at different moments")


def _same_state(existing: Path, new: Path) -> bool:
    """``existing`` is complete and holds what ``new`` holds (its written_at aside)."""
    def content(p: Path) -> tuple[JsonObject, bytes, object, object]:
        state = dict(_check_complete(p))
        state.pop("written_at", None)
        tensors = _guarded(p, WEIGHTS_NAME, lambda: load_file(str(p / WEIGHTS_NAME)))
        opt = _guarded(p, OPTIMIZER_NAME, lambda: torch.load(
            p / OPTIMIZER_NAME, map_location="cpu", weights_only=True))
        return state, (p / CONFIG_NAME).read_bytes(), tensors, opt

    try:
        a, b = content(existing), content(new)
    except (InputError, OSError):
        return False
    return a[:2] == b[:2] and _equal_tensors(a[2], b[2]) and _equal_tensors(a[3], b[3])


def _equal_tensors(x: object, y: object) -> bool:
    return (isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys()
            and all(isinstance(x[k], torch.Tensor) and isinstance(y[k], torch.Tensor)
                    and x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x))
