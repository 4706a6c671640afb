"""The packed CPU decoder layer as one TorchScript function: `model.layer`'s ATen calls, without the Python between.

Why. On a CPU a small model's plain decode step spends a large share of its time between its matmuls: each of a
layer's ~45 ATen calls (norms, RoPE, the attention's gathers, the residual adds) is reached through a few microseconds
of Python (`model.layer`, `RMSNorm.forward`, `apply_rope`, `plain_attention`, the ops' argument parsing). TorchScript
runs the same body from C++, so only the calls themselves remain. Unlike torch.compile (compiled.py) it generates no
code: every call is one the eager layer makes.

Same bits. `_layer` calls the same ATen kernels, in the same order and on the same operands, as `model.layer` for a
plain step (not the exact mode) on packed weights (packed.py) whose attention is the twins' `Keys` plan, and shares
its pieces (`model.rms_norm`, `model.apply_rope`, `tree_attention_ref.paged_sdpa`):
    h = RMSNorm(x) (or a);  y = h Wqkv;  [Qwen3: RMSNorm over Dh of q and k];  q, k, v = split(RoPE(y)) (v: angle 0)
    o = SDPA(q, [cache blocks; k], [cache blocks; v], bias);  x = x + o Wo
    h = RMSNorm(x);  g, u = split(h Wgu);  x = x + (silu(g) * u) Wd
with one exception: in fp32 the two residual adds ride on the o and down matmuls (`_linear_add`, oneDNN's fused
add), two calls fewer per layer and the same sums. So each output has the eager layer's bits (tests/test_scripted.py
compares them bit for bit, and greedy tokens). The op count differs from the eager layer's only there (and in one
overload: the norms' eps reaches the dispatcher as add.Scalar, not add.Tensor). TorchScript's CPU fuser is off by
default, and no pass here rewrites a call's arithmetic. Every norm of a `Block` is built with the config's one
rms_norm_eps, so the layer takes one eps.

Where it runs: the twins' ops ("torch", "compiled") carry `layer` as `plain_layer`, and `LlamaEngine.forward_tree`
runs it for a step that is not exact, on packed weights (`packed_layers`: fp32 and, on CPUs that multiply bf16
natively, bf16: prefill and the drafters' plain steps), while `model.script_layers` is on (the default). The exact
mode, the Triton kernels, nn.Linear weights and autograd run `model.layer` itself. TorchScript is deprecated in
PyTorch 2.13 (a DeprecationWarning, silenced here); if scripting fails, it warns once and `model.layer` runs, with
the same bits.
"""
import functools
import warnings
from typing import List, Optional

import torch
import torch.nn.functional as F

from .kernels.tree_attention_ref import paged_sdpa
from .model import apply_rope, layer as python_layer, rms_norm


def _linear(x: torch.Tensor, packed: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """packed.PackedLinear's eager call: x [..., K] -> [..., N] through oneDNN's packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none",
                                              torch.jit.annotate(List[Optional[number]], []), "")  # noqa: F821


def _linear_add(x: torch.Tensor, h: torch.Tensor, packed: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """x + _linear(h, packed, b): a residual add. fp32: one oneDNN call with the add fused after the matmul; each
    output is the fp32 sum of the same two fp32 values, rounded once, as by the separate add. bf16: a separate add
    (fused, oneDNN would add to the fp32 accumulator before rounding, where the eager layer rounds the matmul first)."""
    if x.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(h, x, packed, b, "add")        # the .binary overload
    return x + _linear(h, packed, b)


def _layer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ln1: torch.Tensor, ln2: torch.Tensor, eps: float,
           qkv: torch.Tensor, qkv_b: Optional[torch.Tensor], o: torch.Tensor, o_b: Optional[torch.Tensor],
           gu: torch.Tensor, gu_b: Optional[torch.Tensor], dn: torch.Tensor, dn_b: Optional[torch.Tensor],
           q_norm: Optional[torch.Tensor], k_norm: Optional[torch.Tensor], k_cache: torch.Tensor,
           v_cache: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor, Hq: int, a: Optional[torch.Tensor]):
    """model.layer for a plain packed step attending through a `Keys` plan (blocks, bias). x [B, T, D];
    cos, sin [B, T, Hq + 2 Hkv, Dh]; ln1, ln2 the norms' weights; qkv .. dn the packed weights
    [(Hq + 2 Hkv) Dh | D | 2F | D] and their biases; q_norm, k_norm: Qwen3's per-head norms or None; k_cache,
    v_cache [NB, BS, Hkv, Dh]; a [B, T, D_a] or None (what q, k, v are projected from).
    -> (x [B, T, D], k, v [B, T, Hkv, Dh])"""
    B, T = x.shape[0], x.shape[1]
    Hkv, Dh = k_cache.shape[2], k_cache.shape[3]
    h = rms_norm(x, ln1, eps) if a is None else a
    y = _linear(h, qkv, qkv_b).reshape(B, T, Hq + 2 * Hkv, Dh)
    if q_norm is not None and k_norm is not None:
        y = torch.cat([rms_norm(y[:, :, :Hq], q_norm, eps), rms_norm(y[:, :, Hq:Hq + Hkv], k_norm, eps),
                       y[:, :, Hq + Hkv:]], 2)
    q, k, v = apply_rope(y, cos, sin).split([Hq, Hkv, Hkv], 2)
    att = paged_sdpa(q, k_cache, v_cache, k, v, blocks, bias)      # plain_attention(finite=True): nothing zeroed
    x = _linear_add(x, att.reshape(B, T, Hq * Dh), o, o_b)
    h = rms_norm(x, ln2, eps)
    g, u = _linear(h, gu, gu_b).chunk(2, -1)
    return _linear_add(x, F.silu(g) * u, dn, dn_b), k, v


@functools.cache
def scripted_layer():
    """`_layer` through torch.jit.script, once per process; None where scripting fails (then `model.layer` runs)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)       # torch.jit is deprecated (module docstring)
            return torch.jit.script(_layer)
    except Exception as e:                                            # a torch without TorchScript, or a new error
        warnings.warn(f"mtp_triton: the TorchScript layer is unavailable ({type(e).__name__}: {e}); the engine "
                      "runs its Python layer (same results, slower on a CPU)")
        return None


def layer(x, cos, sin, blk, packed, k_cache, v_cache, attend, a=None):
    """`model.layer`'s signature and results for a plain packed step (attend: a `Keys` plan), through the TorchScript
    function (`model.layer` itself where scripting failed). blk: the layer's Block (its norms); packed: its
    (qkv, o, gate_up, down) PackedLinears."""
    fn = scripted_layer()
    if fn is None:
        return python_layer(x, cos, sin, blk, packed, k_cache, v_cache, attend, a)
    qkv, o, gu, dn = packed
    qn, kn = getattr(blk, "q_norm", None), getattr(blk, "k_norm", None)
    Hq = blk.q_proj.out_features // k_cache.shape[-1]
    return fn(x, cos, sin, blk.input_layernorm.weight, blk.post_attention_layernorm.weight, blk.input_layernorm.eps,
              qkv.packed, qkv.b, o.packed, o.b, gu.packed, gu.b, dn.packed, dn.b, None if qn is None else qn.weight,
              None if kn is None else kn.weight, k_cache, v_cache, attend.blocks, attend.bias, Hq, a)


def available():
    """Does the engine's plain packed step run from TorchScript here (torch.jit.script scripts `_layer`)?"""
    return scripted_layer() is not None
