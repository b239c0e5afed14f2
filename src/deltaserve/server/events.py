"""Where a job's progress is written: its events and state in the store, its adapters in the
adapter store, and progress lines in the log."""

from __future__ import annotations

from deltaserve.server.data_dir import DataDir
from deltaserve.server.db_records import (
    CHECKPOINT_PREFIX,
    AdapterRecord,
    CheckpointRecord,
    new_id,
)
from deltaserve.server.model_registry import checkpoint_model_name
from deltaserve.server.progress import ProgressLog
from deltaserve.server.protocols import CheckpointEvent, FinishedEvent, StepMetrics
from deltaserve.server.store import Store, now_s


class EventSink:
    def __init__(self, store: Store, data_dir: DataDir, progress: ProgressLog):
        self.store = store
        self.data_dir = data_dir
        self.progress = progress

    def message(self, job_id: str, text: str, *, level: str = "info",
                state: bool = False) -> None:
        """A ``message`` event; ``state`` marks a state change, which is logged too."""
        self.store.add_event(job_id, text, level=level)
        if state or level != "info":
            self.progress.state(job_id, text)

    def step(self, job_id: str, m: StepMetrics) -> None:
        self.store.add_event(job_id, f"Step {m.step}: training loss={m.train_loss:.4f}",
                             metrics=m)
        self.store.set_trained_tokens(job_id, m.trained_tokens)
        self.progress.step(job_id, m)

    def checkpoint(self, job_id: str, fine_tuned_model: str, ev: CheckpointEvent
                   ) -> CheckpointRecord:
        """Copy the checkpoint's adapter into the store and record it (raises ``OSError``)."""
        step = ev.metrics.step
        adapter_dir = self.data_dir.store_adapter(ev.path, job_id, step)
        rec = CheckpointRecord(new_id(CHECKPOINT_PREFIX), job_id, now_s(), ev.metrics, ev.path,
                               adapter_dir, checkpoint_model_name(fine_tuned_model, step))
        self.store.add_checkpoint(rec)
        self.message(job_id, f"Checkpoint created at step {step}: {rec.model_name}")
        return rec

    def final_adapter(self, job_id: str, fine_tuned_model: str, ev: FinishedEvent
                      ) -> AdapterRecord:
        adapter_dir = self.data_dir.store_adapter(ev.adapter_path, job_id, None)
        return AdapterRecord(fine_tuned_model, job_id, adapter_dir, now_s())

    def succeeded(self, job_id: str, fine_tuned_model: str, adapter: AdapterRecord,
                  ev: FinishedEvent) -> None:
        tokens = ev.metrics.trained_tokens if ev.metrics else None
        self.store.set_succeeded(job_id, fine_tuned_model, adapter, tokens)
        self.message(job_id, f"New fine-tuned model created: {fine_tuned_model}")
        self.message(job_id, "The job has successfully completed", state=True)

    def forget(self, job_id: str) -> None:
        self.progress.forget(job_id)
