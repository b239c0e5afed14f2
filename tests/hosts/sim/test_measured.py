"""The oracle built from an engine's own measured steps (the CPU validation's), and the
comparison of a simulated run with a real one."""

from __future__ import annotations

import json
import random

import pytest

from deltaserve.bench.outcome import HardwareShare
from deltaserve.bench.sim.compare import comparison_doc, comparison_markdown, ranking
from deltaserve.bench.sim.validate import recorded_shares
from deltaserve.core.errors import InputError
from deltaserve.hosts.sim.backward import BackwardJob
from deltaserve.hosts.sim.measured import (
    FORMAT,
    MeasuredBackward,
    MeasuredJob,
    MeasuredOracle,
    MeasuredStep,
    load_profile,
)


def closed_form_s(prefill: tuple[int, ...], decodes: int, kv: int, ft: tuple[int, ...]) -> float:
    """A step time of the oracle's physical form with known coefficients: 2 ms, 40 µs per
    token, 3 µs per decode row, 10 ns per attended KV token, 20 ns per squared prefill token."""
    tokens = sum(prefill) + decodes + sum(ft)
    return (2e-3 + 4e-5 * tokens + 3e-6 * decodes + 1e-8 * decodes * (kv + 1)
            + 2e-8 * (sum(n * n for n in prefill) + sum(m * m for m in ft)))


def random_steps(n: int, seed: int = 0) -> list[MeasuredStep]:
    rng, out = random.Random(seed), []
    while len(out) < n:
        prefill = tuple(rng.randint(8, 200) for _ in range(rng.choice((0, 1, 2))))
        ft = tuple(rng.randint(16, 128) for _ in range(rng.choice((0, 1, 2))))
        decodes, kv = rng.choice((0, 1, 4, 16)), rng.choice((32, 128, 512))
        if prefill or ft or decodes:
            out.append(MeasuredStep(prefill, 0, decodes, kv, ft,
                                    closed_form_s(prefill, decodes, kv, ft), 0.02))
    return out


def test_the_oracle_reproduces_a_closed_form_it_was_measured_from():
    oracle = MeasuredOracle(random_steps(120), num_layers=30)
    for step in random_steps(40, seed=1):  # shapes it never saw
        assert oracle.step_seconds(step.batch()) == pytest.approx(step.seconds, rel=1e-3)
    assert oracle.fit_error.mape < 1e-3 and oracle.sigma == pytest.approx(0.02)


def test_the_measured_backward_reproduces_its_jobs_and_grows_with_tokens():
    jobs = [MeasuredJob(lens, 0.05 + 2e-4 * sum(lens))
            for lens in ((100, 156), (64, 64, 128), (250,), (30, 90, 140))]
    bw = MeasuredBackward(jobs, num_layers=30)
    for j in jobs:
        assert bw.seconds(BackwardJob(j.lens, 1)) == pytest.approx(j.seconds, rel=1e-3)
    t = bw.time(BackwardJob((128, 128), 1))
    assert t.total_s == pytest.approx(0.05 + 2e-4 * 256, rel=1e-3)
    assert bw.seconds(BackwardJob((300,), 1)) > bw.seconds(BackwardJob((200,), 1))


def test_a_profile_file_loads_and_a_wrong_one_is_refused(tmp_path):
    steps = random_steps(25)
    doc = {"format": FORMAT, "threads": {"1": {
        "steps": [{"prefill": list(s.prefill), "prefix": 0, "decodes": s.decodes, "kv": s.kv,
                   "ft": list(s.ft), "seconds": s.seconds, "log_spread": 0.01} for s in steps],
        "backward": [{"lens": [128, 128], "seconds": 0.1}], "standalone_tokens_per_s": 300.0}}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    got = load_profile(path)[1]
    assert got.steps[3].seconds == steps[3].seconds and got.standalone_tokens_per_s == 300.0
    path.write_text(json.dumps(doc | {"format": "other/1"}))
    with pytest.raises(InputError, match="cpu_profile"):
        load_profile(path)


def _metrics(ft: float, slo: float = 1.0) -> dict:
    return {"ft_tokens_per_s": ft, "slo_attainment": slo, "ttft_p99_ms": 100.0,
            "tpot_p99_ms": 50.0}


def test_the_comparison_states_each_error_and_the_ranking():
    real = {"trace": {"name": "burst-light", "requests": 200, "rate_factor": 0.1},
            "slo": {"ttft_ms": 900.0, "tpot_ms": 300.0},
            "systems": {"inference-only": _metrics(0.0), "deltaserve": _metrics(200.0),
                        "llmstation": _metrics(180.0), "split-pool": _metrics(250.0)}}
    sim = {"inference-only": _metrics(0.0), "deltaserve": _metrics(220.0),
           "llmstation": _metrics(150.0, 0.9), "split-pool": _metrics(240.0)}
    doc = comparison_doc(real, "real.json", "p.json", sim, {}, 200)
    assert doc["systems"]["deltaserve"]["ft_error"] == pytest.approx(0.10)
    assert doc["systems"]["llmstation"]["ft_error"] == pytest.approx(150 / 180 - 1)
    assert doc["systems"]["inference-only"]["ft_error"] is None  # trains nothing
    assert doc["ft_error_max_abs"] == pytest.approx(30 / 180) and not doc["within_target"]
    assert doc["ranking"]["real"] == ["split-pool", "deltaserve", "llmstation"]
    assert doc["ranking"]["same"]
    assert ranking({"a": _metrics(1.0), "b": _metrics(2.0)}) == ["b", "a"]
    assert "missed" in comparison_markdown(doc)


def test_validation_reads_each_systems_recorded_share_and_refuses_a_shared_backward():
    def real(deltaserve_reserved: int) -> dict:
        host = 2 - deltaserve_reserved
        return {"config": {"systems": "inference-only,deltaserve,split-pool"}, "systems": {
            "inference-only": {"hardware_share": {"cores": 2, "host": 2, "reserved": 0}},
            "deltaserve": {"hardware_share": {"cores": 2, "host": host,
                                              "reserved": deltaserve_reserved}},
            "split-pool": {"hardware_share": {"cores": 2, "host": 1, "reserved": 1}}}}

    assert recorded_shares(real(1)) == {"inference-only": HardwareShare(2, 2, 0),
                                        "deltaserve": HardwareShare(2, 1, 1),
                                        "split-pool": HardwareShare(2, 1, 1)}
    with pytest.raises(InputError, match=r"real=.deltaserve.: .*--backward-grant-policy partition"):
        recorded_shares(real(0))
