"""close() while the backward is hung mid-job: the checkpoint it still writes agrees with itself
(trainer state, adapter, optimizer) and with the pool, so a resume trains nothing twice."""

import json
import os
import signal

import pytest
import torch

from deltaserve.model.peft_io import load_adapter
from deltaserve.train.checkpoint_store import find_latest
from tests.tiny import hf_tiny_llama
from tests.train import fixtures as fx


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf_tiny_llama(seed=7).save_pretrained(path)
    return path


def test_close_with_a_hung_backward_times_out_yet_checkpoints_and_stops(base_path, tmp_path):
    """A backward that never answers: close raises after its deadline, stops the process, and
    the checkpoint's trainer state, adapter and optimizer state all say the last committed step
    (here: none), so a resume trains nothing twice."""
    samples = fx.samples(10)
    root = tmp_path / "ck"
    co = fx.coserver(base_path, samples, root=root, batch_tokens=10_000)
    model = fx.model(base_path)
    init = co.adapter.flat.clone()
    proc = fx.process(co)
    try:
        fx.capture_all(co, model)
        os.kill(proc.process.pid, signal.SIGSTOP)  # hung: alive, never answers
        with pytest.raises(TimeoutError, match="did not finish step 0"):
            co.close(timeout_s=2.0)
        assert not proc.process.is_alive()
        latest = find_latest(root)
        assert latest is not None and latest.name == "checkpoint-000000"
        state = json.loads((latest / "trainer_state.json").read_text())
        assert state["step"] == 0 and state["pool"]["committed"] == []
        opt = torch.load(latest / "optimizer.pt", weights_only=True)
        assert int(opt["step"]) == 0
        assert torch.equal(load_adapter(latest, co.model.config).flat, init)
    finally:
        proc.stop()
