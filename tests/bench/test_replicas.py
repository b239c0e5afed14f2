"""``deltaserve bench --replicas N``: the flag is checked before any model loads, the router
splits the trace round-robin over replicas that replay concurrently, the fleet's totals are
its replicas' sums (by hand), and a short two-replica bench on the tiny model reports both
replicas, the all-reduce time per step and a ledger in which no sample is trained twice in an
epoch across the replicas."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from deltaserve.bench import replicas as bench_replicas
from deltaserve.bench.config import REPLICA_HOSTS, BenchConfig
from deltaserve.bench.fleet_score import fleet_score
from deltaserve.bench.outcome import Commit, HardwareShare, ReplicaRun, SystemRun
from deltaserve.bench.replay import (
    PromptSource,
    ReplayResult,
    RequestRecord,
    replay_fleet,
)
from deltaserve.bench.replicas import fleet_result
from deltaserve.bench.systems import parse_systems
from deltaserve.cli import main
from deltaserve.core.errors import InputError
from deltaserve.core.slo import SLOConfig
from deltaserve.model import loading
from deltaserve.train.checkpoint_store import find_latest
from deltaserve.workloads.trace import from_arrivals
from tests.bench.test_bench_smoke import tiny_model  # noqa: F401 - the module's fixture
from tests.bench.test_replay import FakeHost


# ---- the flag ---------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["--replicas", "0"], "must be an integer >= 1"),
    (["--replicas", "2", "--host", "sglang"], "replicas run on the hosts native, vllm"),
])
def test_a_bad_replica_count_names_the_flag(argv, says, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert "--replicas" in err and says in err


@pytest.mark.parametrize("argv, says", [
    (["--replicas", "3"], "a thread of its own"),
    (["--replicas", "2", "--systems", "inference-only,split-pool"], "split-pool"),
])
def test_replicas_the_machine_or_a_system_cannot_run_fail_before_any_model_loads(
        argv, says, capsys, monkeypatch, tmp_path):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the replicas were checked")

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr("deltaserve.bench.run.resolve_model", no_load)
    monkeypatch.setattr(loading, "resolve_model", no_load)
    assert main(["bench", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert "replicas" in err and says in err


def test_one_replica_is_the_default():
    assert BenchConfig().replicas == 1
    with pytest.raises(InputError) as e:
        BenchConfig(replicas=2, host="sglang")
    assert e.value.field == "replicas"
    # vLLM's replicas are processes, each replaying round-robin's share: no least-loaded client
    assert BenchConfig(replicas=2, host="vllm").router == "round-robin"
    with pytest.raises(InputError) as e:
        BenchConfig(replicas=2, host="vllm", router="least-loaded")
    assert e.value.field == "router" and "round-robin" in e.value.reason
    assert BenchConfig(replicas=2, router="least-loaded").router == "least-loaded"
    bench_replicas.check_replicas(BenchConfig(replicas=1), parse_systems("split-pool"), 1)


# ---- the router and the concurrent replay -----------------------------------------------------
def test_the_router_splits_the_trace_round_robin_and_every_replica_replays_at_once():
    trace = from_arrivals("t", [0.0, 0.0, 0.05, 0.05, 0.1], [5, 6, 7, 8, 9], [2, 2, 2, 2, 2],
                          0.2, "test")
    hosts = [FakeHost(), FakeHost()]
    results = replay_fleet(hosts, trace, PromptSource(list(range(100))), progress=False)
    assert [len(h.sent) for h in hosts] == [3, 2]
    assert [[len(p) for _, p in h.sent] for h in hosts] == [[5, 7, 9], [6, 8]]
    for r, res in enumerate(results):
        assert [rec.index for rec in res.records] == list(range(r, 5, 2))
        assert all(rec.finished for rec in res.records)
    assert results[0].start_s == results[1].start_s and results[0].end_s == results[1].end_s
    fleet = fleet_result(results)
    assert [rec.index for rec in fleet.records] == list(range(5))


# ---- the fleet's totals -----------------------------------------------------------------------
def _record(index: int, ttft_s: float) -> RequestRecord:
    return RequestRecord(index, 0.0, 4, 2, (ttft_s, ttft_s + 0.1), True)


def test_the_totals_are_the_replicas_sums_and_the_allreduce_is_every_steps():
    slo = SLOConfig(ttft_s=1.0, tpot_s=0.5)
    window_s = 10.0
    # replica 0: 3 requests, 2 met; replica 1: 1 request, met. Commits at 1 s, 2 s; one late.
    reps = (ReplicaRun(0, ReplayResult([_record(0, 0.5), _record(2, 2.0), _record(4, 0.1)],
                                       0.0, 12.0, 8.0), [Commit(1.0, 30, 2, 30),
                                                         Commit(11.0, 99, 1, 99)], [0.1, 0.4]),
            ReplicaRun(1, ReplayResult([_record(1, 0.2)], 0.0, 12.0, 8.0),
                       [Commit(2.0, 20, 1, 20), Commit(3.0, 0, 0, 0)], [0.2, 0.3]))
    run = SystemRun(parse_systems("deltaserve")[0], fleet_result([r.result for r in reps]),
                    [c for r in reps for c in r.commits], (), HardwareShare(2, 1, 0), 2.0,
                    replicas=reps)
    f = fleet_score(run, slo, window_s)
    assert [(s.rank, s.requests, s.ft_tokens_in_window) for s in f.replicas] == \
        [(0, 3, 30), (1, 1, 20)]
    assert [s.slo_attainment for s in f.replicas] == [pytest.approx(2 / 3), 1.0]
    assert [s.ft_tokens_per_s for s in f.replicas] == [3.0, 2.0]
    assert f.ft_tokens_in_window == 50 and f.ft_tokens_per_s == 5.0
    assert f.slo_attainment == pytest.approx(3 / 4)  # every request, not the replicas' mean
    assert f.allreduce_steps == 4
    assert f.allreduce_s_median == pytest.approx(0.25)
    assert f.allreduce_s_p90 == pytest.approx(0.37)


# ---- a short two-replica bench on the tiny model -----------------------------------------------
DURATION_S, DRAIN_S = 5.0, 2.0


@pytest.fixture(scope="module", params=["threads", "processes"])
def bench(request, tiny_model, tmp_path_factory):  # noqa: F811 - the imported fixture
    """The bench with its replicas as threads of this process (the native host's way) and as
    processes of their own (vLLM's way, :mod:`deltaserve.bench.replica_processes`)."""
    out = tmp_path_factory.mktemp(f"bench-replicas-{request.param}") / "results"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(REPLICA_HOSTS, "native", request.param == "threads")
        rc = _run_bench(out, tiny_model)
    assert rc == 0
    return json.loads((out / "results.json").read_text()), out


def _run_bench(out, model) -> int:
    return main(["bench", "--replicas", "2", "--model", str(model), "--dtype", "float32",
                 "--trace", "burst-light", "--duration", f"{DURATION_S:g}",
                 "--drain-s", f"{DRAIN_S:g}", "--rate-scale", "0.08",
                 "--max-prompt-tokens", "48", "--max-output-tokens", "12",
                 "--systems", "inference-only,deltaserve", "--slo-scale", "1.5",
                 "--standalone-seconds", "2", "--heldout", "4",
                 "--backward-batch-tokens", "64", "--latency-error-min-ms", "0",
                 "--out", str(out), "--no-progress"])


@pytest.mark.slow
def test_two_replicas_report_each_replica_the_totals_and_the_allreduce(bench):
    doc, out = bench
    fleet = doc["replicas"]
    assert fleet["count"] == 2 and fleet["router"] == "round-robin"
    assert set(fleet["systems"]) == {"inference-only", "deltaserve"}
    requests = doc["trace"]["requests"]
    for name, f in fleet["systems"].items():
        assert [r["rank"] for r in f["replicas"]] == [0, 1]
        assert sum(r["requests"] for r in f["replicas"]) == requests
        assert all(r["requests"] > 0 for r in f["replicas"])
        assert f["ft_tokens_per_s"] == pytest.approx(
            sum(r["ft_tokens_per_s"] for r in f["replicas"]))
        # the fleet's total is the system's scored row
        assert f["ft_tokens_per_s"] == pytest.approx(doc["systems"][name]["ft_tokens_per_s"],
                                                     abs=1e-6)
        assert f["slo_attainment"] == pytest.approx(
            sum(r["slo_attainment"] * r["requests"] for r in f["replicas"]) / requests)
        assert f["slo_attainment"] == pytest.approx(doc["systems"][name]["slo_attainment"],
                                                    abs=1e-6)
    assert fleet["systems"]["inference-only"]["allreduce_steps"] == 0
    ds = fleet["systems"]["deltaserve"]
    assert ds["ft_tokens_in_window"] > 0
    assert ds["allreduce_steps"] > 0 and ds["allreduce_s_median"] > 0
    assert ds["allreduce_s_p90"] >= ds["allreduce_s_median"]
    assert "Replicas" in (out / "report.html").read_text()


@pytest.mark.slow
def test_two_replicas_train_no_sample_twice_in_an_epoch_and_step_together(bench):
    _, out = bench
    roots = list((out / "work" / "checkpoints").glob("deltaserve*"))
    assert len(roots) == 1
    # one root for the group: each rank's log, rank 0's checkpoint
    logs = sorted(roots[0].glob("train_log*.jsonl"))
    assert [p.name for p in logs] == ["train_log.jsonl", "train_log.rank-1.jsonl"]
    steps = []
    for log in logs:
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        steps.append([r for r in rows if r["event"] == "OptimizerStep"])
    # one global step at a time: both replicas committed the same steps
    assert [r["step"] for r in steps[0]] == [r["step"] for r in steps[1]]
    assert steps[0], "the replicas trained nothing"
    trained = Counter((r["epoch"], sid) for rows in steps for r in rows for sid in r["sample_ids"])
    assert trained and max(trained.values()) == 1
    # rank 0's checkpoint holds the group's progress: every replica's commits of its epoch
    latest = find_latest(roots[0])
    assert latest is not None
    pool = json.loads((latest / "trainer_state.json").read_text())["pool"]
    assert "shard" not in pool
    assert sorted(pool["committed"]) == sorted(sid for e, sid in trained if e == pool["epoch"])
