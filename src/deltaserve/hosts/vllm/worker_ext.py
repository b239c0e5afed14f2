"""``CoServingWorkerExtension``: what DeltaServe adds to vLLM's worker.

Passed to vLLM as ``worker_extension_cls``; vLLM appends it to the worker class's bases, so its
methods become worker methods callable through ``collective_rpc``. vLLM forbids overriding any
worker attribute and never runs an extension's ``__init__``, so every method here is new
(``deltaserve_*``) and state is set up by the explicit :meth:`deltaserve_install` call.

The worker and the scheduler meet in :mod:`registry` (same process, same ``VllmConfig``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from deltaserve.hosts.vllm import registry
from deltaserve.hosts.vllm.hooks import ForwardHooks
from deltaserve.hosts.vllm.publish import AdapterPublisher
from deltaserve.hosts.vllm.version import check_version


@dataclass(frozen=True)
class WorkerInfo:
    """Facts about the worker's model the host reports and checks."""

    num_layers: int
    capture_path: str
    interrupt: bool
    compilation_mode: int
    cudagraph_mode: str
    device: str
    has_lora: bool
    weights_viewable: bool


class CoServingWorkerExtension:
    # ---- set-up -----------------------------------------------------------------------------
    def deltaserve_install(self, capture: str = "auto", interrupt: bool = True) -> dict:
        """Install the forward hooks (timing, capture, interrupt) and join the engine's link.
        Idempotent. Returns :class:`WorkerInfo` as a dict (it crosses process boundaries)."""
        import vllm

        from deltaserve.hosts.vllm.weights import views_available

        check_version(str(vllm.__version__))
        link = registry.link_for(self.vllm_config)
        old = getattr(self, "_deltaserve_hooks", None)
        if old is not None:
            old.remove()
        hooks = ForwardHooks(self.model_runner, link, capture=capture, interrupt=interrupt)
        hooks.install()
        self._deltaserve_hooks = hooks
        link.worker = self
        cc = self.vllm_config.compilation_config
        runner = self.model_runner
        return asdict(WorkerInfo(
            hooks.num_layers, hooks.path, hooks.interrupt, int(cc.mode), str(cc.cudagraph_mode),
            str(runner.device), getattr(runner, "lora_manager", None) is not None,
            views_available(runner.model)))

    def deltaserve_uninstall(self) -> None:
        hooks = getattr(self, "_deltaserve_hooks", None)
        if hooks is not None:
            hooks.remove()
            self._deltaserve_hooks = None

    def deltaserve_reserve_adapter(self, name: str, lora_id: int, path: str) -> int:
        """Load the PEFT adapter at ``path`` as vLLM LoRA ``lora_id`` (replacing any adapter with
        that id), pin it so LRU eviction never drops it, and point the publisher at its slot.
        Returns the slot index."""
        from vllm.lora.request import LoRARequest

        if getattr(self.model_runner, "lora_manager", None) is None:
            raise RuntimeError("vLLM was started without LoRA support: pass enable_lora=True")
        if lora_id in self.list_loras():
            self.remove_lora(lora_id)
        request = LoRARequest(name, lora_id, path)
        if not self.add_lora(request):
            raise RuntimeError(f"vLLM refused to load the training adapter from {path}")
        self.pin_lora(lora_id)
        link = registry.link_for(self.vllm_config)
        link.train_lora = request
        link.publisher = AdapterPublisher(self.model_runner, lora_id)
        return link.publisher.slot

    # ---- co-serving inside this process (``deltaserve serve``) ------------------------------
    def deltaserve_attach(self, spec: dict) -> dict:
        """Start attaching a co-server in the engine process from a JSON-able spec
        (:class:`deltaserve.hosts.vllm.remote.RemoteSpec`); the engine loop then runs the
        calibration and the co-server starts when it is done. Returns the status."""
        from deltaserve.hosts.vllm.remote import begin_remote_attach

        return begin_remote_attach(self, spec)

    def deltaserve_status(self) -> dict:
        from deltaserve.hosts.vllm.remote import remote_status

        return remote_status(self)

    def deltaserve_detach(self, drain: bool = True, checkpoint: bool = True) -> dict:
        from deltaserve.hosts.vllm.remote import remote_detach

        return remote_detach(self, drain, checkpoint)
