#!/usr/bin/env bash
# The GPU checks (not CI: CI has no GPU). Run from the repository root on a machine whose python3
# holds a CUDA build of torch plus transformers and peft, e.g. the lent H200:
#   bash scripts/device_check.sh
# Runs every test marked `cuda` (CUDA-graph decode replay of the embedded engine, co-serving on
# CUDA with the activation buffer shared with the backward process by CUDA IPC) and writes a
# JUnit report to $OUT (or the current directory).
set -euo pipefail
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1
python3 - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("torch", torch.__version__, "on", torch.cuda.get_device_name())
PY
python3 -m pytest -m cuda -p no:cacheprovider -q tests --junitxml="${OUT:-.}/device_check.xml"
