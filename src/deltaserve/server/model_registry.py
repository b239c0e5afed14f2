"""Which ``model`` names clients may use: the base model and every stored adapter.

This map is the only way from a request's ``model`` to an adapter on the backend. The adapter
being trained is never put in it (it has no name here), so no client can address it, whatever
name the host gives it internally."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from deltaserve.server.db_records import AdapterRecord
from deltaserve.server.protocols import InferenceBackend

log = logging.getLogger("deltaserve.server")


def fine_tuned_model_name(base: str, suffix: str | None, job_id: str) -> str:
    """OpenAI's convention, ``ft:<base>:<org>:<suffix>:<id>``, without the org part."""
    return f"ft:{base}:{suffix or ''}:{job_id}"


def checkpoint_model_name(fine_tuned_model: str, step: int) -> str:
    """OpenAI's convention for a checkpoint: the job's model name and ``:ckpt-step-N``."""
    return f"{fine_tuned_model}:ckpt-step-{step}"


@dataclass(frozen=True)
class ServedModel:
    id: str
    created_at: int
    adapter: str | None  # the backend's adapter name; None for the base model
    parent: str | None  # the job that trained it


class ModelRegistry:
    def __init__(self, backend: InferenceBackend, created_at: int):
        self.backend = backend
        self._base = ServedModel(backend.model_name, created_at, None, None)
        self._lock = threading.Lock()
        self._adapters: dict[str, ServedModel] = {}

    def register(self, rec: AdapterRecord) -> None:
        """Load the adapter on the backend under its model name, then make the name usable."""
        self.backend.add_lora(rec.model_name, str(rec.adapter_dir))
        with self._lock:
            self._adapters[rec.model_name] = ServedModel(rec.model_name, rec.created_at,
                                                         rec.model_name, rec.job_id)
        log.info("serving %s", rec.model_name)

    def restore(self, records: list[AdapterRecord]) -> None:
        """At start-up: re-register every stored adapter; one that fails to load is logged and
        skipped (the others, and the base model, still serve)."""
        for rec in records:
            try:
                self.register(rec)
            except Exception:
                log.exception("could not load stored adapter %s from %s", rec.model_name,
                              rec.adapter_dir)

    def get(self, name: str) -> ServedModel | None:
        if name == self._base.id:
            return self._base
        with self._lock:
            return self._adapters.get(name)

    def is_base(self, name: str) -> bool:
        return name == self._base.id

    def all(self) -> list[ServedModel]:
        with self._lock:
            return [self._base, *sorted(self._adapters.values(), key=lambda m: m.created_at)]
