"""The launch matrix: which public launcher is called, with which shapes, for the compile audit.

Every case calls a public launcher of `mtp_triton.kernels` exactly as the engine does (check_values=False: the
engine's hot loop), on meta tensors that say they are on a GPU, so the launcher picks its GPU tiles, split counts
and kernels itself. To audit a new launcher or keyword: add a `_run_<launcher>` function and its cases in `matrix`.

Model shapes (hidden D, query/KV heads Hq/Hkv, head dim Dh, vocab V, layers L) are those of the models' published
configs:
  Llama-2-7B    https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
  Llama-3-8B    https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
  SmolLM2-135M  https://huggingface.co/HuggingFaceTB/SmolLM2-135M/blob/main/config.json
The paged cache uses the engine's default block size (16 tokens) and room for context + tree per sequence.
"""
import itertools
from dataclasses import asdict, dataclass

import torch

from .driver import meta_cuda

MODELS = {
    "llama2-7b": dict(D=4096, Hq=32, Hkv=32, Dh=128, V=32000, L=32),
    "llama3-8b": dict(D=4096, Hq=32, Hkv=8, Dh=128, V=128256, L=32),
    "smollm2-135m": dict(D=576, Hq=9, Hkv=3, Dh=64, V=49152, L=30),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BLOCK_SIZE = 16         # paged-cache block size (the engine's default)
TOP_K = 10


@dataclass(frozen=True)
class Case:
    """One call of a public launcher. Fields a launcher does not use are None."""
    launcher: str
    model: str = None
    dtype: str = None
    B: int = None
    T: int = None
    ctx: int = None               # cached tokens per sequence
    H: int = None                 # draft heads
    top_k: int = None
    kwargs: tuple = ()            # extra keyword arguments for the launcher, as (name, value) pairs

    @property
    def label(self):
        parts = [self.launcher, self.model, self.dtype] + [
            f"{k}{v}" for k, v in (("B", self.B), ("T", self.T), ("ctx", self.ctx), ("H", self.H), ("k", self.top_k))
            if v is not None] + [f"{k}={v}" for k, v in self.kwargs]
        return " ".join(p for p in parts if p)

    def as_dict(self):
        d = asdict(self)
        d["kwargs"] = " ".join(f"{k}={v}" for k, v in self.kwargs)
        return d


# ------------------------------------------------------------------------------------------------ launchers

def _cache_geometry(case):
    """Blocks per sequence and pool size for ctx cached tokens plus a T-node tree, in blocks of BLOCK_SIZE."""
    max_blocks = -(-(case.ctx + case.T) // BLOCK_SIZE)
    return max_blocks, case.B * max_blocks


def _run_fused_draft(case):
    from ..kernels.drafting import fused_draft
    m, dt = MODELS[case.model], DTYPES[case.dtype]
    B, H, D, V = case.B, case.H, m["D"], m["V"]
    fused_draft(meta_cuda((B, D), dt), meta_cuda((H, D, D), dt), meta_cuda((H, D), dt), meta_cuda((V, D), dt),
                case.top_k, **dict(case.kwargs))


def _run_tree_attention(case):
    from ..kernels.tree_attention import tree_attention
    m, dt = MODELS[case.model], DTYPES[case.dtype]
    B, T, Hq, Hkv, Dh = case.B, case.T, m["Hq"], m["Hkv"], m["Dh"]
    max_blocks, NB = _cache_geometry(case)
    tree_attention(meta_cuda((B, T, Hq, Dh), dt),                                        # q
                   meta_cuda((NB, BLOCK_SIZE, Hkv, Dh), dt), meta_cuda((NB, BLOCK_SIZE, Hkv, Dh), dt),  # one layer
                   meta_cuda((B, max_blocks), torch.int32), meta_cuda((B,), torch.int32),
                   meta_cuda((B, T, Hkv, Dh), dt), meta_cuda((B, T, Hkv, Dh), dt),
                   meta_cuda((T, T), torch.bool), check_values=False, **dict(case.kwargs))


def _run_tree_accept(case):
    from ..kernels.accept import tree_accept
    B, T = case.B, case.T
    tree_accept(meta_cuda((B, T), torch.int64), meta_cuda((T,), torch.int64), meta_cuda((B, T), torch.int64),
                check_values=False, **dict(case.kwargs))


def _run_tree_accept_sample(case):
    from ..kernels.accept import tree_accept_sample
    B, T, V, dt = case.B, case.T, MODELS[case.model]["V"], DTYPES[case.dtype]
    tree_accept_sample(meta_cuda((B, T), torch.int64), meta_cuda((T,), torch.int64), meta_cuda((B, T, V), dt),
                       meta_cuda((B, T), dt), meta_cuda((B,), dt), check_values=False, **dict(case.kwargs))


def _run_kv_append(case):
    from ..kernels.kv_append import kv_append
    m, dt = MODELS[case.model], DTYPES[case.dtype]
    L, B, T, Hkv, Dh = m["L"], case.B, case.T, m["Hkv"], m["Dh"]
    max_blocks, NB = _cache_geometry(case)
    cache = (L, NB, BLOCK_SIZE, Hkv, Dh)
    tree = (L, B, T, Hkv, Dh)
    kv_append(meta_cuda(cache, dt), meta_cuda(cache, dt), meta_cuda((B, max_blocks), torch.int32),
              meta_cuda((B,), torch.int32), meta_cuda(tree, dt), meta_cuda(tree, dt),
              meta_cuda((B, T), torch.int64), meta_cuda((B,), torch.int64), check_values=False, **dict(case.kwargs))


RUNNERS = {
    "fused_draft": _run_fused_draft,
    "tree_attention": _run_tree_attention,
    "tree_accept": _run_tree_accept,
    "tree_accept_sample": _run_tree_accept_sample,
    "kv_append": _run_kv_append,
}


def run_case(case):
    """Call the case's public launcher (inside a `driver.gpu_session`)."""
    RUNNERS[case.launcher](case)


# ------------------------------------------------------------------------------------------------ the matrix

def matrix(quick=False):
    """The cases to audit. quick: one or two per launcher, enough to compile every kernel (incl. the split
    combine) for every target; full: models x dtypes x batch 1/8 x tree 1/16/64 x context 512/8192 x heads 4/5."""
    if quick:
        return [
            Case("fused_draft", "llama3-8b", "bf16", B=1, H=4, top_k=TOP_K),
            Case("tree_attention", "llama3-8b", "bf16", B=1, T=16, ctx=8192),     # split-KV + combine
            Case("tree_attention", "smollm2-135m", "fp16", B=8, T=64, ctx=512),   # one split, GQA 3
            Case("tree_accept", B=1, T=16),
            Case("tree_accept_sample", "llama3-8b", "fp32", B=1, T=16),
            Case("kv_append", "llama2-7b", "bf16", B=1, T=16, ctx=8192),
        ]
    cases = []
    grid = itertools.product(MODELS, ("bf16", "fp16"), (1, 8))
    for model, dtype, B in grid:
        cases += [Case("fused_draft", model, dtype, B=B, H=H, top_k=TOP_K) for H in (4, 5)]
        for T, ctx in itertools.product((1, 16, 64), (512, 8192)):
            cases.append(Case("tree_attention", model, dtype, B=B, T=T, ctx=ctx))
            cases.append(Case("kv_append", model, dtype, B=B, T=T, ctx=ctx))
    for B, T in itertools.product((1, 8), (1, 16, 64)):
        cases.append(Case("tree_accept", B=B, T=T))
        # the engine's sampling probabilities are fp32 (logits_to_probs upcasts)
        cases += [Case("tree_accept_sample", model, "fp32", B=B, T=T) for model in MODELS]
    return cases
