"""Fused multi-head drafting (Medusa-style heads + LM head + per-head top-k) — Triton.

The math (Medusa, Cai et al. 2024, https://arxiv.org/abs/2401.10774; one ResBlock per head on the target's last
hidden state x):

    z_h      = x + silu(W_h x + b_h)                 h = 0 .. H-1
    logits_h = L_h @ z_h                             [V]   L_h = lm_head (shared) or lm_head[h] (one per head)
    rows_h   = top-k of logits_h (descending, ties -> lower row)
    ids_h    = rows_h, or token_map[rows_h] with a draft vocabulary
    logp_h   = logits_h[rows_h] - logsumexp(logits_h)

What a plain PyTorch version moves: H ResBlock GEMVs (read H*D*D weights), the LM-head GEMM (read the LM head,
write B*H*V logits), then log_softmax (read + write B*H*V) and topk (read B*H*V). The LM head is by far the biggest
tensor, so drafting is a bandwidth problem: the goal is to stream the LM head exactly once, from every SM at once,
and never write the logits. What it costs per draft step at Vicuna/Llama-7B (D 4096, V 32000, H 5, bf16):

    shared LM head  [V, D]        32000 x 4096 x 2 B      =  262 MB   (the model's own head, as the target uses it)
    per-head heads  [H, V, D]     5 x 32000 x 4096 x 2 B  = 1.31 GB   (FasterDecoding's Medusa checkpoints give
                                                                       every head its own Linear(D, V), initialised
                                                                       from the base LM head)
    ResBlocks       [H, D, D]     5 x 4096 x 4096 x 2 B   =  168 MB

Per-head LM heads cost 5x the bytes of a shared one, i.e. ~5x the drafting time: sharing the LM head matters.

Draft vocabulary (FR-Spec, Zhao et al. 2025, https://arxiv.org/abs/2502.14856; EAGLE-3's d2t map,
https://arxiv.org/abs/2503.01840): `token_map` int64 [V'] holds strictly increasing token ids, and lm_head holds
just those V' rows ([V', D] or [H, V', D], gathered once by the caller: lm_head_full[token_map]). The kernels rank
rows; the ids are mapped at the very end (token_map[row]), so nothing is gathered per call, and "lower row" is
"lower id" because the map is increasing. The logprobs are then log_softmax over the *draft* vocabulary (the V'
rows), not the full one. Decoding stays lossless: a draft only proposes tokens, verification scores them with the
target's full vocabulary. A top-8192 draft vocabulary at D 4096 streams 67 MB instead of 262 MB.

Three launches, each covering every head and every batch row:
  1. `_resblock_kernel`     z [B, H, D] for all heads (reads res_weight once). Fusing it into stage 2 would make
                            every vocab program recompute all H*D*D multiply-adds, so z makes one small trip
                            through memory instead: fp32 (B*H*D*4 bytes, 80 KB at B=1, H=5, D=4096), or on a GPU
                            with fp16/bf16 LM heads as the hi + lo split that stage 2 multiplies (same bytes).
  2. `_vocab_tile_kernel`   split-V: program (r, v, g) owns BLOCK_V vocab rows of LM head g and BLOCK_R of its
                            (batch, head) rows. It computes that logits tile in registers, keeps the tile's
                            log-sum-exp pieces (max m, sum of exp(l - m)) and the tile's top-k (k rounds of
                            max-with-index + mask), stored as packed keys.
  3. `_merge_kernel`        per (batch, head) row: combine the tiles' (m, s) into the log-sum-exp, merge the tiles'
                            candidates into the global top-k, map rows to ids, write token_ids and logprobs.
The [B, H, V] logits never exist in memory; the partials are B*H*(V/BLOCK_V)*(top_k + 2) numbers.

A candidate is one int64 key: the fp32 logit's bits mapped to an order-preserving int in the high 32 bits, and
(2^32 - 1 - row) in the low 32 bits, so "larger key" means "larger logit, then lower row" — one max per round
implements the tie rule. Logits must be finite (NaN/inf inputs give unspecified ids).

GPU tiling. The logits tile is computed transposed, [BLOCK_V, BLOCK_R] = L[v-tile] @ z[rows]^T: the vocab fills the
M side of the tensor-core instruction (M = 128, so Hopper's wgmma applies) and the few batch rows are the N side
(16 .. 128). Each vocab program streams its BLOCK_V x D slice of the LM head once and re-reads z from L2:
z bytes / LM-head bytes = R * 4 / (BLOCK_V * 2) with a bf16 head, hence BLOCK_V = 128 (a 256-row tile would halve
that at R > 64 but took all 255 registers in an ahead-of-time sm_90 compile, triton 3.7.1). The tile top-k uses
`tl.max(..., return_indices=True)` on the fp32 logits (ties -> lowest index) and packs only each round's
BLOCK_R winners, so no [BLOCK_V, BLOCK_R] int64 key tile lives in registers (three registers per logit).

Precision: loads are upcast to fp32 and everything accumulates in fp32 (fp64 inputs are computed in fp32 too:
logprobs agree with the fp64 reference to ~1e-5). On a GPU with fp16/bf16 LM heads the dots run on tensor cores in
the weight dtype: z is written once as hi + lo in that dtype (z ~= hi + lo to ~16 bits) and both are multiplied,
so the result stays close to fp32 while the weights are read in their own dtype (the price: twice the MMA work,
~2 * 2 * BLOCK_R * V * D flop per LM head). Under TRITON_INTERPRET=1 (CPU) the dots are plain fp32 (bf16 math is
broken in the interpreter).

Example (CPU tensors, so run it under TRITON_INTERPRET=1; on a GPU pass cuda tensors):
    >>> import torch
    >>> import torch.nn.functional as F
    >>> g = torch.Generator().manual_seed(0)
    >>> B, H, D, V = 2, 3, 16, 50
    >>> hidden = torch.randn(B, D, generator=g)                       # [B, D]
    >>> res_weight = torch.randn(H, D, D, generator=g) / D ** 0.5      # [H, D, D]
    >>> res_bias = torch.zeros(H, D)                                   # [H, D]
    >>> lm_head = torch.randn(V, D, generator=g)                       # [V, D], shared by the heads
    >>> ids, logp = fused_draft(hidden, res_weight, res_bias, lm_head, top_k=4)
    >>> ids.shape, logp.dtype
    (torch.Size([2, 3, 4]), torch.float32)
    >>> z = hidden[:, None] + F.silu(torch.einsum("bd,hed->bhe", hidden, res_weight) + res_bias)   # [B, H, D]
    >>> logits = z @ lm_head.T                                         # [B, H, V]
    >>> torch.equal(ids, logits.topk(4).indices)
    True
    >>> torch.allclose(logp, logits.log_softmax(-1).gather(-1, ids), atol=1e-5)
    True

    A draft vocabulary of 20 ids: rows are ranked over those 20 only, and come back as token ids.
    >>> token_map = torch.arange(0, 40, 2)                             # ids 0, 2, .. 38
    >>> ids, logp = fused_draft(hidden, res_weight, res_bias, lm_head[token_map], 4, token_map=token_map)
    >>> torch.equal(ids, token_map[logits[..., token_map].topk(4).indices])
    True

Its specification, `drafting_ref.py` beside it (torch only), holds the PyTorch twin and the input checks
imported below (so both reject the same inputs): copy the two files together.
"""
import torch
import triton
import triton.language as tl

