#!/usr/bin/env bash
# The README's test command: set up (if needed), then run every test and notebook on the CPU
# (Triton interpreter) with two workers. GPU-only tests are skipped without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
exec .venv/bin/python -m pytest -n 2 --durations=15 tests "$@"
