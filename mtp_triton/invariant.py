"""Batch-invariant tree attention: low-precision MTP that is bit-identical to serial decoding (PyTorch: on a CPU,
and on a GPU with kernels="torch").

Why it is needed. Greedy MTP emits exactly the serial tokens only if the target's logits at every accepted node are
the same numbers serial decoding computes there. In fp64 they are close enough never to flip an argmax; in bf16 two
candidates often tie to within one rounding step, and any change in the order of a reduction flips such a near-tie.
A tree step changes two orders: (1) the matmuls see T rows instead of 1, and (2) the keys a node attends to are split
differently between the cache and the tree (serial: all of them are cached; MTP: the ancestors are tree nodes).
Thinking Machines' "Defeating Nondeterminism in LLM Inference" (2025,
https://thinkingmachines.ai/blog/defeating-nondeterminism-in-llm-inference/) makes the general point: kernels whose
reduction order does not depend on the batch (here: the tree) give identical results.

(1) is a property of the machine's matmuls, within limits: on the CPUs this project has run on (oneDNN; AVX-512 BF16,
and AMX), a bf16 matmul gives each output row the same bits whatever the row's position, the number of columns or
batch entries, and whatever the number of rows from 2 to 32. Outside that range the kernel may change: on some of
these CPUs a 1-row matmul takes another code path, and on AMX CPUs oneDNN blocks 33 rows or more differently (seen on
576 x 1536 and on the 576 x 49152 LM head). So in this mode every linear layer goes through `linear`, which never
hands the matmul more than MATMUL_ROWS = 32 rows at once, nor one row alone unless a probe of that layer on the
running machine found its 1-row call exact (packed.py). On a GPU the rule is stricter: cuBLAS picks its kernel (tile
shape, split-K) by the problem's shape, and an H200 ran a 1-row and a 25-row bf16 step through different kernels
whose rows differ. There `linear` hands every call exactly MATMUL_ROWS rows (the last piece padded with zero rows):
one shape, one kernel, and a kernel computes each of its rows alike. Torch's CUDA reductions also choose their launch
by shape, so the norms go through `linear` too there (`rowwise`). `row_invariance()` checks each of these properties
on the running machine, and `generate` warns once if one fails.

(2) is what this file fixes, by making every sum follow *absolute token positions*:
  - keys are processed in chunks of C positions aligned at position 0, whatever is cached and whatever is a tree node;
  - a node's scores are bf16 matmul outputs (the same bits whichever call computes them), its softmax uses its exact
    max, p = exp(s * scale - max) is rounded to bf16;
  - each chunk's partial sum_j p_j v_j is one bf16 matmul over exactly that chunk's C positions, and sum_j p_j one
    fixed pairwise sum over them (`chunk_sum`), so both are the same whether the chunk's keys came from the cache or
    the tree;
  - the partials are added in position order by a sequential (double-accumulating) cumsum; chunks a node cannot see
    are exact zeros, and adding zeros changes nothing.
Chunks wholly below the earliest tree position are computed for all nodes at once from the cache ("shared"); the last
one or two chunks are gathered per node: the cached keys of the chunk plus the node's ancestors by depth ("tail").
A step of one node (serial decoding) gathers all its keys as its tail: the same partial sums, half the calls.

Cost: the same arithmetic as plain attention plus a per-node gather of at most 2C keys; the per-step plan (masks and
gather indices) is built once and reused by every layer. It costs a little more than the plain twin per
step; notebook 05 measures both. The output is bf16-accurate attention (probabilities and
chunk partials rounded to bf16, sums in fp32/fp64), not the fp32 twin's numbers: use it for bf16/fp16 models.
"""
import importlib
from dataclasses import dataclass

import torch

CHUNK = 32
MATMUL_ROWS = 32            # `linear` hands the matmul 2 .. MATMUL_ROWS rows at a time (a GPU: exactly MATMUL_ROWS)


