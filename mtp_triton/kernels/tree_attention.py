"""Tree-masked attention over a paged KV cache — Triton.

One verification step feeds T tree nodes (node 0 = the root, the newest committed token) through the
target model. In every layer, node i of sequence b attends to all cache_lens[b] cached tokens and to the
tree nodes j that are i itself or an ancestor of i (SpecInfer, Miao et al. 2023; Medusa, Cai et al. 2024):

    S = [q_i K_cache(b)^T, q_i K_tree(b)^T] * sm_scale,   S[j] = -inf where j is a tree node and not tree_mask[b, i, j]
    out[b, i] = softmax(S) [V_cache(b); V_tree(b)]

Bytes, the reason this is one kernel: a step reads the whole K/V cache once per layer
(2 * cache_len * Hkv * Dh * elem bytes) and a little more for the tree. The naive PyTorch route first
gathers the paged cache into a contiguous copy (read + write the same bytes again), builds a
[T, cache_len + T] mask, then runs masked attention over the copy: ~3x the traffic of reading the cache once.

The kernel is flash-attention style (Dao et al. 2022): one program per (query tile, sequence, KV head,
KV split). Its query tile holds the G = Hq // Hkv query heads of that KV head for a run of tree nodes
(row r <-> node r // G, head kv_head * G + r % G), so each K/V tile is loaded once for all G heads (GQA).
It streams the cache through the block table (key position n lives in block block_table[b, n // BS],
slot n % BS), then the tree keys under the ancestor mask, with an online softmax accumulated in fp32.
Tree keys past the tile's last node are skipped (the mask is lower-triangular), so the same kernel
serves prefill (cache_len 0, a causal mask over hundreds of nodes).

Sliding window (Mistral, Jiang et al. 2023; `sliding_window` in transformers): node i sits at position
p_i = cache_len + depth_i, with depth_i = (number of True in tree_mask[b, i]) - 1. With a window W it sees
cache position j only if p_i - j < W, and tree node a only if p_i - p_a < W (transformers: query q_idx
sees kv_idx iff q_idx - kv_idx < sliding_window). The launcher counts the mask rows once (one reduction
on the device); each program reads its rows' depths and streams only the cache tiles that hold a position
some row can see (p >= cache_len + min depth - W + 1): older tiles are never read, and the split-KV
chunks cover only that range. Tree keys a with depth_a <= min depth - W are never visible, and
depth_a <= a, so key tiles before min depth - W + 1 are skipped too.

Split-KV (flash-decoding, Dao et al. 2023): with few programs (batch 1, a handful of KV heads) the cache
of every sequence is cut into n_splits chunks handled by separate programs; each writes its normalised
partial output and log-sum-exp, and `_combine_splits_kernel` merges them:
    out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M),   M = max_s lse_s.
The split count is a run-time argument (`choose_num_splits`: whole waves of programs, partial traffic
bounded against the KV bytes), so new batch sizes or cache capacities never recompile a kernel.

Batch-invariant variant (exact=True, `_exact_tree_attention_kernel`): the kernel above sums a node's cached keys and
its tree keys in separate passes, in tiles and splits that depend on T, so a tree step rounds differently from the
serial steps that would emit the same tokens, and in bf16 a near-tie can flip. The variant gives every node its own
program and walks its keys by absolute position, in tiles aligned at 0, taking each key from the cache or from the
node's ancestor at that depth: the same tiles, in the same order, whatever is cached and whatever else is in the tree.
Its twin, `tree_attention_ref.tree_attention(..., exact=True)`, is the engine's exact attention on a CPU.

Dtypes: fp32, fp16, bf16 (fp32 accumulation; fp16/bf16 tensor-core dots on the GPU, fp32 dots on
fp32 inputs and under the interpreter, whose bf16 arithmetic is broken). fp64 is refused with a
TypeError: use the twin, `tree_attention_ref.tree_attention` (the engine's CPU path), for fp64.

Its specification, `tree_attention_ref.py` beside it (torch only), holds the PyTorch twin and the input checks
imported below (so both reject the same inputs): copy the two files together.

Example (on CPU: call mtp_triton.use_interpreter() or set TRITON_INTERPRET=1 before importing this file):
    >>> B, T, Hq, Hkv, Dh, BS = 2, 3, 4, 2, 16, 16
    >>> q = torch.randn(B, T, Hq, Dh)
    >>> k_cache, v_cache = torch.randn(2, 4, BS, Hkv, Dh).unbind(0)
    >>> block_table = torch.tensor([[0, -1], [3, 2]], dtype=torch.int32)  # sequence 0 owns one block
    >>> cache_lens = torch.tensor([5, 17], dtype=torch.int32)
    >>> k_tree, v_tree = torch.randn(2, B, T, Hkv, Dh).unbind(0)
    >>> mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root with two children
    >>> out = tree_attention(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, mask)
    >>> out.shape
    torch.Size([2, 3, 4, 16])

    The root of sequence 0, query head 0 (KV head 0): its 5 cached tokens (block 0) and itself.
    >>> k = torch.cat([k_cache[0, :5, 0], k_tree[0, :1, 0]]); v = torch.cat([v_cache[0, :5, 0], v_tree[0, :1, 0]])
    >>> torch.allclose(out[0, 0, 0], torch.softmax(k @ q[0, 0, 0] / Dh ** 0.5, dim=0) @ v, atol=1e-5)
    True

    A sliding window of 2: the root sits at position 5 and sees position 4 and itself only.
    >>> out = tree_attention(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, mask, window=2)
    >>> torch.allclose(out[0, 0, 0], torch.softmax(k[4:] @ q[0, 0, 0] / Dh ** 0.5, dim=0) @ v[4:], atol=1e-5)
    True

    The split-KV count for Llama-2-7B at batch 1 (32 programs) on 132 SMs: 4 splits, 128 programs.
    >>> choose_num_splits(32, 132, 8192, 1, 32, 32, 128, torch.bfloat16, programs_per_sm=1)
    4
"""
import functools

