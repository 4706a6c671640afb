"""Tiled KV append into the paged cache, all layers in one launch — Triton.

After a tree-verification step the K/V of every tree node sit in a scratch buffer
``k_tree[l, b, node]``; the root and the accepted nodes (scattered in that buffer, e.g. nodes
0, 2, 7, 19) must become the dense tail of sequence b's cache, positions cache_len .. cache_len + a.

    for every layer l, sequence b and j = 0..accept_len[b]:
        pos = cache_lens[b] + j
        k_cache[l, block_table[b, pos // BS], pos % BS] = k_tree[l, b, accept_nodes[b, j]]    (and V)

Bytes: 2 (K, V) x L x sum_b(accept_len[b] + 1) x Hkv x Dh x elt read, the same written. For Llama-7B
(L 32, Hkv 32, Dh 128, bf16) that is 512 KiB read + 512 KiB written per appended token: a few
microseconds of HBM time. A per-layer PyTorch loop instead pays ~2 x L kernel launches (plus the
index math); this kernel does the whole step in ONE launch.

Tiling: one program per (layer, row chunk, accepted token j, sequence b). The [Hkv, Dh] row of one token
is contiguous in both the tree buffer and the cache (only the token -> slot map is indirect), so a
program copies a flat chunk of BLOCK elements of that row for K and V with wide, fully coalesced
loads/stores. Programs with j > accept_len[b] exit at once, so sequences can accept different counts.
Offsets are int64 (a cache can exceed 2**31 elements).

Its specification, `kv_append_ref.py` beside it (torch only), holds the PyTorch twin and the input checks
imported below (so both reject the same inputs): copy the two files together.

Example (on CPU: call mtp_triton.use_interpreter() or set TRITON_INTERPRET=1 before importing this file):
    >>> L, NB, BS, Hkv, Dh, B, T = 2, 8, 4, 2, 24, 2, 5
    >>> k_cache = torch.zeros(L, NB, BS, Hkv, Dh); v_cache = torch.zeros_like(k_cache)
    >>> k_tree = torch.randn(L, B, T, Hkv, Dh); v_tree = torch.randn_like(k_tree)
    >>> block_table = torch.tensor([[5, 2, -1], [0, 3, 1]], dtype=torch.int32)   # -1: no block
    >>> cache_lens = torch.tensor([3, 6], dtype=torch.int32)           # seq 0 crosses into block 2
    >>> accept_nodes = torch.tensor([[0, 2, 4, -1, -1], [0, -1, -1, -1, -1]])
    >>> accept_len = torch.tensor([2, 0])
    >>> kv_append(k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, accept_nodes, accept_len)
    >>> bool((k_cache[:, 2, 0] == k_tree[:, 0, 2]).all())             # seq 0, j = 1 -> pos 4 = block 2, slot 0
    True

    Sequence 0 owns 2 blocks (8 tokens): appending 3 tokens at position 7 would need a third.
    >>> kv_append(k_cache, v_cache, block_table, torch.tensor([7, 6], dtype=torch.int32), k_tree, v_tree,
    ...           accept_nodes, accept_len)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: kv_append: block_table entries in use must be in [0, 8): block_table[0, 2] = -1, but sequence 0 ...
"""
import torch
import triton
import triton.language as tl

from .kv_append_ref import check_kv_append_inputs


# batch size and cache size change between runs: not specialised on == 1 / divisibility by 16 (no recompiles)
@triton.jit(do_not_specialize=["B", "NB", "max_blocks"],
            do_not_specialize_on_alignment=["B", "NB", "max_blocks"])   # value (== 1) and alignment (% 16)
def _kv_append_kernel(
    k_cache_ptr, v_cache_ptr,        # [L, NB, BS, Hkv, Dh]  ROW = Hkv * Dh contiguous elements per slot
    k_tree_ptr, v_tree_ptr,          # [L, B, T, Hkv, Dh]
    block_table_ptr,                 # [B, max_blocks] int32
    cache_lens_ptr,                  # [B] int32
    accept_nodes_ptr,                # [B, T] int64
    accept_len_ptr,                  # [B] int64
    B, T, NB, max_blocks, ROW, N_CHUNKS,
    BS: tl.constexpr,                # tokens per cache block
    BLOCK: tl.constexpr,             # elements of a row one program copies (power of two)
):
    pid_lc = tl.program_id(0).to(tl.int64)     # layer * N_CHUNKS + chunk
    j = tl.program_id(1).to(tl.int64)          # j-th token written for this sequence (0 = root)
    b = tl.program_id(2).to(tl.int64)          # sequence
    n_acc = tl.load(accept_len_ptr + b)        # accepted drafts: tokens j = 0..n_acc are written
    if j > n_acc:
        return
    layer = pid_lc // N_CHUNKS
    chunk = pid_lc % N_CHUNKS

    # where the token comes from: node accept_nodes[b, j] of the tree buffer
    node = tl.load(accept_nodes_ptr + b * T + j)
    src = ((layer * B + b) * T + node) * ROW                              # int64 element offset
    # where it goes: position pos of sequence b -> block block_table[b, pos // BS], slot pos % BS
    pos = tl.load(cache_lens_ptr + b).to(tl.int64) + j
    col = pos // BS
    blk = tl.load(block_table_ptr + b * max_blocks + col, mask=(pos >= 0) & (col < max_blocks), other=-1)
    blk = blk.to(tl.int64)
    # unchecked inputs (check_values=False): a token with no valid block or node is dropped, so nothing
    # outside the cache and the tree buffers is ever touched
    if (blk < 0) | (blk >= NB) | (node < 0) | (node >= T):
        return
    dst = ((layer * NB + blk) * BS + pos % BS) * ROW

    offs = chunk * BLOCK + tl.arange(0, BLOCK)                           # [BLOCK] within the [Hkv*Dh] row
    mask = offs < ROW                                                    # ROW need not be a power of two
    k = tl.load(k_tree_ptr + src + offs, mask=mask)
    v = tl.load(v_tree_ptr + src + offs, mask=mask)
    tl.store(k_cache_ptr + dst + offs, k, mask=mask)
    tl.store(v_cache_ptr + dst + offs, v, mask=mask)


