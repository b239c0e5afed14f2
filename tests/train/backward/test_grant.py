"""The grant flag between host and backward process."""

import os
import signal
import threading
import time

import torch.multiprocessing as mp

from deltaserve.train.backward.grant import Grant


def _wait_then_report(grant, woke):
    woke.value = 2  # started: about to wait
    grant.wait()
    woke.value = 1


def _start_waiter():
    """A process waiting on a cleared grant; ``woke`` turns 1 once its wait returns."""
    ctx = mp.get_context("spawn")
    grant = Grant(ctx)
    grant.clear()
    woke = ctx.Value("b", 0, lock=False)
    proc = ctx.Process(target=_wait_then_report, args=(grant, woke), daemon=True)
    proc.start()
    deadline = time.monotonic() + 120  # a spawned interpreter's start-up, on a loaded machine
    while woke.value != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the child is inside wait()
    return grant, woke, proc


def test_waiter_in_another_process_resumes_on_set():
    grant, woke, proc = _start_waiter()
    assert woke.value == 2 and proc.is_alive()  # cleared: it waits
    grant.set()
    proc.join(60)
    assert woke.value == 1 and proc.exitcode == 0


def test_set_returns_after_a_waiter_was_killed():
    # multiprocessing.Event.set() blocks forever here: it waits for the dead waiter to
    # acknowledge its wake-up. A backward killed while paused must not hang the host.
    grant, woke, proc = _start_waiter()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)
    returned = threading.Event()
    threading.Thread(target=lambda: (grant.set(), grant.clear(), grant.set(), returned.set()),
                     daemon=True).start()
    assert returned.wait(5), "set() hung after its waiter died"
    assert grant.is_set() and woke.value == 2  # it never woke


def test_wait_times_out_while_cleared():
    grant = Grant(mp.get_context("spawn"))
    assert grant.wait(timeout_s=0.0)
    grant.clear()
    t = time.monotonic()
    assert not grant.wait(timeout_s=0.05)
    assert time.monotonic() - t >= 0.05


def test_a_deadline_admits_only_layers_that_end_by_it():
    grant = Grant(mp.get_context("spawn"))
    assert grant.admits(1e6)  # set without a deadline: any layer
    grant.set(until_s=time.monotonic() + 0.5)
    assert grant.admits(0.0) and grant.admits(0.1) and not grant.admits(5.0)
    t = time.monotonic()
    assert not grant.wait(timeout_s=0.05, layer_s=5.0)  # a layer that would overrun waits
    assert time.monotonic() - t >= 0.05
    grant.clear()
    assert not grant.admits(0.0)
    grant.set()  # the deadline goes with the next set
    assert grant.admits(1e6)


def _switches(pid: int) -> int:
    """Voluntary context switches of ``pid`` so far (Linux): one per sleep the process took."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f
                    if line.startswith("voluntary_ctxt_switches"))


def test_a_paused_waiter_sleeps_until_a_set_instead_of_polling():
    """A waiter polling every 0.2 ms (the grant before) took ~5000 sleeps a second, each a time
    slice taken from the host's threads; a waiting backward now takes none until woken."""
    grant, woke, proc = _start_waiter()
    before = _switches(proc.pid)
    time.sleep(0.5)
    assert _switches(proc.pid) - before < 20 and woke.value == 2
    grant.set()
    grant.clear()  # woken, not admitted any more: it sleeps again, still without polling
    time.sleep(0.2)
    before = _switches(proc.pid)
    time.sleep(0.5)
    assert _switches(proc.pid) - before < 20 and woke.value == 2
    for _ in range(100_000):  # far more wake-ups than the pipe holds: set() never blocks
        grant.clear()
        grant.set()
    proc.join(60)
    assert woke.value == 1 and proc.exitcode == 0
