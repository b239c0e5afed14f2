import argparse
import datetime
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from deltaserve.bench.config import BenchConfig
from deltaserve.bench.greedy import GreedyFixedYieldScheduler, GreedyScheduler
from deltaserve.bench.llmstation import LLMStationScheduler
from deltaserve.bench.run import out_dir
from deltaserve.bench.score import order
from deltaserve.bench.systems import SYSTEMS, parse_systems
from deltaserve.cli import main
from deltaserve.cli_flags import add_dataclass_flags, from_args
from deltaserve.core import AdmissionMode, InputError
from deltaserve.hosts.config import HostConfig
from deltaserve.model import loading
from deltaserve.model.lora import LoRAConfig
from deltaserve.train.config import BackwardConfig, GrantPolicy


def test_parse_systems():
    specs = parse_systems("inference-only,deltaserve-temp,llmstation,split-pool")
    assert [s.name for s in specs] == ["inference-only", "deltaserve-temp", "llmstation",
                                       "split-pool"]
    assert not specs[0].coserve and specs[1].mode is AdmissionMode.TEMP
    assert specs[2].scheduler_cls is LLMStationScheduler and specs[3].split_pool
    assert len(parse_systems(",".join(SYSTEMS))) == len(SYSTEMS) == 10
    pilot, pipe = parse_systems("deltaserve-pipeline")  # the pilot runs whether listed or not
    assert pilot.name == "inference-only" and not pilot.coserve
    assert pipe.coserve and pipe.pipeline and pipe.mode is AdmissionMode.FULL
    _, lp = parse_systems("llmstation-pipeline")
    assert lp.pipeline and lp.scheduler_cls is LLMStationScheduler
    assert lp.pair == "deltaserve-pipeline" and pipe.pair == "llmstation-pipeline"
    _, greedy, fixed = parse_systems("greedy,greedy-fixed-yield")
    # greedy prices its yields against the SLO: a sweep reruns it; its fixed-yield variant not
    assert greedy.coserve and greedy.scheduler_cls is GreedyScheduler and greedy.slo_aware
    assert fixed.scheduler_cls is GreedyFixedYieldScheduler and not fixed.slo_aware
    assert (greedy.pair, fixed.pair) == ("deltaserve", "greedy")
    with pytest.raises(InputError):
        parse_systems("deltaserve,s-lora")
    with pytest.raises(InputError):
        parse_systems("deltaserve,deltaserve")


def test_every_pair_is_a_known_system_and_a_table_puts_pairs_side_by_side():
    specs = parse_systems(",".join(SYSTEMS))
    assert all(s.pair in SYSTEMS for s in specs[1:]) and specs[0].pair is None
    names = order(specs)
    assert sorted(names) == sorted(SYSTEMS) and names[0] == "inference-only"
    for a, b in (("deltaserve", "llmstation"), ("deltaserve-pipeline", "llmstation-pipeline")):
        assert names.index(b) == names.index(a) + 1


def test_bench_config_validation():
    with pytest.raises(InputError) as e:
        BenchConfig(ttft_slo_ms=0)
    assert e.value.field == "ttft_slo_ms"
    for bad in ("1.5,x", "1,-2", "nan"):
        with pytest.raises(InputError) as e:
            BenchConfig(slo_sweep=bad)
        assert e.value.field == "slo_sweep"
    with pytest.raises(InputError) as e:  # a sweep scales the pilot: no fixed SLO beside it
        BenchConfig(slo_sweep="1.5,2", tpot_slo_ms=300.0)
    assert e.value.field == "slo_sweep"
    with pytest.raises(InputError) as e:
        BenchConfig(slo_scale=0)
    assert e.value.field == "slo_scale"
    with pytest.raises(InputError) as e:
        BenchConfig(latency_holdout_every=1)
    assert e.value.field == "latency_holdout_every"
    assert BenchConfig(slo_scale=2.0, slo_sweep="3, 1.25,2").slo_scales == (1.25, 2.0, 3.0)
    assert BenchConfig(slo_scale=2.0).slo_scales == (2.0,)
    with pytest.raises(InputError):
        BenchConfig(max_prompt_tokens=1000, max_output_tokens=100,
                    engine=HostConfig(max_model_len=1024))
    with pytest.raises(InputError) as e:
        BenchConfig(host="tgi")
    assert e.value.field == "host"


