"""A step-time oracle built from a real engine's own measured steps (the embedded CPU engine
here), and its measured backward cost: what validates the simulator against a real run.

The profile (``bench/sim/cpu_profile.py`` records it) is the engine's real steps timed through
its own forward path (``hosts/native/calibrate.py::time_probe``): the calibration plan's probes
plus random mixed shapes over the region a trace reaches, each the median of its repeats; the
backward process timed on real jobs; a standalone trainer's throughput.

The oracle is a non-negative regression with a physical form, fitted in relative terms like the
GPU attention regressors (so it grows with every input), and deliberately richer than the
latency model's Equation I that the simulated control plane calibrates against it:

    t = c + Σ_k h_k · max(0, N − knot_k)            (linear layers and LM head by step tokens,
                                                       piecewise: GEMM efficiency changes)
        + d · B_d + e · Σkv_decode                    (decode attention: per sequence, per token)
        + q · Σ n² + x · Σ n·p                        (prefill attention: causal area, prefix)
        + s · chunks + l · logit rows                 (per-sequence work, the LM head's rows)
        + f · T_ft + g · ft samples                   (LoRA and capture on training rows)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deltaserve.core.errors import InputError, require
from deltaserve.core.nnls import nnls
from deltaserve.hosts.sim.attention import FitError
from deltaserve.hosts.sim.backward import BackwardJob, BackwardTime
from deltaserve.hosts.sim.oracle import PrefillChunk, SimBatch

FORMAT = "deltaserve.sim_cpu_profile/1"
TOKEN_KNOTS = (0, 16, 32, 64, 128, 192)


@dataclass(frozen=True)
class MeasuredStep:
    """One probe as the engine ran it: prefill chunks of ``prefill`` tokens behind ``prefix``
    cached ones, ``decodes`` decode rows over ``kv`` cached tokens each, training samples of
    ``ft`` tokens; the median ``seconds`` of its repeats and their log-space spread."""

    prefill: tuple[int, ...]
    prefix: int
    decodes: int
    kv: int
    ft: tuple[int, ...]
    seconds: float
    log_spread: float = 0.0

    def batch(self) -> SimBatch:
        return SimBatch(tuple(PrefillChunk(n, self.prefix) for n in self.prefill),
                        (self.kv + 1,) * self.decodes, self.ft)


def features(batch: SimBatch) -> np.ndarray:
    tokens = batch.num_tokens
    chunks = [(c.new_tokens, c.prefix_tokens) for c in batch.prefills]
    return np.array([
        1.0, *(max(0, tokens - k) for k in TOKEN_KNOTS),
        batch.num_decode, sum(batch.decode_context_lens),
        sum(n * n for n, _ in chunks) + sum(m * m for m in batch.ft_lens),
        sum(n * p for n, p in chunks),
        len(chunks), batch.num_decode + len(chunks),
        sum(batch.ft_lens), len(batch.ft_lens)], dtype=np.float64)


class MeasuredOracle:
    """:class:`~deltaserve.hosts.sim.oracle.StepTimeOracle` of a profiled engine."""

    def __init__(self, steps: list[MeasuredStep], num_layers: int):
        require(len(steps) >= 20, "profile", len(steps), "needs at least 20 measured steps")
        x = np.stack([features(s.batch()) for s in steps])
        y = np.array([s.seconds for s in steps])
        w = 1.0 / y
        self.coef = nnls(x * w[:, None], y * w)
        self._num_layers = num_layers
        self.sigma = float(np.median([s.log_spread for s in steps]))
        self.fit_error = FitError.score(x @ self.coef * 1e3, y * 1e3)

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def hbm_bytes_per_s(self) -> float:
        return math.inf  # no modelled copies: the measured steps include them

    def step_seconds(self, batch: SimBatch) -> float:
        return float(features(batch) @ self.coef)

    def layer_seconds(self, batch: SimBatch) -> float:
        return self.step_seconds(batch) / self._num_layers

    def head_seconds(self, rows: int, tp: int) -> float:
        return rows * float(self.coef[-3])  # the logit-row term

    def noise_sigma(self, tp: int) -> float:
        return self.sigma


@dataclass(frozen=True)
class MeasuredJob:
    lens: tuple[int, ...]
    seconds: float


class MeasuredBackward:
    """The backward process's measured cost: ``t = a + b · tokens + c · Σm²`` (per job, fitted
    non-negative in relative terms on real jobs), spread evenly over the layers it walks."""

    def __init__(self, jobs: list[MeasuredJob], num_layers: int):
        require(len(jobs) >= 3, "profile", len(jobs), "needs at least 3 measured backward jobs")
        x = np.array([self._features(j.lens) for j in jobs])
        y = np.array([j.seconds for j in jobs])
        self.coef = nnls(x / y[:, None], np.ones_like(y))
        self.fit_error = FitError.score(x @ self.coef * 1e3, y * 1e3)
        self._num_layers = num_layers

    @staticmethod
    def _features(lens: tuple[int, ...]) -> list[float]:
        return [1.0, float(sum(lens)), float(sum(n * n for n in lens))]

    @property
    def num_layers(self) -> int:
        return self._num_layers

    def seconds(self, job: BackwardJob) -> float:
        return float(np.dot(self._features(job.sample_lens), self.coef))

    def time(self, job: BackwardJob) -> BackwardTime:
        total = self.seconds(job)
        return BackwardTime(total / self._num_layers, total, 0.0, 0.0)


@dataclass(frozen=True)
class ThreadProfile:
    """What was measured with the engine on ``threads`` CPU threads."""

    threads: int
    steps: list[MeasuredStep]
    backward: list[MeasuredJob]
    standalone_tokens_per_s: float | None


def load_profile(path: str | Path) -> dict[int, ThreadProfile]:
    """Profiles by thread count from a file ``bench/sim/cpu_profile.py`` wrote."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError("cpu_profile", str(path), f"not a readable profile: {e}") from None
    require(doc.get("format") == FORMAT, "cpu_profile", str(path), f"format must be {FORMAT}")
    out = {}
    for key, t in doc["threads"].items():
        steps = [MeasuredStep(tuple(s["prefill"]), s["prefix"], s["decodes"], s["kv"],
                              tuple(s["ft"]), s["seconds"], s["log_spread"])
                 for s in t["steps"]]
        jobs = [MeasuredJob(tuple(j["lens"]), j["seconds"]) for j in t["backward"]]
        out[int(key)] = ThreadProfile(int(key), steps, jobs, t.get("standalone_tokens_per_s"))
    return out
