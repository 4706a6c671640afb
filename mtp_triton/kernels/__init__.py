"""The Triton kernels, one copyable pair per family: `<family>.py` (torch + triton) and its PyTorch twin beside it,
`<family>_ref.py` (torch only: the input checks and the specification).

Importing this package imports no kernel and changes no environment variable. On a machine without CUDA, Triton
can only run kernels in its interpreter (numpy on the CPU), and Triton decides that when `@triton.jit` runs, i.e.
when a kernel module is first imported. So opt in first, before anything imports a kernel module:

    >>> import mtp_triton
    >>> mtp_triton.use_interpreter()          # same as setting TRITON_INTERPRET=1 before importing the kernels
    >>> from mtp_triton.kernels.accept import tree_accept

Without that, a kernel launched on CPU tensors raises a RuntimeError that says so.
"""
import os
import sys

# The one kernel registry: each public launcher and the module (file) it lives in. `ops` and the package's top-level
# names read it; a kernel family is a kernel file and its torch-only twin `<family>_ref.py` here, a line below,
# and the twin's re-export in reference.py.
KERNELS = {"fused_draft": "drafting", "tree_attention": "tree_attention", "tree_accept": "accept",
           "tree_accept_sample": "accept", "kv_append": "kv_append"}
KERNEL_MODULES = tuple(sorted(set(KERNELS.values())))


def launcher(name):
    """The Triton launcher `name` (imports its kernel module on first use)."""
    import importlib
    return getattr(importlib.import_module(f"{__name__}.{KERNELS[name]}"), name)


def interpreter_enabled():
    """True when kernel modules imported now (or already imported) run in Triton's interpreter."""
    loaded = [sys.modules[f"{__name__}.{m}"] for m in KERNEL_MODULES if f"{__name__}.{m}" in sys.modules]
    if loaded:
        return all(m._interpreting() for m in loaded)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_interpreter():
    """Run this process's Triton kernels in Triton's interpreter (CPU). Call it before any kernel module is imported.

    Sets TRITON_INTERPRET=1 (the switch Triton reads when a kernel is decorated). Raises RuntimeError if a kernel
    module was already imported in compiled mode: Triton cannot switch it afterwards, so restart the process (or
    the notebook kernel) and call this first. Returns True.
    """
    compiled = [m for m in KERNEL_MODULES
                if f"{__name__}.{m}" in sys.modules and not sys.modules[f"{__name__}.{m}"]._interpreting()]
    if compiled:
        raise RuntimeError(f"use_interpreter(): the kernel modules {compiled} were already imported without the "
                           "interpreter; restart the process and call mtp_triton.use_interpreter() before "
                           "importing or running any Triton kernel")
    os.environ["TRITON_INTERPRET"] = "1"
    return True
