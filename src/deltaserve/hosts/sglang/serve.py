"""``deltaserve serve --engine sglang --model-path MODEL --finetune-dataset PATH [...]``: SGLang's
own OpenAI-compatible server with co-serving on.

Every ``sglang serve`` flag is accepted (SGLang's own parser), plus the ``--finetune-*`` flags
generated from :class:`~deltaserve.hosts.sglang.serve_config.ServeConfig`. ``--model-path`` also
takes DeltaServe's built-in names (``smollm2``). DeltaServe sets what it depends on: the normal
(non-overlapped) scheduler loop, LoRA with room for the training adapter, arrival-order
scheduling, and SGLang's CPU path (the only one this host was built and tested on). The dataset
and the latency model are checked before SGLang starts. SGLang then starts as it always does,
with DeltaServe's scheduler in its scheduler process
(:class:`~deltaserve.hosts.sglang.serving.ServingScheduler`), which reports through a status
file (printed at start). When the HTTP server stops, the scheduler is asked to checkpoint the
last committed step before SGLang ends its processes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from deltaserve.cli_flags import add_dataclass_flags, from_args
from deltaserve.core.data import DataConfig, load_dataset
from deltaserve.core.errors import InputError
from deltaserve.core.latency_model import LatencyModel
from deltaserve.hosts.sglang.config import CPU_ARGS, REQUIRED_ARGS
from deltaserve.hosts.sglang.serve_config import ServeConfig, ServeState, ServeStatus
from deltaserve.hosts.sglang.version import SERVE_ENV, import_sglang
from deltaserve.model.loading import load_tokenizer, resolve_model

STOP_WAIT_S = 120.0


def parse(argv: list[str]) -> tuple[Any, ServeConfig]:
    """SGLang's server arguments and the co-serving config."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog="deltaserve serve --engine sglang",
        description="SGLang's OpenAI-compatible server with LoRA fine-tuning co-served")
    ServerArgs.add_cli_args(parser)
    add_dataclass_flags(parser.add_argument_group("DeltaServe co-serving"), ServeConfig,
                        prefix="finetune-")
    ns = parser.parse_args(argv)
    config = from_args(ServeConfig, ns)
    config = replace(config, status_file=str(config.status_path()))
    args = ServerArgs.from_cli_args(ns)
    args.model_path = str(resolve_model(args.model_path))
    return prepare(args, config), config


def prepare(args: Any, config: ServeConfig) -> Any:
    """The server arguments co-serving depends on (an explicit value that contradicts them is
    an error)."""
    for name, value in {**REQUIRED_ARGS, **CPU_ARGS}.items():
        setattr(args, name, value)
    lora = config.lora
    args.max_lora_rank = max(args.max_lora_rank or 0, lora.r)
    targets = set(args.lora_target_modules or ())
    if "all" not in targets:
        args.lora_target_modules = sorted(targets | set(lora.target_modules))
    args.max_loras_per_batch = max(args.max_loras_per_batch or 0, 2)
    return args


def check_inputs(args: Any, config: ServeConfig) -> int:
    """Bad data fails here, before SGLang loads anything. Returns the number of samples."""
    tok = load_tokenizer(args.model_path)
    limit = args.chunked_prefill_size if args.chunked_prefill_size else None
    samples, _ = load_dataset(DataConfig(config.dataset or "", max_tokens=limit), tok)
    if not samples:
        raise InputError("finetune_dataset", config.dataset, "holds no usable sample")
    if config.latency_model:
        LatencyModel.load(config.latency_model)
    return len(samples)


def stop_coserving(status_path: Path) -> ServeStatus | None:
    """Ask the scheduler process to detach (checkpoint) and wait until it has."""
    status = ServeStatus.read(status_path)
    if status is None or status.state is not ServeState.COSERVING:
        return status
    try:
        os.kill(status.pid, signal.SIGUSR1)
    except ProcessLookupError:
        return status
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        status = ServeStatus.read(status_path)
        if status is not None and status.state is ServeState.STOPPED:
            break
        time.sleep(0.2)
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``deltaserve serve --engine sglang``."""
    import_sglang()  # marks SGLang's processes as driven by DeltaServe (the plugin acts)
    from sglang.srt.entrypoints.http_server import launch_server

    args, config = parse(sys.argv[1:] if argv is None else argv)
    n = check_inputs(args, config)
    status_path = Path(config.status_file or "")
    status_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="deltaserve-serve-") as tmp:
        spec = Path(tmp) / "serve_config.pickle"
        config.write(spec)
        os.environ[SERVE_ENV] = str(spec)
        print(f"deltaserve: co-serving {n} samples inside SGLang; status in {status_path}",
              file=sys.stderr, flush=True)
        try:
            launch_server(args)
        finally:
            final = stop_coserving(status_path)
            print(f"deltaserve: co-serving ended: {final}", file=sys.stderr, flush=True)
    return 0
