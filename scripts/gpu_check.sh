#!/usr/bin/env bash
# One command for a lent GPU machine: GPU tests, end-to-end A/B, speedup tables, kernel benchmarks, compile audit.
#
#   OUT=/path/to/out bash scripts/gpu_check.sh             # on the GPU: finishes within its budget (default 480 s)
#   OUT=/tmp/x       bash scripts/gpu_check.sh --dry-run   # CPU, tiny sizes: the CPU-checkable parts (~30 s, plus
#                                                          # the compile audit: ~30 s warm, ~80 s cold Triton cache)
#   GPU_CHECK_ONLY="tests-gpu e2e-llama7b" OUT=... bash scripts/gpu_check.sh   # a rerun of some stages only
#
# Needs only what the GPU image has (python, torch, triton, transformers, matplotlib, pytest, pytest-xdist): no
# installs, no network. Every stage has its own timeout and the whole run a budget (GPU_CHECK_BUDGET_S); a stage
# that fails or times out is logged and the next one runs. On the GPU the stages run in order of value, so a short
# lease still brings back the correctness checks and the headline rows: the kernel tests, the other GPU tests, the
# end-to-end A/B, the kernel benchmarks, the tables, and last the compile audit (which also runs on any CPU).
# Writes at most 6 files to $OUT:
#   gpu_check.log            everything every stage printed, with a status line per stage and a summary
#   tables/tables.{csv,md,png}   python -m mtp_lab tables (published vs measured, analytic model, phases, HF)
#   e2e.csv                  python -m mtp_lab.bench.e2e (serial vs MTP at batch 1 and 4, bf16 and fp32, with and
#                            without the verify step as a CUDA graph, transformers' greedy and prompt-lookup generate)
#   kernel_bench.tar.gz      the kernel benchmarks' CSV + PNG, the pytest junit XML files and the compile audit's
#                            aot/aot.{csv,md} (python -m mtp_lab aot --quick, with this machine's Triton)
# Environment: PYTHON (default python, else python3), OUT (default out/gpu_check), GPU_CHECK_BUDGET_S (default
# 480 on the GPU, so that a run and a shorter rerun fit a 15-minute lease; 460 for the dry run), GPU_CHECK_ONLY
# (space-separated stage names: run only those),
# MTP_TRITON_COMMIT (the commit the machine was sent, for its rows, where its copy's .git is not that commit's: a
# machine sent only the working tree; write it into the command, e.g. MTP_TRITON_COMMIT=$(git rev-parse --short
# HEAD) expanded before sending).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: OUT=dir bash scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
PY=${PYTHON:-$(command -v python || command -v python3)}
OUT=${OUT:-out/gpu_check}
BUDGET=${GPU_CHECK_BUDGET_S:-$([[ $DRY == 1 ]] && echo 460 || echo 480)}
ONLY=" ${GPU_CHECK_ONLY:-} "
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/kernels"
LOG="$OUT/gpu_check.log"
: > "$LOG"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
if [[ $DRY == 1 ]]; then export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1; fi
START=$SECONDS
FAILED=()

log() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$LOG"; }

# stage NAME LIMIT_S CMD...: run CMD with a timeout of min(LIMIT_S, budget left), output appended to the log
stage() {
  local name=$1 limit=$2; shift 2
  if [[ $ONLY != "  " && $ONLY != *" $name "* ]]; then return; fi
  local left=$((BUDGET - (SECONDS - START)))
  local t=$((limit < left ? limit : left))
  if ((t < 15)); then log "SKIP    $name: the ${BUDGET}s budget is spent"; FAILED+=("$name(skipped)"); return; fi
  log "START   $name (timeout ${t}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$t" "$@" >>"$LOG" 2>&1
  local rc=$?
  if ((rc == 5)) && [[ $name == tests* ]]; then log "OK      $name: no tests selected"; return; fi
  if ((rc == 124 || rc == 137)); then log "TIMEOUT $name after ${t}s"; FAILED+=("$name(timeout)")
  elif ((rc != 0)); then log "FAIL    $name (exit $rc, $((SECONDS - t0))s)"; FAILED+=("$name(exit $rc)")
  else log "OK      $name ($((SECONDS - t0))s)"; fi
}

log "mode: $([[ $DRY == 1 ]] && echo 'DRY RUN (CPU, tiny sizes)' || echo GPU); OUT=$OUT; budget ${BUDGET}s"
# ---- the compile audit: every kernel compiled ahead of time, as its launcher launches it (needs no GPU; sm_80/90/
# 100/120). First in the dry run (it is the dry run's main check), last on the GPU (any CPU can run it; the GPU's
# own rows come first). The dry run compiles with one job, on a CPU that CI shares with another test worker:
# about 55 s alone, more under load.
aot() {
  stage aot "$([[ $DRY == 1 ]] && echo 200 || echo 90)" "$PY" -m mtp_lab aot --quick \
    --jobs "$([[ $DRY == 1 ]] && echo 1 || echo 8)" --out "$WORK/kernels/aot"
}
if [[ $DRY == 1 ]]; then aot; fi
stage env 60 "$PY" -c "
import platform, torch, triton, transformers
print('python', platform.python_version(), '| torch', torch.__version__, '| triton', triton.__version__,
      '| transformers', transformers.__version__)
print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')
from mtp_lab.bench.common import env_info; print(env_info())"
if [[ $DRY == 0 ]]; then nvidia-smi >>"$LOG" 2>&1 || log "nvidia-smi not available"; fi

