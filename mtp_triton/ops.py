"""Kernel dispatch: the engine calls `ops.<name>` and gets the Triton kernel or its PyTorch twin.

kernels = "triton" | "torch" | "auto" (triton on a CUDA device, torch on CPU). The two sets have the
same signatures, so swapping them changes nothing but speed (and fp rounding).
"""
from types import SimpleNamespace

from . import reference
from .kernels import KERNELS, interpreter_enabled, launcher

NAMES = tuple(KERNELS)


def torch_ops():
    return SimpleNamespace(kind="torch", **{n: getattr(reference, n) for n in NAMES})


def triton_ops(device="cuda"):
    if not str(device).startswith("cuda") and not interpreter_enabled():
        raise RuntimeError(f"kernels='triton' on {device}: without CUDA the Triton kernels run only in Triton's "
                           "interpreter; call mtp_triton.use_interpreter() (or set TRITON_INTERPRET=1) before "
                           "importing any kernel, or use kernels='torch'")
    return SimpleNamespace(kind="triton", **{n: launcher(n) for n in NAMES})


def get_ops(kernels="auto", device="cpu"):
    if kernels not in ("auto", "torch", "triton"):
        raise ValueError(f"kernels must be 'auto', 'torch' or 'triton', got {kernels!r}")
    if kernels == "auto":
        kernels = "triton" if str(device).startswith("cuda") else "torch"
    return triton_ops(device) if kernels == "triton" else torch_ops()