from .drafting_ref import check_fused_draft_inputs


# ----------------------------------------------------------------------------------------------------- kernels

KEY_MIN = tl.constexpr(-9223372036854775808)  # below every packed key: "empty slot / already taken"
KEY_MAX = tl.constexpr(9223372036854775807)
FLT_MAX = tl.constexpr(3.4028234663852886e38)  # the largest finite fp32: NaN and -inf logits rank as -FLT_MAX


@triton.jit
def _pack_key(logit, row):
    """(fp32 logit, int row) -> int64 key; key order = logit descending, then row ascending."""
    bits = (logit + 0.0).to(tl.int32, bitcast=True)          # + 0.0 turns -0.0 into +0.0
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)     # signed-int order == float order
    return (ordered.to(tl.int64) << 32) | (4294967295 - row.to(tl.int64))


@triton.jit
def _unpack_key(key):
    """int64 key -> (fp32 logit, int64 row); inverse of _pack_key."""
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), 4294967295 - (key & 4294967295)


@triton.jit
def _resblock_kernel(
    x_ptr, w_ptr, b_ptr, z_hi_ptr, z_lo_ptr,  # x [B, D]; w [H, D, D] (out, in); b [H, D]; z_hi, z_lo [B, H, D]
    B, H, D,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_IN: tl.constexpr,
    SPLIT_OUT: tl.constexpr, RES: tl.constexpr,
):
    """z[b, h, n] = x[b, n] + silu(sum_k W_h[n, k] x[b, k] + b_h[n]) for one (head, n-tile, b-tile).
    RES=False: the ResBlock switched off, z = x (H = 1; w and b are not read): the MTP module's scores.

    Computed transposed, z^T tile [BLOCK_N, BLOCK_B] = W_h[n-tile] @ x^T, so the output features fill the MMA's M.
    SPLIT_IN (GPU, fp16/bf16 W): x = hi + lo in W's dtype, two tensor-core dots. Otherwise an fp32 "ieee" dot.
    SPLIT_OUT: store z as hi (z_hi_ptr) + lo (z_lo_ptr) in their (fp16/bf16) dtype; otherwise z_hi_ptr is fp32 z.
    """
    pid_h = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    pid_b = tl.program_id(2).to(tl.int64)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)                      # [BLOCK_B] batch rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BLOCK_N] output features
    mask_b, mask_n = offs_b < B, offs_n < D
    x_n = tl.load(x_ptr + offs_b[None, :] * D + offs_n[:, None],
                  mask=mask_b[None, :] & mask_n[:, None], other=0.0).to(tl.float32)    # [BLOCK_N, BLOCK_B]
    z = x_n                                                               # RES=False: z = x
    if RES:
        w_head = w_ptr + pid_h * D * D
        acc = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < D
            w = tl.load(w_head + offs_n[:, None] * D + offs_k[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0)              # [BLOCK_N, BLOCK_K]
            xt = tl.load(x_ptr + offs_b[None, :] * D + offs_k[:, None],
                         mask=mask_b[None, :] & mask_k[:, None], other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_B]
            if SPLIT_IN:
                x_hi = xt.to(w.dtype)
                x_lo = (xt - x_hi.to(tl.float32)).to(w.dtype)
                acc = tl.dot(w, x_hi, acc)
                acc = tl.dot(w, x_lo, acc)
            else:
                acc = tl.dot(w.to(tl.float32), xt, acc, input_precision="ieee")
        bias = tl.load(b_ptr + pid_h * D + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
        pre = acc + bias[:, None]
        z = x_n + pre * tl.sigmoid(pre)                                   # x + silu(pre)
    offs_z = (offs_b[None, :] * H + pid_h) * D + offs_n[:, None]          # z[b, h, n]
    mask_z = mask_b[None, :] & mask_n[:, None]
    if SPLIT_OUT:
        z_hi = z.to(z_hi_ptr.dtype.element_ty)
        tl.store(z_hi_ptr + offs_z, z_hi, mask=mask_z)
        tl.store(z_lo_ptr + offs_z, (z - z_hi.to(tl.float32)).to(z_lo_ptr.dtype.element_ty), mask=mask_z)
    else:
        tl.store(z_hi_ptr + offs_z, z, mask=mask_z)


@triton.jit
def _vocab_tile_kernel(
    z_hi_ptr, z_lo_ptr, lm_ptr,          # z [R, D] (R = B*H rows, as hi + lo or fp32 hi); lm_head [G, V, D]
    key_ptr, m_ptr, s_ptr,               # key [R, NT, TOP_K] int64; m, s [R, NT] fp32   (NT = vocab tiles)
    RG, D, V, NT, stride_i, stride_g,    # a group's rows: row = i * stride_i + g * stride_g, i < RG
    TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """One vocab tile of LM head g for BLOCK_R of its rows: logits in registers -> tile max, sum-exp, top-k keys.

    Shared LM head: G = 1 group of all R rows (stride_i 1). Per-head LM heads: G = H groups, group h = the B rows of
    head h (row b*H + h: stride_i H, stride_g 1). SPLIT: z is hi + lo in lm_head's dtype, two tensor-core dots;
    otherwise z_hi_ptr is fp32 z and the dot is fp32 "ieee".
    """
    pid_r = tl.program_id(0).to(tl.int64)  # r is the fast grid axis: programs sharing a vocab tile run together
    pid_v = tl.program_id(1).to(tl.int64)
    pid_g = tl.program_id(2).to(tl.int64)
    offs_i = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)                      # [BLOCK_R] rows of this group
    mask_r = offs_i < RG
    rows = offs_i * stride_i + pid_g * stride_g                           # [BLOCK_R] (batch, head) rows b*H + h
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)                      # [BLOCK_V] vocab rows
    mask_v = offs_v < V
    lm_group = lm_ptr + pid_g * V * D
    acc = tl.zeros((BLOCK_V, BLOCK_R), dtype=tl.float32)                  # logits^T
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        w = tl.load(lm_group + offs_v[:, None] * D + offs_d[None, :],
                    mask=mask_v[:, None] & mask_d[None, :], other=0.0)               # [BLOCK_V, BLOCK_D]
        offs_zt = rows[None, :] * D + offs_d[:, None]                                # [BLOCK_D, BLOCK_R]
        mask_zt = mask_r[None, :] & mask_d[:, None]
        if SPLIT:
            acc = tl.dot(w, tl.load(z_hi_ptr + offs_zt, mask=mask_zt, other=0.0), acc)
            acc = tl.dot(w, tl.load(z_lo_ptr + offs_zt, mask=mask_zt, other=0.0), acc)
        else:
            zt = tl.load(z_hi_ptr + offs_zt, mask=mask_zt, other=0.0)
            acc = tl.dot(w.to(tl.float32), zt, acc, input_precision="ieee")
    # Non-finite logits (a NaN or inf in the hidden state or a weight) follow the twin's rules:
    #  * ranking: NaN ranks as -inf (lowest, ties to the lower id), +inf highest. Both rank as -FLT_MAX here, so
    #    that -inf is left to mean "padding or taken" and every real row can be picked: the top-k is always k
    #    valid ids (the merge turns a -FLT_MAX logit back into -inf).
    #  * log-sum-exp: a NaN or +inf anywhere in the row makes s NaN, so the merged logprobs are NaN (the twin's
    #    log_softmax is NaN or -inf there too); a tile of only -inf has m = -inf and s = 0.
    # One [BLOCK_V, BLOCK_R] tensor stays live (registers: the per-head LM-head tiles sit at ptxas's limit).
    poisoned = tl.max((mask_v[:, None] & ((acc != acc) | (acc == float("inf")))).to(tl.int32), axis=0)  # [BLOCK_R]
    logits = tl.where((acc == acc) & (acc > -FLT_MAX), acc, -FLT_MAX)
    logits = tl.where(mask_v[:, None], logits, float("-inf"))             # [BLOCK_V, BLOCK_R]

    # log-sum-exp pieces of this tile: m = max_v l, s = sum_v exp(l - m)
    m = tl.max(logits, axis=0)                                            # [BLOCK_R]
    s = tl.sum(tl.exp(logits - m[None, :]), axis=0)                      # -FLT_MAX entries add exp(-huge) = 0
    s = tl.where(m == -FLT_MAX, 0.0, s)                                   # a tile of only NaN / -inf
    s = tl.where(poisoned > 0, float("nan"), s)
    m = tl.where(m == -FLT_MAX, float("-inf"), m)
    tl.store(m_ptr + rows * NT + pid_v, m, mask=mask_r)
    tl.store(s_ptr + rows * NT + pid_v, s, mask=mask_r)

    # tile top-k: TOP_K rounds of "take the max (lowest index among equals), then mask it out"
    local = tl.arange(0, BLOCK_V)
    out_base = key_ptr + (rows * NT + pid_v) * TOP_K                      # [BLOCK_R]
    for j in range(TOP_K):
        best, at = tl.max(logits, axis=0, return_indices=True)            # [BLOCK_R]
        key = tl.where(best > float("-inf"), _pack_key(best, pid_v * BLOCK_V + at), KEY_MIN)  # -inf: no more ids
        tl.store(out_base + j, key, mask=mask_r)
        logits = tl.where(local[:, None] == at[None, :], float("-inf"), logits)


@triton.jit
def _merge_kernel(
    key_ptr, m_ptr, s_ptr,               # partials from _vocab_tile_kernel
    map_ptr,                             # token_map [V] int64 (read only if HAS_MAP)
    ids_ptr, logp_ptr,                   # outputs [R, TOP_K] int64 / fp32
    R, NT,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, MERGE_R: tl.constexpr, CHUNK: tl.constexpr,
    CHUNK_T: tl.constexpr, HAS_MAP: tl.constexpr,
):
    """Per row: lse = log(sum_t s_t exp(m_t - M)) + M; global top-k of the NT*TOP_K candidate keys; rows -> ids."""
    pid = tl.program_id(0).to(tl.int64)
    offs_r = pid * MERGE_R + tl.arange(0, MERGE_R)                        # [MERGE_R]
    mask_r = offs_r < R

    # 1. log-sum-exp: an online max/rescale per lane, then across lanes
    m_acc = tl.full((MERGE_R, CHUNK_T), float("-inf"), tl.float32)
    s_acc = tl.zeros((MERGE_R, CHUNK_T), dtype=tl.float32)
    for t0 in range(0, NT, CHUNK_T):
        offs_t = t0 + tl.arange(0, CHUNK_T)
        mask = mask_r[:, None] & (offs_t[None, :] < NT)
        m = tl.load(m_ptr + offs_r[:, None] * NT + offs_t[None, :], mask=mask, other=float("-inf"))
        s = tl.load(s_ptr + offs_r[:, None] * NT + offs_t[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m_acc, m)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)             # lanes with nothing yet
        s_acc = s_acc * tl.exp(m_acc - m_safe) + s * tl.exp(m - m_safe)
        m_acc = m_new
    m_row = tl.max(m_acc, axis=1)                                         # [MERGE_R]
    m_row_safe = tl.where(mask_r, m_row, 0.0)
    s_row = tl.sum(s_acc * tl.exp(m_acc - m_row_safe[:, None]), axis=1)
    lse = m_row_safe + tl.log(tl.where(mask_r, s_row, 1.0))

    # 2. top-k: a running set of TOP_K slots; a candidate enters by replacing the smallest slot.
    #    Per chunk, only as many rounds as candidates beat the current k-th best (few after the first chunk).
    kk = tl.arange(0, K_PAD)
    run = tl.where(kk[None, :] < TOP_K, KEY_MIN, KEY_MAX)                 # pad slots: never the minimum
    run = tl.broadcast_to(run, (MERGE_R, K_PAD))
    N = NT * TOP_K
    for c0 in range(0, N, CHUNK):
        offs_c = c0 + tl.arange(0, CHUNK)
        cand = tl.load(key_ptr + offs_r[:, None] * N + offs_c[None, :],
                       mask=mask_r[:, None] & (offs_c[None, :] < N), other=KEY_MIN)   # [MERGE_R, CHUNK]
        kth = tl.min(run, axis=1)                                         # [MERGE_R]
        n_above = tl.max(tl.sum((cand > kth[:, None]).to(tl.int32), axis=1), axis=0)
        for _ in range(tl.minimum(n_above, TOP_K)):
            best = tl.max(cand, axis=1)                                   # [MERGE_R]
            low, slot = tl.min(run, axis=1, return_indices=True)
            enter = best > low
            run = tl.where((kk[None, :] == slot[:, None]) & enter[:, None], best[:, None], run)
            cand = tl.where(cand == best[:, None], KEY_MIN, cand)

    # 3. emit the running set in descending key order; a draft vocabulary maps rows to token ids here
    run = tl.where(kk[None, :] < TOP_K, run, KEY_MIN)
    for j in range(TOP_K):
        best = tl.max(run, axis=1)                                        # [MERGE_R]
        logit, row = _unpack_key(best)
        if HAS_MAP:
            row = tl.load(map_ptr + row, mask=mask_r, other=0)
        tl.store(ids_ptr + offs_r * TOP_K + j, row, mask=mask_r)
        logit = tl.where(logit == -FLT_MAX, float("-inf"), logit)         # a NaN or -inf logit (tile kernel)
        tl.store(logp_ptr + offs_r * TOP_K + j, logit - lse, mask=mask_r)
        run = tl.where(run == best[:, None], KEY_MIN, run)


# ---------------------------------------------------------------------------------------------------- launcher

def _interpreting():
    """True when these kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import time)."""
    return type(_vocab_tile_kernel).__name__ == "InterpretedFunction"


def _empty(shape, dtype, device):
    """Every buffer the launcher allocates comes from here (tests swap in NaN-filled ones)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _p2(n, lo, hi):
    """Next power of two of n, clamped to [lo, hi]."""
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def draft_config(B, H, D, V, top_k, device, per_head=False, capability=None):
    """Tile sizes and launch settings: big tiles under the interpreter (fewer programs = faster); on a GPU, enough
    vocab programs that every SM streams a slice of the LM head, BLOCK_V >= 128, and rows padded to >= 16 (tl.dot).

    `RG` rows share an LM head: B*H with a shared head, B with one head per head. capability: the GPU's
    (major, minor) compute capability; None asks the device (give it to plan for a GPU this machine lacks).
    """
    RG = B if per_head else B * H
    if device.type != "cuda":
        return dict(BLOCK_B=_p2(B, 16, 64), BLOCK_N=_p2(D, 16, 64), BLOCK_K=_p2(D, 16, 128),
                    BLOCK_R=_p2(RG, 16, 64), BLOCK_V=_p2(V, 16, 256), BLOCK_D=_p2(D, 16, 128),
                    MERGE_R=_p2(B * H, 1, 16), CHUNK=1024, CHUNK_T=1024, num_warps=4, num_stages=1,
                    res_warps=4, res_stages=1)
    block_r = _p2(RG, 16, 128)
    # Per target, so that no vocab tile spills (ahead-of-time compiles: the repository's compile audit):
    #  * warps: 8 for 64+ rows; always 8 on sm_100 (tcgen05: the logits tile is read from tensor memory into
    #    registers for the top-k, and spills at 4 warps), and 8 on sm_80 for per-head LM heads (4 warps spill);
    #  * BLOCK_D: 64; on sm_120 at 64+ rows 32 (64 spills there; 32 also halves the shared memory per stage, so two
    #    blocks fit an SM's 100 KB).
    major = (capability or torch.cuda.get_device_capability(device))[0]
    return dict(BLOCK_B=_p2(B, 16, 64), BLOCK_N=64, BLOCK_K=64,
                BLOCK_R=block_r, BLOCK_V=128, BLOCK_D=32 if major == 12 and block_r >= 64 else 64,
                MERGE_R=1, CHUNK=2048, CHUNK_T=1024,
                num_warps=8 if block_r >= 64 or major == 10 or (per_head and major == 8) else 4, num_stages=3,
                res_warps=4, res_stages=3)


def fused_draft(hidden, res_weight, res_bias, lm_head, top_k, *, token_map=None, check_values=True):
    """All H Medusa heads on one hidden state, then per-head top-k of the LM head — in Triton.

    head h:  z_h = x + silu(W_h x + b_h);  logits_h = L_h @ z_h               (Medusa, Cai et al. 2024)
    hidden [B, D]; res_weight [H, D, D]; res_bias [H, D]; lm_head [V, D] (shared: L_h = lm_head) or [H, V, D]
    (one per head: L_h = lm_head[h]); fp16 / bf16 / fp32 / fp64, contiguous. res_weight = res_bias = None: the
    ResBlock switched off, one "head" with z = x (the MTP module's scores: L x, top-k; the ResBlock kernel with
    RES=False only converts x).
    token_map: None, or int64 [V] strictly increasing token ids of a draft vocabulary whose V rows lm_head holds;
    then token_ids = token_map[row] and logprobs are log_softmax over the V draft rows.
    check_values=False skips the checks that read token_map's values (host syncs); shapes are always checked.
    returns token_ids [B, H, top_k] int64 (descending logit, ties -> lower id) and
            logprobs  [B, H, top_k] float32 = log_softmax(logits_h) at those ids.
    Same signature and results as ``drafting_ref.fused_draft``; the logits are never materialised.
    """
    check_fused_draft_inputs(hidden, res_weight, res_bias, lm_head, top_k, token_map, values=check_values)
    return _fused_draft(hidden, res_weight, res_bias, lm_head, top_k, token_map=token_map)


def _fused_draft(hidden, res_weight, res_bias, lm_head, top_k, token_map=None, **overrides):
    """The launches; `overrides` replaces entries of `draft_config` (tests use it to force many small tiles)."""
    device = hidden.device
    if device.type != "cuda" and not _interpreting():
        raise RuntimeError("fused_draft (Triton): tensors must be on a CUDA device, or run the kernels in Triton's "
                           "interpreter: call mtp_triton.use_interpreter() (or set TRITON_INTERPRET=1) before "
                           "importing them")
    B, D = hidden.shape
    H, V = 1 if res_weight is None else res_weight.shape[0], lm_head.shape[-2]
    per_head = lm_head.dim() == 3
    R = B * H
    cfg = {**draft_config(B, H, D, V, top_k, device, per_head), **overrides}
    gpu = device.type == "cuda" and not _interpreting()
    half = (torch.float16, torch.bfloat16)
    split = gpu and lm_head.dtype in half

    # 1. ResBlocks of all heads: z [B, H, D], fp32, or hi + lo in lm_head's dtype for the tensor-core dots
    #    (res_weight None: the ResBlock off, z = x, H = 1; w and b are not read, so x stands in for them)
    res = res_weight is not None
    z_hi = _empty((B, H, D), lm_head.dtype if split else torch.float32, device)
    z_lo = _empty((B, H, D), lm_head.dtype, device) if split else z_hi
    grid = (H, triton.cdiv(D, cfg["BLOCK_N"]), triton.cdiv(B, cfg["BLOCK_B"]))
    _resblock_kernel[grid](hidden, res_weight if res else hidden, res_bias if res else hidden, z_hi, z_lo, B, H, D,
                           BLOCK_B=cfg["BLOCK_B"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                           SPLIT_IN=gpu and res and res_weight.dtype in half, SPLIT_OUT=split, RES=res,
                           num_warps=cfg["res_warps"], num_stages=cfg["res_stages"])

    # 2. split-V: every (row tile, vocab tile, LM head) -> tile max, sum-exp, top-k keys
    NT = triton.cdiv(V, cfg["BLOCK_V"])
    keys = _empty((R, NT, top_k), torch.int64, device)
    m = _empty((R, NT), torch.float32, device)
    s = _empty((R, NT), torch.float32, device)
    RG, G, stride_i, stride_g = (B, H, H, 1) if per_head else (R, 1, 1, 0)
    grid = (triton.cdiv(RG, cfg["BLOCK_R"]), NT, G)
    _vocab_tile_kernel[grid](z_hi, z_lo, lm_head, keys, m, s, RG, D, V, NT, stride_i, stride_g,
                             TOP_K=top_k, BLOCK_R=cfg["BLOCK_R"], BLOCK_V=cfg["BLOCK_V"], BLOCK_D=cfg["BLOCK_D"],
                             SPLIT=split, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    # 3. merge tiles per (batch, head) row
    token_ids = _empty((B, H, top_k), torch.int64, device)
    logprobs = _empty((B, H, top_k), torch.float32, device)
    chunk = min(cfg["CHUNK"], triton.next_power_of_2(NT * top_k))
    chunk_t = min(cfg["CHUNK_T"], triton.next_power_of_2(NT))
    grid = (triton.cdiv(R, cfg["MERGE_R"]),)
    _merge_kernel[grid](keys, m, s, token_ids if token_map is None else token_map, token_ids, logprobs, R, NT,
                        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), MERGE_R=cfg["MERGE_R"],
                        CHUNK=chunk, CHUNK_T=chunk_t, HAS_MAP=token_map is not None, num_warps=cfg["num_warps"])
    return token_ids, logprobs