import torch
import triton
import triton.language as tl

from .tree_attention_ref import check_tree_attention_inputs, check_window


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _online_softmax_update(acc, m_i, l_i, s, v, INPUT_PRECISION: tl.constexpr):
    """Fold one tile of scores into the running softmax (Milakov & Gimelshein 2018).

    s [M, N] scores in log2 units (already * sm_scale * log2(e), -inf where invisible); v [N, D];
    acc [M, D] = sum_j 2^(s_j - m) v_j; m_i [M] running max; l_i [M] = sum_j 2^(s_j - m).
    """
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)                      # rescale what was accumulated under the old max
    p = tl.exp2(s - m_new[:, None])                   # -inf -> 0
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, m_new, l_i


# Triton specialises integer arguments on == 1 and on divisibility by 16, one compiled variant each. The
# split count, the table width and the window change with batch size and cache capacity: not specialised,
# so those never recompile. T is (a constant T = 1 and aligned mask rows save 30-50 registers for the
# serial step and for trees of 16k nodes; at most three variants of T).
@triton.jit(do_not_specialize=["NB", "max_blocks", "window", "n_splits"],
            do_not_specialize_on_alignment=["NB", "max_blocks", "window", "n_splits"])
def _tree_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, cache_lens_ptr, k_tree_ptr, v_tree_ptr, mask_ptr,
    count_ptr,                                  # [B or 1, T] int32 |tree_mask row| = depth + 1 (window only)
    out_ptr, part_ptr, lse_ptr,
    T, Hq, Hkv, Dh, NB, max_blocks, qk_scale, window, n_splits,
    stride_qb, stride_qt, stride_qh,            # q / out [B, T, Hq, Dh] (last stride 1)
    stride_cn, stride_cs, stride_ch,            # k_cache / v_cache [NB, BS, Hkv, Dh]
    stride_tb, stride_tt, stride_th,            # k_tree / v_tree [B, T, Hkv, Dh]
    stride_mb, stride_cb,                       # tree mask [B or 1, T, T] as bytes, counts (0 when shared)
    G: tl.constexpr, BS: tl.constexpr, SPLIT: tl.constexpr,   # SPLIT: write partials (n_splits > 1)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_WINDOW: tl.constexpr,
):
    pid_m = tl.program_id(0)                    # query tile over the G * T rows of one KV head
    pid_bh = tl.program_id(1).to(tl.int64)      # (sequence, KV head)
    pid_s = tl.program_id(2)                    # KV split
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv

    # rows of this tile: row r is tree node r // G seen by query head kvh * G + r % G
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                        # [M]
    row_ok = rows < G * T
    t = rows // G                                                         # [M] tree node of each row
    h = kvh * G + rows % G                                                # [M] query head of each row
    d = tl.arange(0, BLOCK_D)                                             # [D] padded head dim
    d_ok = d < Dh
    q_off = b * stride_qb + t.to(tl.int64) * stride_qt + h * stride_qh    # [M]
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(COMPUTE_DTYPE)                                               # [M, D]

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)   # finite start: a fully masked tile gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    last_node = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, T - 1)
    n_cached = tl.load(cache_lens_ptr + b)
    mask_row = mask_ptr + b * stride_mb + t[:, None] * T                  # [M, 1] this row's mask row

    # ---- 0. sliding window: the depth of each row's node, and the oldest cache tile any row can see --------
    lo = 0                                                                # first cache position read
    tree_lo = 0                                                           # first tree key read
    if USE_WINDOW:
        depth = tl.load(count_ptr + b * stride_cb + t, mask=row_ok, other=1) - 1      # [M] |mask row| - 1
        pos_i = n_cached + depth                                          # [M] position of each row's node
        min_depth = tl.min(tl.where(row_ok, depth, T), axis=0)
        # row i sees cache positions >= pos_i - W + 1; the shallowest row reaches back furthest
        lo_seen = tl.maximum(n_cached + min_depth - window + 1, 0)
        lo = lo_seen // BLOCK_N * BLOCK_N
        # tree key a is visible only if depth_a > depth_i - W, and depth_a <= a (a lower-triangular row a
        # holds at most a + 1 nodes): keys before min depth - W + 1 are never visible
        tree_lo = tl.maximum(min_depth - window + 1, 0) // BLOCK_N * BLOCK_N

    # ---- 1. the paged cache [lo, n_cached): all of it visible to every node, or the window's part ---------
    span = tl.maximum(n_cached - lo, 0)
    chunk = tl.cdiv(tl.cdiv(span, n_splits), BLOCK_N) * BLOCK_N          # this sequence's split size
    start = lo + pid_s * chunk
    end = tl.minimum(start + chunk, n_cached)
    for start_n in range(start, end, BLOCK_N):
        pos = start_n + tl.arange(0, BLOCK_N)                             # [N] token positions
        pos_ok = pos < end
        if USE_WINDOW:
            pos_ok = pos_ok & (pos >= lo_seen)                            # older positions: not even loaded
        col = pos // BS                                                   # [N] block-table column
        blk = tl.load(block_table_ptr + b * max_blocks + col, mask=pos_ok & (col < max_blocks), other=-1)
        pos_ok = pos_ok & (blk >= 0) & (blk < NB)     # unchecked tables: a bad entry is skipped, never followed
        blk = blk.to(tl.int64)
        kv_off = blk * stride_cn + (pos % BS) * stride_cs + kvh * stride_ch          # [N]
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale        # [M, N]
        vis = pos_ok[None, :]
        if USE_WINDOW:
            vis = vis & (pos_i[:, None] - pos[None, :] < window)                       # [M, N]
        s = tl.where(vis, s, float("-inf"))
        acc, m_i, l_i = _online_softmax_update(acc, m_i, l_i, s, v, INPUT_PRECISION)

    # ---- 2. the tree, under the ancestor mask (last split only) ------------------------------------------
    # the mask is lower-triangular, so keys after the tile's last node are never visible: stop there
    tree_end = tl.where(pid_s == n_splits - 1, last_node + 1, 0)
    for start_j in range(tree_lo, tree_end, BLOCK_N):
        j = start_j + tl.arange(0, BLOCK_N)                               # [N] tree nodes
        j_ok = j < T
        kv_off = b * stride_tb + j.to(tl.int64) * stride_tt + kvh * stride_th
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_tree_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
        v = tl.load(v_tree_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
        vis = tl.load(mask_row + j[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0) != 0   # [M, N]
        if USE_WINDOW:
            depth_j = tl.load(count_ptr + b * stride_cb + j, mask=j_ok, other=1) - 1  # [N] key depths
            vis = vis & (depth[:, None] - depth_j[None, :] < window)          # p_i - p_a < W
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        s = tl.where(vis, s, float("-inf"))
        acc, m_i, l_i = _online_softmax_update(acc, m_i, l_i, s, v, INPUT_PRECISION)

    # ---- 3. normalise and store ---------------------------------------------------------------------------
    l_safe = tl.where(l_i > 0, l_i, 1.0)        # l = 0 only for padding rows or an empty split
    o = acc / l_safe[:, None]
    o_mask = row_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        tl.store(out_ptr + q_off[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # partials [n_splits, B, T, Hq, Dh] fp32 and their log2-sum-exp [n_splits, B, T, Hq]
        n_seq = tl.num_programs(1) // Hkv
        r = ((pid_s * n_seq + b) * T + t) * Hq + h                       # [M] row in the partials
        tl.store(part_ptr + r[:, None] * Dh + d[None, :], o, mask=o_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + r, lse, mask=row_ok)


@triton.jit(do_not_specialize=["R", "n_splits"], do_not_specialize_on_alignment=["R", "n_splits"])
def _combine_splits_kernel(part_ptr, lse_ptr, out_ptr, R, Dh, n_splits, MAX_SPLITS: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """out[r] = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse); one program per output row.

    n_splits (runtime) <= MAX_SPLITS, a power of two: one compiled variant per bucket 2, 4, ..., 32.
    """
    r = tl.program_id(0).to(tl.int64)           # row (b, t, h) of out [B, T, Hq, Dh]
    s = tl.arange(0, MAX_SPLITS)
    s_ok = s < n_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < Dh
    lse = tl.load(lse_ptr + s * R + r, mask=s_ok, other=float("-inf"))   # [S]; the last split is finite
    w = tl.exp2(lse - tl.max(lse, axis=0))                                # empty splits -> 0
    o = tl.load(part_ptr + (s * R + r)[:, None] * Dh + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + r * Dh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


# ----------------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------------
# The batch-invariant variant (exact=True). Nothing here depends on the tree's size or on which keys are cached: one
# program per (node, KV head), keys in tiles of BLOCK_N positions aligned at position 0, each key loaded from the cache
# or from the node's ancestor at that depth, no split-KV. T is not specialised, so a serial step (T = 1) runs the very
# kernel a tree step runs.
@triton.jit(do_not_specialize=["T", "NB", "max_blocks", "window"],
            do_not_specialize_on_alignment=["T", "NB", "max_blocks", "window"])
def _exact_tree_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, cache_lens_ptr, k_tree_ptr, v_tree_ptr,
    anc_ptr,                                    # [B, T, T] int32: anc[b, i, d] = node i's ancestor at depth d
    depth_ptr,                                  # [B, T] int32: each node's depth
    out_ptr,
    T, Hq, Hkv, Dh, NB, max_blocks, qk_scale, window,
    stride_qb, stride_qt, stride_qh,            # q / out [B, T, Hq, Dh] (last stride 1)
    stride_cn, stride_cs, stride_ch,            # k_cache / v_cache [NB, BS, Hkv, Dh]
    stride_tb, stride_tt, stride_th,            # k_tree / v_tree [B, T, Hkv, Dh]
    G: tl.constexpr, BS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_WINDOW: tl.constexpr,
):
    node = tl.program_id(0).to(tl.int64)        # b * T + i
    kvh = tl.program_id(1).to(tl.int64)         # KV head
    b = node // T
    g = tl.arange(0, BLOCK_G)                                             # [G] the KV head's query heads
    g_ok = g < G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < Dh
    q_off = b * stride_qb + (node % T) * stride_qt + (kvh * G + g) * stride_qh      # [G]
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(COMPUTE_DTYPE)                                               # [G, D]
    n_cached = tl.load(cache_lens_ptr + b)
    pos_i = n_cached + tl.load(depth_ptr + node)                          # this node's position
    lo = 0
    if USE_WINDOW:                                                        # tile-aligned: the same tiles either way
        lo = tl.maximum(pos_i - window + 1, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, pos_i + 1, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)                               # [N] absolute positions
        col = pos // BS
        blk = tl.load(block_table_ptr + b * max_blocks + col, mask=(pos < n_cached) & (col < max_blocks), other=-1)
        cached = (pos < n_cached) & (blk >= 0) & (blk < NB)   # unchecked tables: a bad entry is skipped
        in_tree = (pos >= n_cached) & (pos <= pos_i)                      # the ancestor at depth pos - n_cached
        if USE_WINDOW:                                                    # outside the window: not even loaded
            cached = cached & (pos_i - pos < window)
            in_tree = in_tree & (pos_i - pos < window)
        anc = tl.load(anc_ptr + node * T + (pos - n_cached), mask=in_tree, other=0)
        c_off = blk.to(tl.int64) * stride_cn + (pos % BS) * stride_cs + kvh * stride_ch      # [N]
        t_off = b * stride_tb + anc.to(tl.int64) * stride_tt + kvh * stride_th               # [N]
        cm = cached[:, None] & d_ok[None, :]
        tm = in_tree[:, None] & d_ok[None, :]
        k = tl.where(cm, tl.load(k_cache_ptr + c_off[:, None] + d[None, :], mask=cm, other=0.0),
                     tl.load(k_tree_ptr + t_off[:, None] + d[None, :], mask=tm, other=0.0)).to(COMPUTE_DTYPE)
        v = tl.where(cm, tl.load(v_cache_ptr + c_off[:, None] + d[None, :], mask=cm, other=0.0),
                     tl.load(v_tree_ptr + t_off[:, None] + d[None, :], mask=tm, other=0.0)).to(COMPUTE_DTYPE)
        vis = cached | in_tree
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale        # [G, N]
        s = tl.where(vis[None, :], s, float("-inf"))
        acc, m_i, l_i = _online_softmax_update(acc, m_i, l_i, s, v, INPUT_PRECISION)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]                        # the node itself is always visible
    tl.store(out_ptr + q_off[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


_COMPUTE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _interpreting():
    """True when these kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import time)."""
    return type(_tree_attention_kernel).__name__ == "InterpretedFunction"


@functools.lru_cache(maxsize=None)
def _num_sms(device_index):
    """SM count of a CUDA device (a host-side property: no sync)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


MAX_NUM_SPLITS = 32      # split counts run 1..32; the combine kernel compiles once per power-of-two bucket
MIN_SPLIT_TOKENS = 128   # two 64-key tiles per split, so one tile's loads can overlap the other's dots
MAX_PARTIAL_FRACTION = 0.25
SPLIT_TOLERANCE = 0.1


def choose_num_splits(programs, num_sms, capacity, T, Hq, Hkv, Dh, dtype, *, programs_per_sm=2,
                      min_split_tokens=MIN_SPLIT_TOKENS, max_partial_fraction=MAX_PARTIAL_FRACTION,
                      tolerance=SPLIT_TOLERANCE, max_splits=MAX_NUM_SPLITS):
    """Split-KV count S for a grid of `programs` (query tiles x sequences x KV heads) on `num_sms` SMs.

    Occupancy model: programs run in waves of k * SMs (k = programs_per_sm resident at once, set by their
    registers and shared memory), and the programs in flight share the HBM stream. S splits make P * S
    programs with 1/S of the cache each, so in bytes at full bandwidth, per sequence,
        cost(S) = KV * k*SMs * ceil(P*S / (k*SMs)) / (P*S)  +  partials(S)
        KV = capacity * Hkv * Dh * 2 * elem (K and V);  partials(S) = S * T * Hq * (Dh + 1) * 4 * 2
    (fp32 partial outputs and log-sum-exps, written, then read by the combine; 0 for S = 1). The first
    factor is 1 for whole waves and k*SMs / (P*S) for a partly idle GPU. Admissible S:
      * P < k * SMs: a grid that already fills a wave is not split;
      * capacity / S >= min_split_tokens: shorter splits have no second tile to pipeline;
      * partials(S) <= max_partial_fraction * KV: the model charges idle SMs their full share of bandwidth,
        but one SM can stream more than that, so the sure extra traffic is capped;
      * S <= max_splits.
    Returns the fewest splits whose cost is within `tolerance` of the cheapest admissible one: more
    programs, partials and combine work than that buy less than the model can resolve.
    capacity: the block table's width in tokens (an upper bound on cache_lens known without a host sync;
    the window + one tile when a sliding window is shorter). dtype: of the cache (its element size).
    Pure (no device queries), so tests and audits can call it.
    """
    if programs < 1 or num_sms < 1 or programs_per_sm < 1:
        raise ValueError(f"choose_num_splits: programs ({programs}), num_sms ({num_sms}) and programs_per_sm "
                         f"({programs_per_sm}) must be >= 1")
    wave = programs_per_sm * num_sms
    if programs >= wave:
        return 1
    kv = capacity * Hkv * Dh * 2 * dtype.itemsize
    costs = {1: kv * wave / programs}
    for S in range(2, max_splits + 1):
        partials = S * T * Hq * (Dh + 1) * 4 * 2
        if capacity < S * min_split_tokens or partials > max_partial_fraction * kv:
            break                                           # both bounds only tighten as S grows
        costs[S] = kv * wave * triton.cdiv(programs * S, wave) / (programs * S) + partials
    best = min(costs.values())
    return min(S for S, c in costs.items() if c <= (1 + tolerance) * best)


def split_bucket(num_splits):
    """MAX_SPLITS constexpr of the combine kernel for a split count: the next power of two (>= 2)."""
    return max(2, triton.next_power_of_2(num_splits))


# programs of each query-tile size that fit on one SM at once (registers x threads <= 64K, shared memory),
# read off ahead-of-time compiles for sm_90 and sm_80 (bf16, Dh 128; see `_tiles`)
_PROGRAMS_PER_SM = {16: 3, 32: 2, 64: 1}


def _tiles(rows, interp, major=None, window=False):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, programs per SM) for G * T = rows query rows per KV head, on a
    GPU of compute capability `major`.x (None: the interpreter, or no target-specific choice); `window`: the
    sliding-window variant (USE_WINDOW).

    GPU dots need every dim >= 16. Register budget (the repository's ahead-of-time compile audit of the Llama-2-7B /
    Llama-3-8B bf16 launches): 64-row tiles at 4 warps reach the 255-register cap and spill on sm_80, so they run 8
    warps (no spills on sm_80 or sm_90); 16- and 32-row tiles fit in 4 warps; the window variant adds a few
    registers. sm_100, window variant, 64-row tiles: 32-key tiles and 3 stages, since 64-key tiles and 2 stages
    spill under ptxas-blackwell's 128-register allocation, and 32 x 3 keeps the same bytes in flight.
    """
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    block_n, num_stages = (32 if interp else 64), 2
    if major == 10 and window and block_m == 64:
        block_n, num_stages = 32, 3
    return block_m, block_n, 8 if block_m == 64 else 4, num_stages, _PROGRAMS_PER_SM[block_m]


def _tree_attention(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, tree_mask, sm_scale=None,
                    num_splits=None, block_m=None, block_n=None, check_values=True, window=None, exact=False):
    """`tree_attention` with the tuning knobs exposed (tests force split-KV and small tiles through these)."""
    check_tree_attention_inputs(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, tree_mask,
                                values=check_values, window=window)
    window = check_window(window)
    if q.dtype not in _COMPUTE:
        raise TypeError(f"tree_attention (Triton): dtype {q.dtype} is not supported; use fp32, fp16 or bf16 "
                        "(its PyTorch twin, mtp_triton.reference.tree_attention, handles fp64)")
    if q.device.type != "cuda" and not _interpreting():
        raise RuntimeError("tree_attention (Triton): tensors must be on a CUDA device, or run the kernels in "
                           "Triton's interpreter: call mtp_triton.use_interpreter() (or set TRITON_INTERPRET=1) "
                           "before importing them")
    B, T, Hq, Dh = q.shape
    _, BS, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    scale = Dh ** -0.5 if sm_scale is None else float(sm_scale)
    interp = _interpreting()

    if exact:
        return _exact_tree_attention(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, tree_mask, scale,
                                     window, block_n or 32, interp)

    # tiles: the G * T rows of one KV head in query tiles of BLOCK_M
    major = None if interp else torch.cuda.get_device_capability(q.device)[0]
    auto_m, auto_n, num_warps, num_stages, per_sm = _tiles(G * T, interp, major, window is not None)
    block_m, block_n = block_m or auto_m, block_n or auto_n
    block_d = max(16, triton.next_power_of_2(Dh))
    num_m = triton.cdiv(G * T, block_m)
    if num_splits is None:
        # from shapes only (no host sync, CUDA-graph safe): the table's width bounds every cache_len, and
        # a shorter window bounds the range a program reads; the interpreter runs one split
        capacity = block_table.shape[1] * BS
        if window is not None:
            capacity = min(capacity, window + block_n)      # + one tile: the range starts tile-aligned
        num_splits = 1
        if not interp:
            sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
            num_splits = choose_num_splits(num_m * B * Hkv, sms, capacity, T, Hq, Hkv, Dh, k_cache.dtype,
                                           programs_per_sm=per_sm)
    if not 1 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"tree_attention: num_splits must be in [1, {MAX_NUM_SPLITS}], got {num_splits}")

    # the mask as bytes, [T, T] shared by the batch (batch stride 0) or [B, T, T]
    mask = tree_mask.contiguous().view(torch.uint8)
    stride_mb = 0 if mask.dim() == 2 else T * T
    # with a window: depth + 1 of every node, one reduction on the device (no sync; the kernel would
    # otherwise re-count every key's mask row in every program)
    counts = tree_mask.sum(-1, dtype=torch.int32) if window is not None else cache_lens   # [B or 1, T]
    stride_cb = 0 if mask.dim() == 2 else T
    # fp32 inputs: exact fp32 dots (tf32 would cost ~1e-3 relative error); interpreter: fp32 (bf16 math broken)
    compute = tl.float32 if interp else _COMPUTE[q.dtype]
    precision = "ieee" if compute == tl.float32 else "tf32"

    out = torch.empty_like(q)
    if num_splits > 1:
        part = torch.empty(num_splits, B, T, Hq, Dh, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_splits, B, T, Hq, dtype=torch.float32, device=q.device)
    else:
        part = lse = out                        # unused
    grid = (num_m, B * Hkv, num_splits)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, mask, counts, out, part, lse,
        T, Hq, Hkv, Dh, k_cache.shape[0], block_table.shape[1], scale * 1.4426950408889634,   # log2(e): base 2
        window or 0, num_splits,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_tree.stride(0), k_tree.stride(1), k_tree.stride(2),
        stride_mb, stride_cb,
        G=G, BS=BS, SPLIT=num_splits > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        COMPUTE_DTYPE=compute, INPUT_PRECISION=precision, USE_WINDOW=window is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        R = B * T * Hq
        _combine_splits_kernel[(R,)](part, lse, out, R, Dh, num_splits, MAX_SPLITS=split_bucket(num_splits),
                                     BLOCK_D=block_d)
    return out


def _exact_tree_attention(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, tree_mask, scale, window,
                          block_n, interp):
    """The exact=True launch: each node's depth and its ancestor at every depth, computed on the device (no host
    sync, CUDA-graph safe), then one program per (node, KV head)."""
    B, T, Hq, Dh = q.shape
    _, BS, Hkv, _ = k_cache.shape
    mask = tree_mask.expand(B, T, T)
    depth = (mask.sum(-1, dtype=torch.int32) - 1).contiguous()                   # [B, T]
    # the k-th visible node of row i is its ancestor at depth k (parents precede children)
    rank = torch.cumsum(mask, -1) - 1                                            # [B, T, T] int64
    anc = mask.new_zeros((B, T, T + 1), dtype=torch.int32)                       # [..., T]: the unused slot
    nodes = torch.ones_like(mask, dtype=torch.int32).cumsum(-1, dtype=torch.int32) - 1   # [B, T, T]: j at [b, i, j]
    anc.scatter_(2, rank.masked_fill(mask.logical_not(), T), nodes)
    anc = anc.narrow(2, 0, T).reshape(-1)                                        # [B T T] (a copy)
    compute = tl.float32 if interp else _COMPUTE[q.dtype]
    out = torch.empty_like(q)
    _exact_tree_attention_kernel[(B * T, Hkv)](
        q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, anc, depth, out,
        T, Hq, Hkv, Dh, k_cache.shape[0], block_table.shape[1], scale * 1.4426950408889634, window or 0,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_tree.stride(0), k_tree.stride(1), k_tree.stride(2),
        G=Hq // Hkv, BS=BS, BLOCK_G=max(16, triton.next_power_of_2(Hq // Hkv)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(Dh)), COMPUTE_DTYPE=compute,
        INPUT_PRECISION="ieee" if compute == tl.float32 else "tf32", USE_WINDOW=window is not None,
        num_warps=4, num_stages=2,
    )
    return out


def tree_attention(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, tree_mask, sm_scale=None, *,
                   window=None, check_values=True, exact=False):
    """Attention of T tree nodes over a paged cache plus the tree itself (Triton): `tree_attention_ref.tree_attention`
    (the math, shapes, window and exact=True are stated there), on the GPU. fp32 / fp16 / bf16; fp64 raises TypeError.
    Cache tiles outside every row's window are not read. The split-KV count comes from `choose_num_splits` (grid
    size, SM count, the block table's capacity: no host sync, and a run-time argument, so new batch sizes and
    capacities do not recompile). exact=True: one program per (node, KV head), keys in tiles aligned at position 0,
    each read from the cache or from the node's ancestor at that depth, no split-KV. The price: a tree of T nodes
    reads the cache T times (from L2 where it fits), and batch 1 at a long context runs on few SMs.
    check_values=False skips the checks that read tensor values (mask structure, cache lengths, block ids: host
    syncs on a GPU); shapes, dtypes and devices are always checked. For callers that built the inputs themselves
    (the engine's hot loop). With bad values this kernel
      * leaves out of the softmax every cached position whose block-table entry is not a block id in
        [0, NB) (-1: no block) or lies past the table's width: silently wrong output, but nothing outside
        the cache is read;
      * reads an entry naming another sequence's block as this sequence's (silently wrong output).
    Other bad values (a mask that is not reflexive and lower-triangular, negative cache_lens) give undefined output,
    still without out-of-bounds reads.
    """
    return _tree_attention(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, tree_mask, sm_scale,
                           check_values=check_values, window=window, exact=exact)
