"""``deltaserve bench`` end to end on the tiny model: the metric wiring, never speed.

A few-second trace, four systems (the pilot, ``deltaserve`` and the ``greedy`` controls), with
a two-scale ``--slo-sweep`` (``deltaserve`` and ``greedy``, whose yields are priced, are
SLO-aware and run again per scale; ``greedy-fixed-yield`` runs once per repeat), two repeats and
a one-second drain. What is checked is what a wrong wire would break:
every field is there, the replays ran in the stated order (the pilot once, then each repeat
round-robin, inference-only's scored row a replay of its own), the SLO is the stated multiple
of the pilot's p99s, fine-tuning is counted in the one window, inference-only's harvest is 0, a
co-serving system committed fine-tuning tokens, the repeats are reported as medians with
ranges, the latency model's online and held-out errors were both scored, the provenance names
this checkout's commit and COMMAND is written from it, the sweep's figure draws each system's
results.json numbers as one curve, and the README table renders from the file.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

import deltaserve
from deltaserve.bench import run as bench_run
from deltaserve.bench.tables import blocks, render, summary, update
from deltaserve.cli import main
from tests.conftest import make_word_tokenizer
from tests.tiny import save_tiny

SCALE = 1.5
SWEEP = (1.5, 3.0)  # the main scale is one of the sweep's: its point must equal the main table
SYSTEMS = ["inference-only", "deltaserve", "greedy", "greedy-fixed-yield"]
DURATION_S, DRAIN_S, REPEATS = 5.0, 1.0, 2
WORDS = ("user assistant system the a of to and is in what add two numbers reverse word answer "
         "give sum list first last letter count how many . , ? : 0 1 2 3 4 5 6 7 8 9").split()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("tiny-model"), seed=5)
    tok = make_word_tokenizer(WORDS)
    assert len(tok) <= 97  # the tiny model's vocabulary
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    """The run's results.json, every figure it drew (kept open to be read, closed after), its
    folder, and each replay's label in the order they ran."""
    out = tmp_path_factory.mktemp("bench") / "results"
    figures, labels = [], []
    real_run_system = bench_run.run_system

    def run_system(inputs, spec, slo, scale, **kw):
        labels.append((spec.name, scale, kw.get("label"), kw.get("tag", "")))
        return real_run_system(inputs, spec, slo, scale, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plt, "close", figures.append)
        mp.setattr(bench_run, "run_system", run_system)
        rc = main(["bench", "--model", str(tiny_model), "--dtype", "float32",
                   "--trace", "burst-light", "--duration", f"{DURATION_S:g}",
                   "--drain-s", f"{DRAIN_S:g}", "--repeats", str(REPEATS), "--rate-scale", "0.08",
                   "--max-prompt-tokens", "48", "--max-output-tokens", "12",
                   "--systems", ",".join(SYSTEMS), "--slo-scale", str(SCALE),
                   "--standalone-seconds", "2", "--heldout", "4",
                   "--backward-batch-tokens", "64", "--latency-error-min-ms", "0",
                   "--latency-holdout-every", "3", "--out", str(out), "--no-progress",
                   "--slo-sweep", ",".join(f"{s:g}" for s in SWEEP)])
    assert rc == 0
    for name in ("results.json", "COMMAND", "report.html", "latency.png", "throughput.png",
                 "attainment.png", "sweep.png", "work/.gitignore"):
        assert (out / name).is_file(), name
    yield json.loads((out / "results.json").read_text()), figures, out, labels
    for fig in figures:
        plt.close(fig)


@pytest.fixture(scope="module")
def doc(run):
    return run[0]


def test_the_pilot_runs_once_then_every_system_round_robin_per_repeat(run):
    labels = run[3]
    one_round = [("inference-only", None, None), ("deltaserve", SCALE, None),
                 ("greedy", SCALE, None), ("greedy-fixed-yield", None, None),
                 ("deltaserve", SWEEP[1], None), ("greedy", SWEEP[1], None)]
    assert labels == [("inference-only", None, "pilot", ""),
                      *((n, s, lab, f" #{k}") for k in (1, 2) for n, s, lab in one_round)]


def test_slo_is_the_stated_multiple_of_the_pilots_p99s(doc):
    slo = doc["slo"]
    assert slo["ttft_from"] == slo["tpot_from"] == "pilot" and slo["scale"] == SCALE
    assert slo["ttft_ms"] == pytest.approx(SCALE * slo["pilot_ttft_p99_ms"])
    assert slo["tpot_ms"] == pytest.approx(SCALE * slo["pilot_tpot_p99_ms"])
    assert f"{SCALE:g} × the pilot's p99" in slo["text"]


