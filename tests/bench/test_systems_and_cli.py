import pytest

from deltaserve.bench.config import BenchConfig
from deltaserve.bench.llmstation import LLMStationScheduler
from deltaserve.bench.systems import SYSTEMS, parse_systems
from deltaserve.cli import main
from deltaserve.core import AdmissionMode, InputError


def test_parse_systems():
    specs = parse_systems("inference-only,deltaserve-temp,llmstation,split-pool")
    assert [s.name for s in specs] == ["inference-only", "deltaserve-temp", "llmstation",
                                       "split-pool"]
    assert not specs[0].coserve and specs[1].mode is AdmissionMode.TEMP
    assert specs[2].scheduler_cls is LLMStationScheduler and specs[3].split_pool
    assert len(parse_systems(",".join(SYSTEMS))) == 7
    pipe, = parse_systems("deltaserve-pipeline")
    assert pipe.coserve and pipe.pipeline and pipe.mode is AdmissionMode.FULL
    with pytest.raises(InputError):
        parse_systems("deltaserve,s-lora")
    with pytest.raises(InputError):
        parse_systems("deltaserve,deltaserve")


def test_bench_config_validation():
    with pytest.raises(InputError) as e:
        BenchConfig(ttft_slo_ms=0)
    assert e.value.field == "ttft_slo_ms"
    with pytest.raises(InputError):
        BenchConfig(max_prompt_tokens=1000, max_output_tokens=100, max_model_len=1024)


def test_cli_reports_bad_input_as_an_error(capsys):
    assert main(["bench", "--ttft-slo-ms", "-5"]) == 2
    assert "ttft_slo_ms" in capsys.readouterr().err
    assert main(["bench", "--systems", "nope", "--out", "/tmp/deltaserve-cli-test"]) == 2


def test_bool_flags_follow_their_default():
    import argparse

    from deltaserve.cli import add_dataclass_flags

    p = argparse.ArgumentParser()
    add_dataclass_flags(p, BenchConfig)
    ns = p.parse_args(["--skip-bad-rows", "--no-progress", "--duration", "30"])
    assert ns.skip_bad_rows is True and ns.progress is False and ns.duration_s == 30.0
    ns = p.parse_args([])
    assert ns.skip_bad_rows is False and ns.progress is True and ns.duration_s is None
