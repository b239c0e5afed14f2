"""``deltaserve serve --engine vllm MODEL [vLLM flags]``: the fine-tuning service inside vLLM's
own OpenAI server.

Every ``vllm serve`` flag is accepted (vLLM's parser), plus the co-serving flags of
:mod:`deltaserve.hosts.vllm.serve` (``--finetune-*``: the config every job starts from, the
start-up calibration or ``--finetune-latency-model``; the SLO defaults to the embedded
service's) and the service's (``--data-dir``, ``--max-upload-bytes``,
``--checkpoint-every-steps``, ``--metrics-public``, ...). ``--bind`` (127.0.0.1 by default),
``--port`` and ``--api-key`` are vLLM's server's: the key then guards every route, the
service's included. With ``--finetune-dataset`` the server instead trains that one dataset for
its lifetime (:func:`deltaserve.hosts.vllm.serve.run`).

Every flag, the data directory and the latency-model file are checked before vLLM starts. Then
vLLM's own start-up runs (``vllm.entrypoints.launchers.api_server.entry.run_server``) with
DeltaServe's endpoint plugin allowlisted (:mod:`deltaserve.server.vllm_plugin`), which mounts
the service and calibrates the engine once before the server accepts requests.
"""

from __future__ import annotations

import argparse
import os
from importlib.metadata import entry_points

from deltaserve.cli_flags import add_dataclass_flags, checked_from_args
from deltaserve.core.errors import InputError
from deltaserve.hosts.vllm import serve
from deltaserve.hosts.vllm.serve import Flags
from deltaserve.hosts.vllm.version import import_vllm
from deltaserve.hosts.vllm.wire import CalibrateSpec
from deltaserve.server.cli import API_KEY_ENV
from deltaserve.server.config import ServerConfig
from deltaserve.server.data_dir import DataDir
from deltaserve.server.hyperparameters import job_defaults
from deltaserve.server.launch import DEFAULT_SLO
from deltaserve.server.vllm_plugin import SPEC_ARG, VLLMServiceSpec

PLUGIN = "deltaserve"  # the entry points' name in vllm.general_plugins and vllm.endpoint_plugins
_OWN = ("bind", "port", "api_key")  # vLLM's server flags say these
# plugin groups vLLM filters by VLLM_PLUGINS; endpoint plugins load only when named there
_GROUPS = ("vllm.general_plugins", "vllm.platform_plugins", "vllm.stat_logger_plugins",
           "vllm.io_processor_plugins")


def build_parser() -> tuple[argparse.ArgumentParser, Flags, Flags]:
    parser, coserve_flags = serve.build_parser()
    group = parser.add_argument_group("DeltaServe fine-tuning service")
    server_flags = add_dataclass_flags(group, ServerConfig, dest="service.", skip=_OWN)
    return parser, coserve_flags, server_flags


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
    needs and the listening address (:func:`serve.prepare_args`)."""
    for dest, default in (("finetune.slo.ttft_s", DEFAULT_SLO.ttft_s),
                          ("finetune.slo.tpot_s", DEFAULT_SLO.tpot_s)):
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    coserve = serve.coserve_config(args, coserve_flags)
    job_defaults(coserve, 1)  # a job must end: num_epochs is set
    given = args.model_tag or args.model
    if not args.served_model_name and given and not os.path.isdir(given):
        args.served_model_name = [given]  # a built-in name stays the model's name, not a path
    serve.prepare_args(args, coserve.lora.r)
    config: ServerConfig = checked_from_args(ServerConfig, args, server_flags, "service.",
                                             bind=args.host, port=args.port,
                                             api_key=_api_key(args))
    try:
        DataDir(config.data_dir)
    except InputError as e:
        raise InputError("--data-dir", str(config.data_dir), e.reason) from None
    calibration = CalibrateSpec(coserve, args.finetune_calibration, args.finetune_latency_model)
    return VLLMServiceSpec(config, coserve, calibration)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``deltaserve serve --engine vllm``; ``argv``: everything after it."""
    import_vllm()  # CPU defaults, the single-process engine core, the plugin's version check
    parser, coserve_flags, server_flags = build_parser()
    args = parser.parse_args(argv)
    if args.finetune_dataset is not None:
        return serve.run(args, coserve_flags)
    spec = service_spec(args, coserve_flags, server_flags)
    setattr(args, SPEC_ARG, spec)
    allow_plugin()
    serve.run_vllm_server(args)
    return 0
