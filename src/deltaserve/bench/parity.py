"""Every host side by side, from committed runs: each system's fine-tuning rate, SLO
attainment, harvest and latency-model error, and each host's check of issue 23's goal.

A document block between ``<!-- hosts-parity: DIR DIR ... -->`` and ``<!-- /hosts-parity -->``
(each DIR a results folder holding ``results.json`` and, where the run recorded one,
``COMMAND``; relative to the document's folder; one or more per host) holds exactly
:func:`render` of those runs. ``python -m deltaserve.bench.tables --update FILE`` rewrites it.
A host with several runs (e.g. one with the pipelined systems beside the check command's) is
checked part by part on the first of its runs, in the block's order, that ran the systems the
part compares: every part is decided within one run, against that run's greedy or llmstation,
never across runs.

The goal, on each host at that host's SLO, decided on the medians of N ≥ 3 repeats:

* deltaserve and deltaserve-pipeline meet the SLO (attainment ≥ ``MET``) where greedy does not;
* deltaserve's FT tokens/s ≥ llmstation's, with the two systems' repeat ranges apart (a margin
  the repeats' noise cannot explain);
* deltaserve's harvest ≥ llmstation's.

Each check says met, not met, or not measured (a system not run, fewer than N repeats, an SLO
that inference alone misses or greedy meets), with the figures it was decided on. A figure
the results do not hold prints "—".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from deltaserve.bench.score import MET, overlaps
from deltaserve.bench.systems import PILOT

MACHINE_TIME = "machine_time.json"  # :mod:`deltaserve.bench.machine_time`'s report
MIN_REPEATS = 3  # the N: fewer repeats cannot say whether a margin is noise
MISSING = "—"
HOST_NAMES = {"native": "embedded (native)", "vllm": "vLLM", "sglang": "SGLang",
              "sim": "simulated"}
SIMULATED = "sim"  # the goal is for real hosts; the simulated one is checked for reference
GREEDY, LLMSTATION = "greedy", "llmstation"
DELTASERVE, PIPELINE = "deltaserve", "deltaserve-pipeline"
GOAL_SYSTEMS = (PILOT, DELTASERVE, PIPELINE, LLMSTATION, GREEDY)  # a row each, run or not
COLUMNS = ("host", "system", "FT tokens/s", "SLO attainment", "harvest",
           "latency MAPE online, per mode")


class Verdict(StrEnum):
    MET = "met"
    NOT_MET = "not met"
    NOT_MEASURED = "not measured"


@dataclass(frozen=True)
class Check:
    """One part of the goal on one host: what it asks, the verdict, and why (the figures it
    was decided on, or what was missing)."""

    goal: str
    verdict: Verdict
    why: str


@dataclass(frozen=True)
class HostRun:
    """One host's committed run: its folder as the document names it, its ``results.json``,
    and its ``COMMAND`` file's text (None: the folder has none)."""

    folder: str
    doc: dict
    command: str | None
    machine_time: dict | None = None  # the folder's machine_time.json, where it has one

    @property
    def host(self) -> str:
        return self.doc["machine"]["host"]

    @property
    def label(self) -> str:
        return HOST_NAMES.get(self.host, self.host)


def load_runs(base: Path, folders: Sequence[str]) -> list[HostRun]:
    """The runs in ``folders`` (relative to ``base``); a missing results.json raises
    FileNotFoundError."""
    runs = []
    for folder in folders:
        command, split = base / folder / "COMMAND", base / folder / MACHINE_TIME
        runs.append(HostRun(folder, json.loads((base / folder / "results.json").read_text()),
                            command.read_text() if command.is_file() else None,
                            json.loads(split.read_text()) if split.is_file() else None))
    return runs


def repeats(doc: dict) -> int:
    return doc.get("repeats") or 1


def _value(s: dict, key: str) -> float | None:
    if key == "harvest_ratio":  # the median tokens' harvest; older files hold only the ratio
        return (s.get("harvest") or {}).get("ratio", s.get("harvest_ratio"))
    return s.get(key)