# ---- tests: the kernel test files and the exact path's (all their tests, on the GPU), then other gpu tests ----
KERNEL_TESTS=()
for f in tests/test_drafting.py tests/test_tree_attention.py tests/test_accept.py tests/test_kv_append.py \
         tests/test_invariant.py tests/test_engine_triton.py; do
  if [[ -f $f ]]; then KERNEL_TESTS+=("$f"); else log "MISSING $f (not written yet): skipped"; fi
done
IGNORE=(); for f in "${KERNEL_TESTS[@]}"; do IGNORE+=("--ignore=$f"); done
if [[ $DRY == 1 ]]; then
  stage tests-collect 60 "$PY" -m pytest -q -p no:cacheprovider --collect-only "${KERNEL_TESTS[@]}"
else
  XDIST=(); if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n 8); fi   # Triton compiles on 8 cores
  stage tests-kernels 100 "$PY" -m pytest -q -p no:cacheprovider --maxfail=30 "${XDIST[@]}" \
    --junitxml="$WORK/kernels/junit-kernels.xml" "${KERNEL_TESTS[@]}"
  stage tests-gpu 100 "$PY" -m pytest -q -p no:cacheprovider -m gpu "${XDIST[@]/8/4}" \
    --junitxml="$WORK/kernels/junit-gpu.xml" \
    "${IGNORE[@]}" --ignore=tests/test_notebooks.py tests
fi

# ---- the end-to-end A/B (the headline: serial vs MTP, CUDA graphs on and off, transformers) ----
if [[ $DRY == 1 ]]; then
  stage e2e 40 "$PY" -m mtp_lab.bench.e2e --quick --shape llama7b --no-hf --batches 1,2 --out "$OUT/e2e.csv"
else
  # bf16: the Triton kernels' batch-invariant path (tree_attention's exact variant, 32-row linear pieces), whose MTP
  # must equal its serial, with and without CUDA graphs; then which of the exact mode's premises hold here, per dtype
  stage e2e-llama7b 120 "$PY" -m mtp_lab.bench.e2e --shape llama7b --batches 1,4 --max-new-tokens 64 \
    --out "$OUT/e2e.csv"
  stage invariance 30 "$PY" -c "
import torch
from mtp_triton.invariant import row_invariance
for dt in (torch.bfloat16, torch.float16, torch.float32):
    print('row_invariance', dt, 'cuda:', row_invariance(dt, 'cuda'))"
  # fp32 at the 7B shape: greedy MTP token-identical to serial and to transformers
  stage e2e-llama7b-fp32 75 "$PY" -m mtp_lab.bench.e2e --shape llama7b --dtype float32 --batches 1 \
    --max-new-tokens 64 --out "$OUT/e2e.csv"
  stage e2e-embedded 40 "$PY" -m mtp_lab.bench.e2e --shape embedded --batches 1,4 --max-new-tokens 64 \
    --out "$OUT/e2e.csv"
fi

# ---- the kernel benchmarks, then the tables ----
BENCHES=()
for name in drafting tree_attention kv_append kv_layout; do
  if [[ -f mtp_lab/bench/$name.py ]]; then BENCHES+=("$name")
  else log "MISSING mtp_lab/bench/$name.py (not written yet): skipped"; fi
done
if [[ $DRY == 1 ]]; then
  # import each benchmark and parse its --help in one process (its GPU sizes cannot run here)
  stage bench-imports 40 "$PY" -c "
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module('mtp_lab.bench.' + name).main(['--help'])
    except SystemExit as e:
        assert e.code in (0, None), (name, e.code)
    print('ok', name)" "${BENCHES[@]}"
else
  for name in "${BENCHES[@]}"; do
    args=(--out "$WORK/kernels/$name.csv" --plot "$WORK/kernels/$name.png")    # every kernel benchmark takes --plot
    if [[ $name == drafting ]]; then
      # torch.compile's compile time must not cost the kernel's own rows: it gets a stage of its own
      stage bench-drafting 25 "$PY" -m mtp_lab.bench.drafting "${args[@]}" --providers triton-fused,torch-unfused
      stage bench-drafting-compile 30 "$PY" -m mtp_lab.bench.drafting --out "$WORK/kernels/drafting.csv" \
        --providers torch-compile
    else
      case $name in      # grids cut to fit the stage (each script's full default grid takes minutes)
        tree_attention) args+=(--contexts 1024 8192 --tree-sizes 1 16 64 --batches 1 16) ;;
        kv_append) args+=(--models llama-7b --batches 1 16 --accept-lens 0 4) ;;
      esac
      stage "bench-$name" 45 "$PY" -m "mtp_lab.bench.$name" "${args[@]}"
    fi
  done
fi

if [[ $DRY == 1 ]]; then
  stage tables 60 "$PY" -m mtp_lab tables --quick --shape llama7b --out "$OUT/tables"
else
  # 64 new tokens: the two default suites then take about 140 s (128 took about 270 s on the first H200 runs)
  stage tables 170 "$PY" -m mtp_lab tables --resume --max-new-tokens 64 --out "$OUT/tables"
fi

if [[ $DRY == 0 ]]; then aot; fi

# ---- bring-back: at most 6 files in $OUT ----
if compgen -G "$WORK/kernels/*" >/dev/null; then
  tar -czf "$OUT/kernel_bench.tar.gz" -C "$WORK" kernels \
    && log "packed $(ls "$WORK/kernels" | wc -l) files into kernel_bench.tar.gz"
fi
log "files in OUT: $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
if ((${#FAILED[@]})); then
  log "SUMMARY: ${#FAILED[@]} stage(s) did not pass: ${FAILED[*]} ($((SECONDS - START))s)"
  exit 1
fi
log "SUMMARY: all stages passed ($((SECONDS - START))s)"