def _interpreting():
    """True when this kernel was built for Triton's interpreter (TRITON_INTERPRET=1 at import time)."""
    return type(_kv_append_kernel).__name__ == "InterpretedFunction"


MAX_BLOCK = 2048   # elements per program: 2048 bf16 = 4 KiB of K plus 4 KiB of V, 16 B per thread-load


def _launch_kv_append(k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, accept_nodes, accept_len,
                      max_tokens, block=None):
    """Launch only (no input checks): for callers that validated once and know a bound on the tokens.

    max_tokens: an upper bound on accept_len + 1 over the batch (e.g. tree depth + 1, or T); it sets the
    grid's token axis, programs beyond a sequence's own accept_len exit at once. block: elements per program
    (power of two, default min(next_pow2(Hkv * Dh), MAX_BLOCK)); tests set it small to exercise chunking.
    """
    L, NB, BS, Hkv, Dh = k_cache.shape
    B, T = k_tree.shape[1], k_tree.shape[2]
    ROW = Hkv * Dh
    if B == 0 or max_tokens <= 0 or L == 0 or ROW == 0:
        return
    if k_cache.device.type != "cuda" and not _interpreting():
        raise RuntimeError("kv_append (Triton): tensors must be on a CUDA device, or run the kernels in Triton's "
                           "interpreter: call mtp_triton.use_interpreter() (or set TRITON_INTERPRET=1) before "
                           "importing them")
    BLOCK = block or min(triton.next_power_of_2(ROW), MAX_BLOCK)
    n_chunks = triton.cdiv(ROW, BLOCK)
    if max_tokens > 65535 or B > 65535:
        raise ValueError(f"kv_append: grid axes 1/2 are limited to 65535 (tokens {max_tokens}, batch {B})")
    grid = (L * n_chunks, max_tokens, B)
    _kv_append_kernel[grid](
        k_cache, v_cache, k_tree, v_tree, block_table, cache_lens, accept_nodes, accept_len,
        B, T, NB, block_table.shape[1], ROW, n_chunks,
        BS=BS, BLOCK=BLOCK, num_warps=max(1, min(8, BLOCK // 256)),
    )


def kv_append(k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, accept_nodes, accept_len, *,
              check_values=True):
    """Copy the root's and accepted nodes' K/V into the paged cache, every layer, in place — ONE launch.

    For layer l, sequence b and j = 0..accept_len[b]: node n = accept_nodes[b, j] goes to position
    pos = cache_lens[b] + j, i.e. block block_table[b, pos // BS], slot pos % BS.
    k_cache, v_cache [L, NB, BS, Hkv, Dh]; k_tree, v_tree [L, B, T, Hkv, Dh] (any one dtype: a pure copy);
    block_table [B, max_blocks] int32; cache_lens [B] int32 (not changed); accept_nodes [B, T] int64;
    accept_len [B] int64. Returns None. Same signature and checks as ``kv_append_ref.kv_append``.
    The checks cost one host sync; ``_launch_kv_append`` skips them.

    check_values=False (or ``_launch_kv_append``) trusts the values; with bad ones this kernel
      * drops a token whose block-table entry is not a block id in [0, NB) (-1: the sequence has no block
        there), whose column is past the table's width, or whose node id is outside [0, T): nothing is
        stored for it, and nothing outside the cache is written;
      * writes a token whose entry names another sequence's block (or a block two sequences share) into
        that block, overwriting the other sequence's K/V without a word.
    The twin raises IndexError in the first case (on CPU; on CUDA a device-side assert) and overwrites
    like the kernel in the second. Only check_values=True refuses both.
    """
    n_tok = check_kv_append_inputs(k_cache, v_cache, block_table, cache_lens, k_tree, v_tree,
                                   accept_nodes, accept_len, values=check_values)
    _launch_kv_append(k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, accept_nodes, accept_len,
                      max_tokens=n_tok)
