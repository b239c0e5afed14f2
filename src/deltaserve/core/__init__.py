"""Host-agnostic control plane: step shapes, the latency model, SLO budgets, admission
(Algorithm 1), the sample pool and fine-tuning data. Pure Python and numpy: importing it never
imports torch or an inference engine."""

from deltaserve.core.admission import (
    AdmissionConfig,
    AdmissionMode,
    AdmissionPlan,
    AdmissionScheduler,
    AdmittedSample,
    SchedulingView,
    Skip,
)
from deltaserve.core.buffer_ledger import BufferLedger, RowSpan
from deltaserve.core.calibration import (
    Batching,
    CalibrationConfig,
    CalibrationProbe,
    HostLimits,
    ProbeKind,
    build_plan,
)
from deltaserve.core.contract import (
    CoServingHooks,
    StepReport,
    TrainingHost,
    TrainingRows,
    TrainingStep,
)
from deltaserve.core.data import DataConfig, DatasetReport, TrainingSample, load_dataset
from deltaserve.core.errors import InputError
from deltaserve.core.latency_model import Equation, LatencyModel, LatencyModelConfig
from deltaserve.core.pool import PoolProgress, PoolStateError, SamplePool
from deltaserve.core.shape import ExecMode, StepShape
from deltaserve.core.slo import SLOConfig, StepBudget, WaitingRequest

__all__ = [
    "AdmissionConfig", "AdmissionMode", "AdmissionPlan", "AdmissionScheduler", "AdmittedSample",
    "Batching", "BufferLedger", "CalibrationConfig", "CalibrationProbe", "CoServingHooks",
    "DataConfig", "DatasetReport", "Equation", "ExecMode", "HostLimits", "InputError",
    "LatencyModel", "LatencyModelConfig", "PoolProgress", "PoolStateError", "ProbeKind", "RowSpan",
    "SLOConfig", "SamplePool", "SchedulingView", "Skip", "StepBudget", "StepReport", "StepShape",
    "TrainingHost", "TrainingRows", "TrainingSample", "TrainingStep", "WaitingRequest",
    "build_plan", "load_dataset",
]
