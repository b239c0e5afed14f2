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
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI

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


@dataclass(frozen=True)
class _Parts:
    services: Services
    driver: JobDriver
    db: Database


def _build(config: ServerConfig, backend: InferenceBackend, runner: TrainingRunner,
           stats: ServingStats) -> _Parts:
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
    return _Parts(services, driver, db)


def create_app(config: ServerConfig, backend: InferenceBackend, runner: TrainingRunner,
               stats: ServingStats) -> FastAPI:
    parts = _build(config, backend, runner, stats)
    svc = parts.services

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        svc.models.restore(svc.store.adapters())
        svc.jobs.start()
        parts.driver.start()
        sampler = asyncio.create_task(svc.timeline.run())
        log.info("serving %s on http://%s:%d (API key %s)", backend.model_name, config.bind,
                 config.port, "required" if config.api_key else "not set")
        try:
            yield
        finally:
            sampler.cancel()
            svc.jobs.close()
            await asyncio.to_thread(parts.driver.stop)
            parts.db.close()

    app = FastAPI(title="DeltaServe", lifespan=lifespan)
    app.state.services = svc
    install_error_handlers(app)
    for module in (inference_api, files_api, jobs_api, metrics, dashboard):
        app.include_router(module.router)
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key,
                           metrics_public=config.metrics_public)
    return app
