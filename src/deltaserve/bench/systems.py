"""The systems a benchmark compares, all on the same host, trace, model and data."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.bench.llmstation import LLMStationScheduler
from deltaserve.core.admission import AdmissionMode, AdmissionScheduler
from deltaserve.core.errors import InputError

SYSTEMS = ("inference-only", "deltaserve", "deltaserve-pipeline", "deltaserve-temp",
           "deltaserve-no-interrupt", "llmstation", "split-pool")


@dataclass(frozen=True)
class SystemSpec:
    """``coserve``: fine-tuning rides in the host's batches; ``split_pool``: the host gets part
    of the machine and a standalone trainer the rest; ``pipeline``: admission fills the next
    backward batch while the backward runs (Algorithm 1 waits for it), at one optimizer step of
    staleness in the captured activations."""

    name: str
    coserve: bool = False
    mode: AdmissionMode = AdmissionMode.FULL
    interrupt: bool = True
    scheduler_cls: type[AdmissionScheduler] = AdmissionScheduler
    split_pool: bool = False
    pipeline: bool = False


_SPECS = {
    "inference-only": SystemSpec("inference-only"),
    "deltaserve": SystemSpec("deltaserve", coserve=True),
    "deltaserve-pipeline": SystemSpec("deltaserve-pipeline", coserve=True, pipeline=True),
    "deltaserve-temp": SystemSpec("deltaserve-temp", coserve=True, mode=AdmissionMode.TEMP),
    "deltaserve-no-interrupt": SystemSpec("deltaserve-no-interrupt", coserve=True,
                                          interrupt=False),
    "llmstation": SystemSpec("llmstation", coserve=True, scheduler_cls=LLMStationScheduler),
    "split-pool": SystemSpec("split-pool", split_pool=True),
}


def parse_systems(text: str) -> tuple[SystemSpec, ...]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in _SPECS]
    if unknown or not names:
        raise InputError("systems", text, f"choose from {', '.join(SYSTEMS)}")
    if len(set(names)) != len(names):
        raise InputError("systems", text, "a system is listed twice")
    return tuple(_SPECS[n] for n in names)
