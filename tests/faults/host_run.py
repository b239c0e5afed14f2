"""One life of a co-serving host, for the kill-and-restart test: it resumes from the checkpoint
directory, trains (training-only steps and a trickle of client requests) and records each
optimizer step it commits, until the epochs are done or it is killed.

    python -m tests.faults.host_run MODEL_DIR ROOT RUN
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from deltaserve.core.requests import SamplingParams
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.native import EngineConfig, LLMEngine
from deltaserve.model import LoRAConfig
from deltaserve.train.checkpoint_store import CheckpointConfig
from deltaserve.train.config import BackwardConfig, CoServeConfig
from deltaserve.train.events import OptimizerStep, TrainingEvent
from tests.train import fixtures as fx

NUM_SAMPLES, NUM_EPOCHS = 40, 2


def main(model_dir: str, root: str, run: int) -> None:
    eng = LLMEngine(EngineConfig(model=model_dir, dtype="float32", max_num_seqs=8,
                                 max_num_batched_tokens=128, block_size=8, kv_cache_tokens=2048,
                                 max_model_len=256))
    co = eng.attach(CoServeConfig(SLOConfig(5.0, 5.0), lora=LoRAConfig(r=4, alpha=8),
                                  backward=BackwardConfig(batch_tokens=64),
                                  num_epochs=NUM_EPOCHS,
                                  checkpoint=CheckpointConfig(root=f"{root}/ck", every_steps=1)),
                    dataset=fx.samples(NUM_SAMPLES), latency_model=fx.latency_model(),
                    progress=False)
    out = Path(root)
    resumed = co.trainer.optimizer_steps if co.trainer.resumed_from else 0
    (out / f"start-{run}.json").write_text(json.dumps({"resumed_step": resumed}))
    steps = (out / f"steps-{run}.jsonl").open("a", buffering=1)

    def record(ev: TrainingEvent) -> None:
        if isinstance(ev, OptimizerStep):
            steps.write(json.dumps({"step": ev.step, "epoch": ev.epoch,
                                    "sample_ids": list(ev.sample_ids)}) + "\n")

    co.subscribe(record)
    n = 0
    while co.stats().epoch < NUM_EPOCHS:
        if n % 7 == 0:
            eng.add_request([1 + n % 90, 2, 3], SamplingParams(max_tokens=2))
        n += 1
        if not eng.step():
            co.idle(0.01)
    eng.detach(drain=True, checkpoint=True)
    (out / f"done-{run}").write_text("done")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
