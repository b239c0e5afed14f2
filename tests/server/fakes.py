"""In-process stand-ins for the three Protocols the service is built against.

* :class:`FakeBackend`: a deterministic "model" streaming tokens from its own thread. Token k of
  a request is a function of the prompt, k and the served adapter's weights, so a fine-tuned
  model answers differently from the base model and from its other checkpoints. Adapters are
  loaded from their PEFT directories with the project's loader: a directory that is not a valid
  adapter for the tiny model fails here as it would on a real host.
* :class:`FakeRunner`: trains nothing, but keeps the runner contract exactly: optimizer steps
  with a falling loss, checkpoints written as real PEFT directories plus a resume state, pause,
  cancel and resume from a checkpoint.
* :class:`FakeStats`: the co-server's counters, partly fed by the two fakes.
"""

from __future__ import annotations

import hashlib
import json
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltaserve.core.admission import Skip
from deltaserve.core.errors import InputError
from deltaserve.core.requests import RequestOutput, SamplingParams, TokenCallback
from deltaserve.core.slo import SLOConfig
from deltaserve.model.config import ModelConfig
from deltaserve.model.lora import AdapterWeights, LoRAConfig
from deltaserve.model.peft_io import load_adapter, save_adapter
from deltaserve.server.hyperparameters import job_defaults
from deltaserve.server.protocols import (
    CheckpointEvent,
    FinishedEvent,
    PausedEvent,
    RunnerEvent,
    ServingStatsSnapshot,
    StepEvent,
    StepMetrics,
    TrainingJobSpec,
)
from deltaserve.train.config import CoServeConfig
from tests.conftest import make_word_tokenizer
from tests.tiny import TINY

BASE_MODEL = "tiny-llama"
TINY_MODEL = ModelConfig.from_hf(TINY)
FAKE_LORA = LoRAConfig(r=2, alpha=4.0, dropout=0.0)
NUMBERS = [str(i) for i in range(41)]
WORDS = ["Add", "and", "Say", "hi", "hello", "there", "What", "is", "?", *NUMBERS]
NUM_SPECIAL = 4  # <unk>, <|im_start|>, <|im_end|>, </s> come first in the vocabulary


def fake_tokenizer():
    return make_word_tokenizer(WORDS)


def adapter_signature(adapter: AdapterWeights) -> int:
    return int(hashlib.sha256(adapter.flat.numpy().tobytes()).hexdigest()[:12], 16)


def next_token(prompt: tuple[int, ...], k: int, signature: int, vocab: int) -> int:
    """The fake model: never a special token, deterministic in (prompt, k, adapter)."""
    return NUM_SPECIAL + (sum(prompt) * 31 + k * 7 + signature) % (vocab - NUM_SPECIAL)


@dataclass
class _Request:
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    signature: int
    callback: TokenCallback | None
    arrival_s: float
    output: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)


