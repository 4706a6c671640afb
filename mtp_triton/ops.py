"""Kernel dispatch: the engine calls `ops.<name>` and gets the Triton kernel or its PyTorch twin.

kernels (KINDS):
    "triton"    the Triton kernels (a CUDA device, or Triton's interpreter on a CPU)
    "torch"     their PyTorch twins, eager (for teaching and debugging)
    "compiled"  the twins, with the decoder layer compiled by torch.compile on a CPU (mtp_triton/compiled.py); it
                runs the batch-invariant numerics in every dtype, so MTP steps are bit-identical to serial ones, and a
                batch's sequences decode as they do alone. Opt-in: the first generation compiles for minutes on a
                small CPU, and generations ran at 0.86-1.08x eager's speed (two recorded runs, compiled.py)
    "auto"      triton on a CUDA device, torch elsewhere
The sets have the same signatures, so swapping them changes nothing but speed (and fp rounding).
"""
from types import SimpleNamespace

from . import reference
from .kernels import KERNELS, interpreter_enabled, launcher

NAMES = tuple(KERNELS)
KINDS = ("auto", "torch", "compiled", "triton")


def torch_ops():
    return SimpleNamespace(kind="torch", **{n: getattr(reference, n) for n in NAMES})


def compiled_ops(device="cpu"):
    if str(device).startswith("cuda"):
        raise ValueError("kernels='compiled' is the CPU path; on a CUDA device use 'triton' (with cuda_graph=True)")
    from .compiled import compiled_layer
    return SimpleNamespace(kind="compiled", layer=compiled_layer(), **{n: getattr(reference, n) for n in NAMES})


def triton_ops(device="cuda"):
    if not str(device).startswith("cuda") and not interpreter_enabled():
        raise RuntimeError(f"kernels='triton' on {device}: without CUDA the Triton kernels run only in Triton's "
                           "interpreter; call mtp_triton.use_interpreter() (or set TRITON_INTERPRET=1) before "
                           "importing any kernel, or use kernels='torch'")
    return SimpleNamespace(kind="triton", **{n: launcher(n) for n in NAMES})


def cpu_twins(ops, device):
    """Do `ops` run the PyTorch twins ("torch" or "compiled") on a CPU device? Where they do, the drafters multiply in
    bf16 and `generate` sizes each step's tree by the measured step costs."""
    return getattr(ops, "kind", None) in ("torch", "compiled") and str(device).startswith("cpu")


def get_ops(kernels="auto", device="cpu"):
    if kernels not in KINDS:
        raise ValueError(f"kernels must be one of {', '.join(map(repr, KINDS))}, got {kernels!r}")
    if kernels == "auto":
        kernels = "triton" if str(device).startswith("cuda") else "torch"
    if kernels == "compiled":
        return compiled_ops(device)
    return triton_ops(device) if kernels == "triton" else torch_ops()
