"""PyTorch twins of every Triton kernel — same signatures, same return values — in one namespace. Each twin lives
beside its kernel in `mtp_triton/kernels/<family>_ref.py` (torch only, with the input checks both share), so a copied
kernel file keeps its specification. kernels="torch" (and "auto" on a CPU) runs these names, read from here at run
time (a test can patch one). They compute in at least fp32 (fp64 stays fp64, so parity tests against `transformers`
can be exact). `check_values=False` (keyword-only) skips the checks that read tensor values (host syncs on a GPU);
shapes, dtypes and devices are always checked. Shapes: B batch, T tree nodes (node 0 = root), H heads, D hidden,
V vocab, L layers, Hq/Hkv query/key-value heads, Dh head dim, NB cache blocks, BS block size.
"""
from .kernels.accept_ref import sample_from_probs, tree_accept, tree_accept_sample
from .kernels.drafting_ref import fused_draft, topk_lower_id_first
from .kernels.kv_append_ref import kv_append
from .kernels.tree_attention_ref import tree_attention
