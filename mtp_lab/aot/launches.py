"""The launch matrix: which public launcher is called, with which shapes, for the compile audit.

Every case calls a public launcher of `mtp_triton.kernels` exactly as the engine does (check_values=False: the
engine's hot loop), on meta tensors that say they are on a GPU, so the launcher picks its GPU tiles, split counts
and kernels itself. To audit a new launcher or keyword: add a `_run_<launcher>` function and its cases in `matrix`.

Model shapes (hidden D, query/KV heads Hq/Hkv, head dim Dh, vocab V, layers L, sliding window W) are those of the
models' published configs:
  Llama-2-7B    https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
  Llama-3-8B    https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
  SmolLM2-135M  https://huggingface.co/HuggingFaceTB/SmolLM2-135M/blob/main/config.json
  Vicuna-7B     https://huggingface.co/lmsys/vicuna-7b-v1.3/blob/main/config.json, with the Medusa heads of
                https://huggingface.co/FasterDecoding/medusa-vicuna-7b-v1.3 (5 heads, each with its own [V, D] LM head)
  Mistral-7B    https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json (sliding_window 4096)
The paged cache uses the engine's default block size (16 tokens) and room for context + tree per sequence.
Draft vocabularies (FR-Spec, https://arxiv.org/abs/2502.14856): the V' most frequent ids of the model's vocabulary,
e.g. 8192 of SmolLM2's 49152 and 32768 of Llama-3's 128256 (lm_head [V', D] plus an int64 token_map [V']).
"""
import itertools
from dataclasses import asdict, dataclass

import torch

from .driver import meta_cuda

MODELS = {
    "llama2-7b": dict(D=4096, Hq=32, Hkv=32, Dh=128, V=32000, L=32),
    "llama3-8b": dict(D=4096, Hq=32, Hkv=8, Dh=128, V=128256, L=32),
    "smollm2-135m": dict(D=576, Hq=9, Hkv=3, Dh=64, V=49152, L=30),
    "vicuna-7b": dict(D=4096, Hq=32, Hkv=32, Dh=128, V=32000, L=32),
    "mistral-7b": dict(D=4096, Hq=32, Hkv=8, Dh=128, V=32000, L=32, W=4096),
}
GRID_MODELS = ("llama2-7b", "llama3-8b", "smollm2-135m")   # the full cross product; the others: their feature only
DRAFT_VOCABS = {"smollm2-135m": 8192, "llama3-8b": 32768}
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
    per_head: bool = None         # fused_draft: one LM head per draft head, lm_head [H, V, D] (else shared [V, D])
    draft_V: int = None           # fused_draft: a draft vocabulary of draft_V rows (lm_head [V', D] + token_map)
    res_off: bool = None          # fused_draft: the ResBlock switched off (None, None: the MTP module's scores)
    kwargs: tuple = ()            # extra keyword arguments for the launcher, as (name, value) pairs

    @property
    def label(self):
        parts = [self.launcher, self.model, self.dtype] + [
            f"{k}{v}" for k, v in (("B", self.B), ("T", self.T), ("ctx", self.ctx), ("H", self.H), ("k", self.top_k),
                                   ("V'", self.draft_V))
            if v is not None] + (["per-head-lm"] if self.per_head else []) + (["resblock-off"] if self.res_off else [])
        parts += [f"{k}={v}" for k, v in self.kwargs]
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
    from mtp_triton.kernels.drafting import fused_draft
    m, dt = MODELS[case.model], DTYPES[case.dtype]
    B, H, D = case.B, case.H, m["D"]
    V = case.draft_V or m["V"]                                  # lm_head rows: the draft vocabulary's, if any
    lm_head = meta_cuda((H, V, D) if case.per_head else (V, D), dt)
    token_map = meta_cuda((V,), torch.int64) if case.draft_V else None
    res = (None, None) if case.res_off else (meta_cuda((H, D, D), dt), meta_cuda((H, D), dt))
    fused_draft(meta_cuda((B, D), dt), *res, lm_head, case.top_k, token_map=token_map, check_values=False,
                **dict(case.kwargs))


def _run_tree_attention(case):
    from mtp_triton.kernels.tree_attention import tree_attention
    m, dt = MODELS[case.model], DTYPES[case.dtype]
    B, T, Hq, Hkv, Dh = case.B, case.T, m["Hq"], m["Hkv"], m["Dh"]
    max_blocks, NB = _cache_geometry(case)
    tree_attention(meta_cuda((B, T, Hq, Dh), dt),                                        # q
                   meta_cuda((NB, BLOCK_SIZE, Hkv, Dh), dt), meta_cuda((NB, BLOCK_SIZE, Hkv, Dh), dt),  # one layer
                   meta_cuda((B, max_blocks), torch.int32), meta_cuda((B,), torch.int32),
                   meta_cuda((B, T, Hkv, Dh), dt), meta_cuda((B, T, Hkv, Dh), dt),
                   meta_cuda((T, T), torch.bool), check_values=False, **dict(case.kwargs))


