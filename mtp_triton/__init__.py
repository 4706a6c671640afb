"""mtp_triton — Multi-Token Prediction speculative decoding with handwritten Triton kernels.

Public names: the Triton kernels at the top level, their PyTorch twins in `mtp_triton.reference`, the engine
(`load_model`), drafters (MTP heads, the MTP module, EAGLE-3's drafter: `load_drafter`), trees and `generate`.
Importing the package imports no Triton kernel and changes no environment variable; kernel modules load on first
use. To run the kernels on a CPU-only machine (in Triton's interpreter), call `mtp_triton.use_interpreter()` first.
"""
from . import reference
from .generate import GenerateResult, RuntimeConfig, generate
from .stats import GenerateStats
from .kernels import KERNELS, launcher, use_interpreter
from .heads import MTPHeads, init_heads, load_heads
from .loading import load_model, load_tokenizer
from .model import LlamaEngine, ModelConfig
from .mtp_module import MTPModule, load_drafter, load_module
from .eagle3 import Eagle3Module
from .tree import PRESETS, Tree, get_tree
from .version import __version__, package_hash  # noqa: F401  (__version__: the package version)

def __getattr__(name):
    if name in KERNELS:
        return launcher(name)
    raise AttributeError(f"module 'mtp_triton' has no attribute {name!r}")


__all__ = ["reference", "generate", "GenerateResult", "GenerateStats", "RuntimeConfig", "MTPHeads", "init_heads",
           "load_heads", "LlamaEngine", "ModelConfig", "load_model", "load_tokenizer", "Tree", "PRESETS", "get_tree",
           "use_interpreter", "package_hash", "MTPModule", "Eagle3Module", "load_module", "load_drafter", *KERNELS]
