"""The fine-tuning service inside vLLM's OpenAI server: DeltaServe's ``vllm.endpoint_plugins``
entry point (vLLM 0.32's documented way to add routes to its server, no fork).

vLLM loads an endpoint plugin only when ``VLLM_PLUGINS`` names it (``deltaserve serve --engine
vllm`` sets that) and gives it two calls (``vllm/plugins/endpoint_plugins/interface.py``):

* ``attach_router(app)``, while vLLM builds its app: the Files and Fine-tuning Jobs routes and
  ``/dashboard`` are mounted beside vLLM's own, with the service's error objects and its API
  key in front of every route (vLLM's own ``--api-key`` guards ``/v1`` only); the service's
  start and stop join vLLM's lifespan;
* ``init_state(engine_client, state, args)``, before vLLM accepts requests: the worker's hooks
  are installed, the engine process calibrates the latency model once (every job reuses it),
  and the service is built over :class:`~deltaserve.hosts.vllm.service_host.VLLMBackend`
  (adapters by name through vLLM's runtime LoRA loading) and a
  :class:`~deltaserve.server.coserving_runner.CoServingRunner` whose jobs attach in the engine
  process (:class:`~deltaserve.hosts.vllm.service_host.EngineJobs`).

vLLM serves inference and ``/metrics``; the service's ``deltaserve:`` metrics join vLLM's
registry, so one scrape reads both. The plugin is inert in a vLLM that ``deltaserve serve`` did
not start (no :class:`VLLMServiceSpec` on its args).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from argparse import Namespace
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.datastructures import State as AppState

from deltaserve.core.admission import Skip
from deltaserve.core.config_io import from_dict, to_dict
from deltaserve.hosts.vllm.service_host import (
    EngineCalls,
    EngineJobs,
    VLLMBackend,
    register_metrics,
)
from deltaserve.hosts.vllm.wire import CalibrateSpec, RemoteStatus, State
from deltaserve.model.loading import load_tokenizer
from deltaserve.server.app import SERVICE_ROUTERS, Parts, build_parts, mount, running
from deltaserve.server.config import ServerConfig
from deltaserve.server.coserving_runner import CoServingRunner
from deltaserve.server.metrics import ServingCollector
from deltaserve.server.protocols import ServingStatsSnapshot
from deltaserve.train.config import CoServeConfig

if TYPE_CHECKING:
    from vllm.engine.protocol import EngineClient

log = logging.getLogger("deltaserve.server")
SPEC_ARG = "deltaserve_service"  # the attribute of vLLM's args that carries the spec
_CALIBRATION_POLL_S = 0.5


@dataclass(frozen=True)
class VLLMServiceSpec:
    """What ``deltaserve serve --engine vllm`` (no ``--finetune-dataset``) checked before vLLM
    started: the service's config, the co-serving config every job starts from and the
    start-up calibration."""

    server: ServerConfig
    coserve: CoServeConfig
    calibration: CalibrateSpec


def service_spec(args: Namespace) -> VLLMServiceSpec | None:
    return getattr(args, SPEC_ARG, None)


class RunnerServingStats:
    """The service's counters on vLLM: the co-servers' (summed over jobs by the runner) and the
    backward's busy share. Per-request TTFT/TPOT are vLLM's own histograms in ``/metrics``
    (``vllm:time_to_first_token_seconds``, ...); the request fields here stay 0."""

    def __init__(self, runner: CoServingRunner):
        self.runner = runner
        self._start_s = time.monotonic()

    def snapshot(self) -> ServingStatsSnapshot:
        ft = self.runner.totals()
        uptime_s = max(time.monotonic() - self._start_s, 1e-9)
        return ServingStatsSnapshot(
            ft_tokens_committed=ft.tokens_committed, ft_samples_committed=ft.samples_committed,
            ft_tokens_admitted=ft.tokens_admitted,
            admission_skips={r: ft.skips.get(r.value, 0) for r in Skip},
            steps=ft.steps_timed, step_time_predicted_s=ft.step_time_predicted_s,
            step_time_measured_s=ft.step_time_measured_s, latency_model_mape=None,
            slo_misses={}, requests_finished=0, requests_slo_missed=0, inference_tokens=0,
            backward_busy_ratio=min(1.0, ft.backward_busy_s / uptime_s),
            ft_steps_lost=ft.steps_lost)


class DeltaServeEndpoints:
    """The ``vllm.endpoint_plugins`` factory (vLLM instantiates it with no argument)."""

    name = "deltaserve"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        spec = service_spec(app.state.args)
        if spec is None:
            log.warning("DeltaServe's endpoint plugin is allowlisted but this server was not "
                        "started by 'deltaserve serve --engine vllm': no route added")
            return
        mount(app, spec.server, SERVICE_ROUTERS)
        vllm_lifespan = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(a: FastAPI) -> AsyncIterator[None]:
            async with vllm_lifespan(a), running(a.state.deltaserve_parts):
                yield

        app.router.lifespan_context = lifespan

    async def init_state(self, engine_client: EngineClient | None, state: AppState,
                         args: Namespace) -> None:
        spec = service_spec(args)
        if spec is None or engine_client is None:
            return
        loop = asyncio.get_running_loop()
        calls = EngineCalls(engine_client, loop)
        await calls.call_async("deltaserve_install")
        await calibrate(calls, spec.calibration)
        vllm_config = state.vllm_config
        model = vllm_config.model_config
        backend = VLLMBackend(state.openai_serving_models, loop,
                              state.openai_serving_models.base_model_paths[0].name,
                              load_tokenizer(model.model), model.max_model_len)
        max_tokens = min(vllm_config.scheduler_config.max_num_batched_tokens,
                         model.max_model_len)
        runner = CoServingRunner(EngineJobs(calls), spec.coserve, None, max_tokens)
        stats = RunnerServingStats(runner)
        parts: Parts = build_parts(spec.server, backend, runner, stats)
        state.services = parts.services
        state.deltaserve_parts = parts
        register_metrics(ServingCollector(stats, parts.services.store))
        pause_before_engine_stops(engine_client, parts)


def pause_before_engine_stops(engine_client: EngineClient, parts: Parts) -> None:
    """At SIGINT/SIGTERM vLLM 0.32 stops the engine first and ends the app's lifespan after
    (``serve_http``'s ``handle_shutdown`` in ``vllm/entrypoints/launchers/launcher.py``), when
    the co-server in the engine process is gone. So the running job is checkpointed and paused
    just before the engine client shuts down (vLLM calls that from an executor thread, leaving
    the event loop free for the pause's RPCs); the lifespan's own stop then finds nothing to
    pause. Without this the job would resume at the next start from its last recorded
    checkpoint (nothing lost, later steps trained again)."""
    stop_engine = engine_client.shutdown

    def shutdown(*args: object, **kwargs: object) -> None:
        try:
            parts.driver.stop()
        except Exception:
            log.exception("could not pause the running job before the engine stopped")
        stop_engine(*args, **kwargs)

    engine_client.shutdown = shutdown


async def calibrate(calls: EngineCalls, spec: CalibrateSpec) -> None:
    """Have the engine process calibrate (or load the given latency model); wait for it."""
    status = from_dict(RemoteStatus, await calls.call_async("deltaserve_calibrate",
                                                            to_dict(spec)))
    while status.state is State.CALIBRATING:
        await asyncio.sleep(_CALIBRATION_POLL_S)
        status = from_dict(RemoteStatus, await calls.call_async("deltaserve_status"))
    if status.state is not State.READY:
        raise RuntimeError(f"the engine process did not calibrate: {status.error or status}")
    log.info("latency model ready; fine-tuning jobs co-serve on this engine")
