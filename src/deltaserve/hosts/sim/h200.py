"""A step-time oracle for one H200 fitted to the steps measured on it (``shared/data/h200/``:
``probe.json``, summarised in ``probe.md`` and ``README.md``): plain-PyTorch Llama-3-8B-shaped
steps, decode with and without CUDA graphs, prefill, mixed decode + fine-tuning steps and the
fine-tuning rows' forward alone. Loaded by path, never copied.

The form is the one the measurements show (README, "The plain-PyTorch floor"): a step's *device
time* is linear in its work, and an eager step cannot finish before the CPU has launched its
kernels, a floor that depends on which kernels it launches, not on how many tokens they carry
(eager decode is flat at 15–17 ms up to 64 rows while its graph replay takes 5.6–12.7 ms):

    device(b) = g0 + g_row · decode rows + g_kv · KV tokens read
                + g_tok · max(0, tokens − RIDGE_TOKENS)
    graph step = device(b)
    eager step = max(launch(b), device(b)),
    launch(b)  = l0 + l_dec · [decode rows] + l_fill · [prefill or training rows] + l_lora · [LoRA]

``g0`` is the weights' read, paid once per step; a token costs compute only once the step's
GEMMs pass the ridge point (``RIDGE_TOKENS``, the measured matmul ceiling over the graph decode's
bandwidth: below it they are bound by the weights' read). A prefill chunk reads its prefix's
KV like a decode row (the same ``g_kv``). Both parts are fitted non-negative in relative terms
(:func:`deltaserve.core.nnls.nnls` weighted by 1/measured) on the measured medians: each eager
point is given to the floor or to the device term, and of every split that is monotone in the
steps' size within each kind the one with the least squared relative error over all points is
kept (an exhaustive search over a few hundred splits). Nothing is fitted to a paper's result.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deltaserve.core.errors import InputError, require
from deltaserve.core.nnls import nnls
from deltaserve.core.shape import ExecMode
from deltaserve.hosts.sim.attention import FitError
from deltaserve.hosts.sim.modelled import graph_capture_size
from deltaserve.hosts.sim.oracle import PrefillChunk, SimBatch

PROBE_FILE = "h200/probe.json"  # under the shared data
# README "Ceilings": bf16 8192³ matmul 769 TFLOP/s; device copy 4,215 GB/s (read + write). The
# graph decode reads the weights at 2.3–2.7 TB/s (probe.md §1); a GEMM over T tokens does 2 FLOP
# per 2-byte weight per token, so it stops being bound by the read at T ≈ 769e12 / 2.5e12.
MATMUL_FLOPS = 769e12
DECODE_READ_BYTES_PER_S = 2.5e12
RIDGE_TOKENS = MATMUL_FLOPS / DECODE_READ_BYTES_PER_S
COPY_BYTES_PER_S = 4215e9  # read + write counted, as capture_layer_seconds counts them
KINDS = ("decode graph", "decode eager", "prefill", "mixed", "training forward")
Z90 = 1.2816  # the standard normal's 90th percentile


@dataclass(frozen=True)
class ProbePoint:
    """One measured step: its kind (``KINDS``), the batch as the oracle sees it, and its median
    and p90 in ms."""

    kind: str
    batch: SimBatch
    median_ms: float
    p90_ms: float


def _stat(entry: dict, path: Path, what: str) -> tuple[float, float]:
    try:
        ms = entry["gpu_ms"]
        median, p90 = float(ms["median"]), float(ms["p90"])
    except (KeyError, TypeError, ValueError):
        raise InputError("h200_probe", str(path), f"{what}: no gpu_ms median/p90") from None
    require(median > 0 and math.isfinite(p90), "h200_probe", str(path), f"{what}: bad times")
    return median, p90


def _decode(b: int, kv: int, mode: ExecMode) -> SimBatch:
    return SimBatch(decode_context_lens=(kv,) * b, mode=mode)


def _ft_lens(shape: str) -> tuple[int, ...]:
    """``"4x64"`` → (64, 64, 64, 64); ``"0x0"`` → ()."""
    count, length = (int(x) for x in shape.split("x"))
    return (length,) * count if count else ()


def load_probe(path: str | Path) -> list[ProbePoint]:
    """Every step measured in ``probe.json`` (sections s1, s2, s3), with its kind."""
    path = Path(path)
    try:
        sections = json.loads(path.read_text())["sections"]
        s1, s2, s3 = sections["s1_decode"], sections["s2_mixed"], sections["s3_backward"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise InputError("h200_probe", str(path), f"not the H200 probe's file: {e}") from None
    points = []
    for r in s1["rows"]:
        for kind, mode, key in (("decode graph", ExecMode.GRAPH, "graph"),
                                ("decode eager", ExecMode.EAGER, "eager")):
            points.append(ProbePoint(kind, _decode(r["B"], r["L"], mode),
                                     *_stat(r[key], path, f"s1 B={r['B']} L={r['L']}")))
    for r in s2["rows"]:
        what = f"s2 {r['kind']} F={r['F']} P={r['P']}"
        if r["kind"] == "prefill":
            batch, kind = SimBatch(prefills=(PrefillChunk(r["P"]),)), "prefill"
        else:
            ft = _ft_lens(r["ft_seqs"])
            batch = SimBatch(decode_context_lens=(r["L"],) * r["B"], ft_lens=ft)
            kind = "mixed" if ft else "decode eager"
        points.append(ProbePoint(kind, batch, *_stat(r["eager"], path, what)))
    first = s2["rows"][0]  # the graph decode at the mixed steps' shape
    points.append(ProbePoint("decode graph", _decode(first["B"], first["L"], ExecMode.GRAPH),
                             *_stat(s2["decode_graph"], path, "s2 decode_graph")))
    for r in s3["rows"]:
        points.append(ProbePoint("training forward", SimBatch(ft_lens=_ft_lens(r["shape"])),
                                 *_stat(r["ft_forward"], path, f"s3 {r['shape']} forward")))
    return points


def device_features(batch: SimBatch) -> np.ndarray:
    kv = sum(batch.decode_context_lens) + sum(c.prefix_tokens for c in batch.prefills)
    return np.array([1.0, batch.num_decode, kv, max(0.0, batch.num_tokens - RIDGE_TOKENS)])


def launch_features(batch: SimBatch) -> np.ndarray:
    return np.array([1.0, float(batch.num_decode > 0), float(bool(batch.prefills or batch.ft_lens)),
                     float(batch.has_lora)])


def is_graph(batch: SimBatch) -> bool:
    return batch.mode is ExecMode.GRAPH and batch.is_decode_only and not batch.lora_inference


def _size(p: ProbePoint) -> tuple[int, int]:
    """The order in which a kind's steps leave the launch floor: tokens, then KV read."""
    return p.batch.num_tokens, int(device_features(p.batch)[2])