def test_fine_tuning_is_counted_in_one_window(doc):
    window = DURATION_S + DRAIN_S
    assert doc["window_s"] == pytest.approx(window) and doc["drain_s"] == DRAIN_S
    assert doc["harvest"]["window_s"] == pytest.approx(window)
    assert doc["harvest"]["total_core_s"] == pytest.approx(doc["harvest"]["cores"] * window)
    for s in doc["systems"].values():
        assert s["ft_tokens_per_s"] == pytest.approx(s["ft_tokens_in_window"] / window,
                                                     abs=1e-6)
        assert s["harvest"]["ft_tokens"] == s["ft_tokens_in_window"]
    assert doc["systems"]["greedy"]["ft_tokens_in_window"] > 0


def test_repeats_are_medians_with_their_range(doc):
    assert doc["repeats"] == REPEATS
    for s in doc["systems"].values():
        assert s["repeats"] == REPEATS and len(s["runs"]) == REPEATS
        for key, (lo, hi) in s["range"].items():
            values = [r[key] for r in s["runs"]]
            assert (lo, hi) == (min(values), max(values))
            assert s[key] in values  # the median is a value a repeat measured
    assert "Each system ran 2 times" in render(doc)


def test_provenance_is_this_checkouts(doc, run):
    root = Path(deltaserve.__file__).resolve().parent
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or None
    assert doc["commit"] == head and isinstance(doc["dirty"], bool | None)
    prov = doc["provenance"]
    assert prov["versions"]["torch"] and prov["cores"] >= 1
    assert "vllm" in prov["versions"] and "sglang" in prov["versions"]
    command = (run[2] / "COMMAND").read_text()
    assert command.startswith(f"# generated by the bench: commit {head or 'unknown'}")


def test_e2e_latency_against_inference_only(doc):
    systems = doc["systems"]
    base = systems["inference-only"]
    for s in systems.values():
        assert s["e2e_mean_vs_inference_only"] == pytest.approx(
            s["mean_e2e_s"] / base["mean_e2e_s"], rel=1e-4)
        assert s["e2e_p95_vs_inference_only"] == pytest.approx(
            s["e2e_p95_s"] / base["e2e_p95_s"], rel=1e-4)


def test_every_system_is_scored_with_every_field(doc):
    assert list(doc["systems"]) == SYSTEMS
    for s in doc["systems"].values():
        assert {"ft_tokens_per_s", "slo_attainment", "ttft_p99_ms", "tpot_p99_ms", "harvest",
                "latency_model_by_mode", "hardware_share", "pair"} <= set(s)
        assert s["completed_requests"] > 0 and 0 <= s["slo_attainment"] <= 1
    assert doc["slo_binding"]["verdict"] and "binds" in doc["slo_binding"]
    assert [(c["system"], c["baseline"]) for c in doc["comparisons"]] == [
        ("greedy", "deltaserve"), ("greedy-fixed-yield", "greedy")]
    assert doc["heldout_accuracy"]["system"] == "deltaserve"


def test_harvest_wiring(doc):
    pilot, greedy = doc["systems"]["inference-only"], doc["systems"]["greedy"]
    h = doc["harvest"]
    assert pilot["harvest"]["ratio"] == 0.0 and pilot["ft_tokens_per_s"] == 0.0
    assert 0 < h["idle_core_s"] <= h["total_core_s"]
    assert h["standalone_tokens_per_s"] > 0
    # a co-serving system committed fine-tuning, and its ratio is the documented quotient
    assert greedy["ft_tokens_per_s"] > 0
    g = greedy["harvest"]
    assert g["ratio"] == pytest.approx(g["ft_tokens"] / (
        (h["idle_core_s"] + g["reserved_core_s"]) * h["standalone_tokens_per_core_s"]))
    # each system's hardware share is the whole machine
    for s in doc["systems"].values():
        share = s["hardware_share"]
        assert share["host"] + share["reserved"] == share["cores"] == doc["machine"]["threads"]


def test_latency_error_is_scored_online_and_held_out(doc):
    by_mode = doc["systems"]["inference-only"]["latency_model_by_mode"]
    assert by_mode and sum(m["online_steps"] for m in by_mode) > 0
    assert sum(m["heldout_steps"] for m in by_mode) > 0
    # every third step held out: about a third of what the online set has, never more
    online = sum(m["online_steps"] for m in by_mode)
    held = sum(m["heldout_steps"] for m in by_mode)
    assert held <= online


