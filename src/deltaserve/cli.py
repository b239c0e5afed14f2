"""``deltaserve``: the command line. Flags are generated from the config dataclasses
(:mod:`deltaserve.cli_flags`), so a default is written once, in its config class.

    deltaserve bench [--trace burst-light] [--systems a,b] [--duration S] ...
    deltaserve calibrate --out latency_model.json [--model smollm2] [--host native]
    deltaserve serve --engine vllm MODEL --finetune-dataset PATH ...
    deltaserve serve --engine sglang --model-path MODEL --finetune-dataset PATH ...
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from deltaserve.bench.config import BenchConfig
from deltaserve.cli_flags import add_dataclass_flags, from_args
from deltaserve.core.errors import InputError
from deltaserve.hosts.config import HostConfig
from deltaserve.hosts.registry import HOSTS, create_host
from deltaserve.model.lora import LoRAConfig


def _writable(path: str, field: str) -> Path:
    """Check an output path before any work is done (a model load, a calibration)."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise InputError(field, path, "is a directory; give a file path")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(field, path, f"cannot create its directory: {e.strerror}") from None
    if not os.access(parent, os.W_OK):
        raise InputError(field, path, f"{parent} is not writable")
    return p


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="replay a trace against every system; write a report")
    add_dataclass_flags(bench, BenchConfig)
    cal = sub.add_parser("calibrate", help="fit a host's latency model; write it as JSON")
    cal.add_argument("--out", default="latency_model.json")
    cal.add_argument("--host", choices=tuple(HOSTS), default="native")
    add_dataclass_flags(cal, HostConfig)
    add_dataclass_flags(cal, LoRAConfig, prefix="lora-")
    serve = sub.add_parser("serve", help="serve the OpenAI API with co-serving on")
    serve.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    serve.add_argument("rest", nargs=argparse.REMAINDER,
                       help="MODEL --finetune-dataset PATH [co-serving and the engine's flags]")
    return parser


def _calibrate(ns: argparse.Namespace) -> None:
    out = _writable(ns.out, "out")
    host = create_host(ns.host, from_args(HostConfig, ns))
    try:
        lm = host.calibrate(from_args(LoRAConfig, ns), None, None, seed=ns.seed, progress=True)
    finally:
        host.close()
    lm.save(out)
    for q in lm.quality():
        print(f"{q.equation.value}/{q.mode.value}: {q.num_points} probes, "
              f"MAPE {q.mape:.1%}, R² {q.r2:.3f}")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        if ns.command == "bench":
            from deltaserve.bench.run import run_bench

            run_bench(from_args(BenchConfig, ns))
        elif ns.command == "calibrate":
            _calibrate(ns)
        elif ns.command == "serve" and ns.engine == "sglang":
            from deltaserve.hosts.sglang.serve import main as sglang_serve

            return sglang_serve(ns.rest)
        elif ns.command == "serve":
            from deltaserve.hosts.vllm.serve import main as serve_main

            return serve_main(ns.rest)
    except InputError as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
