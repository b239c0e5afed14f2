"""``deltaserve serve --engine vllm MODEL [vLLM flags]``: vLLM's own OpenAI-compatible API
server with co-serving on, in one of two modes.

Every ``vllm serve`` flag is accepted (vLLM's own parser is used), plus the co-serving flags,
generated from :class:`~deltaserve.train.config.CoServeConfig` (``--finetune-slo-ttft-s``,
``--finetune-lora-r``, ``--finetune-checkpoint-dir``, ...; ``--help`` lists them with their
defaults) and :class:`~deltaserve.core.data.DataConfig` (``--finetune-data-*``), and:

* ``--bind ADDRESS``: where the server listens, **127.0.0.1 by default** (this machine only).
  It sets vLLM's own ``--host``; give one of the two.
* ``--api-key KEY`` (vLLM's flag, passed through): every request must then carry
  ``Authorization: Bearer KEY``; without it the API is open to whoever reaches the address.

**The fine-tuning service** (no ``--finetune-dataset``): the service's flags too
(``--data-dir``, ``--max-upload-bytes``, ``--checkpoint-every-steps``, ``--metrics-public``,
...; the SLO defaults to the embedded service's). ``--bind``, ``--port`` and ``--api-key`` are
vLLM's server's: the key then guards every route, the service's included. Every flag, the data
directory and the latency-model file are checked before vLLM starts. Then vLLM's own start-up
runs (``vllm.entrypoints.launchers.api_server.entry.run_server``) with DeltaServe's endpoint
plugin allowlisted (:mod:`deltaserve.server.vllm_plugin`), which mounts the service and
calibrates the engine once before the server accepts requests.

**One dataset** (``--finetune-dataset PATH``) trained for the server's lifetime.
``--finetune-checkpoint-dir``: where training is checkpointed (PEFT format, resumable); without
it, checkpoints go to a fresh directory under ``deltaserve-data/vllm-serve/`` (the path is
printed at start), so no training is discarded at shutdown. Every co-serving flag is checked
before vLLM loads the model (the config's own checks, the dataset parsed row by row, the
latency-model file, the checkpoint directory writable), and an error names the flag and its
value. Start-up: vLLM starts; the worker's hooks are installed; the engine process loads the
dataset, reserves the training adapter and runs the calibration through vLLM's scheduler and
forward; only then does the HTTP server accept requests. On shutdown the co-server checkpoints
the last committed step, which vLLM serves with ``--lora-modules``.

In both modes DeltaServe sets the engine flags it depends on (``--scheduler-cls``,
``--worker-extension-cls``, ``--enable-lora``, a ``--max-lora-rank`` that holds
``--finetune-lora-r``, synchronous scheduling, eager execution) and runs the engine core's
worker inside the engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in the environment
it inherits).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import replace
from importlib.metadata import entry_points
from pathlib import Path

import uvloop
from vllm.entrypoints.launchers.api_server.entry import (
    build_and_serve,
    build_async_engine_client,
    run_server,
)
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.launchers.launcher import setup_server
from vllm.utils.argparse_utils import FlexibleArgumentParser

from deltaserve.cli_flags import add_dataclass_flags, checked_from_args
from deltaserve.core.config_io import from_dict, to_dict
from deltaserve.core.data import DataConfig
from deltaserve.core.errors import InputError
from deltaserve.core.latency_model import LatencyModel
from deltaserve.entrypoints.serve_inputs import checked_dataset, writable_checkpoint
from deltaserve.entrypoints.serve_native import DEFAULT_SLO
from deltaserve.hosts.vllm.config import SCHEDULER_CLS, WORKER_EXTENSION_CLS, lora_rank_for
from deltaserve.hosts.vllm.remote import ServeSpec
from deltaserve.hosts.vllm.version import import_vllm
from deltaserve.hosts.vllm.wire import CALIBRATIONS, CalibrateSpec, RemoteStatus, State
from deltaserve.model.loading import load_tokenizer, resolve_model
from deltaserve.server.config import ServerConfig
from deltaserve.server.data_dir import DataDir
from deltaserve.server.hyperparameters import job_defaults
from deltaserve.server.run import API_KEY_ENV
from deltaserve.server.vllm_plugin import SPEC_ARG, VLLMServiceSpec
from deltaserve.train.buffer import BufferSave
from deltaserve.train.config import CoServeConfig

DEFAULT_BIND = "127.0.0.1"  # this machine only, unless --bind says otherwise
CHECKPOINT_PARENT = Path("deltaserve-data") / "vllm-serve"  # without --finetune-checkpoint-dir
_POLL_S = 0.5
Flags = dict[str, str]
PLUGIN = "deltaserve"  # the entry points' name in vllm.general_plugins and vllm.endpoint_plugins
_OWN = ("bind", "port", "api_key")  # vLLM's server flags say these
# plugin groups vLLM filters by VLLM_PLUGINS; endpoint plugins load only when named there
_GROUPS = ("vllm.general_plugins", "vllm.platform_plugins", "vllm.stat_logger_plugins",
           "vllm.io_processor_plugins")


def add_coserve_args(parser: argparse.ArgumentParser) -> Flags:
    """The co-serving flags (``--finetune-*``, ``--bind``; vLLM owns every other name)."""
    g = parser.add_argument_group("DeltaServe co-serving")
    g.add_argument("--finetune-dataset", default=None,
                   help="fine-tuning data (Alpaca JSON/JSONL, chat JSONL or ShareGPT) trained "
                   "for the server's lifetime; without it the server is the fine-tuning "
                   "service (Files and Fine-tuning Jobs API)")
    g.add_argument("--finetune-calibration", choices=CALIBRATIONS, default="quick",
                   help="the start-up calibration sweep (default: %(default)s)")
    g.add_argument("--finetune-latency-model", default=None,
                   help="a fitted latency model's JSON (skips calibration)")
    g.add_argument("--bind", default=None, help=f"address to listen on (default: "
                   f"{DEFAULT_BIND}); sets vLLM's --host")
    flags = add_dataclass_flags(g, DataConfig, "finetune-data-", "finetune_data.",
                                skip=("path", "max_tokens"))
    flags.update(add_dataclass_flags(g, CoServeConfig, "finetune-", "finetune."))
    return flags


def build_parser() -> tuple[FlexibleArgumentParser, Flags, Flags]:
    """vLLM's parser plus the co-serving flags and the service's (each set by its ``dest``)."""
    parser = FlexibleArgumentParser(
        prog="deltaserve serve --engine vllm",
        description="vLLM's OpenAI-compatible server with LoRA fine-tuning co-served")
    parser = make_arg_parser(parser)
    coserve_flags = add_coserve_args(parser)
    group = parser.add_argument_group("DeltaServe fine-tuning service")
    server_flags = add_dataclass_flags(group, ServerConfig, dest="service.", skip=_OWN)
    return parser, coserve_flags, server_flags


# ---- both modes, and one dataset (--finetune-dataset): checked before vLLM loads the model ---
def coserve_config(args: argparse.Namespace, flags: Flags) -> CoServeConfig:
    """The co-serving config from the ``--finetune-*`` flags, each checked (``InputError``
    naming the flag and value), and the latency-model file if one is given."""
    for dest in ("finetune.slo.ttft_s", "finetune.slo.tpot_s"):
        if getattr(args, dest) is None:
            raise InputError(flags[dest], None, "required: the objective in seconds")
    coserve: CoServeConfig = checked_from_args(CoServeConfig, args, flags, "finetune.")
    if coserve.backward.buffer_save is not BufferSave.RESIDUAL:
        raise InputError(flags["finetune.backward.buffer_save"], coserve.backward.buffer_save.value,
                         "the vLLM host captures the residual stream only")
    lora_rank_for(coserve.lora.r)
    if args.finetune_latency_model is not None:
        try:
            LatencyModel.load(args.finetune_latency_model)
        except (InputError, OSError) as e:
            raise InputError("--finetune-latency-model", args.finetune_latency_model,
                             str(e)) from e
    return coserve


def serve_spec(args: argparse.Namespace, flags: Flags) -> ServeSpec:
    """The co-serving spec from the parsed flags, every flag checked (``InputError`` naming the
    flag and value) and nothing heavy loaded: no model, no engine."""
    if args.finetune_dataset is None:
        raise InputError("--finetune-dataset", None, "required to co-serve one dataset")
    coserve = coserve_config(args, flags)
    data = checked_from_args(DataConfig, args, flags, "finetune_data.",
                             path=args.finetune_dataset)
    _check_dataset(args, data)
    coserve = replace(coserve, checkpoint=writable_checkpoint(
        coserve.checkpoint, flags["finetune.checkpoint.root"], CHECKPOINT_PARENT))
    return ServeSpec(coserve, data, args.finetune_calibration, args.finetune_latency_model)


def _check_dataset(args: argparse.Namespace, data: DataConfig) -> None:
    """Parse and tokenize every row now (errors name the line); report what is dropped."""
    model = args.model_tag or args.model
    try:
        tokenizer = load_tokenizer(resolve_model(model))
    except (OSError, ValueError) as e:
        raise InputError("model", model, f"cannot load its tokenizer: {e}") from e
    limits = [data.max_tokens, args.max_num_batched_tokens, args.max_model_len and
              args.max_model_len - 1]
    data = replace(data, max_tokens=min(n for n in limits if n))
    checked_dataset(data, tokenizer)


def prepare_args(args: argparse.Namespace, lora_r: int) -> argparse.Namespace:
    """Resolve the model, pick the listening address, set the engine flags co-serving needs."""
    if args.bind is not None and args.host is not None and args.bind != args.host:
        raise InputError("--bind", args.bind, f"vLLM's --host says {args.host}; give one")
    args.host = args.bind or args.host or DEFAULT_BIND
    model = args.model_tag or args.model
    if model:
        args.model = str(resolve_model(model)) if not os.path.isdir(model) else model
        args.model_tag = args.model
    args.scheduler_cls = SCHEDULER_CLS
    args.worker_extension_cls = WORKER_EXTENSION_CLS
    args.enable_lora = True
    args.max_lora_rank = max(args.max_lora_rank or 0, lora_rank_for(lora_r))
    args.max_loras = max(args.max_loras or 1, 2)  # the pinned training slot + client adapters
    args.async_scheduling = False
    args.enforce_eager = True
    return args


# ---- the fine-tuning service: every flag checked before vLLM starts ------------------------
def allow_plugin() -> None:
    """Name DeltaServe in ``VLLM_PLUGINS`` (vLLM loads endpoint plugins only when named); when
    it was unset, every installed plugin of the other groups stays loaded as before."""
    given = os.environ.get("VLLM_PLUGINS")
    names = given.split(",") if given is not None else sorted(
        {e.name for g in _GROUPS for e in entry_points(group=g)})
    if PLUGIN not in names:
        names.append(PLUGIN)
    os.environ["VLLM_PLUGINS"] = ",".join(names)


def _api_key(args: argparse.Namespace) -> str | None:
    keys = [k for k in (args.api_key or [os.environ.get("VLLM_API_KEY")
                                         or os.environ.get(API_KEY_ENV)]) if k]
    if len(keys) > 1:
        raise InputError("--api-key", "<several keys>", "the service takes one key")
    return keys[0] if keys else None


def service_spec(args: argparse.Namespace, coserve_flags: Flags,
                 server_flags: Flags) -> VLLMServiceSpec:
    """Every flag checked, nothing heavy loaded; ``args`` get the engine flags co-serving
    needs and the listening address (:func:`prepare_args`)."""
    for dest, default in (("finetune.slo.ttft_s", DEFAULT_SLO.ttft_s),
                          ("finetune.slo.tpot_s", DEFAULT_SLO.tpot_s)):
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    coserve = coserve_config(args, coserve_flags)
    job_defaults(coserve, 1)  # a job must end: num_epochs is set
    given = args.model_tag or args.model
    if not args.served_model_name and given and not os.path.isdir(given):
        args.served_model_name = [given]  # a built-in name stays the model's name, not a path
    prepare_args(args, coserve.lora.r)
    config: ServerConfig = checked_from_args(ServerConfig, args, server_flags, "service.",
                                             bind=args.host, port=args.port,
                                             api_key=_api_key(args))
    try:
        DataDir(config.data_dir)
    except InputError as e:
        raise InputError("--data-dir", str(config.data_dir), e.reason) from None
    calibration = CalibrateSpec(coserve, args.finetune_calibration, args.finetune_latency_model)
    return VLLMServiceSpec(config, coserve, calibration)


# ---- the server -----------------------------------------------------------------------------
async def _serve(args: argparse.Namespace, spec: ServeSpec) -> None:
    listen_address, sock = setup_server(args, reuse_port=False)
    async with build_async_engine_client(args) as client:
        await client.collective_rpc("deltaserve_install")
        status = from_dict(RemoteStatus, (await client.collective_rpc(
            "deltaserve_attach", args=(to_dict(spec),)))[0])
        while status.state is State.CALIBRATING:
            await asyncio.sleep(_POLL_S)
            status = from_dict(RemoteStatus, (await client.collective_rpc("deltaserve_status"))[0])
        if status.state is not State.COSERVING:
            raise RuntimeError(f"co-serving did not start: {status.error or status}")
        print(f"deltaserve: co-serving {status.samples} samples (at most "
              f"{status.max_ft_tokens_per_step} fine-tuning tokens per step), checkpoints in "
              f"{spec.coserve.checkpoint.root}; accepting requests on {listen_address}",
              file=sys.stderr, flush=True)
        # On shutdown vLLM stops the engine core first; its scheduler then has the co-server
        # checkpoint the last committed step and stop the backward (RemoteCoServing.shutdown).
        shutdown = await build_and_serve(client, listen_address, sock, args)
    try:
        await shutdown
    finally:
        sock.close()


def run(args: argparse.Namespace, flags: Flags) -> int:
    """Serve one dataset (``--finetune-dataset``) for the server's lifetime."""
    spec = serve_spec(args, flags)
    args = prepare_args(args, spec.coserve.lora.r)
    validate_parsed_serve_args(args)
    uvloop.run(_serve(args, spec))
    return 0


def run_vllm_server(args: argparse.Namespace) -> None:
    """vLLM's own server start-up, unchanged (its plugins mount what DeltaServe adds)."""
    validate_parsed_serve_args(args)
    uvloop.run(run_server(args))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``deltaserve serve --engine vllm``; ``argv``: everything after it."""
    import_vllm()  # CPU defaults, the single-process engine core, the plugin's version check
    parser, coserve_flags, server_flags = build_parser()
    args = parser.parse_args(argv)
    if args.finetune_dataset is not None:
        return run(args, coserve_flags)
    spec = service_spec(args, coserve_flags, server_flags)
    setattr(args, SPEC_ARG, spec)
    allow_plugin()
    run_vllm_server(args)
    return 0