def _run_tree_accept(case):
    from mtp_triton.kernels.accept import tree_accept
    B, T = case.B, case.T
    tree_accept(meta_cuda((B, T), torch.int64), meta_cuda((T,), torch.int64), meta_cuda((B, T), torch.int64),
                check_values=False, **dict(case.kwargs))


def _run_tree_accept_sample(case):
    from mtp_triton.kernels.accept import tree_accept_sample
    B, T, V, dt = case.B, case.T, MODELS[case.model]["V"], DTYPES[case.dtype]
    tree_accept_sample(meta_cuda((B, T), torch.int64), meta_cuda((T,), torch.int64), meta_cuda((B, T, V), dt),
                       meta_cuda((B, T), dt), meta_cuda((B,), dt), check_values=False, **dict(case.kwargs))


def _run_kv_append(case):
    from mtp_triton.kernels.kv_append import kv_append
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
    """The cases to audit. quick: one or two per launcher and feature, enough to compile every kernel (incl. the
    split combine, per-head LM heads, a draft vocabulary and a sliding window) for every target; full: models x
    dtypes x batch 1/8 x tree 1/16/64 x context 512/8192 x heads 4/5, plus the ResBlock switched off (the MTP module's
    scores over a draft vocabulary), per-head LM heads (Medusa Vicuna-7B), tree attention's exact variant,
    draft vocabularies (SmolLM2 8192 / 49152, Llama-3 32768 / 128256) and Mistral-7B's 4096-token window at 8192."""
    window = (("window", MODELS["mistral-7b"]["W"]),)
    exact = (("exact", True),)
    if quick:
        return [
            Case("fused_draft", "llama3-8b", "bf16", B=1, H=4, top_k=TOP_K),
            Case("fused_draft", "vicuna-7b", "bf16", B=1, H=5, top_k=TOP_K, per_head=True),
            Case("fused_draft", "smollm2-135m", "bf16", B=1, H=4, top_k=TOP_K, draft_V=DRAFT_VOCABS["smollm2-135m"]),
            Case("fused_draft", "smollm2-135m", "bf16", B=1, H=1, top_k=8, draft_V=DRAFT_VOCABS["smollm2-135m"],
                 res_off=True),                                                   # the MTP module's scores
            Case("tree_attention", "llama3-8b", "bf16", B=1, T=16, ctx=8192),     # split-KV + combine
            Case("tree_attention", "smollm2-135m", "fp16", B=8, T=64, ctx=512),   # one split, GQA 3
            Case("tree_attention", "mistral-7b", "bf16", B=1, T=16, ctx=8192, kwargs=window),
            Case("tree_attention", "llama2-7b", "bf16", B=1, T=16, ctx=8192, kwargs=exact),   # batch-invariant
            Case("tree_accept", B=1, T=16),
            Case("tree_accept_sample", "llama3-8b", "fp32", B=1, T=16),
            Case("kv_append", "llama2-7b", "bf16", B=1, T=16, ctx=8192),
        ]
    cases = []
    for model, dtype, B in itertools.product(GRID_MODELS, ("bf16", "fp16"), (1, 8)):
        cases += [Case("fused_draft", model, dtype, B=B, H=H, top_k=TOP_K) for H in (4, 5)]
        if model in DRAFT_VOCABS:
            cases += [Case("fused_draft", model, dtype, B=B, H=H, top_k=TOP_K, draft_V=DRAFT_VOCABS[model])
                      for H in (4, 5)]
            cases.append(Case("fused_draft", model, dtype, B=B, H=1, top_k=8, draft_V=DRAFT_VOCABS[model],
                              res_off=True))
        for T, ctx in itertools.product((1, 16, 64), (512, 8192)):
            cases.append(Case("tree_attention", model, dtype, B=B, T=T, ctx=ctx))
            cases.append(Case("kv_append", model, dtype, B=B, T=T, ctx=ctx))
    for dtype, B in itertools.product(("bf16", "fp16"), (1, 8)):
        cases.append(Case("fused_draft", "vicuna-7b", dtype, B=B, H=5, top_k=TOP_K, per_head=True))
        cases += [Case("tree_attention", "mistral-7b", dtype, B=B, T=T, ctx=8192, kwargs=window) for T in (1, 16, 64)]
        cases += [Case("tree_attention", "llama2-7b", dtype, B=B, T=T, ctx=ctx, kwargs=exact)
                  for T, ctx in itertools.product((1, 16), (512, 8192))]
    for B, T in itertools.product((1, 8), (1, 16, 64)):
        cases.append(Case("tree_accept", B=B, T=T))
        # the engine's sampling probabilities are fp32 (logits_to_probs upcasts)
        cases += [Case("tree_accept_sample", model, "fp32", B=B, T=T) for model in GRID_MODELS]
    return cases
