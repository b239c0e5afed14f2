"""The modelled parameters and the backward-time model."""

from __future__ import annotations

import pytest

from deltaserve.core.errors import InputError
from deltaserve.hosts.sim.backward import BackwardJob, BackwardModel
from deltaserve.hosts.sim.catalogue import LLAMA_3_8B
from deltaserve.hosts.sim.modelled import (
    AdapterShape,
    ModelledParams,
    adamw_seconds,
    backward_progress_seconds,
    graph_capture_size,
    overlapped_decode_seconds,
)
from deltaserve.hosts.sim.oracle import ProfileOracle, SimBatch


def test_every_parameter_has_a_source_and_a_range_around_its_default():
    rows = ModelledParams.table()
    assert {r[0] for r in rows} == set(ModelledParams.__dataclass_fields__)
    for name, default, unit, (low, high), source in rows:
        assert low <= default <= high, name
        assert unit and len(source) > 40, name


def test_parameters_refuse_nonsense():
    with pytest.raises(InputError, match="backward_to_forward"):
        ModelledParams(backward_to_forward=-1.0)
    with pytest.raises(InputError, match="backward_share_under_decode"):
        ModelledParams(backward_share_under_decode=0.0)
    with pytest.raises(InputError, match="target_modules"):
        AdapterShape(target_modules=("gate_proj",))


def test_lora_parameter_count_closed_form():
    # r16 on q (4096→4096), k and v (4096→1024), o (4096→4096), 32 layers
    expected = 32 * 16 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096))
    assert AdapterShape().num_params(LLAMA_3_8B) == expected == 13_631_488


def test_graph_capture_sizes_follow_vllm():
    sizes = {n: graph_capture_size(n, 512) for n in (1, 2, 3, 4, 5, 8, 9, 512, 513)}
    assert sizes == {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 512: 512, 513: None}


def test_adamw_is_bandwidth_bound_over_the_adapter(oracle: ProfileOracle):
    params = ModelledParams()
    got = adamw_seconds(params, AdapterShape(), LLAMA_3_8B, oracle.hbm_bytes_per_s)
    traffic_s = 13_631_488 * 28 / oracle.hbm_bytes_per_s
    assert got == pytest.approx(traffic_s + 4 * params.launch_overhead_s)


def test_contention_helpers():
    params = ModelledParams(decode_slowdown_under_backward=0.25, backward_share_under_decode=0.4)
    assert overlapped_decode_seconds(params, 0.02) == pytest.approx(0.025)
    assert backward_progress_seconds(params, 0.01) == pytest.approx(0.004)


def test_backward_time_recomposes_and_grows_with_tokens(oracle: ProfileOracle):
    params = ModelledParams()
    model = BackwardModel(oracle, LLAMA_3_8B, params)
    job = BackwardJob((100, 156))
    forward_layer = oracle.layer_seconds(SimBatch(ft_lens=(100, 156)))
    unit = forward_layer * (1 + params.backward_to_forward)
    assert model.layer_unit_seconds(job) == pytest.approx(unit)
    assert model.pause_granularity_seconds(job) == pytest.approx(unit + params.grant_poll_s)
    parts = model.time(job)
    assert parts.total_s == pytest.approx(
        32 * (unit + params.grant_poll_s)
        + oracle.head_seconds(256, 1) * (1 + params.backward_to_forward)
        + adamw_seconds(params, AdapterShape(), LLAMA_3_8B, oracle.hbm_bytes_per_s))
    # more tokens cost more; the backward costs more than the forward that captured the rows
    assert model.seconds(BackwardJob((512,))) > model.seconds(BackwardJob((256,)))
    assert model.seconds(job) > oracle.step_seconds(SimBatch(ft_lens=(100, 156)))
    with pytest.raises(InputError):
        BackwardJob(())