def test_readme_table_renders_from_the_file(doc):
    text = render(doc)
    for name in SYSTEMS:
        assert f"| {name} |" in text
    assert doc["slo"]["text"] in text and doc["slo_binding"]["verdict"] in text
    prose = summary(doc)
    assert f"{doc['window_s']:.0f}-s window" in prose
    # each system's median, then its range over the repeats
    greedy = doc["systems"]["greedy"]
    lo, hi = greedy["range"]["ft_tokens_per_s"]
    assert (f"greedy {greedy['ft_tokens_per_s']:.1f} ({lo:.1f}–{hi:.1f}) FT tokens/s"
            in prose)


def test_readme_blocks_are_checked_and_rewritten_from_the_file(doc, tmp_path):
    run_dir = tmp_path / "results" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text(json.dumps(doc))
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n\nbefore\n<!-- results: results/run/results.json -->\n"
                      "| stale | table |\n<!-- /results -->\nmiddle\n"
                      "<!-- results-summary: results/run/results.json -->\nstale prose 85 %\n"
                      "<!-- /results-summary -->\nafter\n")
    table, prose = blocks(readme)
    assert table.path == prose.path == "results/run/results.json"
    assert not table.matches and not prose.matches
    assert update(readme) == 2
    table, prose = blocks(readme)
    assert table.matches and table.body == render(doc)
    assert prose.matches and prose.body == summary(doc)
    text = readme.read_text()
    assert text.startswith("# Title\n\nbefore\n")
    assert text.endswith("<!-- /results-summary -->\nafter\n") and "85 %" not in text
    (run_dir / "results.json").unlink()
    with pytest.raises(FileNotFoundError):
        blocks(readme)


def test_slo_sweep_runs_the_slo_aware_systems_per_scale(doc):
    points = doc["sweep"]
    assert [p["scale"] for p in points] == list(SWEEP)
    pilot = doc["slo"]  # the pilot's p99s; the inference-only row is a replay of its own
    for p in points:
        assert list(p["systems"]) == SYSTEMS
        assert p["slo"]["ttft_ms"] == pytest.approx(p["scale"] * pilot["pilot_ttft_p99_ms"])
        assert p["slo"]["tpot_ms"] == pytest.approx(p["scale"] * pilot["pilot_tpot_p99_ms"])
        # deltaserve and greedy price Δ (admission, yields), so they ran again at each scale;
        # the blind ones ran once
        assert p["systems"]["deltaserve"]["ran_at_scale"]
        assert p["systems"]["greedy"]["ran_at_scale"]
        assert not p["systems"]["greedy-fixed-yield"]["ran_at_scale"]
        assert not p["systems"]["inference-only"]["ran_at_scale"]
    once = ("greedy-fixed-yield", "inference-only")
    for name in once:  # one run per repeat, scored against each SLO
        assert len({p["systems"][name]["ft_tokens_per_s"] for p in points}) == 1
    # a looser SLO can only let a run that ran once meet more of it
    for name in once:
        att = [p["systems"][name]["slo_attainment"] for p in points]
        assert att == sorted(att)
    (main_point,) = [p for p in points if p["scale"] == SCALE]
    for name, s in main_point["systems"].items():
        # results.json rounds each system's numbers to 6 decimals (metrics.py); the sweep's
        # are exact, so a relative tolerance fails on values like 4/11
        assert s["ft_tokens_per_s"] == pytest.approx(doc["systems"][name]["ft_tokens_per_s"],
                                                     abs=1e-6)
        assert s["slo_attainment"] == pytest.approx(doc["systems"][name]["slo_attainment"],
                                                    abs=1e-6)


def test_slo_sweep_figure_draws_one_curve_per_system_from_the_results(run):
    doc, figures, out, _ = run
    (fig,) = [f for f in figures if f.axes and f.axes[0].get_xlabel().startswith(
        "SLO attainment (%)")]
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()
             if not ln.get_label().startswith("_")}
    assert sorted(lines) == sorted(SYSTEMS)
    for name, line in lines.items():
        xs = [100 * p["systems"][name]["slo_attainment"] for p in doc["sweep"]]
        ys = [p["systems"][name]["ft_tokens_per_s"] for p in doc["sweep"]]
        assert list(line.get_xdata()) == pytest.approx(xs)
        assert list(line.get_ydata()) == pytest.approx(ys)
    page = (out / "report.html").read_text()
    assert "SLO sweep" in page and '<img src="sweep.png">' in page
    assert "SLO sweep" in render(doc)
