"""The systems the simulated bench compares: the CPU bench's own specs
(:mod:`deltaserve.bench.systems`), so both run the same policies (``greedy`` and
``llmstation-pipeline`` included), every one under the host's grant (``prefill`` on a GPU), so
each pair differs in one thing. One system exists only here, where the host models more than one
grant: ``llmstation-exclusive``, LLMStation's own design (backward tasklets time-sliced into
inference iterations: the ``exclusive`` grant), reported beside ``llmstation``, from which it
differs in the grant alone. The issue's spelling ``deltaserve-nointerrupt`` is accepted for
``deltaserve-no-interrupt``.
"""

from __future__ import annotations

from dataclasses import replace

from deltaserve.bench.systems import SPECS, SYSTEMS, SystemSpec
from deltaserve.core.errors import InputError
from deltaserve.train.config import GrantPolicy

ALIASES = {"deltaserve-nointerrupt": "deltaserve-no-interrupt"}
LLMSTATION_OWN = "llmstation-exclusive"
SIM_ONLY = {LLMSTATION_OWN: replace(SPECS["llmstation"], name=LLMSTATION_OWN,
                                    grant=GrantPolicy.EXCLUSIVE, pair="llmstation")}
SIM_SYSTEM_NAMES = (*SYSTEMS, *SIM_ONLY)  # the built-in ones


def sim_systems(text: str) -> tuple[SystemSpec, ...]:
    """The listed systems in order, each once (the pilot only where listed: a sensitivity
    point needs none): any of :data:`~deltaserve.bench.systems.SPECS` (read when called, so a
    system added there runs here too) or of :data:`SIM_ONLY`."""
    known = SPECS | SIM_ONLY
    names = [ALIASES.get(n.strip(), n.strip()) for n in text.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise InputError("systems", text, "list each system once")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InputError("systems", text, f"choose from {', '.join(known)}")
    return tuple(known[n] for n in names)
