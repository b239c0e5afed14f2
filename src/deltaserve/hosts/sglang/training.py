"""The co-server's side of the host contract (:class:`~deltaserve.core.contract.TrainingHost`)
over a :class:`~deltaserve.hosts.sglang.scheduler.CoServingScheduler`, wherever it runs: in the
caller's process (:class:`~deltaserve.hosts.sglang.host.SGLangHost` delegates to it) or in the
scheduler process of SGLang's own server (:mod:`deltaserve.hosts.sglang.serving`).

Adapters are SGLang's own: a PEFT directory loaded through the scheduler's
``load_lora_adapter`` (the path SGLang's ``/load_lora_adapter`` endpoint takes). The training
adapter is loaded ``pinned`` under a reserved name no client can send (names starting with
``deltaserve-`` are refused by the client API) and slotted at once; the backward publishes into
its slot in place (:mod:`.publish`).
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

import torch
from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput

from deltaserve.core.calibration import CalibrationConfig, HostLimits
from deltaserve.core.calibration_loop import run_calibration
from deltaserve.core.contract import CoServingHooks
from deltaserve.core.errors import InputError
from deltaserve.core.latency_model import LatencyModel, LatencyModelConfig
from deltaserve.core.tokenizer import Tokenizer
from deltaserve.hosts.base import RESERVED_ADAPTER_PREFIX
from deltaserve.hosts.sglang.calibrate import SGLangProber
from deltaserve.hosts.sglang.publish import AdapterPublisher
from deltaserve.hosts.sglang.scheduler import CoServingScheduler
from deltaserve.hosts.sglang.weights import weights_from_sglang
from deltaserve.model.config import ModelConfig
from deltaserve.model.llama import BaseWeights
from deltaserve.model.lora import AdapterWeights, LoRAConfig
from deltaserve.model.peft_io import save_adapter

TRAIN_ADAPTER = f"{RESERVED_ADAPTER_PREFIX}train"


class SchedulerTrainingHost:
    """:class:`~deltaserve.core.contract.TrainingHost` over one SGLang scheduler."""

    def __init__(self, scheduler: CoServingScheduler, model_path: Path,
                 model_config: ModelConfig, tokenizer: Tokenizer | None, limits: HostLimits):
        self.scheduler = scheduler
        self._model_path = model_path
        self._model_config = model_config
        self._tokenizer = tokenizer
        self._limits = limits
        self._dir = Path(tempfile.mkdtemp(prefix="deltaserve-sglang-"))
        self._publisher: AdapterPublisher | None = None

    # ---- TrainingHost -----------------------------------------------------------------------
    @property
    def limits(self) -> HostLimits:
        return self._limits

    @property
    def model_path(self) -> str:
        return str(self._model_path)

    @property
    def model_config(self) -> ModelConfig:
        return self._model_config

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    @property
    def dtype(self) -> torch.dtype:
        return next(self.scheduler.tp_worker.model_runner.model.parameters()).dtype

    def backward_weights(self) -> BaseWeights:
        return weights_from_sglang(self.scheduler.tp_worker.model_runner.model,
                                   self._model_config)

    def training_dropout(self, lora: LoRAConfig) -> float:
        return 0.0  # SGLang's LoRA kernels apply no dropout

    def install_training_adapter(self, adapter: AdapterWeights) -> None:
        """Load ``adapter`` as SGLang's pinned, slotted training adapter (replacing one
        installed before)."""
        self.check_adapter(adapter.config, "lora")
        if self.scheduler.deltaserve_train_lora_id is not None:
            self.unload(TRAIN_ADAPTER, self.scheduler.deltaserve_train_lora_id)
        lora_id = self.load_weights(TRAIN_ADAPTER, adapter, pinned=True)
        self.scheduler.deltaserve_train_lora_id = lora_id
        self._publisher = AdapterPublisher(self.scheduler.tp_worker.model_runner.lora_manager,
                                           lora_id)

    def publish_adapter(self, adapter: AdapterWeights) -> None:
        if self._publisher is None:
            raise RuntimeError("publish_adapter before install_training_adapter")
        self._publisher.publish(adapter)

    def calibrate(self, lora: LoRAConfig, calibration: CalibrationConfig | None,
                  latency: LatencyModelConfig | None, *, seed: int = 0,
                  progress: bool = True) -> LatencyModel:
        self.check_adapter(lora, "lora")
        return run_calibration(SGLangProber(self, lora, seed=seed), calibration, latency,
                               progress=progress)

    def set_coserver(self, co: CoServingHooks | None) -> None:
        self.scheduler.deltaserve_co = co

    def has_unfinished(self) -> bool:
        return self.scheduler.deltaserve_has_unfinished()

    # ---- SGLang's adapters ------------------------------------------------------------------
    def check_adapter(self, lora: LoRAConfig, field: str) -> None:
        """Raise :class:`InputError` unless SGLang's LoRA pool can hold ``lora``."""
        args = self.scheduler.server_args
        if lora.r > args.max_lora_rank:
            raise InputError(f"{field}_r", lora.r, f"SGLang was started with max_lora_rank="
                             f"{args.max_lora_rank}")
        configured = set(args.lora_target_modules or ())
        missing = sorted(set(lora.target_modules) - configured)
        if missing and "all" not in configured:
            raise InputError("target_modules", missing, "SGLang was started with "
                             f"lora_target_modules={args.lora_target_modules}")

    def load(self, name: str, path: str, *, pinned: bool = False) -> str:
        """Load the PEFT adapter at ``path`` into SGLang as ``name``; returns its SGLang id."""
        lora_id = uuid.uuid4().hex
        out = self.scheduler.load_lora_adapter(LoadLoRAAdapterReqInput(
            lora_name=name, lora_path=path, pinned=pinned, lora_id=lora_id))
        if not out.success:
            raise InputError("adapter", path, f"SGLang cannot load it: {out.error_message}")
        return lora_id

    def load_weights(self, name: str, adapter: AdapterWeights, *, pinned: bool = False) -> str:
        """Load ``adapter`` into SGLang as ``name`` (through a PEFT directory of its own)."""
        path = save_adapter(self._dir / uuid.uuid4().hex, adapter, self.model_path)
        return self.load(name, str(path), pinned=pinned)

    def unload(self, name: str, lora_id: str) -> None:
        self.scheduler.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=name,
                                                                     lora_id=lora_id))

    def read_slot(self, lora: LoRAConfig) -> AdapterWeights:
        """The training adapter's weights as the forward reads them (its pool slot)."""
        if self._publisher is None:
            raise RuntimeError("no training adapter installed")
        return self._publisher.read(self._model_config, lora)

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
