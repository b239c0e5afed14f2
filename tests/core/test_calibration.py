import pytest

from deltaserve.core import (
    Batching,
    CalibrationConfig,
    HostLimits,
    InputError,
    ProbeKind,
    build_plan,
)


@pytest.mark.parametrize("limits", [
    HostLimits(2048, 64, 2048, 200_000),
    HostLimits(256, 8, 512, 2048),
    HostLimits(8192, 256, 4096, 1_000_000, Batching.PHASE_SEPARATED),
])
def test_every_probe_fits_the_host(limits):
    for p in build_plan(limits):
        s = p.shape
        assert s.num_tokens <= limits.max_tokens_per_step
        assert s.num_seqs <= limits.max_seqs_per_step
        assert max(s.prefill_lens + s.ft_lens, default=0) <= limits.max_model_len
        assert p.kv_per_decode < limits.max_model_len and p.prefix_len < limits.max_model_len
        kv = s.num_decode * (p.kv_per_decode + 1) + sum(s.prefill_lens) + p.prefix_len
        assert kv <= limits.max_kv_tokens
        assert p.repeats == 3


def test_plan_covers_every_kind_and_separates_the_quadratic_term():
    plan = build_plan(HostLimits(2048, 64, 2048, 200_000))
    kinds = {p.kind for p in plan}
    assert kinds == set(ProbeKind)
    split = [p.shape for p in plan if p.kind is ProbeKind.PREFILL_SPLIT]
    assert {s.num_prefill_tokens for s in split} == {512}  # same T_in ...
    assert len({s.prefill_sq_tokens for s in split}) == len(split) == 8  # ... different Σn²
    sweep = [p.shape.num_prefill_tokens for p in plan if p.kind is ProbeKind.PREFILL_SWEEP]
    assert sweep[0] == 16 and sweep[-1] == 2048
    ft = [p.shape for p in plan if p.kind is ProbeKind.WITH_FT]
    assert any(not s.has_inference for s in ft) and any(s.has_inference for s in ft)
    assert all(s.ft_lens for s in ft)


def test_phase_separated_host_gets_no_mixed_probes():
    plan = build_plan(HostLimits(2048, 64, 2048, 200_000, Batching.PHASE_SEPARATED))
    for p in plan:
        assert not (p.shape.prefill_lens and p.shape.num_decode)


def test_decode_grid_respects_kv_capacity():
    limits = HostLimits(4096, 64, 1100, 8192)
    grid = [p for p in build_plan(limits) if p.kind is ProbeKind.DECODE_GRID]
    assert grid and all(p.shape.num_decode * (p.kv_per_decode + 1) <= 8192 for p in grid)
    assert max(p.shape.num_decode for p in grid) == 64  # short contexts still reach the batch cap


def test_contradictory_limits_are_rejected():
    with pytest.raises(InputError) as e:
        HostLimits(2048, 64, max_model_len=4096, max_kv_tokens=1024)
    assert e.value.field == "max_kv_tokens"
    with pytest.raises(InputError):
        HostLimits(0, 64, 100, 100)
    with pytest.raises(InputError):
        CalibrationConfig(repeats=0)
