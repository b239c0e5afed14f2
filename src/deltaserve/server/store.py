"""Reads and writes of the service's state (files, jobs, events, checkpoints, adapters).

Every row crosses this boundary as a typed record (``records``); JSON columns hold frozen
dataclasses. Lists are newest first, paged with OpenAI's ``after`` cursor (the id of the last
object of the previous page)."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from pathlib import Path
from typing import Generic, TypeVar

from deltaserve.server.db import Database
from deltaserve.server.db_records import (
    EVENT_PREFIX,
    AdapterRecord,
    CheckpointRecord,
    EventRecord,
    FileRecord,
    JobError,
    JobRecord,
    JobStatus,
)
from deltaserve.server.hyperparameters import Hyperparameters
from deltaserve.server.protocols import StepMetrics, TrainingHyperparameters


def now_s() -> int:
    return int(time.time())


def _json(obj: object | None) -> str | None:
    return None if obj is None else json.dumps(
        dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj)


def _job(row: sqlite3.Row) -> JobRecord:
    err = json.loads(row["error"]) if row["error"] else None
    training = json.loads(row["training"]) if row["training"] else None
    return JobRecord(
        id=row["id"], created_at=row["created_at"], model=row["model"],
        training_file=row["training_file"], validation_file=row["validation_file"],
        status=JobStatus(row["status"]),
        hyperparameters=Hyperparameters(**json.loads(row["hyperparameters"])),
        suffix=row["suffix"], seed=row["seed"],
        metadata=json.loads(row["metadata"]) if row["metadata"] else None,
        queue_seq=row["queue_seq"],
        training=TrainingHyperparameters(**training) if training else None,
        fine_tuned_model=row["fine_tuned_model"], finished_at=row["finished_at"],
        trained_tokens=row["trained_tokens"], error=JobError(**err) if err else None)


def _checkpoint(row: sqlite3.Row) -> CheckpointRecord:
    return CheckpointRecord(row["id"], row["job_id"], row["created_at"],
                            StepMetrics(**json.loads(row["metrics"])),
                            Path(row["runner_path"]), Path(row["adapter_dir"]),
                            row["model_name"])


def _event(row: sqlite3.Row) -> EventRecord:
    metrics = StepMetrics(**json.loads(row["metrics"])) if row["metrics"] else None
    return EventRecord(row["seq"], row["job_id"], row["created_at"], row["level"], row["type"],
                       row["message"], metrics)


T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Page(Generic[T]):
    data: list[T]
    has_more: bool


class Store:
    def __init__(self, db: Database):
        self.db = db

    # ---- files ------------------------------------------------------------------------------
    def add_file(self, rec: FileRecord) -> None:
        self.db.execute("INSERT INTO files (id, filename, purpose, bytes, created_at, "
                        "num_records) VALUES (?, ?, ?, ?, ?, ?)",
                        (rec.id, rec.filename, rec.purpose, rec.bytes, rec.created_at,
                         rec.num_records))

    def get_file(self, file_id: str) -> FileRecord | None:
        rows = self.db.query("SELECT id, filename, purpose, bytes, created_at, num_records "
                             "FROM files WHERE id = ?", (file_id,))
        return FileRecord(*rows[0]) if rows else None

    def list_files(self, purpose: str | None, after: str | None, limit: int) -> Page[FileRecord]:
        where, args = [], []
        if purpose:
            where.append("purpose = ?")
            args.append(purpose)
        rows = self._page("files", where, args, after, limit,
                          "id, filename, purpose, bytes, created_at, num_records")
        return Page([FileRecord(*r) for r in rows[:limit]], len(rows) > limit)

    def delete_file(self, file_id: str) -> None:
        self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))

    def jobs_using_file(self, file_id: str) -> list[JobRecord]:
        rows = self.db.query("SELECT * FROM jobs WHERE training_file = ? OR validation_file = ?",
                             (file_id, file_id))
        return [_job(r) for r in rows]

    def _page(self, table: str, where: list[str], args: list, after: str | None, limit: int,
              columns: str = "*") -> list[sqlite3.Row]:
        """Newest first; one row more than ``limit`` tells whether there is more."""
        if after is not None:
            where = [*where, f"seq < (SELECT seq FROM {table} WHERE id = ?)"]
            args = [*args, after]
        sql = f"SELECT {columns} FROM {table}"
        if where:
            sql += " WHERE " + " AND ".join(where)
        return self.db.query(sql + " ORDER BY seq DESC LIMIT ?", (*args, limit + 1))

    # ---- jobs -------------------------------------------------------------------------------
    def add_job(self, job: JobRecord) -> JobRecord:
        with self.db.transaction() as c:
            queue_seq = c.execute("SELECT COALESCE(MAX(queue_seq), 0) + 1 FROM jobs").fetchone()[0]
            c.execute(
                "INSERT INTO jobs (id, created_at, model, training_file, validation_file, status,"
                " hyperparameters, suffix, seed, metadata, queue_seq) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job.id, job.created_at, job.model, job.training_file, job.validation_file,
                 job.status.value, _json(job.hyperparameters), job.suffix, job.seed,
                 _json(job.metadata), queue_seq))
        return dataclasses.replace(job, queue_seq=queue_seq)

    def get_job(self, job_id: str) -> JobRecord | None:
        rows = self.db.query("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return _job(rows[0]) if rows else None

    def list_jobs(self, after: str | None, limit: int) -> Page[JobRecord]:
        rows = self._page("jobs", [], [], after, limit)
        return Page([_job(r) for r in rows[:limit]], len(rows) > limit)

    def jobs_with_status(self, *statuses: JobStatus) -> list[JobRecord]:
        """In queue order (FIFO)."""
        marks = ", ".join("?" * len(statuses))
        rows = self.db.query(f"SELECT * FROM jobs WHERE status IN ({marks}) ORDER BY queue_seq",
                             [s.value for s in statuses])
        return [_job(r) for r in rows]

    def set_status(self, job_id: str, status: JobStatus, *, expect: tuple[JobStatus, ...] = (),
                   requeue: bool = False) -> bool:
        """Move a job to ``status`` if it is in one of ``expect`` (any, if empty); ``requeue``
        puts it at the back of the queue. Returns whether it moved."""
        with self.db.transaction() as c:
            row = c.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None or (expect and JobStatus(row[0]) not in expect):
                return False
            finished = now_s() if status.is_final else None
            c.execute("UPDATE jobs SET status = ?, finished_at = ? WHERE id = ?",
                      (status.value, finished, job_id))
            if requeue:
                c.execute("UPDATE jobs SET queue_seq = (SELECT MAX(queue_seq) + 1 FROM jobs) "
                          "WHERE id = ?", (job_id,))
        return True

    def set_resolved(self, job_id: str, reported: Hyperparameters,
                     training: TrainingHyperparameters) -> None:
        self.db.execute("UPDATE jobs SET hyperparameters = ?, training = ? WHERE id = ?",
                        (_json(reported), _json(training), job_id))

    def set_trained_tokens(self, job_id: str, tokens: int) -> None:
        self.db.execute("UPDATE jobs SET trained_tokens = ? WHERE id = ?", (tokens, job_id))

    def set_failed(self, job_id: str, error: JobError, *, expect: tuple[JobStatus, ...] = ()
                   ) -> bool:
        """Fail a job (if it is in one of ``expect``; any, if empty); returns whether it did."""
        with self.db.transaction() as c:
            row = c.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None or (expect and JobStatus(row[0]) not in expect):
                return False
            c.execute("UPDATE jobs SET status = ?, error = ?, finished_at = ? WHERE id = ?",
                      (JobStatus.FAILED.value, _json(error), now_s(), job_id))
        return True

    def set_succeeded(self, job_id: str, fine_tuned_model: str, adapter: AdapterRecord,
                      trained_tokens: int | None) -> None:
        with self.db.transaction() as c:
            self._insert_adapter(c, adapter)
            c.execute("UPDATE jobs SET status = ?, fine_tuned_model = ?, finished_at = ?, "
                      "trained_tokens = COALESCE(?, trained_tokens) WHERE id = ?",
                      (JobStatus.SUCCEEDED.value, fine_tuned_model, now_s(), trained_tokens,
                       job_id))

    # ---- events -----------------------------------------------------------------------------
    def add_event(self, job_id: str, message: str, *, level: str = "info",
                  metrics: StepMetrics | None = None) -> None:
        self.db.execute("INSERT INTO events (job_id, created_at, level, type, message, metrics) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (job_id, now_s(), level, "metrics" if metrics else "message", message,
                         _json(metrics)))

    def list_events(self, job_id: str, after: str | None, limit: int) -> Page[EventRecord]:
        where, args = ["job_id = ?"], [job_id]
        if after is not None:
            where.append("seq < ?")
            args.append(_event_seq(after))
        rows = self.db.query("SELECT * FROM events WHERE " + " AND ".join(where)
                             + " ORDER BY seq DESC LIMIT ?", (*args, limit + 1))
        return Page([_event(r) for r in rows[:limit]], len(rows) > limit)

    def drop_metrics_after(self, job_id: str, step: int) -> int:
        """Forget the metrics of steps a resume trains again; returns how many."""
        rows = self.db.query("SELECT seq, metrics FROM events WHERE job_id = ? AND "
                             "type = 'metrics'", (job_id,))
        gone = [r["seq"] for r in rows if json.loads(r["metrics"])["step"] > step]
        with self.db.transaction() as c:
            c.executemany("DELETE FROM events WHERE seq = ?", [(s,) for s in gone])
        return len(gone)

    # ---- checkpoints and adapters -----------------------------------------------------------
    def add_checkpoint(self, ckpt: CheckpointRecord) -> None:
        """A checkpoint and its servable adapter, together; the same step again replaces it."""
        with self.db.transaction() as c:
            c.execute("INSERT INTO checkpoints (id, job_id, step, created_at, metrics, "
                      "runner_path, adapter_dir, model_name) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                      "ON CONFLICT (job_id, step) DO UPDATE SET created_at = excluded.created_at,"
                      " metrics = excluded.metrics, runner_path = excluded.runner_path",
                      (ckpt.id, ckpt.job_id, ckpt.step, ckpt.created_at, _json(ckpt.metrics),
                       str(ckpt.runner_path), str(ckpt.adapter_dir), ckpt.model_name))
            self._insert_adapter(c, ckpt.adapter)

    def list_checkpoints(self, job_id: str, after: str | None, limit: int
                         ) -> Page[CheckpointRecord]:
        where, args = ["job_id = ?"], [job_id]
        if after is not None:
            where.append("step < (SELECT step FROM checkpoints WHERE id = ?)")
            args.append(after)
        rows = self.db.query("SELECT * FROM checkpoints WHERE " + " AND ".join(where)
                             + " ORDER BY step DESC LIMIT ?", (*args, limit + 1))
        return Page([_checkpoint(r) for r in rows[:limit]], len(rows) > limit)

    def newest_checkpoint(self, job_id: str) -> CheckpointRecord | None:
        page = self.list_checkpoints(job_id, None, 1)
        return page.data[0] if page.data else None

    def adapters(self) -> list[AdapterRecord]:
        rows = self.db.query("SELECT model_name, job_id, adapter_dir, created_at FROM adapters "
                             "ORDER BY created_at, model_name")
        return [AdapterRecord(r[0], r[1], Path(r[2]), r[3]) for r in rows]

    @staticmethod
    def _insert_adapter(c: sqlite3.Connection, a: AdapterRecord) -> None:
        c.execute("INSERT OR REPLACE INTO adapters (model_name, job_id, adapter_dir, created_at) "
                  "VALUES (?, ?, ?, ?)", (a.model_name, a.job_id, str(a.adapter_dir),
                                          a.created_at))

    def job_status_counts(self) -> dict[JobStatus, int]:
        rows = self.db.query("SELECT status, COUNT(*) FROM jobs GROUP BY status")
        counts = dict.fromkeys(JobStatus, 0)
        counts.update({JobStatus(r[0]): r[1] for r in rows})
        return counts


def _event_seq(event_id: str) -> int:
    digits = event_id.removeprefix(EVENT_PREFIX)
    return int(digits) if digits.isdigit() else 0
