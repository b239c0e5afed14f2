"""A full disk under the training log and the checkpoints (a real 512 KiB tmpfs, filled): every
client request still finishes, training pauses (no more optimizer steps than the one in flight),
and once space returns it resumes, writes what it could not, and trains every sample once."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest

from deltaserve.core.requests import SamplingParams
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.native import EngineConfig, LLMEngine
from deltaserve.model import LoRAConfig
from deltaserve.train.checkpoint_store import CheckpointConfig, find_latest
from deltaserve.train.config import BackwardConfig, CoServeConfig
from deltaserve.train.events import OptimizerStep, TrainingIOError
from tests.hosts.native.test_engine import prompts
from tests.tiny import hf_tiny_llama
from tests.train import fixtures as fx


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(disk: Path) -> Path:
    """Write until the disk refuses; returns the filler file."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError:
            pass
    return filler


def test_full_disk_pauses_training_never_inference(tmp_path, small_disk):
    path = tmp_path / "tiny"
    hf_tiny_llama(seed=3).save_pretrained(path)
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=16,
                                 max_num_batched_tokens=128, block_size=8,
                                 kv_cache_tokens=4096, max_model_len=256))
    root = small_disk / "ck"
    co = eng.attach(CoServeConfig(SLOConfig(5.0, 5.0), lora=LoRAConfig(r=4, alpha=8),
                                  backward=BackwardConfig(batch_tokens=64),
                                  checkpoint=CheckpointConfig(root=str(root), every_steps=1,
                                                              retry_s=0.2)),
                    dataset=fx.samples(40), latency_model=fx.latency_model(), progress=False)
    rec = fx.Recorder(co)
    filler = fill(small_disk)
    stop = threading.Event()
    loop = threading.Thread(target=eng.run_loop, args=(stop,), daemon=True)
    loop.start()
    try:
        ids = [eng.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
               for p in prompts(30, seed=9)]
        deadline = time.monotonic() + 120
        while (eng.has_unfinished() or not any(isinstance(e, TrainingIOError)
                                               for e in rec.events)) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        outs = [eng.pop_finished(i) for i in ids]
        assert [len(o.output_token_ids) for o in outs] == [8] * 30  # inference unharmed
        assert co.stats().io_errors > 0
        first_error = next(i for i, e in enumerate(rec.events)
                           if isinstance(e, TrainingIOError))
        time.sleep(2.0)  # the disk is still full: training holds (the job in flight may land)
        after = [e for e in rec.events[first_error:] if isinstance(e, OptimizerStep)]
        assert len(after) <= 1, "training went on while nothing could be written"
        filler.unlink()  # space returns
        while co.stats().ft_samples_committed < 40 and time.monotonic() < deadline + 120:
            time.sleep(0.05)
    finally:
        stop.set()
        loop.join()
        eng.detach(drain=True, checkpoint=True)
    assert sorted(rec.committed_ids) == list(range(40))  # every sample once, none lost
    latest = find_latest(root)
    assert latest is not None and int(latest.name.split("-")[1]) == len(rec.steps)
    logged = (root / "train_log.jsonl").read_text().count('"OptimizerStep"')
    assert logged == len(rec.steps)  # the lines it could not write were written later