def _spread(s: dict, key: str) -> tuple[float, float] | None:
    r = (s.get("range") or {}).get(key)
    return None if r is None else (r[0], r[1])


def figure(s: dict, key: str, fmt: str, scale: float = 1.0, unit: str = "") -> str:
    """``s[key]`` (the median, where repeated) and its range over the repeats in brackets:
    "114.9 [107.7–129.3]"; "—" where the results hold no such figure."""
    v = _value(s, key)
    if v is None:
        return MISSING
    text = f"{scale * v:{fmt}}{unit}"
    r = _spread(s, key)
    return text if r is None else f"{text} [{scale * r[0]:{fmt}}–{scale * r[1]:{fmt}}{unit}]"


def _attainment(s: dict) -> str:
    return figure(s, "slo_attainment", ".1f", 100, " %")


def _mape(s: dict) -> str:
    """The online latency-model error per execution mode (pooled over the repeats' steps)."""
    modes = [f"{m['mode']} {100 * m['online_mape']:.1f} %"
             for m in s.get("latency_model_by_mode") or [] if m.get("online_mape") is not None]
    return ", ".join(modes) or MISSING


def repeats_note(doc: dict) -> str:
    n = repeats(doc)
    return (f"N={n}, medians [min–max]" if n >= MIN_REPEATS
            else f"N={n}, below the issue's N≥{MIN_REPEATS}")


def _gate(doc: dict, goal: str, names: Sequence[str], figures: str) -> Check | None:
    """The check's verdict where it cannot be measured: a system not run, too few repeats."""
    missing = [n for n in names if n not in doc["systems"]]
    if missing:
        return Check(goal, Verdict.NOT_MEASURED, f"{' and '.join(missing)} not run")
    if repeats(doc) < MIN_REPEATS:
        return Check(goal, Verdict.NOT_MEASURED, f"{repeats_note(doc)}; {figures}")
    return None


def attainment_check(doc: dict, name: str) -> Check:
    """``name`` meets the SLO where greedy misses it (medians)."""
    goal = f"{name} ≥ {100 * MET:.0f} % SLO attainment where greedy is below it"
    systems = doc["systems"]
    figures = ", ".join(f"{n} {_attainment(systems[n])}" for n in (name, GREEDY, PILOT)
                        if n in systems)
    gated = _gate(doc, goal, (name, GREEDY), figures)
    if gated:
        return gated
    pilot = systems.get(PILOT)
    if pilot is not None and pilot["slo_attainment"] < MET:
        return Check(goal, Verdict.NOT_MEASURED, f"inference alone misses this SLO; {figures}")
    if systems[GREEDY]["slo_attainment"] >= MET:
        return Check(goal, Verdict.NOT_MEASURED,
                     f"greedy meets this SLO, so it does not bind; {figures}")
    met = systems[name]["slo_attainment"] >= MET
    return Check(goal, Verdict.MET if met else Verdict.NOT_MET, figures)


def ft_check(doc: dict, machine_time: dict | None = None) -> Check:
    """deltaserve's FT tokens/s above llmstation's, the repeat ranges not overlapping; where
    it is not met and the run's ``machine_time`` report is given, what bound the margin."""
    goal = "deltaserve FT tokens/s ≥ llmstation's, outside the repeats' range"
    systems = doc["systems"]
    key = "ft_tokens_per_s"
    figures = ", ".join(f"{n} {figure(systems[n], key, '.1f')}"
                        for n in (DELTASERVE, LLMSTATION) if n in systems)
    gated = _gate(doc, goal, (DELTASERVE, LLMSTATION), figures)
    if gated:
        return gated
    ds, ll = systems[DELTASERVE], systems[LLMSTATION]
    within = overlaps(_spread(ds, key), _spread(ll, key))
    if within is None or ds.get(key) is None or ll.get(key) is None:
        return Check(goal, Verdict.NOT_MEASURED,
                     f"no figure or repeat range recorded; {figures}")
    if ds[key] < ll[key]:
        return Check(goal, Verdict.NOT_MET,
                     f"below llmstation's; {figures}{ceiling_note(machine_time)}")
    if within:
        return Check(goal, Verdict.NOT_MET,
                     f"within the repeats' range; {figures}{ceiling_note(machine_time)}")
    return Check(goal, Verdict.MET, figures)


