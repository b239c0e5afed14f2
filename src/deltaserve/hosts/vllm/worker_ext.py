"""``CoServingWorkerExtension``: what DeltaServe adds to vLLM's worker.

Passed to vLLM as ``worker_extension_cls``; vLLM appends it to the worker class's bases, so its
methods become worker methods callable through ``collective_rpc``. vLLM forbids overriding any
worker attribute and never runs an extension's ``__init__``, so every method here is new
(``deltaserve_*``) and state is set up by the explicit :meth:`deltaserve_install` call.

The worker and the scheduler meet in :mod:`.link` (same process, same ``VllmConfig``). The
``deltaserve_attach``/``status``/``detach`` RPCs run co-serving inside the engine process of
``deltaserve serve`` (:mod:`.remote`); what crosses the process boundary is plain JSON of typed
dataclasses (:mod:`deltaserve.core.config_io`).
"""

from __future__ import annotations

from dataclasses import dataclass

import vllm
from vllm.config import VllmConfig
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from deltaserve.core.config_io import JSONValue, from_dict, to_dict
from deltaserve.hosts.vllm.hooks import ForwardHooks
from deltaserve.hosts.vllm.link import link_for
from deltaserve.hosts.vllm.remote import RemoteCoServing, ServeSpec
from deltaserve.hosts.vllm.version import check_version
from deltaserve.hosts.vllm.weights import views_available
from deltaserve.hosts.vllm.wire import CalibrateSpec, JobStart

JSON = dict[str, JSONValue]


@dataclass(frozen=True)
class WorkerInfo:
    """Facts about the worker's model: the capture path the hooks use, who adds the training
    adapter to the training rows, whether the hooks can cut a step short, how vLLM runs the
    model, and whether the backward can view its weights."""

    num_layers: int
    capture_path: str
    training_lora: str
    interrupt: bool
    compilation_mode: int
    cudagraph_mode: str
    device: str
    has_lora: bool
    weights_viewable: bool


class CoServingWorkerExtension:
    # set by vLLM's worker (annotations only: an extension may not define worker attributes)
    vllm_config: VllmConfig
    model_runner: GPUModelRunner

    # ---- set-up -----------------------------------------------------------------------------
    def deltaserve_install(self, capture: str = "auto", training_lora: str = "auto"
                           ) -> WorkerInfo:
        """Install the forward hooks (timing, capture, interrupt, the training adapter on the
        training rows) and join the engine's link. Idempotent (a second call replaces the hooks,
        e.g. with another capture path)."""
        check_version(str(vllm.__version__))
        link = link_for(self.vllm_config)
        self.deltaserve_uninstall()
        hooks = ForwardHooks(self.model_runner, link, capture, training_lora)
        hooks.install()
        self.deltaserve_hooks: ForwardHooks | None = hooks
        link.runner = self.model_runner
        cc = self.vllm_config.compilation_config
        runner = self.model_runner
        return WorkerInfo(hooks.num_layers, hooks.path, hooks.training_lora, hooks.interrupt,
                          int(cc.mode),
                          str(cc.cudagraph_mode), str(runner.device),
                          getattr(runner, "lora_manager", None) is not None,
                          views_available(runner.model))

    def deltaserve_uninstall(self) -> None:
        hooks = getattr(self, "deltaserve_hooks", None)
        if hooks is not None:
            hooks.remove()
            self.deltaserve_hooks = None

    # ---- co-serving inside this process (``deltaserve serve``) ------------------------------
    def deltaserve_attach(self, spec: JSON) -> JSON:
        """Start co-serving from a :class:`ServeSpec` (as JSON): the dataset is loaded and the
        engine loop runs the calibration; the co-server starts when it is done. Returns the
        status (poll :meth:`deltaserve_status` until it leaves ``calibrating``)."""
        side = self._deltaserve_remote()
        return to_dict(side.begin(from_dict(ServeSpec, spec)))

    def deltaserve_status(self) -> JSON:
        return to_dict(self._deltaserve_remote().status())

    def deltaserve_detach(self, drain: bool = True, checkpoint: bool = True) -> JSON:
        """Detach the co-server: a :class:`JobPoll` with its last events and counters."""
        return to_dict(self._deltaserve_remote().detach(drain=drain, checkpoint=checkpoint))

    # ---- the fine-tuning service: calibrate once, one co-server per job ---------------------
    def deltaserve_calibrate(self, spec: JSON) -> JSON:
        """Calibrate for a :class:`CalibrateSpec` (as JSON); poll :meth:`deltaserve_status`
        until it leaves ``calibrating`` (``ready``: a job may start)."""
        return to_dict(self._deltaserve_remote().calibrate(from_dict(CalibrateSpec, spec)))

    def deltaserve_job_start(self, job: JSON) -> JSON:
        """Attach a :class:`JobStart`'s co-server (as JSON); its status."""
        return to_dict(self._deltaserve_remote().start_job(from_dict(JobStart, job)))

    def deltaserve_job_poll(self) -> JSON:
        """The job's training events since the last poll, its counters and the status."""
        return to_dict(self._deltaserve_remote().poll())

    def _deltaserve_remote(self) -> RemoteCoServing:
        side = getattr(self, "deltaserve_remote", None)
        if side is None:
            side = RemoteCoServing(link_for(self.vllm_config), self.vllm_config)
            self.deltaserve_remote: RemoteCoServing | None = side
        return side
