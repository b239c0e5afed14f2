"""CheckpointStore: the durability protocol, the same step saved twice, pruning and stale
leftovers. Crashes, corruption and a killed writer are in ``tests/faults``."""

from __future__ import annotations

import json
import os

import pytest

from deltaserve.core import InputError
from deltaserve.train.checkpoint_store import (
    FILES,
    STATE_NAME,
    CheckpointStore,
    find_latest,
    read_checkpoint,
)
from tests.faults.states import MODEL, assert_consistent, save_step


def test_save_fsyncs_files_and_directories_before_each_rename(tmp_path, monkeypatch):
    """Order of the durable steps: files and temp dir synced before the rename, the root synced
    after it, ``latest``'s temp file synced before it replaces ``latest``, the root after."""
    root = tmp_path / "ck"
    store = CheckpointStore(root)
    save_step(store, 1)
    trace: list[tuple[str, str, str]] = []
    real = {n: getattr(os, n) for n in ("fsync", "rename", "replace")}

    def fsync(fd):
        trace.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), ""))
        real["fsync"](fd)

    def move(name):
        def f(src, dst):
            trace.append((name, str(src), str(dst)))
            real[name](src, dst)
        return f

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", move("rename"))
    monkeypatch.setattr(os, "replace", move("replace"))
    final = save_step(store, 2)
    monkeypatch.undo()

    def at(op, a, b=""):
        hits = [i for i, t in enumerate(trace) if t == (op, str(a), str(b))]
        assert hits, f"no {op} {a} {b} in {trace}"
        return hits

    rename = at("rename", root / f".tmp-{final.name}-{os.getpid()}", final)[0]
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    assert all(at("fsync", tmp / name)[0] < rename for name in FILES)
    assert at("fsync", tmp)[0] < rename
    replace = at("replace", root / ".tmp-latest", root / "latest")[0]
    assert rename < replace
    assert any(rename < i < replace for i in at("fsync", root))
    assert at("fsync", root / ".tmp-latest")[0] < replace
    assert any(i > replace for i in at("fsync", root))


def test_the_same_step_saved_twice_keeps_the_complete_directory(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    first = save_step(store, 1)
    inode = first.stat().st_ino
    written = json.loads((first / STATE_NAME).read_text())["written_at"]
    again = save_step(store, 1)
    assert again == first and again.stat().st_ino == inode  # never removed, not even briefly
    assert json.loads((first / STATE_NAME).read_text())["written_at"] > written
    assert_consistent(read_checkpoint(first, MODEL))
    assert sorted(p.name for p in store.root.iterdir()) == ["checkpoint-000001", "latest"]


def test_pruning_keeps_the_newest_written(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep=2)
    for step in (5, 1, 3):  # written in this order: 3 and 1 are the newest two
        save_step(store, step)
    assert [p.name for p in store.newest_first()] == ["checkpoint-000003", "checkpoint-000001"]
    assert find_latest(store.root) == store.root / "checkpoint-000003"


def test_clean_stale_removes_only_temporaries(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    assert store.clean_stale() == []  # no root yet
    save_step(store, 1)
    (store.root / ".tmp-checkpoint-000002-123").mkdir()
    (store.root / ".tmp-checkpoint-000002-123" / "optimizer.pt").write_bytes(b"half")
    (store.root / ".tmp-latest").write_text("checkpoint-000002")
    (store.root / "train_log.jsonl").write_text("{}\n")
    removed = store.clean_stale()
    assert sorted(p.name for p in removed) == [".tmp-checkpoint-000002-123", ".tmp-latest"]
    assert sorted(p.name for p in store.root.iterdir()) == [
        "checkpoint-000001", "latest", "train_log.jsonl"]


def test_keep_is_validated():
    with pytest.raises(InputError) as e:
        CheckpointStore("x", keep=0)
    assert e.value.field == "keep_checkpoints"


def test_pruning_removes_an_incomplete_checkpoint_before_a_complete_one(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep=2)
    save_step(store, 1)
    save_step(store, 2)
    (store.root / "checkpoint-000002" / "optimizer.pt").unlink()
    save_step(store, 3)
    assert [p.name for p in store.newest_first()] == ["checkpoint-000003", "checkpoint-000001"]


def test_a_root_that_is_a_file_is_an_input_error(tmp_path):
    root = tmp_path / "ck"
    root.write_text("not a directory")
    with pytest.raises(InputError) as e:
        CheckpointStore(root).resume(MODEL)
    assert (e.value.field, e.value.value) == ("checkpoint_dir", str(root))
