"""What ``deltaserve serve --engine sglang`` hands the scheduler process SGLang spawns, and what
that process reports back.

The co-serving spec (:class:`ServeSpec`, every field a ``--finetune-*`` flag; the vLLM host's
counterpart is :class:`deltaserve.hosts.vllm.remote.ServeSpec`) travels as a file named by
``DELTASERVE_SGLANG_SERVE`` (:data:`~deltaserve.hosts.sglang.version.SERVE_ENV`) in the
environment SGLang's processes inherit; the plugin then runs
:class:`~deltaserve.hosts.sglang.serving.ServingScheduler`. The status (:class:`ServeStatus`)
comes back through a JSON file the scheduler rewrites atomically: when its state changes and
about once a second while it co-serves.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path

from deltaserve.core.admission import AdmissionConfig
from deltaserve.core.errors import require
from deltaserve.core.slo import SLOConfig
from deltaserve.model.lora import LoRAConfig
from deltaserve.train.checkpoint_store import CheckpointConfig
from deltaserve.train.config import BackwardConfig, CoServeConfig
from deltaserve.train.events import CoServeStats
from deltaserve.train.optim import OptimizerConfig


@dataclass(frozen=True)
class ServeSpec:
    """One dataset co-served inside SGLang's own server. ``dataset``: the fine-tuning data
    (Alpaca JSON/JSONL, chat JSONL or ShareGPT). ``latency_model``: a fitted latency model's
    JSON (skips calibration). ``status_file``: where the scheduler reports (default:
    ``status.json`` beside the checkpoints, else in the temporary directory)."""

    dataset: str | None = field(default=None, metadata={"help": "fine-tuning data (required)"})
    ttft_slo_ms: float = 2000.0
    tpot_slo_ms: float = 200.0
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    backward: BackwardConfig = field(default_factory=BackwardConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    num_epochs: int = 1
    latency_model: str | None = None
    status_file: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        require(bool(self.dataset), "finetune_dataset", self.dataset, "is required")
        require(self.latency_model is None or Path(self.latency_model).is_file(),
                "finetune_latency_model", self.latency_model, "no such file")

    def coserve(self) -> CoServeConfig:
        return CoServeConfig(SLOConfig(self.ttft_slo_ms / 1e3, self.tpot_slo_ms / 1e3),
                             self.admission, self.lora, self.optimizer,
                             checkpoint=self.checkpoint, backward=self.backward,
                             num_epochs=self.num_epochs, seed=self.seed)

    def status_path(self) -> Path:
        if self.status_file:
            return Path(self.status_file)
        root = self.checkpoint.root
        return Path(root) / "status.json" if root else Path(os.environ.get(
            "TMPDIR", "/tmp")) / f"deltaserve-sglang-{os.getpid()}.json"

    def write(self, path: Path) -> None:
        """For the scheduler process (our own file, read by our own child)."""
        path.write_bytes(pickle.dumps(self))
        path.chmod(0o600)

    @staticmethod
    def read(path: str | os.PathLike) -> ServeSpec:
        config = pickle.loads(Path(path).read_bytes())
        assert isinstance(config, ServeSpec)
        return config


class ServeState(StrEnum):
    STARTING = "starting"
    CALIBRATING = "calibrating"
    COSERVING = "coserving"
    FAILED = "failed"  # co-serving could not start; SGLang serves inference alone
    STOPPED = "stopped"  # detached: the last committed step is checkpointed


@dataclass(frozen=True)
class ServeStatus:
    """The scheduler process's report. ``at_s``: wall-clock time it was written."""

    state: ServeState
    pid: int
    samples: int = 0
    stats: CoServeStats | None = None
    error: str | None = None
    at_s: float = field(default_factory=time.time)

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)  # readers never see a half-written file

    @staticmethod
    def read(path: Path) -> ServeStatus | None:
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        stats = CoServeStats(**d["stats"]) if d.get("stats") else None
        return ServeStatus(ServeState(d["state"]), d["pid"], d["samples"], stats, d["error"],
                           d["at_s"])
