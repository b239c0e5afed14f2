"""``deltaserve bench`` end to end on the tiny model: the metric wiring, never speed.

A few-second trace, four systems (the pilot, ``deltaserve`` and the ``greedy`` controls), with
a two-scale ``--slo-sweep`` (two extra replays: ``deltaserve`` and ``greedy``, whose yields are
priced, are SLO-aware; ``greedy-fixed-yield`` runs once). What is
checked is what a wrong wire would break: every field is there, the SLO is the stated multiple
of the pilot's own p99s, the pilot's harvest is 0, a co-serving system committed fine-tuning
tokens, the latency model's online and held-out errors were both scored, the sweep's figure
draws each system's results.json numbers as one curve, and the README table renders from the
file.
"""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pytest

from deltaserve.bench.tables import blocks, render, update
from deltaserve.cli import main
from tests.conftest import make_word_tokenizer
from tests.tiny import save_tiny

SCALE = 1.5
SWEEP = (1.5, 3.0)  # the main scale is one of the sweep's: its point must equal the main table
SYSTEMS = ["inference-only", "deltaserve", "greedy", "greedy-fixed-yield"]
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
    """The run's results.json and every figure it drew (kept open to be read, closed after)."""
    out = tmp_path_factory.mktemp("bench") / "results"
    figures = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plt, "close", figures.append)
        rc = main(["bench", "--model", str(tiny_model), "--dtype", "float32",
                   "--trace", "burst-light", "--duration", "5", "--rate-scale", "0.08",
                   "--max-prompt-tokens", "48", "--max-output-tokens", "12",
                   "--systems", ",".join(SYSTEMS), "--slo-scale", str(SCALE),
                   "--standalone-seconds", "2", "--heldout", "4",
                   "--backward-batch-tokens", "64", "--latency-error-min-ms", "0",
                   "--latency-holdout-every", "3", "--out", str(out), "--no-progress",
                   "--slo-sweep", ",".join(f"{s:g}" for s in SWEEP)])
    assert rc == 0
    for name in ("results.json", "report.html", "latency.png", "throughput.png",
                 "attainment.png", "sweep.png", "work/.gitignore"):
        assert (out / name).is_file(), name
    yield json.loads((out / "results.json").read_text()), figures, out
    for fig in figures:
        plt.close(fig)


@pytest.fixture(scope="module")
def doc(run):
    return run[0]


def test_slo_is_the_stated_multiple_of_the_pilots_p99s(doc):
    slo, pilot = doc["slo"], doc["systems"]["inference-only"]
    assert slo["ttft_from"] == slo["tpot_from"] == "pilot" and slo["scale"] == SCALE
    assert slo["pilot_ttft_p99_ms"] == pytest.approx(pilot["ttft_p99_ms"])
    assert slo["pilot_tpot_p99_ms"] == pytest.approx(pilot["tpot_p99_ms"])
    assert slo["ttft_ms"] == pytest.approx(SCALE * pilot["ttft_p99_ms"])
    assert slo["tpot_ms"] == pytest.approx(SCALE * pilot["tpot_p99_ms"])
    assert f"{SCALE:g} × the pilot's p99" in slo["text"]


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
    assert 0 < h["idle_core_s"] <= h["cores"] * h["pilot_wall_s"]
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


def test_readme_blocks_are_checked_and_rewritten_from_the_file(doc, tmp_path):
    run_dir = tmp_path / "results" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text(json.dumps(doc))
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n\nbefore\n<!-- results: results/run/results.json -->\n"
                      "| stale | table |\n<!-- /results -->\nafter\n")
    (block,) = blocks(readme)
    assert block.path == "results/run/results.json" and not block.matches
    assert update(readme) == 1
    (block,) = blocks(readme)
    assert block.matches and block.body == render(doc)
    text = readme.read_text()
    assert text.startswith("# Title\n\nbefore\n") and text.endswith("<!-- /results -->\nafter\n")
    (run_dir / "results.json").unlink()
    with pytest.raises(FileNotFoundError):
        blocks(readme)


def test_slo_sweep_runs_the_slo_aware_systems_per_scale(doc):
    points = doc["sweep"]
    assert [p["scale"] for p in points] == list(SWEEP)
    pilot = doc["systems"]["inference-only"]
    for p in points:
        assert list(p["systems"]) == SYSTEMS
        assert p["slo"]["ttft_ms"] == pytest.approx(p["scale"] * pilot["ttft_p99_ms"])
        assert p["slo"]["tpot_ms"] == pytest.approx(p["scale"] * pilot["tpot_p99_ms"])
        # deltaserve and greedy price Δ (admission, yields), so they ran again at each scale;
        # the blind ones ran once
        assert p["systems"]["deltaserve"]["ran_at_scale"]
        assert p["systems"]["greedy"]["ran_at_scale"]
        assert not p["systems"]["greedy-fixed-yield"]["ran_at_scale"]
        assert not p["systems"]["inference-only"]["ran_at_scale"]
    once = ("greedy-fixed-yield", "inference-only")
    for name in once:  # one run, scored against each SLO
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
    doc, figures, out = run
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