def linear(layer, x):
    """layer(x) [..., N] for x [..., K] (layer: an nn.Linear or any row-wise function), computed in pieces so that
    each row rounds as it would in any other call. On a CPU: pieces of 2 .. MATMUL_ROWS rows (a 1-row piece is
    computed beside a copy of itself, unless the layer is `one_row_exact`: a packed linear whose probe found that its
    1-row call rounds as its many-row ones (packed.py); n = 33 splits as 31 + 2). On a GPU: pieces of exactly
    MATMUL_ROWS rows, the last padded with zero rows (one shape, so one cuBLAS kernel). While torch.compile traces, a
    layer that `splits_rows` itself (a packed linear's custom op, packed.py) gets all rows at once, so the graph does
    not depend on the row count."""
    if getattr(layer, "splits_rows", False) and torch.compiler.is_compiling():
        return layer(x)
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if rows.is_cuda:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, -n % MATMUL_ROWS))               # [ceil(n / 32) * 32, K]
        out = [layer(piece) for piece in rows.split(MATMUL_ROWS)]
        return (out[0] if len(out) == 1 else torch.cat(out))[:n].reshape(*x.shape[:-1], -1)
    if 2 <= n <= MATMUL_ROWS or (n == 1 and getattr(layer, "one_row_exact", False)):
        return layer(x)
    if n == 1:
        return layer(torch.cat([rows, rows]))[:1].reshape(*x.shape[:-1], -1)
    sizes = [MATMUL_ROWS] * (n // MATMUL_ROWS) + ([n % MATMUL_ROWS] if n % MATMUL_ROWS else [])
    if sizes[-1] == 1:
        sizes[-2:] = [MATMUL_ROWS - 1, 2]
    return torch.cat([layer(piece) for piece in rows.split(sizes)]).reshape(*x.shape[:-1], -1)


def rowwise(fn, x):
    """fn(x) for a row-wise function other than a matmul (the RMS norms: a reduction over each row): on a GPU through
    `linear`, since torch's CUDA reductions choose their launch (threads per row, blocks per row) by shape; on a CPU
    as it is (each row reduced alike at any row count, which `row_invariance` checks)."""
    return linear(fn, x) if x.is_cuda else fn(x)


def order_sensitive(rows, k, n, dtype, seed=0):
    """x [rows, k], w [n, k] in dtype on which x @ w.T rounds differently for nearly any change in the order of its
    sums over k: a third of the products are large (~2^10), a third cancel them exactly, a third are small (~2^-4),
    all interleaved, so the fp32 partial sums are large whenever a small product is added and lose bits of it that
    depend on when it is added. Probes use it to tell whether two matmul calls sum alike."""
    g = torch.Generator().manual_seed(seed)
    t = k // 3
    x = (1 + torch.rand(rows, k, generator=g)) * torch.randn(rows, k, generator=g).sign()
    x[:, t:2 * t] = x[:, :t]
    big = (1 + torch.rand(n, t, generator=g)) * 2.0 ** 10
    w = torch.cat([big, -big, torch.randn(n, k - 2 * t, generator=g) * 2.0 ** -4], 1)
    perm = torch.randperm(k, generator=g)
    return x[:, perm].to(dtype), w[:, perm].to(dtype)


def row_invariance(dtype=torch.bfloat16, device="cpu", trials=3):
    """Which of the exact mode's premises hold for `dtype` on `device`? -> {premise: bool}, each on the shapes of a
    small Llama and of Llama-2-7B:
      linear      `linear` gives a row the same bits in every call it makes (1 .. MATMUL_ROWS + 1 rows, at any
                  position): the 576 x 1536 MLP, the 49152-row LM head, a 4096 x 4096 projection
      norm        `rowwise` RMS norm gives a row the same bits at 1 .. 33 rows (D = 576 and 4096)
      attention   the attention's batched matmuls (`attention`: scores q @ k^T over Dh = 64 or 128, chunk partials
                  p @ v over CHUNK keys) give a row the same bits whatever their row count, 1 row included
      cumsum      the double cumsum over chunks gives a row the same bits whatever the number of rows"""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)
    same_rows = lambda f, x, ms: all(torch.equal(f(x[..., -m:, :]), f(x)[..., -m:, :]) for m in ms)
    ms = (1, 2, 5, 17, MATMUL_ROWS)
    out = {}
    lin_ok = True
    for t in range(trials):
        k, n = ((576, 1536), (576, 49152), (4096, 4096))[t % 3]
        w = rand(n, k) * 0.05
        lin_ok &= same_rows(lambda v: linear(lambda r: torch.nn.functional.linear(r, w), v), rand(MATMUL_ROWS + 1, k),
                            ms)
    out["linear"] = lin_ok

    def rms(v):                                      # as model.RMSNorm, without its weight
        v32 = v.float()
        return (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(v.dtype)
    out["norm"] = all(same_rows(lambda v: rowwise(rms, v), rand(MATMUL_ROWS + 1, d), ms) for d in (576, 4096))
    out["attention"] = all(same_rows(lambda a: a @ b, rand(1, 99, k), (1, 3, 21, 63))
                           for k, n in ((64, 96), (128, 96), (CHUNK, 64), (CHUNK, 128)) for b in [rand(1, k, n)])
    c = torch.randn(40, 7, 128, generator=g).double().to(device)                   # [rows, chunks, Dh]
    out["cumsum"] = all(torch.equal(torch.cumsum(x[-m:], 1), torch.cumsum(x, 1)[-m:])   # o's (over chunks), l's (last)
                        for x in (c, c[..., 0].contiguous()) for m in (1, 3, 21))
    return out


def matmul_is_row_invariant(dtype=torch.bfloat16, device="cpu"):
    """Do all of `row_invariance`'s premises hold for `dtype` on `device`?"""
    return all(row_invariance(dtype, device).values())


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
    # gather and one chain of calls, not two (~1/3 less time at T = 1).
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
    way for one shape and another way for another: seen with torch.compile on 1 vs 2 tree nodes)."""
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
    # sequential, in position order (cast first: cumsum(..., dtype=float64) of bf16 ran up to 8x slower here)
    o = torch.cumsum(cat(o).double(), 4)[..., -1, :]
    l = torch.cumsum(l.double(), 4)[..., -1]
    out = (o / l[..., None]).to(dt)                                                # [Hkv, B, T, G, Dh]
    return out.permute(1, 2, 0, 3, 4).reshape(B, T, Hq, Dh)


def tree_attention(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, tree_mask, sm_scale=None, *,
                   window=None, check_values=True):
    """The twin's signature (`mtp_triton.reference.tree_attention`): plan + attention for one layer, with the same
    input checks (shapes always; values unless check_values=False; the window)."""
    checks = importlib.import_module("mtp_triton.kernels.tree_attention")     # the kernel file's checks, on first use
    checks.check_tree_attention_inputs(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, tree_mask,
                                       values=check_values, window=window)
    window = checks.check_window(window)
    return attention(q, k_cache, v_cache, k_tree, v_tree, plan(block_table, cache_lens, tree_mask, k_cache.shape[1],
                                                               window), sm_scale)
