"""Kernel dispatch: the engine calls `ops.<name>` and gets the Triton kernel or its PyTorch twin.

kernels (KINDS):
    "triton"    the Triton kernels (a CUDA device, or Triton's interpreter on a CPU)
    "torch"     their PyTorch twins (`mtp_triton.reference`, from kernels/<family>_ref.py), eager
    "compiled"  the twins, with the decoder layer compiled by torch.compile on a CPU (mtp_triton/compiled.py); it
                runs the batch-invariant numerics in every dtype, so MTP steps are bit-identical to serial ones, and a
                batch's sequences decode as they do alone. Opt-in: the first generation compiles for minutes on a
                small CPU (compiled.py)
    "auto"      triton on a CUDA device, torch elsewhere
The sets have the same signatures, so swapping them changes nothing but speed (and fp rounding). Each set also
carries its numerical policy, `ops.numerics(device, dtype)` (see `numerics`), so the engine and the drafters ask the
ops they run with and never decide it themselves; the compiled set adds `layer` (the compiled decoder layer), and
the twins' sets `plain_layer` (a plain step's layer on packed CPU weights, from TorchScript: scripted.py).
"""
import functools
import os
import platform
import warnings
from types import SimpleNamespace

import torch

from . import invariant, reference, scripted
from .compiled import compiled_layer
from .kernels import KERNELS, interpreter_enabled, launcher

NAMES = tuple(KERNELS)
KINDS = ("auto", "torch", "compiled", "triton")


def _ops(kind, fns, **extra):
    """One set of ops: its kind, its numerical policy, `extra` and the kernels `fns` {name: function}."""
    return SimpleNamespace(kind=kind, numerics=functools.partial(numerics, kind), **extra, **fns)


def torch_ops():
    return _ops("torch", {n: getattr(reference, n) for n in NAMES}, plain_layer=scripted.layer)


def compiled_ops(device="cpu"):
    if str(device).startswith("cuda"):
        raise ValueError("kernels='compiled' is the CPU path; on a CUDA device use 'triton' (with cuda_graph=True)")
    return _ops("compiled", {n: getattr(reference, n) for n in NAMES}, layer=compiled_layer(),
                plain_layer=scripted.layer)


def triton_ops(device="cuda"):
    if not str(device).startswith("cuda") and not interpreter_enabled():
        raise RuntimeError(f"kernels='triton' on {device}: without CUDA the Triton kernels run only in Triton's "
                           "interpreter; call mtp_triton.use_interpreter() (or set TRITON_INTERPRET=1) before "
                           "importing any kernel, or use kernels='torch'")
    return _ops("triton", {n: launcher(n) for n in NAMES})


def cpu_twins(ops, device):
    """Do `ops` (a set of ops, or its kind) run the PyTorch twins ("torch" or "compiled") on a CPU device? Where they
    do, the drafters multiply in bf16 and `generate` sizes each step's tree by the measured step costs."""
    kind = ops if isinstance(ops, str) else getattr(ops, "kind", None)
    return kind in ("torch", "compiled") and str(device).startswith("cpu")


@functools.lru_cache(maxsize=None)
def native_bf16():
    """Does this CPU multiply bf16 natively (AVX-512 BF16 or AMX tiles)? (read once: numerics() asks every forward)"""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_model_and_flags()[1])


def numerics(kind, device, dtype):
    """The engine's numerical policy, decided here and nowhere else, for a model of `dtype` on `device` run by ops of
    this kind (every set of ops carries it as `ops.numerics(device, dtype)`):
      exact       batch-invariant decoding (tree_attention's exact=True, and invariant.py's norms and linear layers
                  whose rows round alike in every call), which makes an MTP step bit-identical to serial steps:
                  always with the compiled kind, and for a bf16/fp16 model with the PyTorch twins or the Triton
                  kernels, on a CPU or a GPU (fp32/fp64 use the plain path, whose greedy output matches serial
                  decoding in practice)
      draft_bf16  the drafters multiply in bf16 (drafters.bf16_draft; the MTP module in bf16): with the twins on a
                  CPU, for a bf16 model, and for an fp32 one where the CPU multiplies bf16 natively (half the bytes
                  per draft; drafts only steer speed, verification decides every token)
    Where `exact`, the first call per (dtype, device) probes the machine's row invariance
    (`invariant.row_invariance`) and warns if a premise fails. -> SimpleNamespace(exact, draft_bf16)"""
    twins = cpu_twins(kind, device)
    half = dtype in (torch.bfloat16, torch.float16)
    exact = kind == "compiled" or (half and kind in ("torch", "triton"))
    if exact:
        _probe_row_invariance(dtype, device)
    return SimpleNamespace(exact=exact, draft_bf16=twins and (dtype == torch.bfloat16 or (
        dtype == torch.float32 and native_bf16())))


_PROBED = {}


def _probe_row_invariance(dtype, device):
    key = (dtype, str(device))
    if key not in _PROBED:
        _PROBED[key] = invariant.row_invariance(dtype, device)
        failed = [k for k, ok in _PROBED[key].items() if not ok]
        if failed:
            advice = "" if dtype == torch.float32 else "; use float32 for exact output"
            warnings.warn(f"{dtype} on {device}: the exact mode's premises {failed} do not hold here "
                          f"(invariant.row_invariance): MTP output may differ from serial decoding at near-ties"
                          f"{advice}", RuntimeWarning, stacklevel=4)


def get_ops(kernels="auto", device="cpu"):
    if kernels not in KINDS:
        raise ValueError(f"kernels must be one of {', '.join(map(repr, KINDS))}, got {kernels!r}")
    if kernels == "auto":
        kernels = "triton" if str(device).startswith("cuda") else "torch"
    if kernels == "compiled":
        return compiled_ops(device)
    return triton_ops(device) if kernels == "triton" else torch_ops()


# ---- which machine: the stamp every cost table and row carries ------------------------------------------
def device_name(device=None):
    """The GPU's name, or 'CPU <arch> x<cores> (<model>; <bf16 matmul units>)': two CPUs of one architecture can
    differ several-fold in bf16 matmul speed (AVX-512 BF16 against AMX tiles), so rows keep which one ran."""
    if torch.cuda.is_available() and (device is None or str(device).startswith("cuda")):
        return torch.cuda.get_device_name()
    name = f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"
    model, flags = cpu_model_and_flags()
    units = [label for flag, label in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16")) if flag in flags]
    extra = "; ".join(x for x in (model, " ".join(units)) if x)
    return f"{name} ({extra})" if extra else name


def cpu_model_and_flags():
    """('model name', set of flags) from /proc/cpuinfo (Linux); ('', set()) elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return "", set()
    model = flags = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = value
    return model, set(flags.split())
