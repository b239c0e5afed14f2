"""The systems the simulated bench compares: the CPU bench's own specs
(:mod:`deltaserve.bench.systems`), so both run the same policies (``greedy`` and
``llmstation-pipeline`` included). The issue's spelling ``deltaserve-nointerrupt`` is accepted
for ``deltaserve-no-interrupt``.
"""

from __future__ import annotations

from deltaserve.bench.systems import SystemSpec, parse_systems
from deltaserve.core.errors import InputError

ALIASES = {"deltaserve-nointerrupt": "deltaserve-no-interrupt"}


def sim_systems(text: str) -> tuple[SystemSpec, ...]:
    """The listed systems in order, each once (the pilot only where listed: a sensitivity
    point needs none)."""
    names = [ALIASES.get(n.strip(), n.strip()) for n in text.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise InputError("systems", text, "list each system once")
    return tuple(parse_systems(name)[-1] for name in names)
