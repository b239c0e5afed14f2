"""``python -m tests.server.fake_server --data-dir D --port P [...]``: the real service entry
(flags, config, uvicorn, signals) over the fakes, as a process a test can kill."""

from __future__ import annotations

import argparse
import sys

from deltaserve.server import add_server_args, config_from_args, run_server
from tests.server.fakes import FakeBackend, FakeRunner, FakeStats, fake_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fake_server")
    add_server_args(parser)
    parser.add_argument("--step-delay-s", type=float, default=0.02)
    ns = parser.parse_args(argv)
    config = config_from_args(ns)
    backend = FakeBackend(fake_tokenizer())
    runner = FakeRunner(ns.step_delay_s)
    run_server(config, backend, runner, FakeStats(backend, runner))
    return 0


if __name__ == "__main__":
    sys.exit(main())
