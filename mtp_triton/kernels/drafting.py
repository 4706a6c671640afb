"""Fused multi-head drafting (Medusa-style heads + shared LM head + per-head top-k) — Triton.

The math (Medusa, Cai et al. 2024; one ResBlock per head on the target's last hidden state x):

    z_h      = x + silu(W_h x + b_h)                 h = 0 .. H-1
    logits_h = lm_head @ z_h                         [V]
    ids_h    = top-k of logits_h (descending, ties -> lower id)
    logp_h   = logits_h[ids_h] - logsumexp(logits_h)

What a plain PyTorch version moves: H ResBlock GEMVs (read H*D*D weights), one LM-head GEMM (read V*D weights,
write B*H*V logits), then log_softmax (read + write B*H*V) and topk (read B*H*V). The LM head is by far the biggest
tensor (Llama-7B: 32000 x 4096 bf16 = 262 MB), so drafting is a bandwidth problem: the goal is to stream the LM head
exactly once, from every SM at once, and never write the logits.

Three launches, each covering every head and every batch row:
  1. `_resblock_kernel`     z [B, H, D] fp32 for all heads (reads res_weight once). Fusing it into stage 2 would
                            make every vocab program recompute all H*D*D multiply-adds, so z makes one small trip
                            through memory instead (B*H*D*4 bytes, 80 KB at B=1, H=5, D=4096).
  2. `_vocab_tile_kernel`   split-V: program (r, v) owns BLOCK_V vocab rows and BLOCK_R of the B*H (batch, head)
                            rows. It computes that logits tile in registers, keeps the tile's log-sum-exp pieces
                            (max m, sum of exp(l - m)) and the tile's top-k (k rounds of max + mask) as packed keys.
  3. `_merge_kernel`        per (batch, head) row: combine the tiles' (m, s) into the log-sum-exp, merge the tiles'
                            candidates into the global top-k, write token_ids and logprobs.
The [B, H, V] logits never exist in memory; the partials are B*H*(V/BLOCK_V)*(top_k + 2) numbers.

A candidate is one int64 key: the fp32 logit's bits mapped to an order-preserving int in the high 32 bits, and
(2^32 - 1 - id) in the low 32 bits, so "larger key" means "larger logit, then lower id" — one max per round
implements the tie rule. Logits must be finite (NaN/inf inputs give unspecified ids).

Precision: loads are upcast to fp32 and everything accumulates in fp32 (fp64 inputs are computed in fp32 too:
logprobs agree with the fp64 reference to ~1e-5). On a GPU with fp16/bf16 weights the dots run on tensor cores in
the weight dtype: the fp32 activations are split into hi + lo parts in that dtype (z ~= hi + lo to ~16 bits) and
both are multiplied, so the result stays close to fp32 while the weights are read in their own dtype. Under
TRITON_INTERPRET=1 (CPU) the dots are plain fp32 (bf16 math is broken in the interpreter).

Example:
    >>> ids, logp = fused_draft(hidden, res_weight, res_bias, lm_head, top_k=10)   # [B, H, 10] each

Input checks live here so this file can be copied alone (torch + triton only); the
PyTorch twin in ``mtp_triton.reference`` imports them, so both reject the same inputs.
"""
import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_fused_draft_inputs(hidden, res_weight, res_bias, lm_head, top_k):
    """Validate ``fused_draft`` arguments; raise ValueError/TypeError with a clear message.

    hidden [B, D]; res_weight [H, D, D]; res_bias [H, D]; lm_head [V, D]; 1 <= top_k <= V.
    """
    tensors = dict(hidden=hidden, res_weight=res_weight, res_bias=res_bias, lm_head=lm_head)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fused_draft: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"fused_draft: {name} must be a floating tensor, got {t.dtype}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"fused_draft: {name} has dtype {t.dtype}; supported: float16, bfloat16, float32, "
                            f"float64")
    if hidden.dim() != 2:
        raise ValueError(f"fused_draft: hidden must be [B, D], got shape {tuple(hidden.shape)}")
    B, D = hidden.shape
    if res_weight.dim() != 3 or res_weight.shape[1:] != (D, D):
        raise ValueError(f"fused_draft: res_weight must be [H, {D}, {D}], got {tuple(res_weight.shape)}")
    H = res_weight.shape[0]
    if H < 1:
        raise ValueError("fused_draft: need at least one head (res_weight.shape[0] >= 1)")
    if tuple(res_bias.shape) != (H, D):
        raise ValueError(f"fused_draft: res_bias must be [{H}, {D}], got {tuple(res_bias.shape)}")
    if lm_head.dim() != 2 or lm_head.shape[1] != D:
        raise ValueError(f"fused_draft: lm_head must be [V, {D}], got {tuple(lm_head.shape)}")
    V = lm_head.shape[0]
    if B < 1 or V < 1:
        raise ValueError(f"fused_draft: empty input (B={B}, V={V})")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= V:
        raise ValueError(f"fused_draft: top_k must be an int in [1, V={V}], got {top_k!r}")
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"fused_draft: all tensors must be on one device, got {sorted(map(str, devices))}")
    dtypes = {res_weight.dtype, res_bias.dtype}
    if len(dtypes) != 1:
        raise TypeError(f"fused_draft: res_weight and res_bias must share a dtype, got {sorted(map(str, dtypes))}")
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"fused_draft: {name} must be contiguous (call .contiguous())")


