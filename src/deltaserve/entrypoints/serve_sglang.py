"""``deltaserve serve --engine sglang --model-path MODEL --finetune-dataset PATH [...]``: SGLang's
own OpenAI-compatible server with co-serving on.

Every ``sglang serve`` flag is accepted (SGLang's own parser), plus the ``--finetune-*`` flags
generated from :class:`~deltaserve.hosts.sglang.serve_spec.ServeSpec`. ``--model-path`` also
takes DeltaServe's built-in names (``smollm2``). DeltaServe sets what it depends on: the normal
(non-overlapped) scheduler loop, LoRA with room for the training adapter, arrival-order
scheduling, and SGLang's CPU path (the only one this host was built and tested on); a flag given
against one of those is an error. Every co-serving flag, the model, the dataset (row by row),
the latency model and the checkpoint directory are checked before SGLang starts, and an error
names the flag and its value. SGLang then starts as it always does, with DeltaServe's scheduler
in its scheduler process (:class:`~deltaserve.hosts.sglang.serving.ServingScheduler`), which
reports through a status file (printed at start). When the HTTP server stops, the scheduler is
asked to checkpoint the last committed step before SGLang ends its processes. Without
``--finetune-checkpoint-dir`` checkpoints go to a fresh directory under
``deltaserve-data/sglang-serve/`` (printed), so no training is discarded at shutdown.
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

from sglang.srt.entrypoints.http_server import launch_server
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import kill_process_tree

from deltaserve.cli_flags import add_dataclass_flags, checked_from_args
from deltaserve.core.data import DataConfig
from deltaserve.core.errors import InputError
from deltaserve.core.latency_model import LatencyModel
from deltaserve.entrypoints.serve_inputs import checked_dataset, writable_checkpoint
from deltaserve.hosts.sglang.config import CPU_ARGS, REQUIRED_ARGS
from deltaserve.hosts.sglang.serve_spec import ServeSpec, ServeState, ServeStatus
from deltaserve.hosts.sglang.version import SERVE_ENV, import_sglang
from deltaserve.model.loading import load_tokenizer, resolve_model

STOP_WAIT_S = 120.0
CHECKPOINT_PARENT = Path("deltaserve-data") / "sglang-serve"  # without a checkpoint dir
DEST = "finetune."
Flags = dict[str, str]


def build_parser() -> tuple[argparse.ArgumentParser, Flags]:
    """SGLang's own parser plus the co-serving flags (every flag by its ``dest``)."""
    parser = argparse.ArgumentParser(
        prog="deltaserve serve --engine sglang",
        description="SGLang's OpenAI-compatible server with LoRA fine-tuning co-served")
    ServerArgs.add_cli_args(parser)
    flags = add_dataclass_flags(parser.add_argument_group("DeltaServe co-serving"),
                                ServeSpec, prefix="finetune-", dest=DEST)
    return parser, flags


def parse(argv: list[str]) -> tuple[Any, ServeSpec]:
    """SGLang's server arguments and the co-serving spec, every input checked (an
    :class:`InputError` naming the flag and its value) before anything heavy loads."""
    parser, flags = build_parser()
    ns = parser.parse_args(argv)
    spec: ServeSpec = checked_from_args(ServeSpec, ns, flags, DEST)
    check_engine_flags(ns, parser)
    try:
        ns.model_path = str(resolve_model(ns.model_path))
    except InputError as e:
        raise InputError("--model-path", ns.model_path, e.reason) from e
    args = prepare(ServerArgs.from_cli_args(ns), spec)
    check_dataset(args, spec)
    if spec.latency_model:
        try:
            LatencyModel.load(spec.latency_model)
        except (InputError, OSError, ValueError, KeyError) as e:
            raise InputError(flags[f"{DEST}latency_model"], spec.latency_model,
                             f"not a latency model: {e}") from e
    spec = replace(spec, checkpoint=writable_checkpoint(
        spec.checkpoint, flags[f"{DEST}checkpoint.root"], CHECKPOINT_PARENT))
    return args, replace(spec, status_file=str(spec.status_path()))


def check_engine_flags(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """A SGLang flag given against what co-serving needs (REQUIRED_ARGS, CPU_ARGS) is an error
    rather than silently overridden."""
    for name, needed in {**REQUIRED_ARGS, **CPU_ARGS}.items():
        given = getattr(ns, name, None)
        if given not in (None, needed, parser.get_default(name)):
            flag = "--" + name.replace("_", "-")
            raise InputError(flag, given, f"DeltaServe co-serving needs {needed!r} here")


def prepare(args: Any, spec: ServeSpec) -> Any:
    """The server arguments co-serving depends on: the required ones, and a LoRA pool with
    room for the training adapter (its rank and modules) beside a client's."""
    for name, value in {**REQUIRED_ARGS, **CPU_ARGS}.items():
        setattr(args, name, value)
    lora = spec.lora
    args.max_lora_rank = max(args.max_lora_rank or 0, lora.r)
    targets = set(args.lora_target_modules or ())
    if "all" not in targets:
        args.lora_target_modules = sorted(targets | set(lora.target_modules))
    args.max_loras_per_batch = max(args.max_loras_per_batch or 0, 2)
    return args


def check_dataset(args: Any, spec: ServeSpec) -> int:
    """Parse and tokenize every row now (an error names the line); returns the sample count.
    A sample must fit one step whole (``--chunked-prefill-size``)."""
    path = spec.dataset or ""
    try:
        tok = load_tokenizer(Path(args.model_path))
    except (OSError, ValueError) as e:
        raise InputError("--model-path", args.model_path, f"cannot load its tokenizer: {e}") \
            from e
    limits = [n for n in (args.chunked_prefill_size, args.context_length) if n and n > 0]
    data = DataConfig(path, max_tokens=min(limits)) if limits else DataConfig(path)
    return checked_dataset(data, tok)


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


def run(args: Any, spec: ServeSpec) -> None:
    """SGLang's server, its scheduler process co-serving; on return training is checkpointed."""
    status_path = Path(spec.status_file or "")
    status_path.parent.mkdir(parents=True, exist_ok=True)
    status_path.unlink(missing_ok=True)  # a previous run's report is not this one's
    with tempfile.TemporaryDirectory(prefix="deltaserve-serve-") as tmp:
        spec_file = Path(tmp) / "serve_spec.pickle"
        spec.write(spec_file)
        os.environ[SERVE_ENV] = str(spec_file)
        print(f"deltaserve: co-serving inside SGLang; checkpoints in {spec.checkpoint.root}; "
              f"status in {status_path}", file=sys.stderr, flush=True)
        try:
            launch_server(args)
        except KeyboardInterrupt:
            pass  # Ctrl-C / SIGINT: the HTTP server stopped; shut down in order below
        finally:
            final = stop_coserving(status_path)
            print(f"deltaserve: co-serving ended: {final}", file=sys.stderr, flush=True)
            # SGLang's processes (the scheduler ignores SIGINT) end as SGLang ends them
            kill_process_tree(os.getpid(), include_parent=False)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``deltaserve serve --engine sglang``; ``argv``: everything after it."""
    import_sglang()  # marks SGLang's processes as driven by DeltaServe (the plugin acts)
    try:
        args, spec = parse(sys.argv[1:] if argv is None else argv)
    except InputError as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    run(args, spec)
    return 0
