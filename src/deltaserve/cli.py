"""``deltaserve``: the command line.

    deltaserve bench [--trace burst-light] [--systems a,b] [--duration S] ...
    deltaserve calibrate --out latency_model.json [--model smollm2]
    deltaserve serve --host vllm MODEL --finetune-dataset PATH ...
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing

from deltaserve.core.errors import InputError

_RENAMES = {"duration_s": "duration"}


def _flag(name: str) -> str:
    return "--" + _RENAMES.get(name, name).replace("_", "-")


def add_dataclass_flags(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per field of a frozen config dataclass, typed from its annotation."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        args = typing.get_args(kind)
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(a for a in args if a is not type(None))
        if kind is bool:
            if f.default:
                parser.add_argument(_flag(f"no_{f.name}"), dest=f.name, action="store_false",
                                    default=True, help=f"turn {f.name} off")
            else:
                parser.add_argument(_flag(f.name), dest=f.name, action="store_true",
                                    default=False, help=f"turn {f.name} on")
            continue
        parser.add_argument(_flag(f.name), dest=f.name, type=kind, default=f.default,
                            help=f"default: {f.default}")


def _from_args(cls, ns: argparse.Namespace):
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def main(argv: list[str] | None = None) -> int:
    from deltaserve.bench.config import BenchConfig

    parser = argparse.ArgumentParser(prog="deltaserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="replay a trace against every system; write a report")
    add_dataclass_flags(bench, BenchConfig)
    cal = sub.add_parser("calibrate", help="fit the latency model of the embedded engine")
    cal.add_argument("--model", default="smollm2")
    cal.add_argument("--out", default="latency_model.json")
    cal.add_argument("--max-num-batched-tokens", type=int, default=256)
    cal.add_argument("--max-num-seqs", type=int, default=32)
    serve = sub.add_parser("serve", help="serve an OpenAI-compatible API with co-serving on")
    serve.add_argument("--host", choices=("vllm",), default="vllm")
    serve.add_argument("rest", nargs=argparse.REMAINDER,
                       help="MODEL --finetune-dataset PATH [co-serving and vLLM flags]")
    ns = parser.parse_args(argv)
    try:
        if ns.command == "bench":
            from deltaserve.bench.run import run_bench

            run_bench(_from_args(BenchConfig, ns))
        elif ns.command == "calibrate":
            from deltaserve.hosts.native import EngineConfig, LLMEngine
            from deltaserve.hosts.native.calibrate import calibrate
            from deltaserve.model.lora import LoRAConfig

            engine = LLMEngine(EngineConfig(model=ns.model, max_num_seqs=ns.max_num_seqs,
                                            max_num_batched_tokens=ns.max_num_batched_tokens))
            lm = calibrate(engine, LoRAConfig())
            lm.save(ns.out)
            for q in lm.quality():
                print(f"{q.equation.value}/{q.mode.value}: {q.num_points} probes, "
                      f"MAPE {q.mape:.1%}, R² {q.r2:.3f}")
            print(f"wrote {ns.out}")
        elif ns.command == "serve":
            from deltaserve.hosts.vllm.serve import main as serve_main

            return serve_main(ns.rest)
    except InputError as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
