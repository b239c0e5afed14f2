"""The app factory: one FastAPI app over one backend, one training runner and one stats source.

Built eagerly (the data directory and the database are checked before anything serves);
started by the lifespan: stored adapters are loaded back, interrupted validations rerun, the
job driver and the dashboard sampler start. At shutdown the running job is checkpointed and
left ``paused`` (see ``driver``), then the database is closed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI

from deltaserve.server import dashboard, files_api, inference_api, jobs_api, metrics
from deltaserve.server.auth import APIKeyMiddleware
from deltaserve.server.config import ServerConfig
from deltaserve.server.context import Services
from deltaserve.server.data_dir import DataDir
from deltaserve.server.db import Database
from deltaserve.server.driver import JobDriver
from deltaserve.server.errors import install_error_handlers
from deltaserve.server.events import EventSink
from deltaserve.server.jobs import JobService
from deltaserve.server.model_registry import ModelRegistry
from deltaserve.server.progress import ProgressLog
from deltaserve.server.protocols import InferenceBackend, ServingStats, TrainingRunner
from deltaserve.server.store import Store
from deltaserve.server.timeline import Timeline

log = logging.getLogger("deltaserve.server")
ROUTERS = tuple(m.router for m in (inference_api, files_api, jobs_api, metrics, dashboard))
# On vLLM's server, vLLM serves inference and /metrics (the service's metrics join its registry)
SERVICE_ROUTERS = tuple(m.router for m in (files_api, jobs_api, dashboard))


@dataclass(frozen=True)
class Parts:
    services: Services
    driver: JobDriver
    db: Database


def build_parts(config: ServerConfig, backend: InferenceBackend, runner: TrainingRunner,
                stats: ServingStats) -> Parts:
    data_dir = DataDir(config.data_dir)
    db = Database(data_dir.database)
    store = Store(db)
    models = ModelRegistry(backend, int(time.time()))
    sink = EventSink(store, data_dir, ProgressLog(config.progress_interval_s))
    driver = JobDriver(config, store, data_dir, backend, runner, models, sink)
    jobs = JobService(store, data_dir, backend, driver, sink)
    timeline = Timeline(stats, config.dashboard_interval_s, config.dashboard_points)
    services = Services(config, store, data_dir, backend, models, jobs, stats, timeline,
                        metrics.build_registry(stats, store))
    return Parts(services, driver, db)


@contextlib.asynccontextmanager
async def running(parts: Parts) -> AsyncIterator[None]:
    """The service between start-up and shutdown: stored adapters are loaded back (off the
    event loop: a backend may need the loop to load one), interrupted validations rerun, the
    job driver and the dashboard sampler run; at shutdown the running job is paused."""
    svc = parts.services
    await asyncio.to_thread(svc.models.restore, svc.store.adapters())
    svc.jobs.start()
    parts.driver.start()
    sampler = asyncio.create_task(svc.timeline.run())
    log.info("serving %s on http://%s:%d (API key %s)", svc.backend.model_name,
             svc.config.bind, svc.config.port, "required" if svc.config.api_key else "not set")
    try:
        yield
    finally:
        sampler.cancel()
        svc.jobs.close()
        await asyncio.to_thread(parts.driver.stop)
        parts.db.close()


def mount(app: FastAPI, config: ServerConfig, routers: Sequence[APIRouter] = ROUTERS) -> None:
    """The service's routes, error objects and API key on ``app``."""
    install_error_handlers(app)
    for router in routers:
        app.include_router(router)
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key,
                           metrics_public=config.metrics_public)


def create_app(config: ServerConfig, backend: InferenceBackend, runner: TrainingRunner,
               stats: ServingStats) -> FastAPI:
    parts = build_parts(config, backend, runner, stats)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with running(parts):
            yield

    app = FastAPI(title="DeltaServe", lifespan=lifespan)
    app.state.services = parts.services
    mount(app, config)
    return app
