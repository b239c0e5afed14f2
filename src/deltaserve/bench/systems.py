"""The systems a benchmark compares, all on the same host, trace, model and data.

Each system but the pilot is reported beside its *pair*, the system that differs from it in one
thing only, so a ratio of the two measures that thing: ``deltaserve`` / ``llmstation``
(admission, neither overlapping forward and backward), ``deltaserve-pipeline`` /
``llmstation-pipeline`` (admission, both overlapping), ``greedy`` / ``deltaserve`` (admission
priced against Δ or blind to it; both price their yields to the backward the same way),
``greedy-fixed-yield`` / ``greedy`` (yields priced against Δ or a fixed ``max_yield_s`` before
every step; both admit blind to Δ), ``split-pool`` / ``deltaserve`` (co-serving or a static
split), ``deltaserve-temp`` and ``deltaserve-no-interrupt`` / ``deltaserve`` (the ablations).
"""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.bench.greedy import GreedyFixedYieldScheduler, GreedyScheduler
from deltaserve.bench.llmstation import LLMStationScheduler
from deltaserve.core.admission import AdmissionMode, AdmissionScheduler
from deltaserve.core.errors import InputError
from deltaserve.train.config import GrantPolicy

PILOT = "inference-only"


@dataclass(frozen=True)
class SystemSpec:
    """``coserve``: fine-tuning rides in the host's batches; ``split_pool``: the host gets part
    of the machine and a standalone trainer the rest; ``pipeline``: admission fills the next
    backward batch while the backward runs (Algorithm 1 waits for it), at one optimizer step of
    staleness in the captured activations. ``pair``: the system it is reported beside.
    ``slo_aware``: its behaviour depends on the SLO (an SLO sweep reruns it per SLO; the others
    run once and are scored against each). ``grant``: how its backward shares the device;
    both benches read it (:func:`deltaserve.bench.coserve_config.system_grant`): the bench's
    ``--backward-grant-policy`` where given, else this, else (``auto``) the host's default, the
    same for every system that names none."""

    name: str
    coserve: bool = False
    mode: AdmissionMode = AdmissionMode.FULL
    interrupt: bool = True
    scheduler_cls: type[AdmissionScheduler] = AdmissionScheduler
    split_pool: bool = False
    pipeline: bool = False
    pair: str | None = None
    slo_aware: bool = False
    grant: GrantPolicy = GrantPolicy.AUTO

    @property
    def trainer_replicas(self) -> int:
        """How much of the machine a standalone trainer holds away from the host for the whole
        run, in replicas: one GPU group of ``tp`` GPUs on the simulated host, the backward's
        threads (``--backward-threads``, default 1) on a CPU. One for split-pool, none for the
        others (co-serving trains in the host's share). Both benches size the host, the
        trainer and the hardware share the harvest is charged from this alone."""
        return 1 if self.split_pool else 0


# every compared system by name; a new system is one entry here (docs/architecture.md)
SPECS: dict[str, SystemSpec] = {s.name: s for s in (
    SystemSpec(PILOT),
    SystemSpec("deltaserve", coserve=True, pair="llmstation", slo_aware=True),
    SystemSpec("llmstation", coserve=True, scheduler_cls=LLMStationScheduler, pair="deltaserve",
               slo_aware=True),
    SystemSpec("deltaserve-pipeline", coserve=True, pipeline=True, pair="llmstation-pipeline",
               slo_aware=True),
    SystemSpec("llmstation-pipeline", coserve=True, scheduler_cls=LLMStationScheduler,
               pipeline=True, pair="deltaserve-pipeline", slo_aware=True),
    # greedy's yields are priced against the SLO (on a host that yields), so it reruns per SLO
    SystemSpec("greedy", coserve=True, scheduler_cls=GreedyScheduler, pair="deltaserve",
               slo_aware=True),
    SystemSpec("greedy-fixed-yield", coserve=True, scheduler_cls=GreedyFixedYieldScheduler,
               pair="greedy"),
    SystemSpec("split-pool", split_pool=True, pair="deltaserve"),
    # temp trains only in steps with no inference work: no slack is priced
    SystemSpec("deltaserve-temp", coserve=True, mode=AdmissionMode.TEMP, pair="deltaserve"),
    SystemSpec("deltaserve-no-interrupt", coserve=True, interrupt=False, pair="deltaserve",
               slo_aware=True),
)}
SYSTEMS = tuple(SPECS)  # the built-in systems


def parse_systems(text: str) -> tuple[SystemSpec, ...]:
    """The listed systems, with the pilot (inference-only) first whether listed or not: the
    SLO and the idle capacity are measured on it."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SPECS]
    if unknown or not names:
        raise InputError("systems", text, f"choose from {', '.join(SPECS)}")
    if len(set(names)) != len(names):
        raise InputError("systems", text, "a system is listed twice")
    return (SPECS[PILOT], *(SPECS[n] for n in names if n != PILOT))