class FakeBackend:
    def __init__(self, tokenizer, *, max_model_len: int = 256, token_delay_s: float = 0.002):
        self.model_name = BASE_MODEL
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.token_delay_s = token_delay_s
        self.vocab = len(tokenizer)
        self._lock = threading.Lock()
        self._adapters: dict[str, int] = {}
        self._requests: dict[str, _Request] = {}
        self.aborted: list[str] = []
        self.generated_tokens = 0
        self.finished_requests = 0
        self._ids = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-host", daemon=True)
        self._thread.start()

    # ---- the Protocol -----------------------------------------------------------------------
    def add_request(self, prompt, params, *, adapter=None, callback=None, request_id=None):
        if adapter is not None and adapter not in self._adapters:
            raise InputError("adapter", adapter, f"not loaded; loaded: {self.lora_names()}")
        if len(prompt) >= self.max_model_len:
            raise InputError("prompt", f"{len(prompt)} tokens", "longer than the context")
        with self._lock:
            self._ids += 1
            rid = request_id or f"fake-{self._ids}"
            sig = self._adapters[adapter] if adapter is not None else 0
            self._requests[rid] = _Request(rid, tuple(prompt), params, sig, callback,
                                           time.monotonic())
        return rid

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            if self._requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def add_lora(self, name: str, path: str) -> None:
        sig = adapter_signature(load_adapter(path, TINY_MODEL))
        with self._lock:
            self._adapters[name] = sig

    def remove_lora(self, name: str) -> None:
        with self._lock:
            self._adapters.pop(name, None)

    def lora_names(self) -> list[str]:
        with self._lock:
            return sorted(self._adapters)

    # ---- what a test compares against -------------------------------------------------------
    def expected_text(self, prompt: list[int], adapter_dir: Path | None, num_tokens: int) -> str:
        sig = adapter_signature(load_adapter(adapter_dir, TINY_MODEL)) if adapter_dir else 0
        ids = [next_token(tuple(prompt), k, sig, self.vocab) for k in range(num_tokens)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    # ---- the host's thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                active = list(self._requests.values())
            for req in active:
                self._advance(req)
            time.sleep(self.token_delay_s)

    def _advance(self, req: _Request) -> None:
        req.output.append(next_token(req.prompt, len(req.output), req.signature, self.vocab))
        req.times.append(time.monotonic())
        text = self.tokenizer.decode(req.output, skip_special_tokens=True)
        reason = None
        cut = min((i for i in (text.find(s) for s in req.params.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, reason = text[:cut], "stop"
        elif len(req.output) >= req.params.max_tokens:
            reason = "length"
        with self._lock:
            if req.request_id not in self._requests:
                return  # aborted meanwhile
            if reason is not None:
                del self._requests[req.request_id]
                self.finished_requests += 1
            self.generated_tokens += 1
        out = RequestOutput(req.request_id, req.prompt, tuple(req.output),
                            text if reason else None, reason is not None, reason, req.arrival_s,
                            req.times[0], tuple(req.times))
        if req.callback is not None:
            req.callback(out)


# ---- training ---------------------------------------------------------------------------------
def fake_loss(step: int) -> float:
    return 2.5 * math.exp(-0.08 * step) + 0.2


def write_fake_adapter(path: Path, step: int, seed: int, base_model: str) -> Path:
    """A real PEFT directory for the tiny model whose B matrices grow with ``step``."""
    adapter = AdapterWeights(TINY_MODEL, FAKE_LORA).init_peft_(seed)
    with torch.no_grad():
        for _, _, _, b in adapter.items():
            b.fill_(1e-3 * step)
    return save_adapter(path, adapter, base_model)


# the library's own defaults, as a server with no co-serving flags would resolve ``auto``
FAKE_DEFAULTS = job_defaults(CoServeConfig(slo=SLOConfig(2.0, 0.2)), max_sample_tokens=256)


class FakeRunner:
    """Steps pack whole samples up to ``backward_batch_tokens``; checkpoints every
    ``checkpoint_every_steps`` steps into ``checkpoint_dir/checkpoint-N`` with a
    ``trainer_state.json`` that :meth:`start` resumes from."""

    def __init__(self, step_delay_s: float = 0.02):
        self.defaults = FAKE_DEFAULTS
        self.step_delay_s = step_delay_s
        self.starts: list[TrainingJobSpec] = []
        self.tokens_committed = 0
        self.samples_committed = 0
        self._events: queue.Queue[RunnerEvent] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pause = threading.Event()
        self._cancel = threading.Event()
        self.gate = threading.Event()  # steps wait while it is clear (a test holds a job)
        self.gate.set()

    def start(self, spec: TrainingJobSpec) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a job is active")
        if not spec.train_samples:
            raise InputError("training_file", 0, "no samples")
        self.starts.append(spec)
        self._pause.clear()
        self._cancel.clear()
        self._thread = threading.Thread(target=self._train, args=(spec,), daemon=True)
        self._thread.start()

    def poll(self) -> list[RunnerEvent]:
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def pause(self) -> None:
        self._pause.set()

    def cancel(self) -> None:
        self._cancel.set()
        if self._thread is not None:
            self._thread.join(10)
        self.poll()

    # ---- the training thread ----------------------------------------------------------------
    @staticmethod
    def batches(spec: TrainingJobSpec) -> list[list[int]]:
        out, cur, tokens = [], [], 0
        for s in spec.train_samples:
            cur.append(s.num_tokens)
            tokens += s.num_tokens
            if tokens >= spec.hyperparameters.backward_batch_tokens:
                out.append(cur)
                cur, tokens = [], 0
        return out + ([cur] if cur else [])

    def _train(self, spec: TrainingJobSpec) -> None:
        batches = self.batches(spec)
        total = len(batches) * spec.hyperparameters.n_epochs
        step, tokens = 0, 0
        if spec.resume_from is not None:
            state = json.loads((spec.resume_from / "trainer_state.json").read_text())
            step, tokens = state["step"], state["trained_tokens"]
        metrics = None
        while step < total:
            if self._cancel.is_set():
                return
            if self._pause.is_set():
                self._checkpoint(spec, step, tokens, metrics)
                self._events.put(PausedEvent(step))
                return
            time.sleep(self.step_delay_s)
            if not self.gate.wait(0.01):
                continue
            batch = batches[step % len(batches)]
            step += 1
            tokens += sum(batch)
            self.tokens_committed += sum(batch)
            self.samples_committed += len(batch)
            loss = fake_loss(step)
            metrics = StepMetrics(step, loss, 1.0 - loss / 3.0, tokens,
                                  loss + 0.1 if spec.valid_samples else None)
            self._events.put(StepEvent(metrics))
            if step % spec.checkpoint_every_steps == 0:
                self._checkpoint(spec, step, tokens, metrics)
        final = write_fake_adapter(spec.checkpoint_dir / "final", step, spec.seed,
                                   spec.base_model)
        self._events.put(FinishedEvent(final, metrics))

    def _checkpoint(self, spec, step, tokens, metrics) -> None:
        path = write_fake_adapter(spec.checkpoint_dir / f"checkpoint-{step:06d}", step,
                                  spec.seed, spec.base_model)
        (path / "trainer_state.json").write_text(json.dumps({"step": step,
                                                             "trained_tokens": tokens}))
        m = metrics or StepMetrics(step, fake_loss(step), 0.0, tokens)
        self._events.put(CheckpointEvent(path, m))


# ---- statistics -------------------------------------------------------------------------------
SKIPS = {Skip.POOL_EMPTY: 3, Skip.OVER_BUDGET: 5, Skip.BACKWARD_RUNNING: 7}
STEPS_LOST = {"RuntimeError": 4, "worker_died": 1}


class FakeStats:
    def __init__(self, backend: FakeBackend, runner: FakeRunner):
        self.backend = backend
        self.runner = runner

    def snapshot(self) -> ServingStatsSnapshot:
        finished = self.backend.finished_requests
        return ServingStatsSnapshot(
            ft_tokens_committed=self.runner.tokens_committed,
            ft_samples_committed=self.runner.samples_committed,
            ft_tokens_admitted=self.runner.tokens_committed + 11,
            admission_skips=SKIPS, steps=40, step_time_predicted_s=1.5,
            step_time_measured_s=1.75, latency_model_mape=0.042,
            slo_misses={"ttft": finished // 10, "tpot": finished // 20},
            requests_finished=finished, requests_slo_missed=finished // 10,
            inference_tokens=self.backend.generated_tokens, backward_busy_ratio=0.25,
            ft_steps_lost=STEPS_LOST)
