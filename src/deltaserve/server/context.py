"""The objects every route uses, built once per app and handed to routes as a dependency."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from prometheus_client import CollectorRegistry

from deltaserve.server.config import ServerConfig
from deltaserve.server.data_dir import DataDir
from deltaserve.server.jobs import JobService
from deltaserve.server.model_registry import ModelRegistry
from deltaserve.server.protocols import InferenceBackend, ServingStats
from deltaserve.server.store import Store
from deltaserve.server.timeline import Timeline


@dataclass(frozen=True)
class Services:
    config: ServerConfig
    store: Store
    data_dir: DataDir
    backend: InferenceBackend
    models: ModelRegistry
    jobs: JobService
    stats: ServingStats
    timeline: Timeline
    registry: CollectorRegistry  # /metrics


def services(request: Request) -> Services:
    return request.app.state.services


Svc = Annotated[Services, Depends(services)]
