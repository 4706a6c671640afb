"""The Triton kernels, one copyable file per family (each depends only on torch + triton).

Without CUDA there is no Triton backend, so the kernels run in Triton's interpreter (numpy on the CPU):
TRITON_INTERPRET must be set before `@triton.jit` runs, i.e. before these modules are imported.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
