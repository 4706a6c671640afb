"""The specification of `tree_attention.py`: its PyTorch twin (`tree_attention`, same signature, same function of the
inputs up to rounding) and the input checks both share. Torch only; the kernel file imports its checks from here, so
copy the two files together.

exact=False, the twin of `_tree_attention_kernel`: the kernel's math, materialised. Each sequence's cache is gathered
through its block table, and a [T, n + T] visibility bias (0 or -inf: the cache, the ancestors, the window) goes into
one `scaled_dot_product_attention`, in fp32 (fp64 stays fp64, so parity tests against transformers can be exact).

exact=True, the twin of `_exact_tree_attention_kernel`: batch-invariant attention. Greedy bf16 MTP emits the serial
tokens only if every accepted node's logits have the bits serial decoding computes there, yet a tree step takes a
node's ancestors from the tree where serial steps take them from the cache, and any change in the order of a sum
can flip a bf16 near-tie. So, like the kernel, every sum follows absolute token positions (Thinking Machines,
"Defeating Nondeterminism in LLM Inference", 2025): keys come in chunks of CHUNK positions aligned at 0, each from
the cache or from the node's ancestor at that depth; scores are matmul outputs (a row's bits do not depend on the
call: `invariant.row_invariance` checks it), p = exp(s * scale - max) is rounded to the input dtype; each chunk's
sum_j p_j v_j is one matmul over its positions and sum_j p_j one fixed pairwise sum (`chunk_sum`); the chunks add up
in position order (an fp64 cumsum), and those a node cannot see add exact zeros. The kernel folds its tiles into an
online softmax instead: each is batch-invariant with itself, and the two round differently (bf16-accurate).
`plan` lays a step out: chunks below the earliest tree position are computed for all nodes at once ("shared"), the
last one or two per node ("tail": the chunk's cached keys, then the node's ancestors by depth); a one-node step takes
all its keys as its tail. Every layer of a step reads the same layout, so the engine plans a step once (`plan`,
`plain_plan`) and calls `attention` / `plain_attention` per layer; the public `tree_attention` plans every call.
"""
import numbers
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

CHUNK = 32


