"""``ServingScheduler``: the co-serving scheduler in the scheduler process of SGLang's own
server (``deltaserve serve --engine sglang``).

DeltaServe's plugin puts this class in place of SGLang's ``Scheduler`` when
``DELTASERVE_SGLANG_SERVE`` names a :class:`~deltaserve.hosts.sglang.serve_spec.ServeSpec`.
Before SGLang reports the scheduler ready (so before the HTTP server takes a request) it loads
the dataset, calibrates through SGLang's own path (unless given a latency model), starts the
backward and reserves the training adapter: :func:`deltaserve.train.attach.attach` over
:class:`~deltaserve.hosts.sglang.training.SchedulerTrainingHost`. A failure there is reported
and SGLang serves inference alone. Idle loop iterations lend the machine to the backward while
training has work. ``SIGUSR1`` (sent by ``deltaserve serve`` once the HTTP server stopped)
detaches: the last committed step is checkpointed before SGLang ends its processes.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from deltaserve.hosts.sglang.scheduler import CoServingScheduler
from deltaserve.hosts.sglang.serve_spec import ServeSpec, ServeState, ServeStatus
from deltaserve.hosts.sglang.training import SchedulerTrainingHost
from deltaserve.hosts.sglang.version import SERVE_ENV
from deltaserve.model.loading import load_tokenizer, read_config
from deltaserve.train.attach import attach, detach
from deltaserve.train.facade import CoServer

logger = logging.getLogger("deltaserve.sglang")

IDLE_S = 0.005  # one idle lend to the backward; SGLang's loop polls its sockets in between
STATUS_EVERY_S = 1.0


class ServingScheduler(CoServingScheduler):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._serve = ServeSpec.read(os.environ[SERVE_ENV])
        self._status_path = self._serve.status_path()
        self._co: CoServer | None = None
        self._port: SchedulerTrainingHost | None = None
        self._stop_asked = False
        self._last_status_s = 0.0
        signal.signal(signal.SIGUSR1, self._ask_stop)
        # Ctrl-C reaches the whole process group: the scheduler keeps running until
        # `deltaserve serve` (which got it too) has it checkpoint (SIGUSR1); SGLang ends it then.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self._attach_coserver()

    def _write_status(self, state: ServeState, error: str | None = None) -> None:
        co = self._co
        ServeStatus(state, os.getpid(), co.book.progress().num_samples if co else 0,
                    co.stats() if co else None, error).write(self._status_path)
        self._last_status_s = time.monotonic()

    def _attach_coserver(self) -> None:
        path = Path(self.server_args.model_path)
        self._write_status(ServeState.STARTING)
        try:
            self._port = port = SchedulerTrainingHost(
                self, path, read_config(path), load_tokenizer(path), self.deltaserve_limits())
            if self._serve.latency_model is None:
                self._write_status(ServeState.CALIBRATING)
            self._co = attach(port, dataset=self._serve.dataset or "",
                              config=self._serve.coserve(),
                              latency_model=self._serve.latency_model, progress=False)
        except Exception as e:  # inference never dies of a training-side fault
            logger.exception("DeltaServe: co-serving did not start; SGLang serves inference "
                             "alone")
            self.deltaserve_co = None
            self._write_status(ServeState.FAILED, f"{type(e).__name__}: {e}")
            return
        self._write_status(ServeState.COSERVING)
        logger.warning("DeltaServe: co-serving %d samples in SGLang's scheduler (pid %d)",
                       self._co.book.progress().num_samples, os.getpid())

    def _ask_stop(self, signum: int, frame: Any) -> None:
        self._stop_asked = True  # acted on in the loop, between steps

    def _tick(self) -> None:
        if self._stop_asked and self._co is not None:
            co, self._co = self._co, None
            assert self._port is not None
            detach(self._port, co, drain=False, checkpoint=True)
            ServeStatus(ServeState.STOPPED, os.getpid(), 0, co.stats()).write(self._status_path)
        elif self._co is not None and time.monotonic() - self._last_status_s > STATUS_EVERY_S:
            self._write_status(ServeState.COSERVING)

    def on_idle(self) -> None:
        super().on_idle()
        co = self.deltaserve_co
        if co is not None and co.wants_step():
            co.idle(IDLE_S)
        self._tick()

    def process_batch_result(self, batch: Any, result: Any) -> Any:
        out = super().process_batch_result(batch, result)
        self._tick()
        return out