def ceiling_note(machine_time: dict | None) -> str:
    """What llmstation's repeats left to any policy (:mod:`deltaserve.bench.machine_time`):
    at its ceiling in every repeat, a system would still train in its worst repeat at most
    ``min(ceiling_k × tokens_k)`` tokens; where that is not above llmstation's best repeat,
    no admission policy could have put the ranges apart on this host. Empty without a
    report or an llmstation entry in it."""
    ll = (machine_time or {}).get("systems", {}).get(LLMSTATION, {})
    reps = [r for r in ll.get("repeats", []) if r.get("ceiling")]
    if not reps:
        return ""
    best_low = min(r["ceiling"] * r["backward_tokens"] for r in reps)
    top = max(r["backward_tokens"] for r in reps)
    ceilings = [r["ceiling"] for r in reps]
    verdict = ("so no admission policy could have put the ranges apart here" if best_low <= top
               else "so a policy could still have put the ranges apart")
    return (f"; {MACHINE_TIME}: no policy could have trained more than "
            f"{min(ceilings):.2f}–{max(ceilings):.2f}× llmstation's tokens in its repeats; at "
            f"that ceiling the worst repeat reaches {best_low:.0f} tokens, llmstation's best "
            f"repeat trained {top:.0f}, {verdict}")


def harvest_check(doc: dict) -> Check:
    """deltaserve's harvest at least llmstation's (medians)."""
    goal = "deltaserve harvest ≥ llmstation's"
    systems = doc["systems"]
    key = "harvest_ratio"
    figures = ", ".join(f"{n} {figure(systems[n], key, '.2f')}"
                        for n in (DELTASERVE, LLMSTATION) if n in systems)
    gated = _gate(doc, goal, (DELTASERVE, LLMSTATION), figures)
    if gated:
        return gated
    ds, ll = _value(systems[DELTASERVE], key), _value(systems[LLMSTATION], key)
    if ds is None or ll is None:
        return Check(goal, Verdict.NOT_MEASURED, f"no harvest recorded; {figures}")
    return Check(goal, Verdict.MET if ds >= ll else Verdict.NOT_MET, figures)


def goal_checks(doc: dict, machine_time: dict | None = None) -> list[Check]:
    """The goal's parts on one run (:func:`host_checks` of a host with that run alone)."""
    return host_checks([HostRun("", doc, None, machine_time)])


def _deciding(group: Sequence[HostRun], names: Sequence[str]) -> HostRun:
    """The first run of one host's ``group`` that ran every system in ``names`` (the first run
    where none did: its check then says which is missing)."""
    return next((r for r in group if all(n in r.doc["systems"] for n in names)), group[0])


def host_checks(group: Sequence[HostRun]) -> list[Check]:
    """The goal's parts on one host, each decided within the run :func:`_deciding` picks;
    where the host has several runs, each part's reason names its run."""
    parts = [
        ((DELTASERVE, GREEDY), lambda r: attainment_check(r.doc, DELTASERVE)),
        ((PIPELINE, GREEDY), lambda r: attainment_check(r.doc, PIPELINE)),
        ((DELTASERVE, LLMSTATION), lambda r: ft_check(r.doc, r.machine_time)),
        ((DELTASERVE, LLMSTATION), lambda r: harvest_check(r.doc)),
    ]
    checks = []
    for names, check in parts:
        run = _deciding(group, names)
        c = check(run)
        checks.append(c if len(group) == 1 else
                      Check(c.goal, c.verdict, f"{c.why}; in {Path(run.folder).name}"))
    return checks