def check_window(window):
    """window: None (no limit) or an int >= 1 (a Python or NumPy integer; bool is refused). Returns it as int."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, numbers.Integral):
        raise TypeError(f"tree_attention: window must be None or an int >= 1, got {type(window).__name__}")
    if window < 1:
        raise ValueError(f"tree_attention: window must be >= 1 (or None for no limit), got {window}")
    return int(window)


def check_tree_attention_inputs(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, tree_mask,
                                values=True, window=None):
    """Validate ``tree_attention`` arguments (shapes, dtypes, devices, and the mask/table values).

    q [B, T, Hq, Dh]; k_cache, v_cache [NB, BS, Hkv, Dh]; block_table [B, max_blocks] int32;
    cache_lens [B] int32; k_tree, v_tree [B, T, Hkv, Dh]; tree_mask [T, T] or [B, T, T] bool;
    window None or an int >= 1 (always checked). The block table must hold room for cache_lens + T tokens
    (the step appends up to T). Entries in use, the first ceil(cache_lens[b] / BS) of row b (the blocks
    read), must be block ids in [0, NB), none used twice; unused entries are -1 (any value is ignored).
    Returns the mask expanded to [B, T, T].
    """
    check_window(window)
    named = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, cache_lens=cache_lens,
                 k_tree=k_tree, v_tree=v_tree, tree_mask=tree_mask)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tree_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise ValueError(f"tree_attention: all tensors must be on one device, got {sorted(map(str, devices))}")
    if q.dim() != 4:
        raise ValueError(f"tree_attention: q must be [B, T, Hq, Dh], got {tuple(q.shape)}")
    B, T, Hq, Dh = q.shape
    if B < 1 or T < 1:
        raise ValueError(f"tree_attention: empty batch or tree (B={B}, T={T})")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"tree_attention: k_cache/v_cache must both be [NB, BS, Hkv, Dh], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    NB, BS, Hkv, Dh_c = k_cache.shape
    if Dh_c != Dh:
        raise ValueError(f"tree_attention: head dim of q ({Dh}) and cache ({Dh_c}) differ")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"tree_attention: Hq ({Hq}) must be a multiple of Hkv ({Hkv}) (GQA)")
    if tuple(k_tree.shape) != (B, T, Hkv, Dh) or k_tree.shape != v_tree.shape:
        raise ValueError(f"tree_attention: k_tree/v_tree must be [{B}, {T}, {Hkv}, {Dh}], got "
                         f"{tuple(k_tree.shape)} and {tuple(v_tree.shape)}")
    if not q.is_floating_point() or len({q.dtype, k_cache.dtype, v_cache.dtype, k_tree.dtype, v_tree.dtype}) != 1:
        raise TypeError("tree_attention: q, k_cache, v_cache, k_tree, v_tree must share one floating dtype, got "
                        f"{[str(t.dtype) for t in (q, k_cache, v_cache, k_tree, v_tree)]}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype != torch.int32:
        raise ValueError(f"tree_attention: block_table must be int32 [{B}, max_blocks], got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if tuple(cache_lens.shape) != (B,) or cache_lens.dtype != torch.int32:
        raise ValueError(f"tree_attention: cache_lens must be int32 [{B}], got {cache_lens.dtype} "
                         f"{tuple(cache_lens.shape)}")
    if tree_mask.dtype != torch.bool or tree_mask.shape[-2:] != (T, T) or tree_mask.dim() not in (2, 3) or (
            tree_mask.dim() == 3 and tree_mask.shape[0] != B):
        raise ValueError(f"tree_attention: tree_mask must be bool [{T}, {T}] or [{B}, {T}, {T}], got "
                         f"{tree_mask.dtype} {tuple(tree_mask.shape)}")
    for name in ("q", "k_cache", "v_cache", "k_tree", "v_tree", "block_table", "cache_lens"):
        if not named[name].is_contiguous():
            raise ValueError(f"tree_attention: {name} must be contiguous (call .contiguous())")
    mask = tree_mask.expand(B, T, T)
    if values:
        check_tree_values(block_table, cache_lens, mask, NB, BS)
    return mask


def check_tree_values(block_table, cache_lens, mask, num_blocks, block_size):
    """The values `check_tree_attention_inputs` checks (host syncs on a GPU): mask [B, T, T] reflexive and
    lower-triangular, cache_lens >= 0 with room for cache_lens + T tokens in the table, and the block-table entries in
    use (the first ceil(cache_lens[b] / BS) of row b) distinct block ids in [0, num_blocks)."""
    T, NB, BS = mask.shape[-1], num_blocks, block_size
    eye = torch.eye(T, dtype=torch.bool, device=mask.device)
    if not bool(mask[:, eye].all()):
        raise ValueError("tree_attention: tree_mask must be reflexive (every node sees itself)")
    if bool(mask.triu(1).any()):
        raise ValueError("tree_attention: tree_mask must be lower-triangular (a node sees only earlier nodes)")
    if bool((cache_lens < 0).any()):
        raise ValueError("tree_attention: cache_lens must be >= 0")
    if int((cache_lens.long() + T).max()) > block_table.shape[1] * BS:
        raise ValueError(f"tree_attention: block_table has room for {block_table.shape[1] * BS} tokens, but "
                         f"cache_lens + T needs {int((cache_lens.long() + T).max())}")
    # block-table entries in use: the first ceil(cache_lens[b] / BS) of row b (the blocks this call reads)
    blocks_used = (cache_lens.long() + BS - 1) // BS                     # [B]
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    in_use = cols[None, :] < blocks_used[:, None]                        # [B, max_blocks]
    ids = block_table.long()
    bad_ids = in_use & ((ids < 0) | (ids >= NB))                         # -1 (no block) or out of range
    unused = -1 - torch.arange(ids.numel(), device=ids.device).view_as(ids)   # distinct, all < 0
    ranked = torch.where(in_use, ids, unused).flatten().sort().values
    shared = (ranked[1:] == ranked[:-1]) & (ranked[1:] >= 0)              # a block id in use twice
    bad_block, shared = torch.stack([bad_ids.any(), shared.any()]).tolist()     # one host sync
    if bad_block:
        b, c = bad_ids.nonzero()[0].tolist()
        raise ValueError(f"tree_attention: block_table entries in use must be in [0, {NB}): block_table[{b}, {c}] "
                         f"= {int(ids[b, c])}, but sequence {b} holds {int(cache_lens[b])} cached tokens in "
                         f"{int(blocks_used[b])} blocks (-1 marks an entry with no block)")
    if shared:
        first = {}
        for b, c in in_use.nonzero().tolist():
            seen = first.setdefault(int(ids[b, c]), (b, c))
            if seen != (b, c):
                raise ValueError(f"tree_attention: block id {int(ids[b, c])} is in use twice, at block_table"
                                 f"{list(seen)} and block_table{[b, c]}: no two sequences (or positions) may "
                                 "share a block")


def tree_attention(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, tree_mask, sm_scale=None, *,
                   window=None, check_values=True, exact=False):
    """Attention of T tree nodes over a paged cache plus the tree itself.

    Node i of sequence b attends to the cache_lens[b] cached tokens (all visible) and to tree node j
    where tree_mask[b, i, j] (j is i or an ancestor of i):
        out[b, i] = softmax(q_i K^T * sm_scale + mask) V,  K = [K_cache(b); K_tree(b)]
    GQA: query head h uses KV head h // (Hq // Hkv).
    Sliding window W (None = no limit; Mistral's sliding_window): node i sits at position
    p_i = cache_lens[b] + depth_i, depth_i = tree_mask[b, i].sum() - 1; it sees cache position j iff
    p_i - j < W and ancestor a iff p_i - p_a < W (as transformers: q_idx sees kv_idx iff q_idx - kv_idx < W).
    q [B, T, Hq, Dh]; k_cache, v_cache [NB, BS, Hkv, Dh]; block_table [B, max_blocks] int32;
    cache_lens [B] int32; k_tree, v_tree [B, T, Hkv, Dh]; tree_mask [T, T] or [B, T, T] bool.
    returns out [B, T, Hq, Dh] in q's dtype.
    check_values=False trusts the values: a block-table entry in use (the first ceil(cache_lens[b] / BS) of
    row b) that is not a block id in [0, NB) (-1 = no block), or cache_lens past the table's width, raises
    IndexError here (on CPU; a device-side assert on CUDA) where the Triton kernel leaves those positions
    out of the softmax (exact=True reads a -1 as block 0 instead); an entry naming another sequence's block is read
    as this sequence's, as by the kernel. check_values=True refuses both with a ValueError.
    exact=True: the batch-invariant attention (module docstring): a node's output has the same bits whatever else
    is in the tree and whether its ancestors are cached. It expects the caches to be finite wherever a sequence's
    block-table row points, block 0 for a -1 included (the engine's caches are zero-filled), where the plain twin
    and the kernels ignore whatever no node can see.
    """
    mask = check_tree_attention_inputs(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, tree_mask,
                                       values=check_values, window=window)
    window = check_window(window)
    NB, BS = k_cache.shape[:2]
    if exact:       # one node, no window: the slots it cannot see hold copies of its own row, so none needs zeroing
        return attention(q, k_cache, v_cache, k_tree, v_tree, plan(block_table, cache_lens, mask, BS, window),
                         sm_scale, finite=q.shape[1] == 1 and window is None)
    keys = plain_plan(block_table, cache_lens, mask, NB, BS, window, torch.promote_types(q.dtype, torch.float32))
    return plain_attention(q, k_cache, v_cache, k_tree, v_tree, keys, sm_scale)


@dataclass
class Keys:
    """A plain step's keys, laid out once per step and read by every layer: each sequence's cache blocks (as many as
    the longest cache needs: m = that many blocks x BS positions) through its block table, then its T tree nodes."""
    blocks: torch.Tensor    # [B * nblk] block id of each sequence's first nblk block-table entries (the table's dtype)
    bias: torch.Tensor      # [B, 1, T, m + T] (fp32, fp64 for fp64 inputs): 0 where node i sees key j, else -inf
    visible: torch.Tensor   # [B, T, m + T] bool: node i sees key j

    @property
    def keep(self):
        """[B, m + T, 1, 1] bool: keys some node sees (the others may hold anything, NaN too)."""
        return self.visible.any(1)[:, :, None, None]


def plain_plan(block_table, cache_lens, tree_mask, num_blocks, block_size, window=None, dtype=torch.float32):
    """The step's `Keys`. tree_mask [T, T] or [B, T, T] bool; cache_lens [B] int32; window None or an int >= 1.
    One host read (the longest cache). Positions past a sequence's length, in its last block or in blocks it does not
    have (read as block 0), are never visible. A block-table entry in use that is not a block id (-1) becomes a block
    past the cache, so the gather raises IndexError rather than wrap to the last block."""
    dev, BS = cache_lens.device, block_size
    B, T = cache_lens.shape[0], tree_mask.shape[-1]
    mask = tree_mask.expand(B, T, T)
    lens = cache_lens[:, None]                                                    # [B, 1]
    nblk = (int(lens.max()) + BS - 1) // BS
    if nblk > block_table.shape[1]:
        raise IndexError(f"tree_attention: cache_lens needs {nblk} block-table columns, the table has "
                         f"{block_table.shape[1]}")
    j = torch.arange(nblk * BS, device=dev)                                       # [m] positions gathered
    sees_cache = j < lens                                                         # [B, m]
    blocks = block_table[:, :nblk]                                                # [B, nblk]
    # block c is in use iff its first position c BS is in the cache; one past the table's entries (-1) is block 0
    blocks = blocks.masked_fill(blocks < 0, num_blocks) * sees_cache[:, ::BS]
    sees_cache = sees_cache[:, None, :].expand(B, T, -1)                          # [B, T, m]
    sees_tree = mask                                                              # [B, T, T]
    if window is not None:
        depth = mask.sum(-1) - 1                                                  # [B, T]
        pos = lens + depth                                                        # [B, T] p_i
        sees_cache = sees_cache & (pos[:, :, None] - j[None, None, :] < window)
        sees_tree = sees_tree & (depth[:, :, None] - depth[:, None, :] < window)  # p_i - p_a = depth_i - depth_a
    visible = torch.cat([sees_cache, sees_tree], dim=2)                           # [B, T, m + T]
    bias = torch.full((B, 1, T, visible.shape[2]), float("-inf"), dtype=dtype, device=dev)
    bias.masked_fill_(visible[:, None], 0)
    return Keys(blocks.reshape(-1), bias, visible)


def _paged(cache, tree, blocks, keep: Optional[torch.Tensor], bias):
    """cache [NB, BS, Hkv, Dh] (one layer), tree [B, T, Hkv, Dh], blocks [B * nblk] -> [B, Hkv, nblk * BS + T, Dh]
    in bias's dtype: each sequence's cache blocks, then its tree nodes; those not in keep [B, m + T, 1, 1] zeroed."""
    B, Hkv, Dh = tree.shape[0], cache.shape[2], cache.shape[3]
    x = torch.cat([cache.index_select(0, blocks).view(B, -1, Hkv, Dh), tree], 1)
    if keep is not None:
        x = x.masked_fill(~keep, 0)
    return x.to(bias.dtype).transpose(1, 2)


def paged_sdpa(q, k_cache, v_cache, k_tree, v_tree, blocks, bias, keep: Optional[torch.Tensor] = None,
               sm_scale: Optional[float] = None):
    """`plain_attention` on a `Keys`' tensors, typed for TorchScript (mtp_triton/scripted.py calls it too): q
    [B, T, Hq, Dh]; k_cache, v_cache [NB, BS, Hkv, Dh]; k_tree, v_tree [B, T, Hkv, Dh]; blocks, bias, keep as in
    `Keys` (keep None: nothing zeroed). -> [B, T, Hq, Dh] in q's dtype, one SDPA call in bias's dtype."""
    out = F.scaled_dot_product_attention(q.to(bias.dtype).transpose(1, 2), _paged(k_cache, k_tree, blocks, keep, bias),
                                         _paged(v_cache, v_tree, blocks, keep, bias), attn_mask=bias, scale=sm_scale,
                                         enable_gqa=True)                                      # [B, Hq, T, Dh]
    return out.transpose(1, 2).to(q.dtype)


def plain_attention(q, k_cache, v_cache, k_tree, v_tree, p, sm_scale=None, finite=False):
    """q [B, T, Hq, Dh]; k_cache, v_cache [NB, BS, Hkv, Dh] (one layer); k_tree, v_tree [B, T, Hkv, Dh]; p: the
    step's `Keys`. -> out [B, T, Hq, Dh] in q's dtype: softmax(q K^T * scale + bias) V in p.bias's dtype, as one
    `scaled_dot_product_attention` call (GQA by enable_gqa; `paged_sdpa`). finite=True: the caches hold no NaN/inf
    anywhere (the engine's own caches), so keys no node sees need not be zeroed (their probability is exactly 0)."""
    return paged_sdpa(q, k_cache, v_cache, k_tree, v_tree, p.blocks, p.bias, None if finite else p.keep, sm_scale)


@dataclass
class Plan:
    """Per-step layout, shared by every layer: which positions are shared chunks and what each tail slot holds."""
    B: int
    T: int
    n_shared: int               # shared positions [0, n_shared) (a multiple of CHUNK)
    W: int                      # tail slots per node (a multiple of CHUNK)
    shared_slots: torch.Tensor  # [B, n_shared] int64 flat cache slot (block * BS + offset) per shared position
    shared_ok: torch.Tensor     # [B, 1, T, 1, n_shared] bool: visible to the node (broadcasts over Hkv and G)
    tail_cache: torch.Tensor    # [B * W] int64 flat cache slot of each sequence's tail positions (0 if not cached)
    tail_src: torch.Tensor      # [B, T, W] int64 row of [cached tail rows (B * W); tree rows (B * T)] per tail slot
    tail_ok: torch.Tensor       # [B, 1, T, 1, W] bool: visible to the node
    shared_bias: torch.Tensor   # [1, B, T, 1, n_shared] float32: 0 where shared_ok, else -inf (added to the scores)
    tail_bias: torch.Tensor     # [1, B, T, 1, W] float32: the same for tail_ok


def plan(block_table, cache_lens, tree_mask, block_size, window=None, min_chunks=1):
    """Build the step's Plan. tree_mask [T, T] or [B, T, T] bool (reflexive, ancestors); cache_lens [B].
    min_chunks: the fewest chunks of a non-empty shared part and of the tail (2 for torch.compile, see below)."""
    dev = cache_lens.device
    B, T = cache_lens.shape[0], tree_mask.shape[-1]
    mask = tree_mask.expand(B, T, T)
    depth = mask.sum(-1) - 1                                                       # [B, T]
    n = cache_lens.long()                                                          # [B]
    pos = n[:, None] + depth                                                       # [B, T] position of each node
    # [B] first tail position. The shared part is 0 or at least min_chunks chunks and so is the tail: compiled code
    # asks for 2, since a chunk count of 1 would make torch.compile specialise the graph on it (compiled.py); eager
    # code takes 1, and a tree step then gathers one tail chunk per node instead of two. Where a chunk's keys come
    # from does not change its partial sums, and chunks past a node's keys add exact zeros (see above), so neither
    # choice moves a bit; hence too a step of one node (serial decoding) takes every key through the tail: one
    # gather and one chain of calls, not two.
    start = (n // CHUNK) * CHUNK
    start = torch.where((start >= min_chunks * CHUNK) & (T > 1), start, 0)
    n_shared = int(start.max())
    W = max(min_chunks * CHUNK, int(((n - start).max() + depth.max() + 1 + CHUNK - 1) // CHUNK) * CHUNK)

    def slot(p):                                    # flat cache slot of cached positions p [B, X] (p < n)
        blk = block_table.long().gather(1, (p // block_size).clamp(max=block_table.shape[1] - 1))
        return blk.clamp(min=0) * block_size + p % block_size

    def visible(p, ok):                             # window: node at pos sees p iff pos - p < window
        if window is not None:
            ok = ok & (pos[:, :, None] - p[:, None, :] < window)
        return ok[:, None, :, None, :]              # [B, 1, T, 1, X]

    sp = torch.arange(n_shared, device=dev)[None, :].expand(B, -1)                 # [B, n_shared]
    shared_slots = slot(sp) if n_shared else sp.clone()
    shared_ok = visible(sp, (sp < start[:, None])[:, None, :].expand(B, T, -1))
    tp = start[:, None] + torch.arange(W, device=dev)[None, :]                    # [B, W] absolute position
    is_cache = tp < n[:, None]                                                     # [B, W]
    tail_cache = torch.where(is_cache, slot(torch.minimum(tp, (n[:, None] - 1).clamp(min=0))), 0).reshape(-1)
    # ancestors by depth: the k-th visible tree node of row i is its ancestor at depth k (parents precede children)
    rank = torch.cumsum(mask.long(), -1) - 1                                       # [B, T, T]
    anc = torch.zeros(B, T, T + 1, dtype=torch.int64, device=dev)                 # anc[b, i, k]; k = T: discard
    anc.scatter_(2, torch.where(mask, rank, T), torch.arange(T, device=dev).expand(B, T, T).contiguous())
    d_slot = (tp - n[:, None])[:, None, :].expand(B, T, W)                         # depth a tail slot holds
    is_anc = (d_slot >= 0) & (d_slot <= depth[:, :, None])                         # [B, T, W]
    node = anc.gather(2, d_slot.clamp(0, T - 1)) * is_anc
    b = torch.arange(B, device=dev)[:, None, None]
    cache_row = b * W + torch.arange(W, device=dev)[None, None, :]
    tail_src = torch.where(is_cache[:, None, :], cache_row, B * W + b * T + node)  # [B, T, W]
    tail_ok = visible(tp, is_cache[:, None, :] | is_anc)
    bias = lambda ok: torch.zeros(ok.shape, device=dev).masked_fill_(~ok, float("-inf")).permute(1, 0, 2, 3, 4)
    return Plan(B, T, n_shared, W, shared_slots, shared_ok, tail_cache, tail_src, tail_ok, bias(shared_ok),
                bias(tail_ok))


def chunk_sum(e):
    """e [..., C] -> [...]: sum over the last dim (a power of two) in one fixed pairwise order, halving:
    e[..., :C/2] + e[..., C/2:], then again. Element-wise adds fix the order, so a row's sum has the same bits in
    every call and in compiled code (`sum(-1)` leaves the order to the kernel, which may vectorize a reduction one
    way for one shape and another way for another, as torch.compile may)."""
    while e.shape[-1] > 1:
        half = e.shape[-1] // 2
        e = e[..., :half] + e[..., half:]
    return e[..., 0]


def attention(q, k_cache, v_cache, k_tree, v_tree, p, sm_scale=None, finite=False):
    """q [B, T, Hq, Dh]; k_cache, v_cache [NB, BS, Hkv, Dh] (one layer); k_tree, v_tree [B, T, Hkv, Dh]; p: Plan.
    -> out [B, T, Hq, Dh] in q's dtype. finite=True: the caches hold no NaN/inf anywhere (the engine's own caches),
    so values a node cannot see need not be zeroed (their probability is exactly 0).
    Layout inside: KV-head-major, [Hkv, B, T, G, .], so every gather lands contiguous for the matmuls."""
    B, T, Hq, Dh = q.shape
    Hkv = k_cache.shape[2]
    G, C, W, S = Hq // Hkv, CHUNK, p.tail_src.shape[2], p.shared_slots.shape[1]   # symbolic under torch.compile
    dt = q.dtype
    scale = Dh ** -0.5 if sm_scale is None else sm_scale
    kc = k_cache.reshape(-1, Hkv * Dh)                                             # [slots, Hkv Dh] (a view)
    vc = v_cache.reshape(-1, Hkv * Dh)
    qh = q.view(B, T, Hkv, G, Dh).permute(2, 0, 1, 3, 4).contiguous()              # [Hkv, B, T, G, Dh]

    def rows(src, index, *shape):       # src [R, Hkv Dh] rows index [*shape] -> [Hkv, *shape, Dh] (contiguous)
        got = src.index_select(0, index.reshape(-1)).view(*shape, Hkv, Dh)        # whole rows: a memcpy each
        return got.movedim(-2, 0).contiguous()                                     # then one KV-head-major copy

    # tail: per node, the cached positions of its last chunks, then its ancestors by depth (one gather each)
    def tail_rows(cache, tree):                                                    # -> [Hkv, B, T, W, Dh]
        src = torch.cat([cache.index_select(0, p.tail_cache), tree.reshape(B * T, Hkv * Dh)])   # [B W + B T, Hkv Dh]
        if T == 1:                                                                 # a serial step: W ~ the context
            return rows(src, p.tail_src, B, T, W)
        return src.view(-1, Hkv, Dh).permute(1, 0, 2)[:, p.tail_src]    # many nodes: element-wise, faster there
    kt, vt = tail_rows(kc, k_tree), tail_rows(vc, v_tree)
    if not finite:
        vt = vt.masked_fill(~p.tail_ok.permute(1, 0, 2, 3, 4)[..., 0, :, None], 0)  # no NaN from unused slots
    # scores in fp32, scaled, -inf where not visible: bias + scale * s (bias 0: the bits of scale * s, fused or not)
    s_tail = torch.add(p.tail_bias, qh @ kt.transpose(-1, -2), alpha=scale)        # [Hkv, B, T, G, W]
    m = s_tail.amax(-1)                                                            # [Hkv, B, T, G]; self is visible
    if S:
        ks, vs = rows(kc, p.shared_slots, B, S), rows(vc, p.shared_slots, B, S)    # [Hkv, B, S, Dh]
        if not finite:
            vs = vs.masked_fill(~p.shared_ok.any(2)[None, :, 0, 0, :, None], 0)
        s_sh = (qh.view(Hkv, B, T * G, Dh) @ ks.transpose(-1, -2)).view(Hkv, B, T, G, S)
        s_sh = torch.add(p.shared_bias, s_sh, alpha=scale)                         # [Hkv, B, T, G, S]
        m = torch.maximum(m, s_sh.amax(-1))

    # chunk partials, in position order: o_c = p_c @ v_c (one bf16 matmul per chunk of C positions), l_c = sum p_c
    e_t = torch.exp(s_tail - m[..., None]).to(dt).view(Hkv, B, T, G, W // C, C)
    o = [(e_t.transpose(3, 4) @ vt.view(Hkv, B, T, W // C, C, Dh)).transpose(3, 4)]   # [Hkv, B, T, G, Wc, Dh]
    e = [e_t]
    if S:
        e_s = torch.exp(s_sh - m[..., None]).to(dt).view(Hkv, B, T * G, S // C, C)
        o_s = (e_s.transpose(2, 3) @ vs.view(Hkv, B, S // C, C, Dh)).transpose(2, 3)   # [Hkv, B, T*G, Sc, Dh]
        o.insert(0, o_s.reshape(Hkv, B, T, G, S // C, Dh))
        e.insert(0, e_s.view(Hkv, B, T, G, S // C, C))
    cat = lambda parts: parts[0] if len(parts) == 1 else torch.cat(parts, 4)       # one step's node: no shared part
    l = chunk_sum(cat(e).float())                                                   # [Hkv, B, T, G, Sc + Wc]
    # sequential, in position order (cast first: cumsum(..., dtype=float64) straight from bf16 is a slow path)
    o = torch.cumsum(cat(o).double(), 4)[..., -1, :]
    l = torch.cumsum(l.double(), 4)[..., -1]
    out = (o / l[..., None]).to(dt)                                                # [Hkv, B, T, G, Dh]
    return out.permute(1, 2, 0, 3, 4).reshape(B, T, Hq, Dh)

