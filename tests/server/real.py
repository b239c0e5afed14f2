"""The service on the real embedded engine: a tiny random Llama with the built-in model's
tokenizer (and chat template), calibrated once per test session, served in a thread of the test
process (or as a ``deltaserve serve`` process, for the restart tests) on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import openai
import uvicorn
from fastapi import FastAPI

from deltaserve.core.calibration import CalibrationConfig
from deltaserve.core.slo import SLOConfig
from deltaserve.core.synthetic_task import generate
from deltaserve.entrypoints.serve_native import (
    HostLoop,
    ServeConfig,
    Service,
    host_loops,
    start_service,
    validate,
)
from deltaserve.hosts.native.config import EngineConfig
from deltaserve.hosts.native.engine import LLMEngine
from deltaserve.model.loading import load_tokenizer
from deltaserve.model.lora import ALL_MODULES, LoRAConfig
from deltaserve.server import ServerConfig, create_app
from deltaserve.train.config import BackwardConfig, CoServeConfig
from tests.server.live import API_KEY, wait_for
from tests.tiny import hf_tiny_llama

VOCAB = 49152  # the built-in model's tokenizer
SMALL_CAL = CalibrationConfig(split_total=64, max_split=2, decode_batches=(1, 4),
                              decode_kv_lens=(16, 64), chunk_prefixes=(16,),
                              mixed_decodes=(2,), mixed_prefills=(32,), mixed_kv_lens=(64,),
                              ft_sample_len=48, ft_totals=(48, 96), repeats=1)
# fp32 and no dropout: runs are reproducible; every projection, so the random model learns fast
LORA = LoRAConfig(r=8, alpha=16.0, dropout=0.0, target_modules=ALL_MODULES)


def save_tiny_model(path: Path) -> Path:
    """A tiny random Llama (fp32) with SmolLM2's tokenizer, chat template and end token."""
    hf_tiny_llama(seed=11, vocab_size=VOCAB, num_hidden_layers=4).save_pretrained(path)
    tok = load_tokenizer("smollm2")
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": tok.eos_token_id}))
    return path


def engine_config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), dtype="float32", max_num_seqs=16,
                        max_num_batched_tokens=256, block_size=8, kv_cache_tokens=8192,
                        max_model_len=512)


def calibrate_once(model: Path, out: Path) -> Path:
    """The session's latency model (every server in the tests loads it: no per-test sweep)."""
    host = LLMEngine(engine_config(model))
    try:
        host.calibrate(LORA, SMALL_CAL, None, progress=False).save(out)
    finally:
        host.close()
    return out


def serve_config(model: Path, latency: Path, data_dir: Path, **server) -> ServeConfig:
    base = ServerConfig(data_dir=data_dir, port=0, api_key=API_KEY, checkpoint_every_steps=4,
                        progress_interval_s=0.5, dashboard_interval_s=0.2,
                        shutdown_pause_timeout_s=60.0, job_poll_interval_s=0.02)
    coserve = CoServeConfig(slo=SLOConfig(ttft_s=5.0, tpot_s=2.0), lora=LORA,
                            backward=BackwardConfig(batch_tokens=256))
    return ServeConfig(host=engine_config(model), server=replace(base, **server),
                       coserve=coserve, latency_model=str(latency))


@dataclass
class RealServer:
    config: ServeConfig
    app: FastAPI
    service: Service
    loops: list[HostLoop]
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def host(self) -> LLMEngine:
        """The first replica's engine (the only one, unless ``--replicas``)."""
        return self.service.hosts[0]

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        return self.host.model_name

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0,
                             timeout=120)

    def stop(self) -> None:
        """What SIGTERM does: the running job is checkpointed and paused, then the host."""
        self.server.should_exit = True
        self.thread.join(120)
        for loop in self.loops:
            loop.stop()
        for host in self.service.hosts:
            host.close()
        assert not self.thread.is_alive(), "the server did not stop"


def start_real_server(config: ServeConfig) -> RealServer:
    service = start_service(config, validate(config))
    loops = host_loops(service)
    app = create_app(config.server, service.backend, service.runner, service.stats)
    server = uvicorn.Server(uvicorn.Config(app, host=config.server.bind, port=0,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 60, "the server to start")
    return RealServer(config, app, service, loops, server, thread)


def task_files(num_train: int, num_valid: int = 0, seed: int = 0) -> tuple[bytes, bytes]:
    """Disjoint training and validation records of the built-in generated task
    (``core/synthetic_task.py``), as JSONL."""
    train, valid = generate(num_train=num_train, num_heldout=num_valid, seed=seed)
    return tuple("".join(json.dumps(e.alpaca()) + "\n" for e in part).encode()
                 for part in (train, valid))
