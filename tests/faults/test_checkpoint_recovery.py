"""Faults found on disk at resume: ``latest`` dangling, missing or corrupt; higher-numbered
checkpoints left by an earlier run; a corrupt checkpoint in each form. What survives: the newest
complete checkpoint (adapter, optimizer and trainer_state agreeing), and resume says which it
took and why; with none usable, an InputError naming the directory, never a raw exception and
never a silent fresh start."""

from __future__ import annotations

import json

import pytest
import torch

from deltaserve.core import InputError
from deltaserve.model.peft_io import CONFIG_NAME, WEIGHTS_NAME
from deltaserve.train.checkpoint_store import OPTIMIZER_NAME, STATE_NAME, CheckpointStore
from tests.faults.states import MODEL, assert_consistent, run_of, save_step


def _store(tmp_path, steps=(1, 2, 3), keep=3) -> CheckpointStore:
    store = CheckpointStore(tmp_path / "ck", keep=keep)
    for s in steps:
        save_step(store, s)
    return store


# ---- latest dangling, missing, corrupt -------------------------------------------------------
@pytest.mark.parametrize("pointer,why", [
    ("checkpoint-000009", "latest names checkpoint-000009, which does not exist"),
    (None, "latest is missing"),
    ("", "latest is corrupt"),
    ("../../etc", "latest is corrupt"),
    (b"\xff\xfe\x00", "latest is unreadable"),
])
def test_latest_dangling_or_broken_takes_the_newest_complete(tmp_path, pointer, why):
    store = _store(tmp_path)
    latest = store.root / "latest"
    if pointer is None:
        latest.unlink()
    elif isinstance(pointer, bytes):
        latest.write_bytes(pointer)
    else:
        latest.write_text(pointer)
    resumed = store.resume(MODEL)
    assert resumed.checkpoint.step == 3 and resumed.reason.startswith(why)
    assert resumed.reason.endswith("took checkpoint-000003")
    assert_consistent(resumed.checkpoint)
    assert store.find_latest() == store.root / "checkpoint-000003"


def test_the_issues_case_latest_names_a_removed_checkpoint(tmp_path):
    """``rmtree(final)`` done, the rename not: latest names a directory that is gone."""
    store = _store(tmp_path)
    for f in (store.root / "checkpoint-000003").iterdir():
        f.unlink()
    (store.root / "checkpoint-000003").rmdir()
    resumed = store.resume(MODEL)
    assert resumed.checkpoint.step == 2
    assert resumed.reason == ("latest names checkpoint-000003, which does not exist; "
                              "took checkpoint-000002")
    assert_consistent(resumed.checkpoint)


def test_a_dangling_latest_with_no_checkpoint_left_is_an_error_not_a_fresh_start(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    (root / "latest").write_text("checkpoint-000003")
    with pytest.raises(InputError) as e:
        CheckpointStore(root).resume(MODEL)
    assert e.value.field == "checkpoint_dir" and e.value.value == str(root)
    assert "checkpoint-000003, which does not exist" in e.value.reason
    assert CheckpointStore(tmp_path / "fresh").resume(MODEL) is None  # nothing there: fresh


# ---- checkpoints left by an earlier run ------------------------------------------------------
@pytest.mark.parametrize("keep", [1, 2])
def test_older_higher_numbered_checkpoints_never_displace_the_new_one(tmp_path, keep):
    root = tmp_path / "ck"
    earlier = CheckpointStore(root, keep=2)
    for s in (100, 150):
        save_step(earlier, s, run=1)
    fresh = CheckpointStore(root, keep=keep)  # a new run (resume off) in the same directory
    new = save_step(fresh, 50)
    assert new.is_dir() and (root / "latest").read_text() == "checkpoint-000050"
    names = sorted(p.name for p in root.glob("checkpoint-*"))
    assert names == (["checkpoint-000050"] if keep == 1
                     else ["checkpoint-000050", "checkpoint-000150"])
    resumed = fresh.resume(MODEL)
    assert (run_of(resumed.checkpoint), resumed.checkpoint.step, resumed.reason) == (
        0, 50, "latest")
    assert_consistent(resumed.checkpoint)
    (root / "latest").unlink()  # even without latest, "newest" is the last written, not 150
    resumed = fresh.resume(MODEL)
    assert (run_of(resumed.checkpoint), resumed.checkpoint.step) == (0, 50)
    save_step(fresh, 51)
    assert sorted(p.name for p in root.glob("checkpoint-*")) == (
        ["checkpoint-000051"] if keep == 1 else ["checkpoint-000050", "checkpoint-000051"])


# ---- a corrupt checkpoint --------------------------------------------------------------------
def _truncate(path, keep_bytes=None):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep_bytes is None else keep_bytes])