# ----------------------------------------------------------------------------------------------------- kernels

KEY_MIN = tl.constexpr(-9223372036854775808)  # below every packed key: "empty slot / already taken"
KEY_MAX = tl.constexpr(9223372036854775807)


@triton.jit
def _dot_f32(a, b, acc, SPLIT_HALF: tl.constexpr):
    """acc += a @ b, with a in fp32 and b as loaded (any float dtype), fp32 accumulation.

    SPLIT_HALF (GPU, fp16/bf16 b): a = hi + lo in b's dtype, two tensor-core dots, b never upcast.
    Otherwise b is upcast and the dot is full fp32 ("ieee", no tf32).
    """
    if SPLIT_HALF:
        a_hi = a.to(b.dtype)
        a_lo = (a - a_hi.to(tl.float32)).to(b.dtype)
        acc = tl.dot(a_hi, b, acc)
        acc = tl.dot(a_lo, b, acc)
    else:
        acc = tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def _pack_key(logit, tok):
    """(fp32 logit, int id) -> int64 key; key order = logit descending, then id ascending."""
    bits = (logit + 0.0).to(tl.int32, bitcast=True)          # + 0.0 turns -0.0 into +0.0
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)     # signed-int order == float order
    return (ordered.to(tl.int64) << 32) | (4294967295 - tok.to(tl.int64))


@triton.jit
def _unpack_key(key):
    """int64 key -> (fp32 logit, int64 id); inverse of _pack_key."""
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), 4294967295 - (key & 4294967295)


