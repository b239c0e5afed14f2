"""Exactly once, end to end: a co-serving host process is SIGKILLed three times during its
epochs and restarted from its checkpoints each time. Along the surviving lineage of optimizer
steps (each life's steps from the step it resumed at, up to where the next life resumed), every
sample is committed exactly once per epoch, and the final checkpoint's pool ledger agrees."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.faults.host_run import NUM_EPOCHS, NUM_SAMPLES
from tests.tiny import hf_tiny_llama

KILLS = 3
ROOT = Path(__file__).resolve().parents[2]


def steps_of(out: Path, run: int) -> list[dict]:
    path = out / f"steps-{run}.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def life(model: Path, out: Path, run: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    return subprocess.Popen([sys.executable, "-m", "tests.faults.host_run", str(model),
                             str(out), str(run)], cwd=ROOT, env=env)


def test_host_killed_three_times_trains_every_sample_once_per_epoch(tmp_path):
    model = tmp_path / "tiny"
    hf_tiny_llama(seed=5).save_pretrained(model)
    out = tmp_path / "out"
    out.mkdir()
    for run in range(KILLS):  # each life is killed after it commits a few steps of its own
        proc = life(model, out, run)
        deadline = time.monotonic() + 300
        while len(steps_of(out, run)) < 2 + run and time.monotonic() < deadline:
            assert proc.poll() is None, f"life {run} exited with {proc.returncode}"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    last = life(model, out, KILLS)
    assert last.wait(600) == 0 and (out / f"done-{KILLS}").is_file()

    resumed = [json.loads((out / f"start-{r}.json").read_text())["resumed_step"]
               for r in range(KILLS + 1)]
    assert resumed[0] == 0 and all(b >= a for a, b in itertools.pairwise(resumed))
    assert resumed[-1] > 0  # the lives did continue one another
    lineage: list[dict] = []
    for run in range(KILLS + 1):
        end = resumed[run + 1] if run < KILLS else None
        lineage += [s for s in steps_of(out, run)
                    if s["step"] >= resumed[run] and (end is None or s["step"] < end)]
    assert [s["step"] for s in lineage] == list(range(len(lineage)))  # no gap, no repeat
    for epoch in range(NUM_EPOCHS):
        ids = [i for s in lineage if s["epoch"] == epoch for i in s["sample_ids"]]
        assert sorted(ids) == list(range(NUM_SAMPLES)), f"epoch {epoch}"

    ck = out / "ck"
    latest = ck / (ck / "latest").read_text().strip()
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["step"] == len(lineage)
    assert state["pool"]["epoch"] == NUM_EPOCHS  # the ledger: every epoch finished
    assert state["pool"]["samples_committed_total"] == NUM_SAMPLES * NUM_EPOCHS
