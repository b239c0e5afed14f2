"""Print the oracle's sanity numbers, fit errors and modelled-parameter table (docs/sim.md).

    python -m deltaserve.hosts.sim.sanity [--data-dir DIR] [--network NAME]
"""

from __future__ import annotations

import argparse

import numpy as np

from deltaserve.core.shape import ExecMode
from deltaserve.hosts.sim.backward import BackwardJob, BackwardModel
from deltaserve.hosts.sim.catalogue import lookup_profile
from deltaserve.hosts.sim.modelled import ModelledParams
from deltaserve.hosts.sim.oracle import PrefillChunk, ProfileOracle, SimBatch
from deltaserve.hosts.sim.profiles import LAYER_OPS, GpuProfiles, load_profiles, read_columns


def _token_fit_rows(profiles: GpuProfiles) -> list[str]:
    path = profiles.data_dir / profiles.entry.compute_subdir / "mlp.csv"
    cols = ("num_tokens", "num_tensor_parallel_workers",
            *(f"time_stats.{op}.median" for op in LAYER_OPS))
    mlp = read_columns(path, cols)
    out = []
    for tp in sorted(profiles.by_tp):
        rows = mlp["num_tensor_parallel_workers"] == tp
        tokens = mlp["num_tokens"][rows]
        total = sum(mlp[f"time_stats.{op}.median"][rows] for op in LAYER_OPS)
        uniq = np.unique(tokens)
        measured = np.array([total[tokens == t].mean() for t in uniq])
        rel = np.abs(profiles.tp(tp).layer_token_ops.many(uniq) / measured - 1)
        out.append(f"| TP{tp} | {len(uniq)} | {(rel <= 0.02).mean():.1%} | {rel.max():.1%} |")
    return out


def _attention_rows(profiles: GpuProfiles) -> list[str]:
    out = []
    for tp in sorted(profiles.by_tp):
        prof = profiles.tp(tp)
        for kind, fit in (("decode", prof.decode_attention), ("prefill", prof.prefill_attention)):
            err = getattr(fit, "fit_error", None)
            if err is None:
                out.append(f"| TP{tp} | {kind} | {prof.attention_source} | | | |")
                continue
            out.append(f"| TP{tp} | {kind} | {err.num_rows} | {err.mape:.1%} | {err.p90:.1%} "
                       f"| {err.max_rel:.0%} ({err.max_abs_ms * 1e3:.0f} µs) |")
    return out


def _sanity_rows(oracle: ProfileOracle) -> list[str]:
    cases = [
        ("decode 1 request, 1k context, graph", lambda tp: SimBatch(
            decode_context_lens=(1024,), mode=ExecMode.GRAPH, tp=tp)),
        ("decode 64 requests, 1k context, graph", lambda tp: SimBatch(
            decode_context_lens=(1024,) * 64, mode=ExecMode.GRAPH, tp=tp)),
        ("decode 64 requests, 1k context, eager", lambda tp: SimBatch(
            decode_context_lens=(1024,) * 64, tp=tp)),
        ("prefill 2,048 tokens", lambda tp: SimBatch(prefills=(PrefillChunk(2048),), tp=tp)),
        ("training-only step, 256 tokens (2 × 128)", lambda tp: SimBatch(ft_lens=(128, 128),
                                                                         tp=tp)),
    ]
    backward = BackwardModel(oracle, oracle.shape, oracle.params, oracle.lora)
    out = []
    for name, make in cases:
        cells = []
        for tp in (1, 2, 4):
            b = oracle.breakdown(make(tp))
            cells.append(f"{b.total_s * 1e3:.1f} (comm {b.communication_s * 1e3:.1f})")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    cells = []
    for tp in (1, 2, 4):
        t = backward.time(BackwardJob((128, 128), tp=tp))
        cells.append(f"{t.total_s * 1e3:.1f} (layer unit {t.layer_unit_s * 1e3:.2f})")
    out.append("| its backward (recompute + backward + loss + AdamW) | " + " | ".join(cells)
               + " |")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="Vidur profile directory")
    parser.add_argument("--network", default=None, help="network profile (default: catalogue's)")
    args = parser.parse_args(argv)
    profiles = load_profiles(lookup_profile("a100", "llama-3-8b"), args.data_dir, args.network)
    oracle = ProfileOracle(profiles)
    print(f"data: {profiles.data_dir}  network: {profiles.network}  "
          f"effective HBM bandwidth: {profiles.hbm_bytes_per_s / 1e12:.2f} TB/s  "
          f"noise sigma TP1/2/4: "
          + "/".join(f"{oracle.noise_sigma(tp):.2%}" for tp in (1, 2, 4)))
    print("\n| TP | points | within 2 % | max error |\n|---|---|---|---|")
    print("\n".join(_token_fit_rows(profiles)))
    print("\n| TP | kernel | rows | MAPE | p90 | max (abs) |\n|---|---|---|---|---|---|")
    print("\n".join(_attention_rows(profiles)))
    chk = profiles.tp2_rule_check
    print(f"\nTP2 rule (sqrt(TP1·TP4)) on the measured TP2 MLP rows: MAPE {chk.mape:.1%}, "
          f"p90 {chk.p90:.1%}, max {chk.max_rel:.1%}")
    print("\n| step (ms) | TP1 | TP2 | TP4 |\n|---|---|---|---|")
    print("\n".join(_sanity_rows(oracle)))
    print("\n| parameter | default | unit | range |\n|---|---|---|---|")
    for name, default, unit, (low, high), _ in ModelledParams.table():
        print(f"| {name} | {default:g} | {unit} | {low:g} – {high:g} |")


if __name__ == "__main__":
    main()
