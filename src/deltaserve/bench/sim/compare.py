"""A simulated run beside a real one, system by system: fine-tuning tokens/s (and its relative
error), SLO attainment, p99 TTFT and p99 max-TPOT, and whether the systems rank the same by
fine-tuning tokens/s. The validation's target (issue #13): within 15 % on FT tokens/s and the
same ranking."""

from __future__ import annotations

from dataclasses import asdict

from deltaserve.bench.systems import PILOT
from deltaserve.hosts.sim.hardware import SimHardware
from deltaserve.hosts.sim.measured import MeasuredBackward, MeasuredOracle

FT_TARGET = 0.15
KEYS = ("ft_tokens_per_s", "slo_attainment", "ttft_p99_ms", "tpot_p99_ms")


def _error(sim: float | None, real: float | None) -> float | None:
    return sim / real - 1.0 if sim is not None and real else None


def ranking(systems: dict[str, dict]) -> list[str]:
    """Co-serving and split-pool systems by FT tokens/s, most first (the pilot trains none)."""
    names = [n for n in systems if n != PILOT]
    return sorted(names, key=lambda n: -systems[n]["ft_tokens_per_s"])


def _fits(hardware: dict[int, SimHardware]) -> dict[str, dict]:
    out = {}
    for threads, hw in sorted(hardware.items()):
        entry: dict = {"name": hw.name, "standalone_tokens_per_s": hw.standalone_tokens_per_s}
        if isinstance(hw.oracle, MeasuredOracle):
            entry["oracle_fit"] = asdict(hw.oracle.fit_error)
            entry["noise_sigma"] = hw.oracle.sigma
        if isinstance(hw.backward, MeasuredBackward):
            entry["backward_fit"] = asdict(hw.backward.fit_error)
        out[f"host_{threads}_threads"] = entry
    return out


def comparison_doc(real: dict, real_path: str, profile_path: str, simulated: dict[str, dict],
                   hardware: dict[int, SimHardware], sim_requests: int) -> dict:
    systems = {}
    for name, r in real["systems"].items():
        s = simulated.get(name)
        if s is None:
            continue
        systems[name] = {"real": {k: r[k] for k in KEYS}, "sim": {k: s[k] for k in KEYS},
                         "ft_error": _error(s["ft_tokens_per_s"], r["ft_tokens_per_s"])}
    errs = [abs(v["ft_error"]) for v in systems.values() if v["ft_error"] is not None]
    real_rank = ranking({n: v["real"] for n, v in systems.items()})
    sim_rank = ranking({n: v["sim"] for n, v in systems.items()})
    return {"real_results": real_path, "profile": profile_path,
            "trace": {"name": real["trace"]["name"], "requests_real": real["trace"]["requests"],
                      "requests_sim": sim_requests, "rate_factor": real["trace"]["rate_factor"]},
            "slo": {"ttft_ms": real["slo"]["ttft_ms"], "tpot_ms": real["slo"]["tpot_ms"]},
            "systems": systems,
            "ft_error_mean_abs": sum(errs) / len(errs) if errs else None,
            "ft_error_max_abs": max(errs) if errs else None,
            "within_target": bool(errs) and max(errs) <= FT_TARGET,
            "ranking": {"real": real_rank, "sim": sim_rank, "same": real_rank == sim_rank},
            "hardware": _fits(hardware)}


def _num(v: float | None, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def comparison_markdown(doc: dict) -> str:
    t, slo = doc["trace"], doc["slo"]
    lines = ["# The simulator against a real CPU run", "",
             f"Real run: `{doc['real_results']}`; profile: `{doc['profile']}`. Trace "
             f"{t['name']} ({t['requests_real']} requests real, {t['requests_sim']} rebuilt), "
             f"SLO TTFT {slo['ttft_ms']:.0f} ms / max TPOT {slo['tpot_ms']:.0f} ms.", "",
             "| system | FT tok/s real | sim | error | SLO real | sim | p99 TTFT ms real | sim "
             "| p99 TPOT ms real | sim |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in doc["systems"].items():
        r, s = v["real"], v["sim"]
        err = "–" if v["ft_error"] is None else f"{100 * v['ft_error']:+.1f} %"
        lines.append(
            f"| {name} | {r['ft_tokens_per_s']:.0f} | {s['ft_tokens_per_s']:.0f} | {err} | "
            f"{100 * r['slo_attainment']:.1f} % | {100 * s['slo_attainment']:.1f} % | "
            f"{_num(r['ttft_p99_ms'], '.0f')} | {_num(s['ttft_p99_ms'], '.0f')} | "
            f"{_num(r['tpot_p99_ms'], '.0f')} | {_num(s['tpot_p99_ms'], '.0f')} |")
    rk = doc["ranking"]
    mean, worst = doc["ft_error_mean_abs"], doc["ft_error_max_abs"]
    lines += ["", f"FT tokens/s error: mean |error| {_num(mean and 100 * mean, '.1f')} %, "
                  f"worst {_num(worst and 100 * worst, '.1f')} % (target ≤ "
                  f"{100 * FT_TARGET:.0f} %): {'met' if doc['within_target'] else 'missed'}.",
              f"Ranking by FT tokens/s: real {' > '.join(rk['real'])}; simulated "
              f"{' > '.join(rk['sim'])}: {'same' if rk['same'] else 'different'}.", ""]
    for key, h in doc["hardware"].items():
        fit = h.get("oracle_fit")
        bw = h.get("backward_fit")
        lines.append(f"- {key}: {h['name']}; step oracle fit MAPE "
                     f"{_num(fit and 100 * fit['mape'], '.1f')} % on {fit and fit['num_rows']} "
                     f"measured steps; backward fit MAPE {_num(bw and 100 * bw['mape'], '.1f')} "
                     f"%; standalone {_num(h['standalone_tokens_per_s'], '.0f')} tok/s")
    return "\n".join(lines) + "\n"
