"""``deltaserve``: the command line. Flags are generated from the config dataclasses
(:mod:`deltaserve.cli_flags`), so a default is written once, in its config class.

    deltaserve bench [--trace burst-light] [--systems a,b] [--duration S] ...
    deltaserve bench --host sim --gpu a100 --model llama-3-8b --replicas 4 --trace burst-light
    deltaserve plan --gpu a100 --model llama-3-8b --trace my.csv --replicas 1,2,4
    deltaserve calibrate --out latency_model.json [--model smollm2] [--host native]
    deltaserve serve [MODEL] [--api-key KEY] [--data-dir DIR] ...   (the embedded engine)
    deltaserve serve --engine vllm MODEL [vLLM flags] ...
    deltaserve serve --engine sglang --model-path MODEL --finetune-dataset PATH ...
"""

from __future__ import annotations

import argparse
import sys

from deltaserve.bench.config import BenchConfig
from deltaserve.bench.run import run_bench
from deltaserve.bench.sim.config import SimBenchConfig
from deltaserve.bench.sim.experiment import run_sim_bench
from deltaserve.bench.sim.plan import PlanConfig, plan
from deltaserve.cli_flags import add_dataclass_flags, checked_from_args, from_args
from deltaserve.core.errors import InputError
from deltaserve.entrypoints.serve_native import ServeConfig, serve
from deltaserve.hosts.config import HostConfig
from deltaserve.hosts.native.config import EngineConfig
from deltaserve.hosts.registry import HOSTS, create_host
from deltaserve.model.lora import LoRAConfig
from deltaserve.train.lost_steps import TrainingFailed
from deltaserve.train.preflight import writable_file

Flags = dict[str, str]


def _parser() -> tuple[argparse.ArgumentParser, dict[str, Flags]]:
    """The parser, and each subcommand's flags by their dest (to name a rejected flag)."""
    parser = argparse.ArgumentParser(prog="deltaserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="replay a trace against every system; write a report")
    flags = {"bench": add_dataclass_flags(bench, BenchConfig)}
    cal = sub.add_parser("calibrate", help="fit a host's latency model; write it as JSON")
    cal.add_argument("--out", default="latency_model.json")
    cal.add_argument("--host", choices=tuple(HOSTS), default="native")
    add_dataclass_flags(cal, HostConfig)
    add_dataclass_flags(cal, LoRAConfig, prefix="lora-")
    plan = sub.add_parser("plan", help="simulate a fleet: FT tokens/s it absorbs at an SLO")
    flags["plan"] = add_dataclass_flags(plan, PlanConfig)
    serve = sub.add_parser(
        "serve", help="the OpenAI inference, Files and Fine-tuning Jobs APIs, co-serving",
        description="Serve MODEL (default: the built-in model) on the embedded engine. With "
        "--engine vllm or sglang, every other argument goes to that engine's own server: "
        "deltaserve serve --engine vllm MODEL [vLLM flags].")
    serve.add_argument("--engine", choices=ENGINES, default="native")
    serve.add_argument("host.model", nargs="?", default=EngineConfig().model, metavar="MODEL",
                       help="a Hugging Face directory, a .gguf file or a built-in name "
                            "(default: %(default)s)")
    flags["serve"] = add_dataclass_flags(serve, ServeConfig)
    return parser, flags


ENGINES = ("native", "vllm", "sglang")


def _engine(args: list[str]) -> str:
    """``serve``'s ``--engine`` (vLLM and SGLang take every other argument, so it is read
    first)."""
    for i, arg in enumerate(args):
        if arg == "--engine" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--engine="):
            return arg.split("=", 1)[1]
    return "native"


def _serve_engine(engine: str, args: list[str]) -> int:
    """An engine's own OpenAI server with co-serving on (the lazy engine imports: each engine
    lives in its own venv)."""
    rest = [a for i, a in enumerate(args) if a != "--engine" and not a.startswith("--engine=")
            and not (i > 0 and args[i - 1] == "--engine")]
    if engine == "vllm":
        from deltaserve.entrypoints.serve_vllm import main as serve_main
    else:
        from deltaserve.entrypoints.serve_sglang import main as serve_main
    return serve_main(rest)


def _calibrate(ns: argparse.Namespace) -> None:
    out = writable_file(ns.out, "out")
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


def _sim_bench(argv: list[str]) -> argparse.Namespace | None:
    """``bench --host sim`` takes the simulated host's flags (its defaults are the paper's GPU
    experiment); ``None`` for any other bench."""
    if not argv or argv[0] != "bench":
        return None
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--host")
    if pre.parse_known_args(argv[1:])[0].host != "sim":
        return None
    parser = argparse.ArgumentParser(prog="deltaserve bench --host sim",
                                     description="the benchmark on simulated GPUs")
    add_dataclass_flags(parser, SimBenchConfig)
    return parser.parse_args(argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"] and _engine(argv[1:]) in ("vllm", "sglang"):
        try:
            return _serve_engine(_engine(argv[1:]), argv[1:])
        except InputError as e:  # a bad flag or file, named before the engine starts
            print(f"deltaserve: error: {e}", file=sys.stderr)
            return 2
    sim = _sim_bench(argv)
    parser, flags = _parser()
    ns = sim if sim is not None else parser.parse_args(argv)
    try:
        if sim is not None:
            run_sim_bench(from_args(SimBenchConfig, sim))
        elif ns.command == "plan":
            plan(checked_from_args(PlanConfig, ns, flags["plan"]))
        elif ns.command == "bench":
            run_bench(checked_from_args(BenchConfig, ns, flags["bench"]))
        elif ns.command == "calibrate":
            _calibrate(ns)
        elif ns.command == "serve":
            serve(checked_from_args(ServeConfig, ns, flags["serve"]))
    except InputError as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    except TrainingFailed as e:  # the backward lost every step: no result to report
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
