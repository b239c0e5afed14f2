"""DeltaServe's ``sglang.srt.plugins`` entry point, as SGLang loads it in each of its processes
(a fresh interpreter each: SGLang loads plugins once per process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang", reason="needs the SGLang venv (.venv-sglang: bash "
                    "scripts/bootstrap.sh --sglang)")

pytestmark = pytest.mark.sglang

PROBE = """
import torch
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.managers.scheduler as sched
from sglang.srt.lora.lora_manager import LoRAManager
print(type(sched.Scheduler).__name__, sched.Scheduler.__name__,
      getattr(LoRAManager.prepare_lora_batch, "__wrapped__", None) is not None,
      torch.cuda.is_available())
"""


def _probe(**env: str) -> list[str]:
    full = {k: v for k, v in os.environ.items() if k != "DELTASERVE_SGLANG"} | env
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=full, timeout=300, check=True)
    return out.stdout.split()


def test_plugin_acts_only_when_deltaserve_drives_sglang():
    _, name, pin_hooked, cuda = _probe(DELTASERVE_SGLANG="1")
    assert name == "CoServingScheduler"
    assert pin_hooked == str(cuda == "False")  # the pin shim only where CUDA is absent
    _, name, pin_hooked, _ = _probe()  # installed beside a plain SGLang run: inert
    assert name == "Scheduler" and pin_hooked == "False"
