"""Fault: a crash between any two steps of a checkpoint save (the issue's "crash between rmtree
and rename" and every other point). What survives: resume takes the newest complete checkpoint,
whose adapter, optimizer state and trainer_state agree; never an older one once a newer one was
complete; after ``clean_stale`` nothing temporary is left and saving works again.

A crash is simulated at the k-th filesystem mutation of a save, for every k: the root is copied
at that instant (what a killed process leaves on disk) and the save is aborted. The mutations
counted are every call that changes the disk: mkdir, file writes (open for writing,
``Path.write_text``, ``torch.save``, safetensors' ``save_file``), fsync, rename, replace,
unlink, rmdir (so a crash inside ``rmtree`` is one too)."""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import shutil
from pathlib import Path

import pytest
import torch

from deltaserve.model import peft_io
from deltaserve.train.checkpoint_store import CheckpointStore
from tests.faults.states import MODEL, assert_consistent, run_of, save_step


class Crash(BaseException):
    """Not an Exception: no handler in the code under test may swallow it."""


def _opens_for_writing(args: tuple, kwargs: dict) -> bool:
    mode = kwargs.get("mode", args[1] if len(args) > 1 else "r")
    return any(c in mode for c in "wax+")


class CrashAt:
    """Counts disk mutations; at the ``at``-th, copies ``root`` to ``image`` and raises."""

    def __init__(self, root: Path, image: Path, at: int | None):
        self.root, self.image, self.at = root, image, at
        self.count = 0
        self.crashed = False

    def install(self, mp: pytest.MonkeyPatch) -> None:
        for owner, name in ((os, "mkdir"), (os, "fsync"), (os, "rename"), (os, "replace"),
                            (os, "unlink"), (os, "rmdir"), (torch, "save"),
                            (peft_io, "save_file"), (Path, "write_text"), (builtins, "open"),
                            (io, "open")):
            mp.setattr(owner, name, self._wrap(getattr(owner, name), name))

    def _wrap(self, fn, name):
        def wrapper(*args, **kwargs):
            if self.crashed or (name == "open" and not _opens_for_writing(args, kwargs)):
                return fn(*args, **kwargs)  # after the crash: only the copy and the unwinding
            if self.count == self.at:
                self.crashed = True
                shutil.copytree(self.root, self.image, symlinks=True)
                raise Crash(f"before {name} (mutation {self.count})")
            self.count += 1
            return fn(*args, **kwargs)
        return wrapper


def _scenario(name: str, root: Path) -> tuple[int, int, set[tuple[int, int]]]:
    """Fill ``root``; returns (step, run) the save under test writes and the (run, step) states
    a resume may rightly give at any crash point."""
    store = CheckpointStore(root, keep=2)
    if name == "new step":
        for s in (1, 2):
            save_step(store, s)
        return 3, 0, {(0, 2), (0, 3)}
    if name == "same step again":  # close() right after a periodic checkpoint
        for s in (2, 3):
            save_step(store, s)
        return 3, 0, {(0, 3)}
    if name == "same step over a broken one":
        save_step(store, 3)
        save_step(store, 2)
        weights = root / "checkpoint-000003" / peft_io.WEIGHTS_NAME
        weights.write_bytes(weights.read_bytes()[:100])
        return 3, 0, {(0, 2), (0, 3)}
    if name == "same step, an earlier run's":
        save_step(store, 3, run=1)  # left by an earlier run, then a fresh run (resume off)
        save_step(store, 2)
        return 3, 0, {(0, 2), (0, 3)}
    raise AssertionError(name)


SCENARIOS = ["new step", "same step again", "same step over a broken one",
             "same step, an earlier run's"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_crash_at_every_point_of_a_save_leaves_a_consistent_newest(tmp_path, scenario):
    template = tmp_path / "template"
    step, run, allowed = _scenario(scenario, template)

    def attempt(k: int | None) -> tuple[Path, CrashAt]:
        root, image = tmp_path / f"root-{k}", tmp_path / f"image-{k}"
        shutil.copytree(template, root)
        crash = CrashAt(root, image, k)
        with pytest.MonkeyPatch.context() as mp:
            crash.install(mp)
            with contextlib.suppress(Crash):
                save_step(CheckpointStore(root, keep=2), step, run)
        return (image if crash.crashed else root), crash

    _, full = attempt(None)
    assert full.count >= 12  # the save is the multi-step sequence the module documents
    taken = []
    for k in range(full.count + 1):
        disk, crash = attempt(k)
        assert crash.crashed == (k < full.count)
        store = CheckpointStore(disk, keep=2)
        resumed = store.resume(MODEL)
        assert resumed is not None, f"crash at mutation {k}: nothing to resume"
        ck = resumed.checkpoint
        assert (run_of(ck), ck.step) in allowed, f"crash at mutation {k}: took {ck.path.name}"
        assert_consistent(ck)
        taken.append((run_of(ck), ck.step))
        # what a crash left is cleaned at the next start, and saving works again
        store.clean_stale()
        assert not [p for p in disk.iterdir() if p.name.startswith(".tmp-")]
        save_step(store, step, run)
        again = store.resume(MODEL)
        assert (run_of(again.checkpoint), again.checkpoint.step) == (run, step)
        assert again.reason == "latest"
        assert_consistent(again.checkpoint)
        shutil.rmtree(disk)
    assert taken[-1] == (run, step)  # no crash: the new checkpoint
    # once the new checkpoint was complete and named, no later crash point loses it
    first_new = taken.index((run, step))
    assert all(t == (run, step) for t in taken[first_new:]), taken
