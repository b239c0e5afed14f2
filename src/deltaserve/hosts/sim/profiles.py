"""Load Vidur's measured profiles by path and turn them into per-TP timing tables.

Files (under the Vidur data directory, see ``catalogue.resolve_vidur_dir``):

* ``compute/<gpu>/<model>/mlp.csv``: every non-attention operator of one decoder layer, by the
  batch's total tokens, per TP degree (medians in ms).
* ``compute/<gpu>/<model>/attention_sampled.csv``: a ~10 % sample of the attention operator
  (prefill by chunk and KV length, decode by batch and KV length), TP1 and TP4.
* ``network/<net>/all_reduce.csv``: all-reduce time by size in fp16 elements.

Nothing is copied; a missing file, a missing column or a non-numeric cell is an ``InputError``
naming the file, the column and the line.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deltaserve.core.errors import InputError
from deltaserve.hosts.sim.attention import DecodeFit, FitError, GeometricMean, PrefillFit
from deltaserve.hosts.sim.catalogue import ProfileEntry, resolve_vidur_dir
from deltaserve.hosts.sim.curves import MonotoneCurve

# The per-layer token-level operators (Vidur's list); `emb` runs once per step, not per layer.
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
             "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
_SHAPE_COLUMNS = {"n_embd": "hidden", "n_expanded_embd": "ffn", "vocab_size": "vocab",
                  "n_head": "num_q_heads", "n_kv_head": "num_kv_heads"}
_ATTN_SHAPE_COLUMNS = {"n_embd": "hidden", "n_q_head": "num_q_heads", "n_kv_head": "num_kv_heads"}
_BOOL = {"true": 1.0, "false": 0.0}


def read_columns(path: Path, columns: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The named columns of a CSV file as float arrays (``True``/``False`` read as 1/0)."""
    if not path.is_file():
        raise InputError("profile_file", str(path), "does not exist")
    with path.open(newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise InputError("profile_file", str(path), "is empty")
        missing = [c for c in columns if c not in header]
        if missing:
            raise InputError("profile_file", str(path), f"missing column(s) {missing}")
        index = [header.index(c) for c in columns]
        values: list[list[float]] = []
        for line, row in enumerate(reader, start=2):
            values.append([_cell(path, row, i, c, line) for i, c in zip(index, columns,
                                                                           strict=True)])
    if not values:
        raise InputError("profile_file", str(path), "has a header but no rows")
    table = np.asarray(values, dtype=np.float64)
    return {c: table[:, k] for k, c in enumerate(columns)}


def _cell(path: Path, row: list[str], i: int, column: str, line: int) -> float:
    raw = row[i].strip() if i < len(row) else ""
    if raw.lower() in _BOOL:
        return _BOOL[raw.lower()]
    try:
        value = float(raw)
    except ValueError:
        raise InputError("profile_file", str(path), f"column {column!r}: {raw!r} is not a number",
                         line=line) from None
    if not np.isfinite(value):
        raise InputError("profile_file", str(path), f"column {column!r}: {raw!r} is not finite",
                         line=line)
    return value


def _median(op: str) -> str:
    return f"time_stats.{op}.median"


def _std(op: str) -> str:
    return f"time_stats.{op}.std"


@dataclass(frozen=True)
class TpProfile:
    """Everything the oracle looks up for one TP degree; curves and fits in ms per layer (or per
    step for ``embedding``, ``final_norm``, ``lm_head_rows``).

    ``lm_head_rows``: the LM head GEMM by rows (not profiled: ``mlp_up_proj``, the same GEMM
    shape with N = 2·ffn/TP, scaled by vocab / (2·ffn); it is vocab-parallel, so /TP too).
    ``noise_sigma``: the time-weighted std/median of the layer operators' repeated runs.
    ``attention_source``: "measured" or how it was derived. Times are medians (no noise).
    """

    tp: int
    layer_token_ops: MonotoneCurve
    embedding: MonotoneCurve
    final_norm: MonotoneCurve
    lm_head_rows: MonotoneCurve
    kv_save_decode: MonotoneCurve
    kv_save_prefill: MonotoneCurve
    decode_attention: DecodeFit | GeometricMean
    prefill_attention: PrefillFit | GeometricMean
    all_reduce_elems: MonotoneCurve | None
    noise_sigma: float
    attention_source: str


@dataclass(frozen=True)
class GpuProfiles:
    """The loaded profiles of one catalogue entry: ``by_tp`` for each offered TP degree."""

    entry: ProfileEntry
    data_dir: Path
    network: str
    by_tp: dict[int, TpProfile]
    tp2_rule_check: FitError

    def tp(self, tp: int) -> TpProfile:
        if tp not in self.by_tp:
            raise InputError("tp", tp, f"{self.entry.gpu}/{self.entry.model} profiles serve TP "
                             f"{', '.join(map(str, sorted(self.by_tp)))}")
        return self.by_tp[tp]

    @property
    def hbm_bytes_per_s(self) -> float:
        """Effective HBM bandwidth measured by the profile itself: bytes of K/V one TP1 decode
        reads per cached token per layer over the fitted time per cached token."""
        per_token_s = self.by_tp[1].decode_attention.per_kv_token_ms * 1e-3
        return self.entry.shape.kv_bytes_per_token_per_layer(1) / per_token_s


def _check_shape(entry: ProfileEntry, path: Path, table: dict[str, np.ndarray],
                 columns: dict[str, str]) -> None:
    for column, attr in columns.items():
        expected = getattr(entry.shape, attr)
        if column in table and not np.all(table[column] == expected):
            raise InputError("profile_file", str(path),
                             f"column {column!r} is not {expected} in every row "
                             f"(not {entry.model}'s shape)")


@dataclass(frozen=True)
class _MlpCurves:
    layer_token_ops: MonotoneCurve
    embedding: MonotoneCurve
    final_norm: MonotoneCurve
    lm_head_rows: MonotoneCurve
    noise_sigma: float


def _mlp_curves(entry: ProfileEntry, path: Path, tp: int,
                mlp: dict[str, np.ndarray]) -> _MlpCurves:
    rows = mlp["num_tensor_parallel_workers"] == tp
    if not rows.any():
        raise InputError("profile_file", str(path), f"no rows for TP {tp}")
    tokens = mlp["num_tokens"][rows]
    per_layer = sum(mlp[_median(op)][rows] for op in LAYER_OPS)
    medians = np.stack([mlp[_median(op)][rows] for op in LAYER_OPS])
    stds = np.stack([mlp[_std(op)][rows] for op in LAYER_OPS])
    head_scale = entry.shape.vocab / (2 * entry.shape.ffn)
    return _MlpCurves(
        layer_token_ops=MonotoneCurve.fit(tokens, per_layer),
        embedding=MonotoneCurve.fit(tokens, mlp[_median("emb")][rows]),
        final_norm=MonotoneCurve.fit(tokens, mlp[_median("input_layernorm")][rows]),
        lm_head_rows=MonotoneCurve.fit(tokens, mlp[_median("mlp_up_proj")][rows] * head_scale),
        # std/median weighted by time: the operators that dominate a step set its spread
        noise_sigma=float(stds.sum() / medians.sum()))


@dataclass(frozen=True)
class _AttentionTp:
    decode: DecodeFit | GeometricMean
    prefill: PrefillFit | GeometricMean
    kv_save_decode: MonotoneCurve
    kv_save_prefill: MonotoneCurve


def _attention(path: Path, att: dict[str, np.ndarray], tp: int) -> _AttentionTp:
    rows = att["num_tensor_parallel_workers"] == tp
    dec = rows & (att["is_prefill"] == 0)
    pre = rows & (att["is_prefill"] == 1)
    if not dec.any() or not pre.any():
        raise InputError("profile_file", str(path), f"no decode or no prefill rows for TP {tp}")
    save = att[_median("attn_kv_cache_save")]
    return _AttentionTp(
        decode=DecodeFit.fit(att["batch_size"][dec], att["kv_cache_size"][dec],
                             att[_median("attn_decode")][dec]),
        prefill=PrefillFit.fit(att["prefill_chunk_size"][pre], att["kv_cache_size"][pre],
                               att[_median("attn_prefill")][pre]),
        kv_save_decode=MonotoneCurve.fit(att["batch_size"][dec], save[dec]),
        kv_save_prefill=MonotoneCurve.fit(att["prefill_chunk_size"][pre], save[pre]))


def _interpolate(low: _AttentionTp, high: _AttentionTp) -> _AttentionTp:
    """Attention at the log-midpoint of two measured TP degrees (see ``attention.py``)."""
    return _AttentionTp(GeometricMean(low.decode, high.decode),
                        GeometricMean(low.prefill, high.prefill),
                        low.kv_save_decode.geometric_mean(high.kv_save_decode),
                        low.kv_save_prefill.geometric_mean(high.kv_save_prefill))


def _tp2_rule_check(mlp: dict[str, np.ndarray], by_tp: dict[int, _MlpCurves]) -> FitError:
    """The TP2 rule scored where TP2 is measured: sqrt(TP1 · TP4) of the layer's token
    operators against the measured TP2 medians."""
    rows = mlp["num_tensor_parallel_workers"] == 2
    tokens = mlp["num_tokens"][rows]
    measured = sum(mlp[_median(op)][rows] for op in LAYER_OPS)
    rule = np.sqrt(by_tp[1].layer_token_ops.many(tokens) * by_tp[4].layer_token_ops.many(tokens))
    return FitError.score(rule, measured)


def _all_reduce(path: Path, tp: int) -> MonotoneCurve | None:
    if tp == 1:
        return None
    ar = read_columns(path, ("num_workers", "devices_per_node", "size",
                             _median("all_reduce")))
    # one node, every worker on it: the rows Vidur itself uses for TP within a node
    rows = (ar["num_workers"] == tp) & (ar["devices_per_node"] == tp)
    if not rows.any():
        raise InputError("profile_file", str(path), f"no single-node all-reduce rows for {tp} "
                         "workers")
    return MonotoneCurve.fit(ar["size"][rows], ar[_median("all_reduce")][rows])


def load_profiles(entry: ProfileEntry, data_dir: str | Path | None = None,
                  network: str | None = None) -> GpuProfiles:
    """Read and fit every table of ``entry`` (a few seconds on this machine's CPUs)."""
    root = resolve_vidur_dir(data_dir)
    net = network or entry.default_network
    if net not in entry.networks:
        raise InputError("network", net, f"must be one of {', '.join(entry.networks)}")
    compute = root / entry.compute_subdir
    mlp_path, att_path = compute / "mlp.csv", compute / "attention_sampled.csv"
    mlp_cols = ("num_tokens", "num_tensor_parallel_workers", *_SHAPE_COLUMNS,
                *(f"time_stats.{op}.{s}" for op in (*LAYER_OPS, "emb")
                  for s in ("median", "std")))
    mlp = read_columns(mlp_path, tuple(dict.fromkeys(mlp_cols)))
    _check_shape(entry, mlp_path, mlp, _SHAPE_COLUMNS)
    att = read_columns(att_path, (
        "num_tensor_parallel_workers", "batch_size", "prefill_chunk_size", "kv_cache_size",
        "is_prefill", "n_embd", "n_q_head", "n_kv_head", _median("attn_decode"),
        _median("attn_prefill"), _median("attn_kv_cache_save")))
    _check_shape(entry, att_path, att, _ATTN_SHAPE_COLUMNS)
    measured = {tp: _attention(att_path, att, tp) for tp in entry.attention_tp_measured}
    mlp_curves = {tp: _mlp_curves(entry, mlp_path, tp, mlp) for tp in (1, 2, 4)}
    ar_path = root / "network" / net / "all_reduce.csv"
    by_tp = {}
    for tp in entry.tp_degrees:
        # the geometric-mean rule holds at the log-midpoint of the measured degrees only
        if tp not in measured and not (tp == 2 and {1, 4} <= set(measured)):
            raise InputError("tp", tp, "no attention rows and no measured neighbours")
        attn = measured.get(tp) or _interpolate(measured[1], measured[4])
        source = "measured" if tp in measured else "geometric mean of TP1 and TP4"
        mc = mlp_curves[tp]
        by_tp[tp] = TpProfile(
            tp=tp, layer_token_ops=mc.layer_token_ops, embedding=mc.embedding,
            final_norm=mc.final_norm, lm_head_rows=mc.lm_head_rows,
            kv_save_decode=attn.kv_save_decode, kv_save_prefill=attn.kv_save_prefill,
            decode_attention=attn.decode, prefill_attention=attn.prefill,
            all_reduce_elems=_all_reduce(ar_path, tp), noise_sigma=mc.noise_sigma,
            attention_source=source)
    return GpuProfiles(entry, root, net, by_tp, _tp2_rule_check(mlp, mlp_curves))