def by_host(runs: Sequence[HostRun]) -> list[list[HostRun]]:
    """``runs`` grouped by host, hosts in order of their first run, runs in block order."""
    groups: dict[str, list[HostRun]] = {}
    for r in runs:
        groups.setdefault(r.host, []).append(r)
    return list(groups.values())


def overall(checks: Sequence[Check]) -> Verdict:
    """Not met if any part is not met, else not measured if any part is not, else met."""
    verdicts = {c.verdict for c in checks}
    for v in (Verdict.NOT_MET, Verdict.NOT_MEASURED):
        if v in verdicts:
            return v
    return Verdict.MET


def _table(head: Sequence[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows)]


def _rows(group: Sequence[HostRun]) -> list[list[str]]:
    """Every system each of one host's runs holds (a run named by its folder where the host
    has several), then the goal's systems no run of the host ran."""
    rows, ran = [], set()
    for run in group:
        systems = run.doc["systems"]
        name = "" if len(group) == 1 else f" ({Path(run.folder).name})"
        host = f"{run.label}{name}, N={repeats(run.doc)}"
        rows += [[host, system, figure(s, "ft_tokens_per_s", ".1f"), _attainment(s),
                  figure(s, "harvest_ratio", ".2f"), _mape(s)] for system, s in systems.items()]
        ran |= set(systems)
    last = f"{group[-1].label}, N={repeats(group[-1].doc)}" if len(group) == 1 else group[-1].label
    return rows + [[last, f"{system} (not run)", *[MISSING] * 4]
                   for system in GOAL_SYSTEMS if system not in ran]


def _hardware(m: dict) -> str:
    if m.get("gpu"):
        return f"{m.get('replicas', MISSING)}× {m['gpu']}, simulated"
    return f"{m.get('model', MISSING)} on {m.get('threads', MISSING)} CPU threads"


def _mape_steps(doc: dict) -> str:
    min_ms = (doc.get("config") or {}).get("latency_error_min_ms")
    if min_ms is None:
        return "latency MAPE over steps of a length not recorded"
    return ("latency MAPE over every step" if not min_ms
            else f"latency MAPE over steps ≥ {min_ms:g} ms")


def _host_line(run: HostRun) -> str:
    doc, t = run.doc, run.doc["trace"]
    return (f"- **{run.label}**, [{Path(run.folder).name}]({run.folder}/): "
            f"{_hardware(doc['machine'])}; trace {t.get('source', t['name'])}, "
            f"{t['requests']} requests over {t['duration_s']:.0f} s; SLO: {doc['slo']['text']}; "
            f"{repeats_note(doc)}; {_mape_steps(doc)}.")


def _goal_lines(group: Sequence[HostRun]) -> list[str]:
    checks, first = host_checks(group), group[0]
    note = (" (simulated: the issue's goal is for real hosts, checked here for reference)"
            if first.host == SIMULATED else "")
    return [f"- **{first.label}**{note}: goal {overall(checks)}.",
            *(f"  - {c.goal}: {c.verdict} ({c.why})." for c in checks)]


def _command(run: HostRun) -> list[str]:
    text = (run.command or "(no COMMAND file in the folder)").rstrip("\n")
    return [f"{run.label}, `{Path(run.folder).name}`:", "", "```", text, "```", ""]


def render(runs: Sequence[HostRun]) -> str:
    """The block: each host's runs and SLOs, one table of every host's systems, each host's
    goal verdict, and the commands that produced the runs (a host's runs together, hosts in
    order of their first run)."""
    groups = by_host(runs)
    lines = [_host_line(r) for g in groups for r in g]
    lines += ["", *_table(COLUMNS, [row for g in groups for row in _rows(g)]), "",
              "The goal (issue 23), per host:", ""]
    lines += [line for g in groups for line in _goal_lines(g)]
    lines += ["", "The commands that produced the runs (each folder's `COMMAND`):", ""]
    lines += [line for g in groups for r in g for line in _command(r)]
    return "\n".join(lines).rstrip("\n") + "\n"
