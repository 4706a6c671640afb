"""mtp_triton — Multi-Token Prediction speculative decoding with handwritten Triton kernels.

Public names follow ../shared/API.md: the Triton kernels at the top level, their PyTorch twins in
`mtp_triton.reference`, the engine (`load_model`), heads, trees and `generate`.
Kernel modules are imported lazily so that `import mtp_triton` works without a GPU or an interpreter
flag; set TRITON_INTERPRET=1 before touching a kernel on a CPU-only machine.
"""
from . import reference
from .generate import GenerateResult, RuntimeConfig, generate
from .heads import MTPHeads, init_heads, load_heads
from .model import LlamaEngine, ModelConfig, load_model
from .tree import PRESETS, Tree, get_tree

_KERNELS = {"fused_draft": "drafting", "tree_attention": "tree_attention", "tree_accept": "accept",
            "tree_accept_sample": "accept", "kv_append": "kv_append"}


def __getattr__(name):
    if name in _KERNELS:
        import importlib
        return getattr(importlib.import_module(f".kernels.{_KERNELS[name]}", __name__), name)
    raise AttributeError(f"module 'mtp_triton' has no attribute {name!r}")


__all__ = ["reference", "generate", "GenerateResult", "RuntimeConfig", "MTPHeads", "init_heads", "load_heads",
           "LlamaEngine", "ModelConfig", "load_model", "Tree", "PRESETS", "get_tree", *_KERNELS]
__version__ = "0.1.0"
