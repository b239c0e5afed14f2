"""The SLO a bench run is scored against, and where it came from.

The pilot (inference-only on the trace, on the whole machine) measures each request's TTFT and
longest gap between tokens. The SLO is ``scale`` × the pilot's p99 of each, so it follows the
host, model and load instead of being a guess; ``--ttft-slo-ms`` / ``--tpot-slo-ms`` fix a side.
With ``--pilot-repeats N`` the pilot runs N times and its p99 is their median.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from deltaserve.core.errors import InputError
from deltaserve.core.slo import SLOConfig

FROM_PILOT = "pilot"
FROM_FLAG = "flag"


@dataclass(frozen=True)
class SLOChoice:
    """``ttft_from`` / ``tpot_from``: ``pilot`` (``scale`` × the pilot's p99, the median over
    ``pilots`` of them) or ``flag`` (given on the command line)."""

    ttft_ms: float
    tpot_ms: float
    scale: float
    ttft_from: str
    tpot_from: str
    pilot_ttft_p99_ms: float
    pilot_tpot_p99_ms: float
    pilots: int = 1

    @property
    def config(self) -> SLOConfig:
        return SLOConfig(self.ttft_ms / 1e3, self.tpot_ms / 1e3)

    def describe(self) -> str:
        """One sentence: the SLO and its origin."""
        def side(name: str, ms: float, origin: str, p99: float) -> str:
            whose = "the pilot's p99" if self.pilots == 1 \
                else f"the median of {self.pilots} pilots' p99s"
            how = (f"{self.scale:g} × {whose} {p99:.0f} ms" if origin == FROM_PILOT
                   else f"--{name.lower().replace(' ', '-')}-slo-ms")
            return f"{name} {ms:.0f} ms ({how})"

        return (side("TTFT", self.ttft_ms, self.ttft_from, self.pilot_ttft_p99_ms) + ", "
                + side("TPOT", self.tpot_ms, self.tpot_from, self.pilot_tpot_p99_ms)
                + " per request")


def median_p99s_ms(p99s: Sequence[tuple[float | None, float | None]]
                   ) -> tuple[float | None, float | None]:
    """The median over the pilots of each side's p99 (TTFT, max TPOT), a pilot that measured
    none on a side left out of it (None: no pilot measured that side)."""
    def median(values: list[float | None]) -> float | None:
        measured = [v for v in values if v is not None]
        return statistics.median(measured) if measured else None

    return median([t for t, _ in p99s]), median([g for _, g in p99s])


def derive_slo(pilot_ttft_p99_ms: float | None, pilot_tpot_p99_ms: float | None, scale: float,
               ttft_override_ms: float | None = None,
               tpot_override_ms: float | None = None, pilots: int = 1) -> SLOChoice:
    """The SLO at ``scale`` × the pilot's p99s (over ``pilots`` pilots, their medians), a side
    overridden where a value is given."""
    for name, v, given in (("ttft", pilot_ttft_p99_ms, ttft_override_ms),
                           ("tpot", pilot_tpot_p99_ms, tpot_override_ms)):
        if given is None and (v is None or v <= 0):
            raise InputError(f"{name}_slo_ms", given, f"the pilot measured no {name.upper()} "
                             f"p99 ({v}) to derive it from: give --{name}-slo-ms, or a "
                             "longer --duration")
    ttft_p99 = pilot_ttft_p99_ms or 0.0
    tpot_p99 = pilot_tpot_p99_ms or 0.0
    return SLOChoice(
        ttft_override_ms if ttft_override_ms is not None else scale * ttft_p99,
        tpot_override_ms if tpot_override_ms is not None else scale * tpot_p99,
        scale,
        FROM_FLAG if ttft_override_ms is not None else FROM_PILOT,
        FROM_FLAG if tpot_override_ms is not None else FROM_PILOT,
        ttft_p99, tpot_p99, pilots)
