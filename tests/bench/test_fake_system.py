"""A compared system added the documented way only (docs/architecture.md, "Adding a system"):
its policy as an ``AdmissionScheduler`` subclass and one ``SystemSpec`` entry in
``bench.systems.SPECS`` naming its pair, nothing else. Both benches must then accept it by name,
the simulated bench must run it end to end (its scheduler admitting, its trainer's share
reserved) and its results must carry it with its pair. If a bench read a system list frozen at
import, or branched on a built-in system's name, this fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltaserve.bench.config import BenchConfig
from deltaserve.bench.coserve_config import coserve_config
from deltaserve.bench.execute import bench_training, hardware_share
from deltaserve.bench.sim.config import SimBenchConfig
from deltaserve.bench.sim.experiment import run_sim_bench
from deltaserve.bench.sim.inputs import SimData
from deltaserve.bench.systems import SPECS, SystemSpec, parse_systems
from deltaserve.core.admission import AdmissionScheduler, SchedulingView
from deltaserve.core.data import DatasetReport
from deltaserve.core.slo import SLOConfig
from tests.hosts.sim.conftest import samples


class NoYieldScheduler(AdmissionScheduler):
    """Algorithm 1's admission, never lending the backward a yield before a step."""

    built = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        type(self).built += 1

    def yield_budget_s(self, view: SchedulingView) -> float:
        return 0.0


# a policy on the same machine, and a system that splits it (its own trainer, one replica)
NO_YIELD = SystemSpec("fake-no-yield", coserve=True, scheduler_cls=NoYieldScheduler,
                      pair="deltaserve", slo_aware=True)
SPLIT = SystemSpec("fake-split", split_pool=True, pair="split-pool")
SYSTEMS = "inference-only,deltaserve,split-pool,fake-no-yield,fake-split"


@pytest.fixture
def registered(monkeypatch):
    """The documented step: one entry each in SPECS (undone after the test)."""
    for spec in (NO_YIELD, SPLIT):
        monkeypatch.setitem(SPECS, spec.name, spec)
    NoYieldScheduler.built = 0


def sim_data() -> SimData:
    s = samples(300, low=40, high=200)
    return SimData("synthetic", s, DatasetReport(len(s), 0, (), len(s), 0, 0, 0,
                                                  sum(x.num_tokens for x in s), 1024))


def test_the_cpu_bench_takes_a_new_system_by_name(registered):
    specs = parse_systems("fake-no-yield,fake-split")
    assert [s.name for s in specs] == ["inference-only", "fake-no-yield", "fake-split"]
    cfg = BenchConfig(systems="fake-no-yield,fake-split")
    config = coserve_config(NO_YIELD, bench_training(cfg, SLOConfig(1.0, 0.2), Path("/c")))
    assert config.admission.mode is NO_YIELD.mode and config.interrupt
    # split-pool's share: the backward's thread for its trainer, the rest for the host
    assert hardware_share(cfg, SPLIT, 4) == hardware_share(cfg, SPECS["split-pool"], 4)
    assert hardware_share(cfg, SPLIT, 4).reserved == 1


def test_the_simulated_bench_runs_a_new_system_and_reports_it_with_its_pair(
        registered, tmp_path, shared_data):
    if not (shared_data / "vidur").is_dir():
        pytest.skip("Vidur profiles not found")
    cfg = SimBenchConfig(trace="burst-light", duration_s=20, systems=SYSTEMS, replicas=2,
                         rate_scale=0.2, out=str(tmp_path), ablation=False, progress=False)
    run_sim_bench(cfg, sim_data())
    doc = json.loads((tmp_path / "results.json").read_text())
    systems = doc["systems"]
    assert list(systems) == ["inference-only", "deltaserve", "split-pool", "fake-no-yield",
                             "fake-split"]
    assert NoYieldScheduler.built == 2  # one per replica of its fleet: its policy ran
    fake, split = systems["fake-no-yield"], systems["fake-split"]
    assert (fake["pair"], split["pair"]) == ("deltaserve", "split-pool")
    for m in (fake, split):
        assert m["completed_requests"] == doc["trace"]["requests"]
        assert m["ft_tokens_per_s"] > 0
    # the new split system holds a replica for its trainer, as split-pool does
    assert split["hardware_share"] == systems["split-pool"]["hardware_share"] == {
        "cores": 2, "host": 1, "reserved": 1}
    assert fake["hardware_share"]["reserved"] == 0
    assert "fake-no-yield" in (tmp_path / "report.html").read_text()