def _fit(points: list[ProbePoint], on_floor: set[int]) -> tuple[np.ndarray, np.ndarray]:
    y = np.array([p.median_ms for p in points])
    device = [i for i, p in enumerate(points) if i not in on_floor]
    g = nnls(np.stack([device_features(points[i].batch) for i in device]) / y[device, None],
             np.ones(len(device)))
    if not on_floor:
        return g, np.zeros(4)
    floor = sorted(on_floor)
    l_coef = nnls(np.stack([launch_features(points[i].batch) for i in floor]) / y[floor, None],
                  np.ones(len(floor)))
    return g, l_coef


def _predict_ms(g: np.ndarray, l_coef: np.ndarray, batch: SimBatch) -> float:
    x = device_features(batch)
    if is_graph(batch):  # a replayed graph computes its padding rows too (the probe's B are
        x[1] = graph_capture_size(batch.num_decode, batch.num_decode)  # captured sizes)
        return float(x @ g)
    return max(float(x @ g), float(launch_features(batch) @ l_coef))


def fit(points: list[ProbePoint]) -> tuple[np.ndarray, np.ndarray]:
    """(device, launch) coefficients in ms of the best monotone split (module doc)."""
    eager = {k: sorted((i for i, p in enumerate(points) if p.kind == k),
                       key=lambda i: _size(points[i])) for k in KINDS[1:]}
    y = np.array([p.median_ms for p in points])
    best, best_err = None, math.inf
    for cuts in itertools.product(*(range(len(v) + 1) for v in eager.values())):
        on_floor = {i for v, c in zip(eager.values(), cuts, strict=True) for i in v[:c]}
        g, l_coef = _fit(points, on_floor)
        pred = np.array([_predict_ms(g, l_coef, p.batch) for p in points])
        err = float(np.sum((pred / y - 1.0) ** 2))
        if err < best_err:
            best, best_err = (g, l_coef), err
    assert best is not None
    return best


class H200Oracle:
    """:class:`~deltaserve.hosts.sim.oracle.StepTimeOracle` of the measured H200 (module doc).
    ``fit_error``: per step kind, on the measured points it was fitted to. TP1 only: the
    measurements are of one GPU."""

    def __init__(self, points: list[ProbePoint], num_layers: int):
        require(len(points) >= 20, "h200_probe", len(points), "needs at least 20 steps")
        self.points = points
        self.device_coef, self.launch_coef = fit(points)
        self._num_layers = num_layers
        spreads = [math.log(p.p90_ms / p.median_ms) / Z90 for p in points
                   if p.p90_ms > p.median_ms]
        self.sigma = float(np.median(spreads)) if spreads else 0.0
        self.fit_error = {
            k: FitError.score(np.array([self.step_seconds(p.batch) * 1e3 for p in pts]),
                              np.array([p.median_ms for p in pts]))
            for k in KINDS if (pts := [p for p in points if p.kind == k])}

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def hbm_bytes_per_s(self) -> float:
        return COPY_BYTES_PER_S  # the measured steps include their capture copies

    def step_seconds(self, batch: SimBatch) -> float:
        require(batch.tp == 1, "tp", batch.tp, "the H200 measurements are of one GPU (TP1)")
        return _predict_ms(self.device_coef, self.launch_coef, batch) * 1e-3

    def layer_seconds(self, batch: SimBatch) -> float:
        return self.step_seconds(batch) / self._num_layers

    def head_seconds(self, rows: int, tp: int) -> float:
        if rows < 0:
            raise InputError("rows", rows, "must be >= 0")
        return 0.0  # inside the measured steps, and the loss's inside the backward ratio

    def noise_sigma(self, tp: int) -> float:
        return self.sigma
