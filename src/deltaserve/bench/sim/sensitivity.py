"""Sensitivity of the comparison to every modelled (not profiled) parameter: each field of
:class:`~deltaserve.hosts.sim.modelled.ModelledParams` at the low and high ends of its documented
range (the others at their defaults), the oracle rebuilt and the latency model recalibrated
against it, and DeltaServe, LLMStation and split-pool replayed on the same trace.

A row says whether DeltaServe's ranking (its FT tokens/s above both baselines, at an SLO
attainment no lower than theirs) and its ratios against each hold as at the defaults."""

from __future__ import annotations

from dataclasses import fields, replace

from deltaserve.bench.sim.run import SimSetup, prepare, run_systems, scored_json
from deltaserve.bench.sim.systems import sim_systems
from deltaserve.hosts.sim.modelled import ModelledParams
from deltaserve.workloads.trace import Trace

SENSITIVITY_SYSTEMS = "deltaserve,llmstation,split-pool"


def _point(setup: SimSetup, trace: Trace, replicas: int) -> dict:
    scored = scored_json(setup, run_systems(setup, sim_systems(SENSITIVITY_SYSTEMS), replicas,
                                            trace), 0.0)
    ft = {n: s["ft_tokens_per_s"] for n, s in scored.items()}
    slo = {n: s["slo_attainment"] for n, s in scored.items()}
    ds = ft["deltaserve"]
    return {"ft_tokens_per_s": ft, "slo_attainment": slo,
            "vs_llmstation": ds / ft["llmstation"] if ft["llmstation"] else None,
            "vs_split_pool": ds / ft["split-pool"] if ft["split-pool"] else None,
            "ranked_first": all(ds > ft[b] and slo["deltaserve"] >= slo[b] - 1e-9
                                for b in ("llmstation", "split-pool"))}


def sweep(base: SimSetup, trace: Trace, replicas: int, echo=print) -> dict:
    """The defaults, then each parameter at each end of its range."""
    default = _point(base, trace, replicas)
    echo(f"defaults: {_line(default)}")
    rows = []
    for f in fields(ModelledParams):
        for end, value in zip(("low", "high"), f.metadata["range"], strict=True):
            params = replace(ModelledParams(), **{f.name: type(f.default)(value)})
            setup = prepare(base.cfg, params, base.profiles, base.data)
            point = _point(setup, trace, replicas)
            point |= {"param": f.name, "end": end, "value": value,
                      "ratios_same_side": _same_side(point, default)}
            rows.append(point)
            echo(f"{f.name}={value:g}: {_line(point)}")
    return {"systems": SENSITIVITY_SYSTEMS, "trace": trace.name, "replicas": replicas,
            "default": default, "rows": rows}


def _same_side(point: dict, default: dict) -> bool:
    """Each ratio stays on the same side of 1 as at the defaults."""
    return all(((point[k] or 0) > 1) == ((default[k] or 0) > 1)
               for k in ("vs_llmstation", "vs_split_pool"))


def _line(p: dict) -> str:
    ft = p["ft_tokens_per_s"]
    return (f"DS {ft['deltaserve']:.0f} LLMS {ft['llmstation']:.0f} split {ft['split-pool']:.0f}"
            f" tok/s; ×LLMS {p['vs_llmstation'] or 0:.2f} ×split {p['vs_split_pool'] or 0:.2f};"
            f" first: {p['ranked_first']}")


def sensitivity_markdown(doc: dict) -> str:
    d = doc["default"]
    lines = [f"## Sensitivity to the modelled parameters ({doc['trace']}, "
             f"{doc['replicas']} replicas)", "",
             "Each parameter at one end of its documented range, the others at their defaults; "
             "the oracle rebuilt and the latency model recalibrated each time.", "",
             "| parameter | value | DS tok/s | ÷ LLMStation | ÷ split-pool | DeltaServe first | "
             "ratios hold |", "|---|---|---|---|---|---|---|",
             f"| (defaults) | | {d['ft_tokens_per_s']['deltaserve']:.0f} | "
             f"{_x(d['vs_llmstation'])} | {_x(d['vs_split_pool'])} | "
             f"{'yes' if d['ranked_first'] else 'no'} | |"]
    for r in doc["rows"]:
        lines.append(f"| {r['param']} ({r['end']}) | {r['value']:g} | "
                     f"{r['ft_tokens_per_s']['deltaserve']:.0f} | {_x(r['vs_llmstation'])} | "
                     f"{_x(r['vs_split_pool'])} | {'yes' if r['ranked_first'] else 'no'} | "
                     f"{'yes' if r['ratios_same_side'] else 'no'} |")
    return "\n".join(lines) + "\n"


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"