@triton.jit
def _resblock_kernel(
    x_ptr, w_ptr, b_ptr, z_ptr,  # x [B, D]; w [H, D, D] (out, in); b [H, D]; z [B, H, D] fp32
    B, H, D,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_HALF: tl.constexpr,
):
    """z[b, h, n] = x[b, n] + silu(sum_k x[b, k] W_h[n, k] + b_h[n]) for one (head, n-tile, b-tile)."""
    pid_h = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    pid_b = tl.program_id(2).to(tl.int64)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)                      # [BLOCK_B] batch rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BLOCK_N] output features
    mask_b, mask_n = offs_b < B, offs_n < D
    w_head = w_ptr + pid_h * D * D
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < D
        x = tl.load(x_ptr + offs_b[:, None] * D + offs_k[None, :],
                    mask=mask_b[:, None] & mask_k[None, :], other=0.0).to(tl.float32)   # [BLOCK_B, BLOCK_K]
        w = tl.load(w_head + offs_n[None, :] * D + offs_k[:, None],
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0)                  # [BLOCK_K, BLOCK_N] = W^T
        acc = _dot_f32(x, w, acc, SPLIT_HALF)
    bias = tl.load(b_ptr + pid_h * D + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
    pre = acc + bias[None, :]
    x_n = tl.load(x_ptr + offs_b[:, None] * D + offs_n[None, :],
                  mask=mask_b[:, None] & mask_n[None, :], other=0.0).to(tl.float32)    # [BLOCK_B, BLOCK_N]
    z = x_n + pre * tl.sigmoid(pre)                                       # x + silu(pre)
    z_ptrs = z_ptr + (offs_b[:, None] * H + pid_h) * D + offs_n[None, :]
    tl.store(z_ptrs, z, mask=mask_b[:, None] & mask_n[None, :])


@triton.jit
def _vocab_tile_kernel(
    z_ptr, lm_ptr,                       # z [R, D] fp32 (R = B*H rows); lm_head [V, D]
    key_ptr, m_ptr, s_ptr,               # key [R, NT, TOP_K] int64; m, s [R, NT] fp32   (NT = vocab tiles)
    R, D, V, NT,
    TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_HALF: tl.constexpr,
):
    """One vocab tile for BLOCK_R rows: logits in registers -> tile max, sum-exp and top-k keys."""
    pid_r = tl.program_id(0).to(tl.int64)  # r is the fast grid axis: programs sharing a vocab tile run together
    pid_v = tl.program_id(1).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)                      # [BLOCK_R]
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)                      # [BLOCK_V] token ids
    mask_r, mask_v = offs_r < R, offs_v < V
    acc = tl.zeros((BLOCK_R, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        z = tl.load(z_ptr + offs_r[:, None] * D + offs_d[None, :],
                    mask=mask_r[:, None] & mask_d[None, :], other=0.0)               # [BLOCK_R, BLOCK_D]
        w = tl.load(lm_ptr + offs_v[None, :] * D + offs_d[:, None],
                    mask=mask_v[None, :] & mask_d[:, None], other=0.0)               # [BLOCK_D, BLOCK_V]
        acc = _dot_f32(z, w, acc, SPLIT_HALF)                             # logits tile [BLOCK_R, BLOCK_V]
    logits = tl.where(mask_v[None, :], acc, float("-inf"))

    # log-sum-exp pieces of this tile: m = max_v l, s = sum_v exp(l - m)
    m = tl.max(logits, axis=1)                                            # [BLOCK_R]
    s = tl.sum(tl.exp(logits - m[:, None]), axis=1)
    tl.store(m_ptr + offs_r * NT + pid_v, m, mask=mask_r)
    tl.store(s_ptr + offs_r * NT + pid_v, s, mask=mask_r)

    # tile top-k: TOP_K rounds of "take the max key, then mask it out"
    keys = tl.where(mask_v[None, :], _pack_key(logits, offs_v[None, :]), KEY_MIN)   # [BLOCK_R, BLOCK_V]
    out_base = key_ptr + (offs_r * NT + pid_v) * TOP_K                    # [BLOCK_R]
    for j in range(TOP_K):
        best = tl.max(keys, axis=1)                                       # [BLOCK_R]
        tl.store(out_base + j, best, mask=mask_r)
        keys = tl.where(keys == best[:, None], KEY_MIN, keys)


@triton.jit
def _merge_kernel(
    key_ptr, m_ptr, s_ptr,               # partials from _vocab_tile_kernel
    ids_ptr, logp_ptr,                   # outputs [R, TOP_K] int64 / fp32
    R, NT,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, MERGE_R: tl.constexpr, CHUNK: tl.constexpr,
    CHUNK_T: tl.constexpr,
):
    """Per row: lse = log(sum_t s_t exp(m_t - M)) + M; global top-k of the NT*TOP_K candidate keys."""
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

    # 3. emit the running set in descending key order
    run = tl.where(kk[None, :] < TOP_K, run, KEY_MIN)
    for j in range(TOP_K):
        best = tl.max(run, axis=1)                                        # [MERGE_R]
        logit, tok = _unpack_key(best)
        tl.store(ids_ptr + offs_r * TOP_K + j, tok, mask=mask_r)
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


def draft_config(B, H, D, V, top_k, device):
    """Tile sizes and launch settings: big tiles under the interpreter (fewer programs = faster), and on a GPU
    enough vocab programs that every SM streams a slice of the LM head."""
    R = B * H
    if device.type != "cuda":
        return dict(BLOCK_B=_p2(B, 16, 64), BLOCK_N=_p2(D, 16, 64), BLOCK_K=_p2(D, 16, 128),
                    BLOCK_R=_p2(R, 16, 64), BLOCK_V=_p2(V, 16, 256), BLOCK_D=_p2(D, 16, 128),
                    MERGE_R=_p2(R, 1, 16), CHUNK=1024, CHUNK_T=1024, num_warps=4, num_stages=1)
    block_r = _p2(R, 16, 64)
    block_v = 128 if block_r <= 32 else 64
    return dict(BLOCK_B=_p2(B, 16, 64), BLOCK_N=32, BLOCK_K=128,
                BLOCK_R=block_r, BLOCK_V=block_v, BLOCK_D=128,
                MERGE_R=1, CHUNK=2048, CHUNK_T=1024, num_warps=4, num_stages=3)


def fused_draft(hidden, res_weight, res_bias, lm_head, top_k):
    """All H Medusa heads on one hidden state, then per-head top-k of the shared LM head — in Triton.

    head h:  z_h = x + silu(W_h x + b_h);  logits_h = lm_head @ z_h           (Medusa, Cai et al. 2024)
    hidden [B, D]; res_weight [H, D, D]; res_bias [H, D]; lm_head [V, D]  (fp16 / bf16 / fp32 / fp64, contiguous)
    returns token_ids [B, H, top_k] int64 (descending logit, ties -> lower id) and
            logprobs  [B, H, top_k] float32 = log_softmax(logits_h) at those ids.
    Same signature and results as ``mtp_triton.reference.fused_draft``; the logits are never materialised.
    """
    check_fused_draft_inputs(hidden, res_weight, res_bias, lm_head, top_k)
    return _fused_draft(hidden, res_weight, res_bias, lm_head, top_k)


def _fused_draft(hidden, res_weight, res_bias, lm_head, top_k, **overrides):
    """The launches; `overrides` replaces entries of `draft_config` (tests use it to force many small tiles)."""
    device = hidden.device
    if device.type != "cuda" and not _interpreting():
        raise RuntimeError("fused_draft (Triton): tensors must be on a CUDA device, or run the kernels in Triton's "
                           "interpreter: call mtp_triton.use_interpreter() (or set TRITON_INTERPRET=1) before "
                           "importing them")
    B, D = hidden.shape
    H, V = res_weight.shape[0], lm_head.shape[0]
    R = B * H
    cfg = {**draft_config(B, H, D, V, top_k, device), **overrides}
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    gpu = device.type == "cuda" and not _interpreting()
    half = (torch.float16, torch.bfloat16)

    # 1. ResBlocks of all heads: z [B, H, D] fp32
    z = _empty((B, H, D), torch.float32, device)
    grid = (H, triton.cdiv(D, cfg["BLOCK_N"]), triton.cdiv(B, cfg["BLOCK_B"]))
    _resblock_kernel[grid](hidden, res_weight, res_bias, z, B, H, D,
                           BLOCK_B=cfg["BLOCK_B"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                           SPLIT_HALF=gpu and res_weight.dtype in half, **launch)

    # 2. split-V: every (row tile, vocab tile) -> tile max, sum-exp, top-k keys
    NT = triton.cdiv(V, cfg["BLOCK_V"])
    keys = _empty((R, NT, top_k), torch.int64, device)
    m = _empty((R, NT), torch.float32, device)
    s = _empty((R, NT), torch.float32, device)
    grid = (triton.cdiv(R, cfg["BLOCK_R"]), NT)
    _vocab_tile_kernel[grid](z, lm_head, keys, m, s, R, D, V, NT,
                             TOP_K=top_k, BLOCK_R=cfg["BLOCK_R"], BLOCK_V=cfg["BLOCK_V"], BLOCK_D=cfg["BLOCK_D"],
                             SPLIT_HALF=gpu and lm_head.dtype in half, **launch)

    # 3. merge tiles per (batch, head) row
    token_ids = _empty((B, H, top_k), torch.int64, device)
    logprobs = _empty((B, H, top_k), torch.float32, device)
    chunk = min(cfg["CHUNK"], triton.next_power_of_2(NT * top_k))
    chunk_t = min(cfg["CHUNK_T"], triton.next_power_of_2(NT))
    grid = (triton.cdiv(R, cfg["MERGE_R"]),)
    _merge_kernel[grid](keys, m, s, token_ids, logprobs, R, NT,
                        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), MERGE_R=cfg["MERGE_R"],
                        CHUNK=chunk, CHUNK_T=chunk_t, num_warps=cfg["num_warps"])
    return token_ids, logprobs
