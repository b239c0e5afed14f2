"""The on-disk layout under ``--data-dir``. Every path is built from ids the server generated
(checked against their pattern again here) and step numbers, never from client input::

    state.sqlite3                         files, jobs, events, checkpoints, adapters
    files/file-<hex>                      uploaded content, as received
    jobs/ftjob-<hex>/checkpoints/         the runner's checkpoints (resume state included)
    adapters/ftjob-<hex>/final/           PEFT copies the server serves by name: they outlive
    adapters/ftjob-<hex>/ckpt-step-N/     the runner's pruning of its own checkpoints
    tmp/                                  uploads and copies in progress (emptied at start-up)
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from deltaserve.core.durable import fsync_dir
from deltaserve.core.errors import InputError
from deltaserve.model.peft_io import CONFIG_NAME, WEIGHTS_NAME
from deltaserve.server.db_records import FILE_PREFIX, JOB_PREFIX, new_id

_ID = {FILE_PREFIX: re.compile(r"file-[0-9a-f]{24}"), JOB_PREFIX: re.compile(r"ftjob-[0-9a-f]{24}")}


def is_id(prefix: str, ident: str) -> bool:
    return _ID[prefix].fullmatch(ident) is not None


def _checked(prefix: str, ident: str) -> str:
    if not is_id(prefix, ident):
        raise ValueError(f"not a server-issued id: {ident!r}")
    return ident


class DataDir:
    def __init__(self, root: Path):
        self.root = root
        try:
            for sub in ("files", "jobs", "adapters", "tmp"):
                (root / sub).mkdir(parents=True, exist_ok=True)
            probe = root / "tmp" / ".write-probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise InputError("data_dir", str(root), f"not a writable directory: {e}") from e
        for stale in (root / "tmp").iterdir():  # an upload or copy cut short by a crash
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()

    @property
    def database(self) -> Path:
        return self.root / "state.sqlite3"

    def file(self, file_id: str) -> Path:
        return self.root / "files" / _checked(FILE_PREFIX, file_id)

    def temp_path(self) -> Path:
        return self.root / "tmp" / new_id("upload-")

    def checkpoints(self, job_id: str) -> Path:
        return self.root / "jobs" / _checked(JOB_PREFIX, job_id) / "checkpoints"

    def adapter(self, job_id: str, step: int | None) -> Path:
        name = "final" if step is None else f"ckpt-step-{int(step)}"
        return self.root / "adapters" / _checked(JOB_PREFIX, job_id) / name

    def store_adapter(self, src: Path, job_id: str, step: int | None) -> Path:
        """Copy the PEFT files of ``src`` into the adapter store, durably and atomically."""
        dst = self.adapter(job_id, step)
        tmp = self.temp_path()
        tmp.mkdir()
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            shutil.copyfile(src / name, tmp / name)
            with open(tmp / name, "rb+") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists():  # the same step checkpointed again (a pause right after a periodic one)
            shutil.rmtree(dst)
        os.rename(tmp, dst)
        fsync_dir(dst.parent)
        return dst
