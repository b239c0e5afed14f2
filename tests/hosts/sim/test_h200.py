"""The H200 step oracle against the steps measured on the H200 (issue #21 item 5). The reference
is the measured table as ``shared/data/h200/probe.md`` prints it, typed here (medians, ms), not
the JSON the oracle reads; docs/sim.md states the per-kind errors asserted below."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from deltaserve.bench.sim.config import SimBenchConfig
from deltaserve.bench.sim.plan import PlanConfig, plan
from deltaserve.bench.sim.run import prepare
from deltaserve.core.errors import InputError
from deltaserve.core.shape import ExecMode
from deltaserve.hosts.sim.backward import BackwardJob
from deltaserve.hosts.sim.config import SimHostConfig
from deltaserve.hosts.sim.h200 import H200Oracle, load_probe
from deltaserve.hosts.sim.hardware import gpu_hardware
from deltaserve.hosts.sim.oracle import PrefillChunk, SimBatch
from deltaserve.model.lora import LoRAConfig
from tests.hosts.sim.test_end_to_end import data

# probe.md §1: (B, L) -> (eager, graph) medians
DECODE = {(1, 512): (15.299, 5.590), (8, 512): (16.908, 5.957), (32, 512): (16.042, 6.723),
          (64, 512): (15.944, 7.951), (128, 512): (15.750, 10.407),
          (1, 2048): (16.901, 5.735), (8, 2048): (16.959, 6.327), (32, 2048): (16.507, 9.178),
          (64, 2048): (17.455, 12.739), (128, 2048): (21.753, 21.201)}
# §2: decode B=32 at L=1024 with F fine-tuning tokens as (samples, length); prefill P tokens
MIXED = {(1, 64): 39.066, (1, 128): 35.222, (1, 256): 36.213, (2, 256): 33.347,
         (4, 256): 34.146}
MIXED_F0, MIXED_GRAPH = 16.718, 7.543
PREFILL = {256: 17.812, 512: 17.537, 1024: 29.529, 2048: 59.466}
# §3: the training rows' forward alone, and the whole backward job (ms per batch)
FT_FORWARD = {(1, 256): 28.35, (4, 64): 26.57}
BACKWARD_JOB = {(1, 256): 137.00, (4, 64): 130.88}
# what docs/sim.md states (MAPE per step kind, and the largest single error)
DOC_MAPE = {"decode graph": 0.014, "decode eager": 0.035, "prefill": 0.020, "mixed": 0.044,
            "training forward": 0.032}


@pytest.fixture(scope="module")
def probe_path(shared_data: Path) -> Path:
    path = shared_data / "h200" / "probe.json"
    if not path.is_file():
        pytest.skip(f"H200 measurements not found at {path}")
    return path


@pytest.fixture(scope="module")
def h200(probe_path: Path) -> H200Oracle:
    return H200Oracle(load_probe(probe_path), num_layers=32)


def reference() -> dict[str, list[tuple[SimBatch, float]]]:
    def decode(b: int, kv: int, mode: ExecMode, ft: tuple[int, ...] = ()) -> SimBatch:
        return SimBatch(decode_context_lens=(kv,) * b, ft_lens=ft, mode=mode)

    return {
        "decode graph": [(decode(b, kv, ExecMode.GRAPH), g) for (b, kv), (_, g) in DECODE.items()]
        + [(decode(32, 1024, ExecMode.GRAPH), MIXED_GRAPH)],
        "decode eager": [(decode(b, kv, ExecMode.EAGER), e) for (b, kv), (e, _) in DECODE.items()]
        + [(decode(32, 1024, ExecMode.EAGER), MIXED_F0)],
        "mixed": [(decode(32, 1024, ExecMode.EAGER, (m,) * k), t) for (k, m), t in MIXED.items()],
        "prefill": [(SimBatch(prefills=(PrefillChunk(p),)), t) for p, t in PREFILL.items()],
        "training forward": [(SimBatch(ft_lens=(m,) * k), t) for (k, m), t in FT_FORWARD.items()],
    }


def test_the_oracle_reproduces_every_measured_step_kind(h200: H200Oracle):
    for kind, rows in reference().items():
        predicted = np.array([h200.step_seconds(b) * 1e3 for b, _ in rows])
        measured = np.array([t for _, t in rows])
        rel = np.abs(predicted / measured - 1)
        assert rel.mean() == pytest.approx(DOC_MAPE[kind], abs=0.002), kind
        assert rel.max() < 0.10, (kind, rel.max())
        assert h200.fit_error[kind].num_rows == len(rows)  # it was scored on the same points


def test_eager_steps_sit_on_the_launch_floor_and_graphs_do_not(h200: H200Oracle):
    # the measured pattern: eager decode flat to 64 rows, then it meets the graph's time
    small = [h200.step_seconds(SimBatch(decode_context_lens=(512,) * b)) for b in (1, 8, 32, 64)]
    assert max(small) == pytest.approx(min(small))
    graph = h200.step_seconds(SimBatch(decode_context_lens=(2048,) * 128, mode=ExecMode.GRAPH))
    eager = h200.step_seconds(SimBatch(decode_context_lens=(2048,) * 128))
    assert eager == pytest.approx(graph) and eager > max(small)
    # a graph replays its padding rows: 5 rows cost what the captured 8 do
    five = SimBatch(decode_context_lens=(512,) * 5, mode=ExecMode.GRAPH)
    eight = SimBatch(decode_context_lens=(512,) * 5 + (1,) * 3, mode=ExecMode.GRAPH)
    assert h200.step_seconds(five) == pytest.approx(h200.step_seconds(eight), rel=1e-3)


def test_the_backward_priced_from_the_forward_meets_the_measured_jobs(probe_path):
    hw = gpu_hardware(SimHostConfig(gpu="h200"), LoRAConfig())
    for (k, m), ms in BACKWARD_JOB.items():
        got = hw.backward.seconds(BackwardJob((m,) * k)) * 1e3
        assert got == pytest.approx(ms, rel=0.05), (k, m, got)
    assert hw.name.startswith("h200/llama-3-8b") and hw.kv_tokens > 500_000


def test_h200_refuses_what_was_not_measured(probe_path):
    with pytest.raises(InputError, match="tp"):
        gpu_hardware(SimHostConfig(gpu="h200", tp=2), LoRAConfig())
    cfg = SimBenchConfig(replicas=2, engine=replace(SimHostConfig(), gpu="h200"))
    with pytest.raises(InputError, match="replicas"):
        prepare(cfg)


def test_plan_refuses_a_second_h200_rather_than_a_free_all_reduce(probe_path):
    with pytest.raises(InputError, match="network profile"):
        plan(PlanConfig(gpu="h200", trace="burst-light", duration_s=5, replicas=(2,),
                        rate_scale=0.05), lambda _: None, data())