def test_cli_reports_bad_input_as_an_error(capsys):
    assert main(["bench", "--ttft-slo-ms", "-5"]) == 2
    assert "--ttft-slo-ms=-5.0" in capsys.readouterr().err  # the flag, as typed
    assert main(["bench", "--systems", "nope", "--out", "/tmp/deltaserve-cli-test"]) == 2


def test_serve_rejects_a_tpot_slack_spend_fraction_outside_0_1(capsys):
    assert main(["serve", "--admission-tpot-slack-spend-fraction", "0"]) == 2
    err = capsys.readouterr().err
    assert "--admission-tpot-slack-spend-fraction=0.0" in err and "(0, 1]" in err


def test_bool_flags_follow_their_default():
    p = argparse.ArgumentParser()
    add_dataclass_flags(p, BenchConfig)
    cfg = from_args(BenchConfig, p.parse_args(["--skip-bad-rows", "--no-progress",
                                               "--duration", "30", "--slo-sweep", "1.25,2"]))
    assert cfg.skip_bad_rows is True and cfg.progress is False and cfg.duration_s == 30.0
    # the sweep's scales and the main one (the default --slo-scale)
    assert cfg.slo_scales == tuple(sorted({1.25, 2.0, BenchConfig().slo_scale}))
    assert cfg.ttft_slo_ms is None and cfg.tpot_slo_ms is None
    cfg = from_args(BenchConfig, p.parse_args([]))
    assert cfg.skip_bad_rows is False and cfg.progress is True and cfg.duration_s is None


def test_flags_are_generated_from_the_config_tree_with_its_defaults():
    """Every default comes from the config classes: no flag restates one, and nested
    configs (engine, LoRA, optimizer, backward) round-trip through their flags."""
    p = argparse.ArgumentParser()
    add_dataclass_flags(p, BenchConfig)
    assert from_args(BenchConfig, p.parse_args([])) == BenchConfig()
    cfg = from_args(BenchConfig, p.parse_args([
        "--max-num-seqs", "4", "--lora-r", "8", "--lora-target-modules", "q_proj", "v_proj",
        "--lr", "0.01", "--backward-batch-tokens", "128", "--backward-grant-policy",
        "partition", "--no-backward-yield"]))
    assert cfg.engine == replace(HostConfig(), max_num_seqs=4)
    assert cfg.lora == LoRAConfig(r=8, target_modules=("q_proj", "v_proj"))
    assert cfg.optimizer.lr == 0.01
    assert cfg.backward == BackwardConfig(batch_tokens=128, grant_policy=GrantPolicy.PARTITION,
                                          yield_to_backward=False)
    with pytest.raises(SystemExit):  # an enum flag takes only its values
        p.parse_args(["--backward-grant-policy", "sometimes"])


def test_out_placeholders_name_the_committed_layout():
    cfg = BenchConfig(out="results/{date}-{host}-{trace}", trace="/data/azure_code.csv")
    assert out_dir(cfg, datetime.date(2026, 12, 10)) == Path(
        "results/2026-12-10-native-azure_code")
    assert out_dir(BenchConfig(out="runs/x")) == Path("runs/x")
    with pytest.raises(InputError) as e:
        BenchConfig(out="results/{when}")
    assert e.value.field == "out"
    with pytest.raises(InputError) as e:
        BenchConfig(calibration_file="lm_{host}.json")
    assert e.value.field == "calibration_file"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("argv", [
    ["bench", "--device", "cuda", "--model", "random:tiny"],
    ["calibrate", "--device", "cuda", "--model", "random:tiny"],
    ["serve", "random:tiny", "--device", "cuda:0"],
])
def test_cuda_device_is_refused_before_any_model_loads(argv, capsys, monkeypatch, tmp_path):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the device was checked")

    monkeypatch.setattr(loading, "resolve_model", no_load)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--device=" in err or "device=" in err
    assert "CUDA is not available" in err


def test_device_only_for_the_native_host(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    engine = HostConfig(device="cuda")
    assert BenchConfig(engine=engine).engine.device == "cuda"  # the embedded engine takes it
    with pytest.raises(InputError) as e:
        BenchConfig(host="vllm", engine=engine)
    assert e.value.field == "device" and "cpu" in e.value.reason
    with pytest.raises(InputError, match="1 CUDA device"):
        HostConfig(device="cuda:1")
    with pytest.raises(InputError, match="cpu, cuda or cuda:N"):
        HostConfig(device="gpu")
    with pytest.raises(InputError, match="native host only") as e:
        BenchConfig(host="vllm", engine=HostConfig(model="random:tiny"))
    assert e.value.field == "model"
