"""The SQLite database under ``--data-dir``: one connection, one lock, durable commits.

WAL journaling with ``synchronous=FULL``: a committed row survives a process kill and a power
loss. Writes are small (a job's state, an event per optimizer step), so one connection behind a
lock serves the API handlers and the job driver thread alike.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    num_records INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    created_at INTEGER NOT NULL,
    model TEXT NOT NULL,
    training_file TEXT NOT NULL,
    validation_file TEXT,
    status TEXT NOT NULL,
    hyperparameters TEXT NOT NULL,
    training TEXT,
    suffix TEXT,
    seed INTEGER NOT NULL,
    metadata TEXT,
    queue_seq INTEGER NOT NULL,
    fine_tuned_model TEXT,
    finished_at INTEGER,
    trained_tokens INTEGER,
    error TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, queue_seq);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    level TEXT NOT NULL,
    type TEXT NOT NULL,
    message TEXT NOT NULL,
    metrics TEXT
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, seq);
CREATE TABLE IF NOT EXISTS checkpoints (
    id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    metrics TEXT NOT NULL,
    runner_path TEXT NOT NULL,
    adapter_dir TEXT NOT NULL,
    model_name TEXT NOT NULL,
    UNIQUE (job_id, step)
);
CREATE TABLE IF NOT EXISTS adapters (
    model_name TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    adapter_dir TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
"""

SQLValue = str | int | float | bytes | None  # what sqlite3 binds to a parameter


class Database:
    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._create()

    def _create(self) -> None:
        with self._lock:
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise RuntimeError(f"{self.path}: schema version {version}, this server "
                                   f"knows {SCHEMA_VERSION}")
            self._conn.executescript(SCHEMA)
            self._conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """Several statements that commit together (or not at all)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def execute(self, sql: str, args: Sequence[SQLValue] = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._conn.execute(sql, args)

    def query(self, sql: str, args: Sequence[SQLValue] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            self._conn.close()
