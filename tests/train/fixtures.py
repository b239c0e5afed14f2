"""A tiny model, random instruction-like samples and a calibrated latency model for co-server
tests."""

from __future__ import annotations

import torch

from deltaserve.core import HostLimits, StepShape, TrainingSample, build_plan
from deltaserve.core.data import IGNORE_INDEX
from deltaserve.core.latency_model import fit_from
from deltaserve.core.slo import SLOConfig
from deltaserve.model import LlamaModel, LoRAConfig
from deltaserve.model.loading import load_weights
from deltaserve.train.backward.process import BackwardProcess
from deltaserve.train.capture import training_only_step
from deltaserve.train.checkpoint_store import CheckpointConfig
from deltaserve.train.config import BackwardConfig, CoServeConfig
from deltaserve.train.events import OptimizerStep, TrainingEvent
from deltaserve.train.facade import CoServer
from deltaserve.train.optim import OptimizerConfig

LIMITS = HostLimits(max_tokens_per_step=512, max_seqs_per_step=32, max_model_len=256,
                    max_kv_tokens=8192)


def samples(n: int = 24, seed: int = 0, vocab: int = 97) -> list[TrainingSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(8, 40, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        prompt = max(1, length // 3)
        out.append(TrainingSample(i, tuple(ids), tuple([IGNORE_INDEX] * prompt + ids[prompt:])))
    return out


def latency_model():
    def t(s: StepShape) -> float:
        return 1e-3 + 1e-5 * s.num_tokens + 1e-8 * s.prefill_sq_tokens + 1e-7 * s.kv_tokens
    return fit_from([(p.shape, t(p.shape)) for p in build_plan(LIMITS)])


def model(path) -> LlamaModel:
    return LlamaModel(*load_weights(path))


def config(root=None, every=1, dropout=0.0, batch_tokens=64, buffer_tokens=None,
           **kw) -> CoServeConfig:
    return CoServeConfig(
        slo=SLOConfig(1.0, 0.5),
        lora=LoRAConfig(r=4, alpha=8, dropout=dropout),
        optimizer=OptimizerConfig(lr=1e-2),
        checkpoint=CheckpointConfig(root=str(root) if root else None, every_steps=every),
        backward=BackwardConfig(batch_tokens=batch_tokens, buffer_tokens=buffer_tokens), **kw)


def coserver(base_path, samples, **kw) -> CoServer:
    """A co-server (its backward process started) over the model saved at ``base_path``."""
    return CoServer.for_model(config(**kw), LIMITS, model(base_path), samples,
                              base_model=str(base_path), latency_model=latency_model())


def capture_all(co, model) -> None:
    """Forward the whole pool in training-only steps (the backward is not waited for)."""
    while training_only_step(co, model, co.adapter) is not None:
        pass


def process(co: CoServer) -> BackwardProcess:
    """The co-server's backward process (fault tests kill and pause it)."""
    return co.trainer.backward.process


class Recorder:
    """Subscribes to a co-server's events; the committed optimizer steps, in order."""

    def __init__(self, co: CoServer):
        self.events: list[TrainingEvent] = []
        co.subscribe(self.events.append)

    @property
    def steps(self) -> list[OptimizerStep]:
        return [e for e in self.events if isinstance(e, OptimizerStep)]

    @property
    def committed_ids(self) -> list[int]:
        return [i for e in self.steps for i in e.sample_ids]
