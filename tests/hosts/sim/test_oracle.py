"""The step-time oracle: closed-form recomposition from its tables, monotonicity, TP, graph vs
eager, training rows, and the noise."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from deltaserve.core.errors import InputError
from deltaserve.core.shape import ExecMode
from deltaserve.hosts.sim.oracle import (
    PrefillChunk,
    ProfileOracle,
    SimBatch,
    StepNoise,
    StepTimeOracle,
)


def decode(bs: int, ctx: int, tp: int = 1, mode: ExecMode = ExecMode.EAGER) -> SimBatch:
    return SimBatch(decode_context_lens=(ctx,) * bs, tp=tp, mode=mode)


def prefill(n: int, prefix: int = 0, tp: int = 1) -> SimBatch:
    return SimBatch(prefills=(PrefillChunk(n, prefix),), tp=tp)


def test_it_implements_the_protocol(oracle: ProfileOracle):
    assert isinstance(oracle, StepTimeOracle)
    assert oracle.num_layers == 32


def test_a_graph_decode_step_recomposes_from_the_tables(oracle: ProfileOracle):
    """Closed form: 32 × (token ops + KV write + decode attention) + embedding + final norm +
    LM head, all at TP1, for a batch that is its own capture size (no padding, no launches)."""
    prof = oracle.profiles.tp(1)
    bs, ctx = 64, 1000
    layer_ms = (prof.layer_token_ops(bs) + prof.kv_save_decode(bs)
                + prof.decode_attention(bs, bs * ctx))
    outside_ms = prof.embedding(bs) + prof.final_norm(bs) + prof.lm_head_rows(bs)
    expected_s = (32 * layer_ms + outside_ms) * 1e-3
    assert oracle.step_seconds(decode(bs, ctx, mode=ExecMode.GRAPH)) == pytest.approx(expected_s)


def test_the_lm_head_is_the_up_projection_gemm_scaled_to_the_vocabulary(oracle: ProfileOracle):
    prof = oracle.profiles.tp(1)
    # 1 row: a GEMV bound by reading the 4096 × 128256 fp16 head (1.05 GB) at the measured
    # bandwidth, within the GEMV's efficiency
    weight_read_s = 4096 * 128256 * 2 / oracle.hbm_bytes_per_s
    assert prof.lm_head_rows(1) * 1e-3 == pytest.approx(weight_read_s, rel=0.25)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_decode_time_is_monotone_in_batch_and_context(oracle: ProfileOracle, tp: int):
    for ctx in (128, 1024, 4096):
        times = [oracle.step_seconds(decode(bs, ctx, tp)) for bs in range(1, 300, 7)]
        assert (np.diff(times) >= 0).all()
    for bs in (1, 16, 128):
        times = [oracle.step_seconds(decode(bs, ctx, tp)) for ctx in range(16, 16384, 500)]
        assert (np.diff(times) >= 0).all() and times[-1] > times[0]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_prefill_grows_with_chunk_and_prefix(oracle: ProfileOracle, tp: int):
    by_chunk = [oracle.step_seconds(prefill(n, 0, tp)) for n in (16, 128, 512, 2048, 8192)]
    assert (np.diff(by_chunk) > 0).all()
    by_prefix = [oracle.step_seconds(prefill(512, p, tp)) for p in (0, 1024, 4096, 12000)]
    assert (np.diff(by_prefix) > 0).all()


def test_total_tokens_are_monotone_for_the_whole_step(oracle: ProfileOracle):
    times = [oracle.step_seconds(prefill(n)) for n in range(1, 20000, 37)]
    assert (np.diff(times) >= 0).all()


def test_tp4_is_faster_for_large_batches_and_pays_the_all_reduce(oracle: ProfileOracle):
    for batch_of in (lambda tp: prefill(2048, 0, tp), lambda tp: decode(256, 2048, tp)):
        tp1, tp4 = oracle.breakdown(batch_of(1)), oracle.breakdown(batch_of(4))
        assert tp4.total_s < tp1.total_s
        assert tp1.communication_s == 0.0 and tp4.communication_s > 0.0
    # two all-reduces per layer of tokens × hidden fp16 elements, from the network profile
    ar = oracle.profiles.tp(4).all_reduce_elems
    assert ar is not None
    comm = oracle.breakdown(prefill(2048, 0, 4)).communication_s
    assert comm == pytest.approx(32 * 2 * ar(2048 * 4096) * 1e-3)


def test_graph_decode_is_cheaper_than_eager(oracle: ProfileOracle):
    for tp in (1, 2, 4):
        for bs in (1, 8, 64, 256):
            graph = oracle.breakdown(decode(bs, 1024, tp, ExecMode.GRAPH))
            eager = oracle.breakdown(decode(bs, 1024, tp))
            assert graph.graph and not eager.graph
            assert graph.total_s < eager.total_s
            assert graph.launch_s == 0.0 and eager.launch_s > 0.0


def test_graph_replay_only_where_vllm_replays(oracle: ProfileOracle):
    assert oracle.graph_rows(decode(9, 100, mode=ExecMode.GRAPH)) == 16
    assert oracle.graph_rows(decode(513, 100, mode=ExecMode.GRAPH)) is None
    lora = SimBatch(decode_context_lens=(100,) * 8, lora_inference=True, mode=ExecMode.GRAPH)
    assert oracle.graph_rows(lora) is None
    mixed = SimBatch(prefills=(PrefillChunk(64),), decode_context_lens=(100,) * 8,
                     mode=ExecMode.GRAPH)
    assert oracle.graph_rows(mixed) is None
    # padding rows are computed: 9 rows replay the 16-row graph
    padded = oracle.breakdown(decode(9, 100, mode=ExecMode.GRAPH))
    assert padded.total_s > oracle.breakdown(decode(8, 100, mode=ExecMode.GRAPH)).total_s


def test_training_rows_add_lora_and_capture_and_run_eager(oracle: ProfileOracle):
    base = oracle.breakdown(decode(32, 1024))
    with_ft = oracle.breakdown(SimBatch(decode_context_lens=(1024,) * 32, ft_lens=(128, 128)))
    assert with_ft.lora_s > 0 and with_ft.capture_s > 0 and base.lora_s == 0
    assert with_ft.total_s > base.total_s
    with pytest.raises(InputError, match="eager"):
        SimBatch(ft_lens=(64,), mode=ExecMode.GRAPH)


def test_bad_batches_are_refused(oracle: ProfileOracle):
    with pytest.raises(InputError, match="empty"):
        SimBatch()
    with pytest.raises(InputError, match="new_tokens"):
        PrefillChunk(0)
    with pytest.raises(InputError, match="decode_context_lens"):
        SimBatch(decode_context_lens=(0,))
    with pytest.raises(InputError, match="tp"):
        oracle.step_seconds(decode(4, 100, tp=8))


def test_noise_is_reproducible_with_mean_one_and_the_profile_spread(oracle: ProfileOracle):
    sigma = oracle.noise_sigma(1)
    assert 0.005 < sigma < 0.03  # the profile's repeated runs spread ~1 %
    a = [StepNoise(sigma, seed=7).factor() for _ in range(3)]
    first, second = StepNoise(sigma, seed=7), StepNoise(sigma, seed=7)
    draws = np.array([first.factor() for _ in range(20_000)])
    assert draws.tolist() == [second.factor() for _ in range(20_000)]
    assert a[0] == a[1] == a[2]
    assert StepNoise(sigma, seed=8).factor() != draws[0]
    standard_error = draws.std() / np.sqrt(draws.size)
    assert abs(draws.mean() - 1.0) < 4 * standard_error
    assert np.log(draws).std() == pytest.approx(sigma, rel=0.05)
    assert StepNoise(0.0, seed=1).apply(0.5) == 0.5


def test_the_oracle_modules_import_no_torch():
    code = ("import sys, deltaserve.hosts.sim.oracle, deltaserve.hosts.sim.backward, "
            "deltaserve.hosts.sim.sanity; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
