"""``deltaserve serve``'s flags on the embedded engine: generated from the config tree, and bad
input refused, naming the flag and its value, before any model loads."""

from __future__ import annotations

import argparse

import pytest

from deltaserve.cli import main
from deltaserve.cli_flags import add_dataclass_flags, from_args
from deltaserve.entrypoints.serve_native import DEFAULT_SLO, ServeConfig


def parse(*argv: str) -> ServeConfig:
    p = argparse.ArgumentParser()
    p.add_argument("host.model", nargs="?", default="smollm2")
    add_dataclass_flags(p, ServeConfig)
    return from_args(ServeConfig, p.parse_args(list(argv)))


def test_serve_flags_come_from_the_config_tree():
    assert parse() == ServeConfig()
    assert ServeConfig().coserve.slo == DEFAULT_SLO
    c = parse("/models/x", "--slo-ttft-s", "0.5", "--lora-r", "4", "--optimizer-lr", "0.01",
              "--backward-batch-tokens", "64", "--bind", "0.0.0.0", "--api-key", "k",
              "--max-num-batched-tokens", "128", "--num-epochs", "3", "--no-interrupt")
    assert c.host.model == "/models/x" and c.host.max_num_batched_tokens == 128
    assert c.coserve.slo.ttft_s == 0.5 and c.coserve.slo.tpot_s == DEFAULT_SLO.tpot_s
    assert (c.coserve.lora.r, c.coserve.optimizer.lr, c.coserve.backward.batch_tokens) == (
        4, 0.01, 64)
    assert (c.coserve.num_epochs, c.coserve.interrupt) == (3, False)
    assert (c.server.bind, c.server.api_key) == ("0.0.0.0", "k")


@pytest.mark.parametrize(("argv", "named"), [
    (["--slo-ttft-s", "-0.005"], "--slo-ttft-s=-0.005"),
    (["--lora-r", "0"], "--lora-r=0"),
    (["--num-epochs", "0"], "--num-epochs=0"),
    (["--optimizer-lr", "-1"], "--optimizer-lr=-1.0"),
    (["--bind", "everywhere"], "--bind='everywhere'"),
    (["--port", "70000"], "--port=70000"),
    (["/no/such/model"], "MODEL='/no/such/model'"),
    (["--latency-model", "/no/such.json"], "--latency-model='/no/such.json'"),
    (["--replicas", "0"], "--replicas=0"),
    (["--replicas", "4096"], "--replicas=4096"),
    (["--router", "random"], "--router='random'"),
])
def test_serve_rejects_bad_input_before_any_model_loads(argv, named, tmp_path, capsys):
    """Each error names the flag and its value; none loads a model (the built-in model would
    take seconds, a missing one fails only here)."""
    assert main(["serve", "--data-dir", str(tmp_path / "d"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"deltaserve: error: {named}"), err


def test_serve_rejects_an_unwritable_data_dir(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert main(["serve", "--data-dir", str(blocked / "sub")]) == 2
    assert "--data-dir=" in capsys.readouterr().err
