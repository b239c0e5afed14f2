"""``python -m deltaserve.bench [flags]``: ``deltaserve bench`` (the embedded, vLLM or SGLang
host; the same flags) without the CLI's other subcommands, whose service imports fastapi and
uvicorn: for a machine that has only the engine's dependencies, such as a lent GPU machine
(``scripts/device_bench.sh``)."""

from __future__ import annotations

import argparse
import sys

from deltaserve.bench.config import BenchConfig
from deltaserve.bench.run import run_bench
from deltaserve.cli_flags import add_dataclass_flags, checked_from_args
from deltaserve.core.errors import InputError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deltaserve.bench",
                                     description="deltaserve bench, without the service")
    flags = add_dataclass_flags(parser, BenchConfig)
    ns = parser.parse_args(argv)
    try:
        run_bench(checked_from_args(BenchConfig, ns, flags))
    except InputError as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
