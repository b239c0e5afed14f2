"""Validation loss computed in the backward process, against transformers + PEFT on the same
adapter (each checkpoint the co-server wrote) and the same held-out samples."""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from deltaserve.core.data import IGNORE_INDEX
from deltaserve.train.checkpoint_policy import Checkpointer
from deltaserve.train.checkpoint_store import CheckpointConfig, CheckpointStore
from deltaserve.train.events import OptimizerStep, ValidationLoss
from deltaserve.train.facade import CoServer
from tests.train import fixtures as fx
from tests.train.test_coserver import run_until


def peft_loss(base_path, adapter_dir, samples) -> tuple[float, float]:
    """Mean response-token loss and argmax accuracy of the PEFT adapter, token-weighted over
    all samples (one sample per forward: no padding involved)."""
    hf = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(hf, adapter_dir).eval()
    total, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([list(s.input_ids)])).logits[0, :-1]
            labels = torch.tensor(s.labels[1:])
            keep = labels != IGNORE_INDEX
            total += float(torch.nn.functional.cross_entropy(logits[keep], labels[keep],
                                                             reduction="sum"))
            correct += int((logits[keep].argmax(-1) == labels[keep]).sum())
            count += int(keep.sum())
    return total / count, correct / count


def test_validation_loss_equals_peft_at_every_checkpoint(base_path, tmp_path):
    train, held_out = fx.samples(24), fx.samples(6, seed=9)
    root = tmp_path / "ck"
    co = CoServer.for_model(fx.config(root, every=2), fx.LIMITS, fx.model(base_path), train,
                            base_model=str(base_path), latency_model=fx.latency_model(),
                            validation=held_out)
    rec = fx.Recorder(co)
    try:
        run_until(co, fx.model(base_path), 4)
        co.drain()  # the validation owed for the last step runs before the drain returns
    finally:
        co.close(drain=False)
    steps = [e for e in rec.events if isinstance(e, OptimizerStep)]
    vals = [e for e in rec.events if isinstance(e, ValidationLoss)]
    # every second step (the checkpoint interval) validates, each exactly once
    assert [s.step for s in steps if s.validating] == [s.step for s in steps
                                                       if (s.step + 1) % 2 == 0]
    assert [v.step for v in vals] == [s.step for s in steps if s.validating]
    # each validation comes before the next optimizer step: it measured that step's adapter
    order = [(type(e).__name__, e.step) for e in rec.events
             if isinstance(e, OptimizerStep | ValidationLoss)]
    for v in vals:
        i = order.index(("ValidationLoss", v.step))
        assert order[i - 1] == ("OptimizerStep", v.step)
    assert vals
    for v in vals:
        ref_loss, ref_acc = peft_loss(base_path, root / f"checkpoint-{v.step + 1:06d}", held_out)
        assert v.error is None
        assert v.loss == pytest.approx(ref_loss, rel=1e-5), (v.step, v.loss, ref_loss)
        assert v.mean_token_accuracy == pytest.approx(ref_acc)
        assert v.num_tokens == sum(sum(x != IGNORE_INDEX for x in s.labels[1:])
                                   for s in held_out)
    assert vals[-1].loss != vals[0].loss  # it measured a changing adapter


def test_failed_validation_is_reported_and_training_goes_on(base_path):
    """A validation that raises in the backward process (here: token ids outside the model's
    vocabulary) is reported for its step, with the error; the adapter is untouched and the next
    steps train."""
    co = CoServer.for_model(fx.config(None, valid_every_steps=1), fx.LIMITS,
                            fx.model(base_path), fx.samples(24), base_model=str(base_path),
                            latency_model=fx.latency_model(),
                            validation=fx.samples(4, seed=3, vocab=5000))
    rec = fx.Recorder(co)
    try:
        run_until(co, fx.model(base_path), 3)
        co.drain()
    finally:
        co.close(drain=False)
    vals = [e for e in rec.events if isinstance(e, ValidationLoss)]
    validating = [e.step for e in rec.events if isinstance(e, OptimizerStep) and e.validating]
    assert validating == [0, 1, 2, *validating[3:]]
    assert [v.step for v in vals] == validating  # one report per validating step
    assert all(v.loss is None and "IndexError" in v.error for v in vals)
    assert co.stats().backward_failures == 0  # a failed validation loses no training step


def test_resume_from_is_authoritative(base_path, tmp_path):
    """A caller that recorded checkpoint 2 resumes from it although ``latest`` names a newer
    one (written, but never seen by the caller)."""
    root = tmp_path / "ck"
    co = fx.coserver(base_path, fx.samples(24), root=root, every=1)
    try:
        run_until(co, fx.model(base_path), 3)
    finally:
        co.close(drain=False, checkpoint=False)
    store = CheckpointStore(root)
    assert store.find_latest().name == "checkpoint-000003"
    wanted = root / "checkpoint-000002"
    cp = Checkpointer(CheckpointConfig(str(root), resume_from=str(wanted)), str(base_path),
                      "fp")
    resumed = cp.resume(fx.model(base_path).config)
    assert resumed.checkpoint.path == wanted and resumed.checkpoint.step == 2
    default = Checkpointer(CheckpointConfig(str(root)), str(base_path), "fp")
    assert default.resume(fx.model(base_path).config).checkpoint.step == 3
