"""``deltaserve serve --engine sglang``: SGLang's own OpenAI server, in its own processes (a
child of the test: never SGLang's server in the test process), with co-serving on. Bad input is
refused, naming the flag and value, before SGLang starts. Greedy completions equal
transformers'; the training adapter answers no client (by name or by SGLang's raw id); the
scheduler process reports co-serving and trains in idle time; on shutdown it checkpoints, and
the checkpoint loads in PEFT."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("sglang", reason="needs the SGLang venv (.venv-sglang: bash "
                    "scripts/bootstrap.sh --sglang)")

import openai
import requests
import torch

from deltaserve.core.errors import InputError
from deltaserve.entrypoints.serve_sglang import parse
from deltaserve.hosts.sglang.serve_spec import ServeState, ServeStatus
from deltaserve.hosts.sglang.training import TRAIN_ADAPTER
from deltaserve.train.checkpoint_store import find_latest
from tests.hosts.sglang.common import LORA, hf_greedy

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def alpaca(path, n: int = 24):
    rows = [{"instruction": f"Add {i} and {i + 3}.", "input": "", "output": f"{2 * i + 3}"}
            for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_s: float, proc) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def deltaserve_serve(args: list[str], log, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # see tests/hosts/sglang/session.py
    return subprocess.Popen([sys.executable, "-m", "deltaserve.cli", "serve", "--engine",
                             "sglang", *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                            **kw)


@pytest.fixture()
def inputs(tmp_path):
    data = alpaca(tmp_path / "data.jsonl", 4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text().splitlines()[0] + "\n{not json\n")
    return {"tmp": tmp_path, "data": data, "bad": bad}


@pytest.mark.parametrize("flags, named", [
    (["--finetune-dataset", "{tmp}/missing.jsonl"], "--finetune-dataset='{tmp}/missing.jsonl'"),
    (["--finetune-dataset", "{data}", "--finetune-lora-r", "0"], "--finetune-lora-r=0"),
    (["--finetune-dataset", "{bad}"], "line 2: --finetune-dataset='{bad}'"),
    (["--finetune-dataset", "{data}", "--schedule-policy", "lpm"], "--schedule-policy='lpm'"),
    (["--finetune-dataset", "{data}", "--finetune-latency-model", "{data}"],
     "--finetune-latency-model='{data}'"),
    (["--finetune-dataset", "{data}", "--finetune-checkpoint-dir", "/proc/deltaserve"],
     "--finetune-checkpoint-dir='/proc/deltaserve'"),
    (["--finetune-dataset", "{data}", "--model-path", "no-such-model"],
     "--model-path='no-such-model'"),
])
def test_bad_input_names_flag_and_value(inputs, flags, named):
    """Parsing checks everything and starts nothing (SGLang starts only in ``run``)."""
    with pytest.raises(InputError) as e:
        parse(["--model-path", "smollm2", *[f.format(**inputs) for f in flags]])
    assert str(e.value).startswith(named.format(**inputs)), e.value


def test_bad_input_exits_before_sglang_starts(inputs, tmp_path):
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = deltaserve_serve(["--model-path", "smollm2", "--finetune-dataset",
                                 str(inputs["bad"])], out)
        assert proc.wait(300) == 2
    text = log.read_text()
    assert f"deltaserve: error: line 2: --finetune-dataset='{inputs['bad']}'" in text, text
    assert "Load weight" not in text and "Scheduler" not in text  # nothing of SGLang ran


def serve(tmp_path, latency_file, port):
    args = ["--model-path", "smollm2", "--port", str(port), "--dtype", "float32",
            "--max-total-tokens", "8192", "--mem-fraction-static", "0.5",
            "--chunked-prefill-size", "256", "--max-running-requests", "16",
            "--finetune-dataset", str(alpaca(tmp_path / "data.jsonl")),
            "--finetune-latency-model", str(latency_file),
            "--finetune-lora-r", str(LORA.r), "--finetune-lora-alpha", str(LORA.alpha),
            "--finetune-lora-target-modules", *LORA.target_modules,
            "--finetune-backward-batch-tokens", "64", "--finetune-backward-threads", "1",
            "--finetune-checkpoint-dir", str(tmp_path / "ck"),
            "--finetune-checkpoint-every-steps", "1000", "--finetune-optimizer-lr", "0.02"]
    return deltaserve_serve(args, (tmp_path / "server.log").open("w"))


def assert_training_adapter_unreachable(client, model: str, port: int) -> None:
    """SGLang resolves adapter names in its tokenizer process, which never heard of the
    training adapter (loaded in the scheduler process under a reserved name)."""
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=f"{model}:{TRAIN_ADAPTER}", prompt="Hi", max_tokens=2)
    r = requests.post(f"http://127.0.0.1:{port}/generate", timeout=60, json={
        "text": "Hi", "lora_path": TRAIN_ADAPTER, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400, r.text
    assert TRAIN_ADAPTER not in {m.id for m in client.models.list().data}


@pytest.mark.timeout(1800)  # a hang guard: start, train and stop take minutes on 2 shared cores
def test_serve_coserves_inside_sglangs_own_server(latency, hf_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    latency.save(tmp_path / "lm.json")
    port = free_port()
    status_path = tmp_path / "ck" / "status.json"
    proc = serve(tmp_path, tmp_path / "lm.json", port)
    try:
        def healthy():
            try:
                return requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok
            except requests.RequestException:
                return False

        wait_for(healthy, 600, proc)
        status = ServeStatus.read(status_path)
        assert status is not None and status.state is ServeState.COSERVING
        assert status.samples == 24 and status.pid != proc.pid  # SGLang's scheduler process
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        model = client.models.list().data[0].id
        prompt = "The capital of France is"
        got = client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                        temperature=0).choices[0].text
        tok = AutoTokenizer.from_pretrained(hf_model.config._name_or_path)
        want = hf_greedy(hf_model, tok(prompt)["input_ids"], 8)
        assert got == tok.decode(want)
        assert_training_adapter_unreachable(client, model, port)

        def trained():
            s = ServeStatus.read(status_path)
            return s is not None and s.stats is not None and s.stats.optimizer_steps >= 2

        wait_for(trained, 600, proc)  # idle time trains
        proc.send_signal(signal.SIGINT)
        assert proc.wait(300) == 0  # a clean stop: checkpoint, then SGLang's processes end
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
    final = ServeStatus.read(status_path)
    assert final is not None and final.state is ServeState.STOPPED, final
    ckpt = find_latest(tmp_path / "ck")
    assert ckpt is not None and final.stats.optimizer_steps >= 2
    base = AutoModelForCausalLM.from_pretrained(hf_model.config._name_or_path,
                                                dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(ckpt))
    b = [p for n, p in peft.named_parameters() if "lora_B" in n]
    assert b and any(p.abs().sum() > 0 for p in b)  # trained, saved, loaded
