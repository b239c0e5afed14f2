"""A 60-second simulated trace end to end through ``deltaserve bench --host sim``'s runner (what
CI runs; the paper's experiments are run by hand), and ``deltaserve plan``."""

from __future__ import annotations

import json

import pytest

from deltaserve.bench.sim.config import SimBenchConfig
from deltaserve.bench.sim.experiment import run_sim_bench
from deltaserve.bench.sim.inputs import SimData
from deltaserve.bench.sim.plan import PlanConfig, plan
from deltaserve.bench.tables import render
from deltaserve.cli import _parser, main
from deltaserve.cli_flags import from_args
from deltaserve.core.data import DatasetReport
from deltaserve.core.errors import InputError
from tests.hosts.sim.conftest import samples

SYSTEMS = "inference-only,deltaserve,llmstation,split-pool"


def data() -> SimData:
    s = samples(400, low=40, high=250)
    return SimData("synthetic", s, DatasetReport(len(s), 0, (), len(s), 0, 0, 0,
                                                  sum(x.num_tokens for x in s), 1024))


def test_a_sixty_second_trace_end_to_end(tmp_path, vidur_dir):
    cfg = SimBenchConfig(trace="burst-light", duration_s=60, systems=SYSTEMS, replicas=2,
                         rate_scale=0.2, out=str(tmp_path), ablation=False, progress=False)
    results = run_sim_bench(cfg, data())
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["systems"].keys() == set(SYSTEMS.split(","))
    assert (tmp_path / "report.html").is_file() and (tmp_path / "paper.md").is_file()
    trace = results["trace"]
    assert trace["duration_s"] == 60 and trace["requests"] > 50
    for name, m in doc["systems"].items():
        assert m["completed_requests"] == trace["requests"], name  # nothing lost
        assert m["simulated_s"] >= 60 and not m["timed_out"]
    assert doc["systems"]["inference-only"]["ft_tokens_per_s"] == 0
    # every system's fine-tuning counted in one window: the trace and the real bench's drain
    assert doc["window_s"] == doc["harvest"]["window_s"] == 60 + doc["drain_s"]
    for name, m in doc["systems"].items():
        assert m["simulated_s"] >= doc["window_s"], name  # every fleet ran until it closed
        assert m["ft_tokens_per_s"] == pytest.approx(
            m["ft_tokens_in_window"] / doc["window_s"], abs=1e-6), name
    for name in ("deltaserve", "llmstation", "split-pool"):
        assert doc["systems"][name]["ft_tokens_per_s"] > 0, name
    # the latency model is calibrated against the oracle and its error measured online
    assert doc["calibration"] and doc["systems"]["deltaserve"]["latency_model_mape"] is not None
    assert "| DeltaServe FT tokens/s |" in (tmp_path / "paper.md").read_text()
    # scored by the bench's own scoring: split-pool holds one of the 2 GPUs for its trainer
    share = doc["systems"]["split-pool"]["hardware_share"]
    assert share == {"cores": 2, "host": 1, "reserved": 1}
    assert doc["systems"]["deltaserve"]["hardware_share"]["reserved"] == 0
    assert doc["slo"]["ttft_ms"] == 400 and doc["slo"]["ttft_from"] == "flag"
    # the README's table renders from it, beside the paper's numbers
    table = render(doc)
    assert "| deltaserve | llmstation |" in table and "Beside the paper" in table
    assert f"in one {doc['window_s']:.0f}-s window for every system" in table


def test_repeats_on_their_own_noise_and_an_slo_from_the_pilots_median(tmp_path, vidur_dir):
    cfg = SimBenchConfig(trace="burst-light", duration_s=30, systems="inference-only,deltaserve",
                         rate_scale=0.1, out=str(tmp_path), ablation=False, progress=False,
                         repeats=3, slo_scale=1.5)
    run_sim_bench(cfg, data())
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["repeats"] == 3
    pilots = doc["systems"]["inference-only"]["runs"]
    assert len(pilots) == 3 and len({p["ttft_p99_ms"] for p in pilots}) > 1  # own noise each
    slo = doc["slo"]
    for side in ("ttft", "tpot"):  # 1.5 x the median of the three pilots' p99s
        median = sorted(p[f"{side}_p99_ms"] for p in pilots)[1]
        assert slo[f"{side}_ms"] == pytest.approx(1.5 * median, rel=1e-3)
        assert slo[f"{side}_from"] == "pilot" and slo["pilots"] == 3
    ds = doc["systems"]["deltaserve"]
    assert len(ds["runs"]) == 3 and ds["repeats"] == 3
    fts = sorted(r["ft_tokens_per_s"] for r in ds["runs"])
    assert ds["range"]["ft_tokens_per_s"] == [fts[0], fts[2]]
    assert ds["ft_tokens_per_s"] == pytest.approx(fts[1], abs=0.05)  # the median repeat's
    for r in ds["runs"]:
        assert r["completed_requests"] == doc["trace"]["requests"]  # nothing lost, any repeat


def test_an_slo_from_the_pilot_needs_the_pilot():
    with pytest.raises(InputError, match=r"systems.*include inference-only"):
        SimBenchConfig(systems="deltaserve,greedy", slo_scale=1.5)
    SimBenchConfig(systems="deltaserve,greedy")  # the flags' SLO needs no pilot


@pytest.mark.parametrize(("field", "value"), [("repeats", 0), ("repeats", 1.5),
                                              ("slo_scale", 0.0), ("slo_scale", float("nan"))])
def test_repeats_and_slo_scale_are_checked_before_anything_runs(field, value):
    with pytest.raises(InputError, match=field):
        SimBenchConfig(**{field: value})


def test_plan_prints_a_row_per_fleet_size(vidur_dir):
    lines: list[str] = []
    rows = plan(PlanConfig(trace="burst-light", duration_s=20, replicas=(1, 2),
                           rate_scale=0.1), lines.append, data())
    assert [r["replicas"] for r in rows] == [1, 2]
    assert all(r["ft_tokens_per_s"] > 0 and 0 <= r["slo_attainment"] <= 1 for r in rows)
    assert lines[0].startswith("profiles: a100/llama-3-8b")


def test_plan_refuses_a_gpu_without_profiles(capsys):
    assert main(["plan", "--gpu", "h100", "--model", "llama-3-8b", "--replicas", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "h100/llama-3-8b" in err and "available: a100/llama-3-8b" in err


def test_plan_reads_fleet_sizes_comma_separated():
    ns = _parser()[0].parse_args(["plan", "--replicas", "1,2,4", "--trace", "burst-dense"])
    assert from_args(PlanConfig, ns).replicas == (1, 2, 4)
    with pytest.raises(SystemExit):
        _parser()[0].parse_args(["plan", "--replicas", "1,x"])
