"""``deltaserve serve --host vllm MODEL --finetune-dataset PATH [...]``: vLLM's OpenAI-compatible
API server with co-serving on.

Every ``vllm serve`` flag is accepted (vLLM's own parser is used), plus the co-serving flags of
:func:`add_coserve_args`. DeltaServe sets the flags it depends on (``--scheduler-cls``,
``--worker-extension-cls``, ``--enable-lora``, a large enough ``--max-lora-rank``, synchronous
scheduling, eager execution) and runs the engine core's worker inside the engine-core process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in the environment it inherits). Start-up order: vLLM
starts; the worker's hooks are installed; the engine process loads the dataset, reserves the
training adapter and runs the calibration plan through vLLM's scheduler and forward; only then
does the HTTP server accept requests. On shutdown the co-server trains what it captured and
writes a final checkpoint (``--checkpoint-dir``), which vLLM serves with ``--lora-modules``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from deltaserve.hosts.vllm.remote import RemoteSpec
from deltaserve.model.lora import ALL_MODULES, DEFAULT_TARGETS

_POLL_S = 0.5


def add_coserve_args(parser: argparse.ArgumentParser) -> None:
    """The co-serving flags (``--finetune-*`` and the SLOs; vLLM owns every other name)."""
    g = parser.add_argument_group("DeltaServe co-serving")
    g.add_argument("--finetune-dataset", required=True,
                   help="fine-tuning data: Alpaca JSON/JSONL or chat JSONL")
    g.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    g.add_argument("--tpot-slo-ms", type=float, default=200.0)
    g.add_argument("--finetune-lora-r", type=int, default=16)
    g.add_argument("--finetune-lora-alpha", type=float, default=32.0)
    g.add_argument("--finetune-target-modules", nargs="+", default=list(DEFAULT_TARGETS),
                   choices=ALL_MODULES)
    g.add_argument("--finetune-lr", type=float, default=1e-3)
    g.add_argument("--finetune-batch-tokens", type=int, default=256,
                   help="tokens per optimizer step")
    g.add_argument("--finetune-max-tokens-per-step", type=int, default=256,
                   help="fine-tuning tokens per engine step (bounds a training-only step)")
    g.add_argument("--finetune-epochs", type=int, default=1)
    g.add_argument("--finetune-admission", choices=("full", "temp", "off"), default="full")
    g.add_argument("--finetune-checkpoint-dir", default=None)
    g.add_argument("--finetune-checkpoint-every", type=int, default=50)
    g.add_argument("--finetune-calibration", choices=("quick", "full"), default="quick")
    g.add_argument("--finetune-latency-model", default=None,
                   help="a fitted latency model's JSON (skips calibration)")
    g.add_argument("--finetune-seed", type=int, default=0)


def spec_from_args(args: argparse.Namespace) -> RemoteSpec:
    return RemoteSpec(
        dataset=args.finetune_dataset, ttft_slo_s=args.ttft_slo_ms / 1000,
        tpot_slo_s=args.tpot_slo_ms / 1000, lora_r=args.finetune_lora_r,
        lora_alpha=args.finetune_lora_alpha,
        target_modules=tuple(args.finetune_target_modules), lr=args.finetune_lr,
        backward_batch_tokens=args.finetune_batch_tokens,
        max_ft_tokens_per_step=args.finetune_max_tokens_per_step,
        num_epochs=args.finetune_epochs, admission=args.finetune_admission,
        checkpoint_dir=args.finetune_checkpoint_dir,
        checkpoint_every=args.finetune_checkpoint_every,
        calibration=args.finetune_calibration, latency_model=args.finetune_latency_model,
        seed=args.finetune_seed)


def build_parser() -> Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog="deltaserve serve --host vllm",
        description="vLLM's OpenAI-compatible server with LoRA fine-tuning co-served")
    parser = make_arg_parser(parser)
    add_coserve_args(parser)
    return parser


def prepare_args(args: argparse.Namespace) -> argparse.Namespace:
    """Resolve the model and set the engine flags co-serving depends on."""
    from deltaserve.hosts.vllm.bench import lora_rank_for
    from deltaserve.hosts.vllm.config import SCHEDULER_CLS, WORKER_EXTENSION_CLS
    from deltaserve.model.loading import resolve_model

    model = args.model_tag or args.model
    if model:
        args.model = str(resolve_model(model)) if not os.path.isdir(model) else model
        args.model_tag = args.model
    args.scheduler_cls = SCHEDULER_CLS
    args.worker_extension_cls = WORKER_EXTENSION_CLS
    args.enable_lora = True
    args.max_lora_rank = max(args.max_lora_rank or 0, lora_rank_for(args.finetune_lora_r))
    args.max_loras = max(args.max_loras or 1, 2)  # the pinned training slot + client adapters
    args.async_scheduling = False
    args.enforce_eager = True
    return args


async def _serve(args: argparse.Namespace, spec: RemoteSpec) -> None:
    from vllm.entrypoints.launchers.api_server.entry import (
        build_and_serve,
        build_async_engine_client,
    )
    from vllm.entrypoints.launchers.launcher import setup_server

    listen_address, sock = setup_server(args, reuse_port=False)
    async with build_async_engine_client(args) as client:
        await client.collective_rpc("deltaserve_install")
        status = (await client.collective_rpc("deltaserve_attach", args=(spec.to_json(),)))[0]
        while status["state"] in ("starting", "calibrating"):
            await asyncio.sleep(_POLL_S)
            status = (await client.collective_rpc("deltaserve_status"))[0]
        if status["state"] != "coserving":
            raise RuntimeError(f"co-serving did not start: {status.get('error', status)}")
        print(f"deltaserve: co-serving {status.get('samples')} samples (at most "
              f"{status.get('max_ft_tokens_per_step')} fine-tuning tokens per step); "
              "accepting requests", file=sys.stderr, flush=True)
        # On shutdown vLLM stops the engine core first; its scheduler then checkpoints the last
        # committed step and stops the backward (CoServingScheduler.shutdown).
        shutdown = await build_and_serve(client, listen_address, sock, args)
    try:
        await shutdown
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``deltaserve serve --host vllm``; ``argv``: everything after ``--host``."""
    from deltaserve.hosts.vllm.version import import_vllm

    import_vllm()  # CPU defaults and the single-process engine core before vLLM starts
    import uvloop

    parser = build_parser()
    args = prepare_args(parser.parse_args(argv))
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    validate_parsed_serve_args(args)
    spec = spec_from_args(args)
    uvloop.run(_serve(args, spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