def _edit_state(path, edit):
    state = json.loads((path / STATE_NAME).read_text())
    (path / STATE_NAME).write_text(json.dumps(edit(state)))


def _set(state, key, value):
    state[key] = value
    return state


CORRUPTIONS = {
    "truncated safetensors": lambda p: _truncate(p / WEIGHTS_NAME),
    "safetensors header only": lambda p: _truncate(p / WEIGHTS_NAME, 8),
    "zeroed safetensors": lambda p: (p / WEIGHTS_NAME).write_bytes(
        bytes(len((p / WEIGHTS_NAME).read_bytes()))),
    "truncated optimizer.pt": lambda p: _truncate(p / OPTIMIZER_NAME),
    "optimizer.pt of another step": lambda p: torch.save(
        {**torch.load(p / OPTIMIZER_NAME), "step": torch.tensor(99.0)}, p / OPTIMIZER_NAME),
    "optimizer.pt of another shape": lambda p: torch.save(
        {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3), "step": torch.tensor(2.0)},
        p / OPTIMIZER_NAME),
    "no adapter_model.safetensors": lambda p: (p / WEIGHTS_NAME).unlink(),
    "no adapter_config.json": lambda p: (p / CONFIG_NAME).unlink(),
    "no optimizer.pt": lambda p: (p / OPTIMIZER_NAME).unlink(),
    "no trainer_state.json": lambda p: (p / STATE_NAME).unlink(),
    "garbled adapter_config.json": lambda p: (p / CONFIG_NAME).write_text('{"r": 4'),
    "adapter_config.json without target_modules": lambda p: (p / CONFIG_NAME).write_text(
        json.dumps({k: v for k, v in json.loads((p / CONFIG_NAME).read_text()).items()
                    if k != "target_modules"})),
    "trainer_state without step": lambda p: _edit_state(
        p, lambda s: {k: v for k, v in s.items() if k != "step"}),
    "trainer_state with a step of text": lambda p: _edit_state(p, lambda s: _set(s, "step", "2")),
    "trainer_state of another format": lambda p: _edit_state(
        p, lambda s: _set(s, "format", "other/1")),
    "trainer_state a list": lambda p: (p / STATE_NAME).write_text("[]"),
    "trainer_state truncated": lambda p: _truncate(p / STATE_NAME),
    "trainer_state with damaged pool progress": lambda p: _edit_state(
        p, lambda s: _set(s, "pool", {**s["pool"], "committed": [0, 10_000]})),
}


@pytest.mark.parametrize("form", list(CORRUPTIONS))
def test_a_corrupt_checkpoint_falls_back_to_the_previous_or_errors(tmp_path, form):
    store = _store(tmp_path, steps=(1, 2), keep=2)
    CORRUPTIONS[form](store.root / "checkpoint-000002")
    resumed = store.resume(MODEL)
    assert resumed.checkpoint.step == 1
    assert resumed.reason.startswith("latest names checkpoint-000002, which is unusable")
    assert resumed.reason.endswith("took checkpoint-000001")
    assert len(resumed.passed_over) == 1 and resumed.passed_over[0].startswith(
        "checkpoint-000002: ")
    assert_consistent(resumed.checkpoint)

    CORRUPTIONS[form](store.root / "checkpoint-000001")  # none usable left
    with pytest.raises(InputError) as e:
        store.resume(MODEL)
    assert e.value.field == "checkpoint_dir" and e.value.value == str(store.root)
    assert "checkpoint-000001" in e.value.reason and "checkpoint-000002" in e.value.reason


def test_saving_over_a_corrupt_checkpoint_of_the_same_step_replaces_it(tmp_path):
    store = _store(tmp_path, steps=(1, 2), keep=2)
    CORRUPTIONS["truncated optimizer.pt"](store.root / "checkpoint-000002")
    save_step(store, 2)
    resumed = store.resume(MODEL)
    assert (resumed.checkpoint.step, resumed.reason) == (2, "latest")
    assert_consistent(resumed.checkpoint)
