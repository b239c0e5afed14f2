"""Fault: SIGKILL of a real process in the middle of writing a checkpoint. The child saves step
1, then step 2 with its fsync made slow at a known point; the test kills it there. What
survives: the previous checkpoint, intact and loadable; the temporary leftovers are removed by
``clean_stale`` at the next start, and saving works again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deltaserve.train.checkpoint_store import OPTIMIZER_NAME, CheckpointStore
from tests.faults.states import MODEL, assert_consistent, save_step

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from deltaserve.train.checkpoint_store import CheckpointStore
    from tests.faults.states import save_step

    root, marker, stall_on = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    store = CheckpointStore(root, keep=2)
    save_step(store, 1)
    real_fsync = os.fsync

    def slow_fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(stall_on):
            marker.write_text(path)  # at the kill point: the parent kills us here
            time.sleep(600)
        real_fsync(fd)

    os.fsync = slow_fsync
    save_step(store, 2)
    marker.write_text("finished")
""")


def _kill_at(tmp_path: Path, stall_on: str) -> tuple[Path, str]:
    root, marker = tmp_path / "ck", tmp_path / "at-kill-point"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(marker), stall_on],
                             cwd=REPO, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"the child never reached {stall_on}: " + (
            child.stderr.read().decode() if child.poll() is not None else "timed out")
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stderr.close()
    return root, marker.read_text()


@pytest.mark.parametrize("stall_on,stale", [
    # mid-write: every file of step 2 written into its temp dir, not yet renamed
    (OPTIMIZER_NAME, ".tmp-checkpoint-000002-"),
    # step 2 renamed into place, ``latest`` not yet replaced
    (".tmp-latest", ".tmp-latest"),
])
def test_sigkill_mid_checkpoint_keeps_the_previous_one(tmp_path, stall_on, stale):
    root, killed_at = _kill_at(tmp_path, stall_on)
    assert killed_at.endswith(stall_on)
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1 and leftovers[0].startswith(stale)

    store = CheckpointStore(root, keep=2)  # the next start
    resumed = store.resume(MODEL)
    assert (resumed.checkpoint.step, resumed.reason) == (1, "latest")
    assert_consistent(resumed.checkpoint)
    assert [p.name for p in store.clean_stale()] == leftovers
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert store.resume(MODEL).checkpoint.step == 1
    save_step(store, 2)  # and training goes on
    again = store.resume(MODEL)
    assert (again.checkpoint.step, again.reason) == (2, "latest")
    assert_consistent(again.checkpoint)
