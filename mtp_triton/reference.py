"""PyTorch references for every Triton kernel — same signatures, same return values.

These are the specification: readable, computed in at least fp32 (fp64 stays fp64 so parity
tests against `transformers` can be exact), and used by the engine when ``kernels="torch"``.
`check_values=False` (keyword-only, on the four functions whose checks read tensor values) skips those
checks — host syncs on a GPU — for callers that built the inputs themselves; shapes/dtypes/devices are
always checked. Shapes: B batch, T tree nodes (node 0 = root), H heads, D hidden, V vocab, L layers,
Hq/Hkv query/key-value heads, Dh head dim, NB cache blocks, BS block size.
"""
import importlib

import torch
import torch.nn.functional as F

from . import invariant


def _checks(kernel_file):
    """The input checks of `mtp_triton/kernels/<kernel_file>.py`, shared with the twin so both reject the same inputs.

    They live in the kernel files so that each file can be copied alone; they are imported on first use, so
    importing this module neither imports triton nor fixes Triton's interpreter mode (see `use_interpreter`).
    """
    return importlib.import_module(f"mtp_triton.kernels.{kernel_file}")


def _acc_dtype(dtype):
    """Accumulation dtype: fp32 for half types, fp64 stays fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fused_draft(hidden, res_weight, res_bias, lm_head, top_k, *, token_map=None, check_values=True):
    """All H Medusa heads on one hidden state, then per-head top-k of the LM head.

    head h:  z_h = x + silu(W_h x + b_h);  logits_h = L_h @ z_h           (Medusa, Cai et al. 2024)
    hidden [B, D]; res_weight [H, D, D]; res_bias [H, D]; lm_head [V, D] (shared: L_h = lm_head) or [H, V, D]
    (one per head: L_h = lm_head[h], as FasterDecoding's Medusa checkpoints). res_weight = res_bias = None: the
    ResBlock switched off, one "head" with z = x (the MTP module's scores).
    token_map: None, or int64 [V] strictly increasing token ids (a draft vocabulary, FR-Spec / EAGLE-3's d2t):
    lm_head holds just those V rows, the ranking is over them, and token_ids = token_map[row].
    returns token_ids [B, H, top_k] int64 (descending logit, ties -> lower id) and
            logprobs  [B, H, top_k] float32 = log_softmax(logits_h) at those ids (over the V rows of lm_head, i.e.
            over the draft vocabulary when there is one).
    """
    _checks("drafting").check_fused_draft_inputs(hidden, res_weight, res_bias, lm_head, top_k, token_map,
                                                 values=check_values)
    acc = _acc_dtype(hidden.dtype)
    x = hidden.to(acc)                                                    # [B, D]
    if res_weight is None:                                                # the ResBlock off: z = x, H = 1
        z = x[:, None, :]
    else:
        pre = torch.einsum("bd,hed->bhe", x, res_weight.to(acc)) + res_bias.to(acc)  # [B, H, D]
        z = x[:, None, :] + F.silu(pre)                                   # [B, H, D]
    if lm_head.dim() == 2:
        logits = z @ lm_head.to(acc).T                                    # [B, H, V]  shared LM head
    else:
        logits = torch.einsum("bhd,hvd->bhv", z, lm_head.to(acc))         # [B, H, V]  one LM head per head
    logp = torch.log_softmax(logits, dim=-1)
    rows = topk_lower_id_first(logits, top_k)                             # [B, H, top_k] rows of lm_head
    ids = rows if token_map is None else token_map[rows]                  # increasing map: lower row = lower id
    return ids, logp.gather(-1, rows).float()


def topk_lower_id_first(x, k):
    """Ids of the k largest entries along the last dim, by descending value, ties -> lower id first.

    Equivalent to a stable descending sort cut at k (the definition), but uses topk: within the k selected
    the order is fixed by a tiny sort; only if a tie straddles the k-th place (equal values left out) do
    we fall back to the full stable sort. NaN ranks as -inf (lowest, ties to the lower id), +inf highest: a row
    poisoned by a NaN in a weight or a hidden state still gives k valid, distinct ids (the Triton kernel's rule).
    """
    x = torch.where(torch.isnan(x), float("-inf"), x)
    vals, ids = torch.topk(x, k, dim=-1)                       # tie order unspecified
    kth = vals[..., -1:]
    by_id = torch.argsort(ids, dim=-1)                         # order the selection by id ...
    ids, vals = ids.gather(-1, by_id), vals.gather(-1, by_id)
    out = ids.gather(-1, torch.sort(vals, dim=-1, descending=True, stable=True).indices)  # ... then by value
    straddle = (x == kth).sum(-1) != (vals == kth).sum(-1)     # [...]: rows whose k-th value has a left-out twin
    if bool(straddle.any()):                                   # those rows (only) by the full stable sort
        out[straddle] = torch.sort(x[straddle], dim=-1, descending=True, stable=True).indices[..., :k]
    return out


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
    out of the softmax; an entry naming another sequence's block is read as this sequence's, as by the
    kernel. check_values=True refuses both with a ValueError.
    exact=True: the batch-invariant attention, `mtp_triton.invariant.tree_attention` (a node's output has the same
    bits whatever else is in the tree and whether its ancestors are cached: the same function of the inputs, summed
    in an order fixed by token positions), as the Triton kernel's exact=True. It expects the blocks a sequence owns
    to hold no NaN/inf (the engine's caches never do), where the plain twin also ignores NaN in their unused slots.
    """
    if exact:
        return invariant.tree_attention(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, tree_mask,
                                        sm_scale, window=window, check_values=check_values)
    checks = _checks("tree_attention")
    mask = checks.check_tree_attention_inputs(
        q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, tree_mask, values=check_values, window=window)
    window = checks.check_window(window)
    B, T, Hq, Dh = q.shape
    NB, BS, Hkv = k_cache.shape[:3]
    G = Hq // Hkv
    scale = Dh ** -0.5 if sm_scale is None else sm_scale
    acc = _acc_dtype(q.dtype)
    # gather every sequence's cached tokens through its block table, padded to the longest cache
    n = int(cache_lens.max())
    nblk = (n + BS - 1) // BS
    if nblk > block_table.shape[1]:
        raise IndexError(f"tree_attention: cache_lens needs {nblk} block-table columns, the table has "
                         f"{block_table.shape[1]}")
    blocks = block_table[:, :nblk].long()                                         # [B, nblk]
    in_use = torch.arange(nblk, device=q.device)[None, :] < (cache_lens[:, None].long() + BS - 1) // BS
    blocks = torch.where(in_use, blocks, 0)            # entries past a sequence's blocks (-1): masked below
    blocks = torch.where(blocks < 0, NB, blocks)       # -1 in use must not wrap to the last block: IndexError
    k_c = k_cache[blocks].reshape(B, -1, Hkv, Dh)[:, :n]                          # [B, n, Hkv, Dh]
    v_c = v_cache[blocks].reshape(B, -1, Hkv, Dh)[:, :n]
    cached = torch.arange(n, device=q.device)[None, :] < cache_lens[:, None]     # [B, n] real cache slots
    k = torch.cat([k_c, k_tree], dim=1).to(acc)                                   # [B, n + T, Hkv, Dh]
    v = torch.cat([v_c, v_tree], dim=1).to(acc)
    sees_cache = cached[:, None, :].expand(B, T, n)                               # [B, T, n]
    sees_tree = mask                                                              # [B, T, T]
    if window is not None:
        depth = mask.sum(-1) - 1                                                  # [B, T]
        pos = cache_lens[:, None].long() + depth                                  # [B, T] p_i
        j = torch.arange(n, device=q.device)
        sees_cache = sees_cache & (pos[:, :, None] - j[None, None, :] < window)
        sees_tree = sees_tree & (depth[:, :, None] - depth[:, None, :] < window)  # p_i - p_a = depth_i - depth_a
    visible = torch.cat([sees_cache, sees_tree], dim=2)                           # [B, T, n + T]
    keep = visible.any(dim=1)                             # [B, n + T] keys some node sees
    v = v.masked_fill(~keep[..., None, None], 0.0)        # the others (unused slots, outside every window) may hold NaN
    qb = q.to(acc).view(B, T, Hkv, G, Dh)
    scores = torch.einsum("btkgd,bskd->bkgts", qb, k) * scale                     # [B, Hkv, G, T, n + T]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgts,bskd->btkgd", p, v)                                 # [B, T, Hkv, G, Dh]
    return out.reshape(B, T, Hq, Dh).to(q.dtype)


def _node_depths(parents):
    """parents [B, T] (-1 = root or unused) -> depth [B, T] (root 0; unused nodes 0)."""
    B, T = parents.shape
    depth = torch.zeros(B, T, dtype=torch.int64, device=parents.device)
    for i in range(1, T):
        p = parents[:, i]
        depth[:, i] = torch.where(p >= 0, depth.gather(1, p.clamp(min=0)[:, None])[:, 0] + 1, 0)
    return depth


def _path_to(parents, depth, last):
    """Root-to-`last` node path per sequence, padded with -1: accept_nodes [B, T], accept_len [B]."""
    B, T = parents.shape
    accept_len = depth.gather(1, last[:, None])[:, 0]
    nodes = torch.full((B, T), -1, dtype=torch.int64, device=parents.device)
    for b in range(B):
        node, d = int(last[b]), int(accept_len[b])
        while node >= 0:
            nodes[b, d] = node
            node, d = int(parents[b, node]), d - 1
    return accept_len, nodes


def tree_accept(draft_tokens, parents, target_tokens, *, check_values=True):
    """Greedy tree acceptance (Medusa / SpecInfer).

    Node i > 0 is accepted iff its parent p is accepted and draft_tokens[i] == target_tokens[p];
    the root is always accepted; a node with parent -1 is unused. The deepest accepted node n
    (ties: lowest index) ends the accepted path; the bonus token is target_tokens[n].
    draft_tokens [B, T] int64; parents [T] or [B, T] int64; target_tokens [B, T] int64.
    returns accept_len [B] int64, accept_nodes [B, T] int64 (path from root, -1 padded), next_token [B] int64.
    """
    parents = _checks("accept").check_tree_accept_inputs(draft_tokens, parents, target_tokens, values=check_values)
    B, T = draft_tokens.shape
    accepted = torch.zeros(B, T, dtype=torch.bool, device=draft_tokens.device)
    accepted[:, 0] = True
    for i in range(1, T):
        p = parents[:, i].clamp(min=0)[:, None]
        ok = (parents[:, i] >= 0) & accepted.gather(1, p)[:, 0]
        accepted[:, i] = ok & (draft_tokens[:, i] == target_tokens.gather(1, p)[:, 0])
    depth = _node_depths(parents)
    score = torch.where(accepted, depth, -1)
    last = torch.argmax(score, dim=1)          # first index among the deepest accepted nodes
    accept_len, accept_nodes = _path_to(parents, depth, last)
    next_token = target_tokens.gather(1, last[:, None])[:, 0]
    return accept_len, accept_nodes, next_token


def sample_from_probs(probs, u):
    """Inverse-CDF sampling: the first id whose cumulative probability exceeds u * sum(probs).

    probs [B, V] (need not be normalised; >= 0); u [B] in [0, 1). returns ids [B] int64.
    """
    cdf = torch.cumsum(probs.to(_acc_dtype(probs.dtype)), dim=-1)
    thresh = (u.to(cdf.dtype) * cdf[:, -1])[:, None]
    ids = torch.searchsorted(cdf, thresh, right=True)[:, 0]
    # a zero-probability tail id cannot be chosen: clamp to the last id with mass
    last_nz = probs.shape[1] - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.minimum(ids, last_nz)


def tree_accept_sample(draft_tokens, parents, target_probs, u_accept, u_sample, *, check_values=True):
    """Lossless tree acceptance at temperature > 0 (sibling-wise rejection sampling, SpecInfer/EAGLE).

    Walk from the root. At node n with target distribution p = target_probs[n], try the children of n
    in index order: child c (token x) is accepted iff u_accept[c] < p(x) / sum(p); then the walk moves
    to c. On rejection p(x) <- 0 (renormalised implicitly) and the next sibling is tried. When every
    child is rejected (or n is a leaf), the bonus token is drawn from the residual p with u_sample.
    The emitted token at each depth is then distributed exactly as p (sampling without replacement).
    draft_tokens [B, T] int64; parents [T] or [B, T]; target_probs [B, T, V] (after temperature/top-p; finite,
    >= 0, rows need not be normalised); u_accept [B, T] in [0, 1) (entry 0 unused); u_sample [B] in [0, 1) —
    the random numbers are inputs, so a kernel can be compared with this reference exactly. Invalid values
    raise ValueError unless check_values=False (then the result is unspecified).
    returns accept_len [B], accept_nodes [B, T], next_token [B] (as tree_accept).
    """
    parents = _checks("accept").check_tree_accept_sample_inputs(
        draft_tokens, parents, target_probs, u_accept, u_sample, values=check_values)
    B, T = draft_tokens.shape
    acc = _acc_dtype(target_probs.dtype)
    accept_len = torch.zeros(B, dtype=torch.int64, device=draft_tokens.device)
    accept_nodes = torch.full((B, T), -1, dtype=torch.int64, device=draft_tokens.device)
    next_token = torch.zeros(B, dtype=torch.int64, device=draft_tokens.device)
    for b in range(B):
        node, d = 0, 0
        accept_nodes[b, 0] = 0
        while True:
            p = target_probs[b, node].to(acc).clone()
            moved = False
            for c in range(node + 1, T):
                if int(parents[b, c]) != node:
                    continue
                x = int(draft_tokens[b, c])
                total = p.sum()
                if total > 0 and float(u_accept[b, c]) * float(total) < float(p[x]):
                    node, d, moved = c, d + 1, True
                    accept_nodes[b, d] = c
                    break
                p[x] = 0.0                                   # reject: remove x, renormalise
            if not moved:
                next_token[b] = sample_from_probs(p[None], u_sample[b : b + 1])[0]
                accept_len[b] = d
                break
    return accept_len, accept_nodes, next_token


def kv_append(k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, accept_nodes, accept_len, *,
              check_values=True):
    """Copy the root's and accepted nodes' K/V into the paged cache, every layer, in place.

    For layer l, sequence b and j = 0..accept_len[b]: node n = accept_nodes[b, j] goes to position
    pos = cache_lens[b] + j, i.e. block block_table[b, pos // BS], slot pos % BS.
    k_cache, v_cache [L, NB, BS, Hkv, Dh]; k_tree, v_tree [L, B, T, Hkv, Dh]. cache_lens is not changed.
    check_values=False trusts the values: an entry in use that is not a block id in [0, NB) (-1 = no
    block) or a column past the table's width raises IndexError here (on CPU; a device-side assert on
    CUDA) where the Triton kernel drops the token; an entry naming another sequence's block is written
    there, overwriting its K/V, as by the kernel. check_values=True refuses both with a ValueError.
    """
    _checks("kv_append").check_kv_append_inputs(
        k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, accept_nodes, accept_len, values=check_values)
    BS = k_cache.shape[2]
    B = k_tree.shape[1]
    NB = k_cache.shape[1]
    for b in range(B):
        n = int(accept_len[b]) + 1
        pos = int(cache_lens[b]) + torch.arange(n, device=k_cache.device)
        blocks = block_table[b].long()[pos // BS]        # past the table's width: IndexError
        blocks = torch.where(blocks < 0, NB, blocks)     # -1 must not wrap to the last block: IndexError
        slots = pos % BS
        nodes = accept_nodes[b, :n]
        k_cache[:, blocks, slots] = k_tree[:, b, nodes]
        v_cache[:, blocks, slots] = v_tree[:, b, nodes]
