"""Batch-invariant tree attention: low-precision MTP that is bit-identical to serial decoding (PyTorch, CPU).

Why it is needed. Greedy MTP emits exactly the serial tokens only if the target's logits at every accepted node are
the same numbers serial decoding computes there. In fp64 they are close enough never to flip an argmax; in bf16 two
candidates often tie to within one rounding step, and any change in the order of a reduction flips such a near-tie.
A tree step changes two orders: (1) the matmuls see T rows instead of 1, and (2) the keys a node attends to are split
differently between the cache and the tree (serial: all of them are cached; MTP: the ancestors are tree nodes).
Thinking Machines' "Defeating Nondeterminism in LLM Inference" (2025,
https://thinkingmachines.ai/blog/defeating-nondeterminism-in-llm-inference/) makes the general point: kernels whose
reduction order does not depend on the batch (here: the tree) give identical results.

(1) is a property of the machine's matmuls: on this project's CPUs (oneDNN, AVX-512 BF16) a bf16 matmul gives each
output row the same bits whatever the number of rows (>= 2), the row's position, the number of columns or batch
entries — `matmul_is_row_invariant()` checks it on the running machine. The engine never runs a 1-row linear layer in
this mode (it pads to 2 rows), because the 1-row path rounds differently.

(2) is what this file fixes, by making every sum follow *absolute token positions*:
  - keys are processed in chunks of C positions aligned at position 0, whatever is cached and whatever is a tree node;
  - a node's scores are bf16 matmul outputs (the same bits whichever call computes them), its softmax uses its exact
    max, p = exp(s * scale - max) is rounded to bf16;
  - each chunk's partial [sum_j p_j v_j, sum_j p_j] is one bf16 matmul over exactly that chunk's C positions (with a
    column of ones for the sum of p), so it is the same whether the chunk's keys came from the cache or the tree;
  - the partials are added in position order by a sequential (double-accumulating) cumsum; chunks a node cannot see
    are exact zeros, and adding zeros changes nothing.
Chunks wholly below the earliest tree position are computed for all nodes at once from the cache ("shared"); the last
one or two chunks are gathered per node: the cached keys of the chunk plus the node's ancestors by depth ("tail").

Cost: the same arithmetic as plain attention plus a per-node gather of at most 2C keys; the per-step plan (masks and
gather indices) is built once and reused by every layer. The output is bf16-accurate attention (probabilities and
chunk partials rounded to bf16, sums in fp32/fp64), not the fp32 twin's numbers: use it for bf16/fp16 models.
"""
from dataclasses import dataclass

import torch

CHUNK = 32


def matmul_is_row_invariant(dtype=torch.bfloat16, device="cpu", trials=3):
    """Does a `dtype` matmul on this machine give a row the same bits whatever else is in the batch? (A probe.)"""
    g = torch.Generator().manual_seed(0)
    for t in range(trials):
        k, n = (576, 1536, 64)[t % 3], (49152, 576, 65)[t % 3]
        w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(device)
        x = torch.randn(33, k, generator=g).to(dtype).to(device)
        full = torch.nn.functional.linear(x, w)
        for m in (2, 5, 17):
            part = torch.nn.functional.linear(x[-m:], w)
            if not torch.equal(part, full[-m:]):
                return False
    return True


@dataclass
class Plan:
    """Per-step layout, shared by every layer: which positions are shared chunks and what each tail slot holds."""
    B: int
    T: int
    n_shared: int              # shared positions [0, n_shared) (a multiple of CHUNK)
    W: int                     # tail slots per node (a multiple of CHUNK)
    shared_slots: torch.Tensor  # [B, n_shared] int64 flat cache slot (block * BS + offset) per shared position
    shared_ok: torch.Tensor     # [B, T, n_shared] bool: visible to the node
    tail_cache: torch.Tensor    # [B, W] int64 flat cache slot for tail slots that are cached positions (else 0)
    tail_is_cache: torch.Tensor  # [B, W] bool
    tail_node: torch.Tensor     # [B, T, W] int64 tree node for tail slots that are ancestors (else 0)
    tail_ok: torch.Tensor       # [B, T, W] bool: visible to the node


def plan(block_table, cache_lens, tree_mask, block_size, window=None):
    """Build the step's Plan. tree_mask [T, T] or [B, T, T] bool (reflexive, ancestors); cache_lens [B]."""
    dev = cache_lens.device
    B, T = cache_lens.shape[0], tree_mask.shape[-1]
    mask = tree_mask.expand(B, T, T)
    depth = mask.sum(-1) - 1                                                       # [B, T]
    n = cache_lens.long()                                                          # [B]
    pos = n[:, None] + depth                                                       # [B, T] position of each node
    start = (n // CHUNK) * CHUNK                                                   # [B] first tail position
    n_shared = int(start.max())
    W = int(((n - start).max() + depth.max() + 1 + CHUNK - 1) // CHUNK) * CHUNK

    def slot(p):                                    # flat cache slot of cached positions p [B, X] (p < n)
        blk = block_table.long().gather(1, (p // block_size).clamp(max=block_table.shape[1] - 1))
        return blk.clamp(min=0) * block_size + p % block_size

    def visible(p, ok):                             # window: node at pos sees p iff pos - p < window
        if window is not None:
            ok = ok & (pos[:, :, None] - p[:, None, :] < window)
        return ok

    sp = torch.arange(n_shared, device=dev)[None, :].expand(B, -1)                 # [B, n_shared]
    shared_slots = slot(sp) if n_shared else sp.clone()
    shared_ok = visible(sp, (sp < start[:, None])[:, None, :].expand(B, T, -1))
    tp = start[:, None] + torch.arange(W, device=dev)[None, :]                    # [B, W] absolute position
    tail_is_cache = tp < n[:, None]
    tail_cache = torch.where(tail_is_cache, slot(torch.minimum(tp, (n[:, None] - 1).clamp(min=0))), 0)
    # ancestors by depth: the k-th visible tree node of row i is its ancestor at depth k (parents precede children)
    rank = torch.cumsum(mask.long(), -1) - 1                                       # [B, T, T]
    anc = torch.zeros(B, T, T + 1, dtype=torch.int64, device=dev)                 # anc[b, i, k]; k = T: discard
    anc.scatter_(2, torch.where(mask, rank, T), torch.arange(T, device=dev).expand(B, T, T).contiguous())
    d_slot = tp[:, None, :] - n[:, None, None]                                     # [B, 1, W] depth a slot holds
    is_anc = (d_slot >= 0) & (d_slot <= depth[:, :, None])                         # [B, T, W]
    tail_node = anc.gather(2, d_slot.clamp(0, T - 1).expand(B, T, W)) * is_anc
    tail_ok = visible(tp, tail_is_cache[:, None, :] | is_anc)
    return Plan(B, T, n_shared, W, shared_slots, shared_ok, tail_cache, tail_is_cache, tail_node, tail_ok)


def attention(q, k_cache, v_cache, k_tree, v_tree, p, sm_scale=None):
    """q [B, T, Hq, Dh]; k_cache, v_cache [NB, BS, Hkv, Dh] (one layer); k_tree, v_tree [B, T, Hkv, Dh]; p: Plan.
    -> out [B, T, Hq, Dh] in q's dtype."""
    B, T, Hq, Dh = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    dt = q.dtype
    scale = Dh ** -0.5 if sm_scale is None else sm_scale
    kc, vc = k_cache.reshape(-1, Hkv, Dh), v_cache.reshape(-1, Hkv, Dh)            # [slots, Hkv, Dh]
    qh = q.view(B, T, Hkv, G, Dh).permute(0, 2, 1, 3, 4)                           # [B, Hkv, T, G, Dh]
    ones = torch.ones(1, dtype=dt, device=q.device)

    # tail keys per node: cached positions of the tail chunks, then the node's ancestors by depth
    idx = p.tail_node.reshape(B, T * p.W)
    kt = k_tree.gather(1, idx[..., None, None].expand(-1, -1, Hkv, Dh)).view(B, T, p.W, Hkv, Dh)
    vt = v_tree.gather(1, idx[..., None, None].expand(-1, -1, Hkv, Dh)).view(B, T, p.W, Hkv, Dh)
    cached = p.tail_is_cache[:, None, :, None, None]
    kt = torch.where(cached, kc[p.tail_cache][:, None], kt).permute(0, 3, 1, 2, 4)  # [B, Hkv, T, W, Dh]
    vt = torch.where(cached, vc[p.tail_cache][:, None], vt).permute(0, 3, 1, 2, 4)
    vt = torch.where(p.tail_ok[:, None, :, :, None], vt, 0)                        # no NaN from unused slots
    s_tail = (qh @ kt.transpose(-1, -2)).float() * scale                           # [B, Hkv, T, G, W]
    s_tail = s_tail.masked_fill(~p.tail_ok[:, None, :, None, :], float("-inf"))
    m = s_tail.amax(-1)                                                            # [B, Hkv, T, G]; self is visible
    if p.n_shared:
        ks = kc[p.shared_slots].permute(0, 2, 1, 3)                                # [B, Hkv, S, Dh]
        vs = vc[p.shared_slots].permute(0, 2, 1, 3)
        s_sh = (qh.reshape(B, Hkv, T * G, Dh) @ ks.transpose(-1, -2)).float() * scale  # [B, Hkv, T*G, S]
        s_sh = s_sh.view(B, Hkv, T, G, -1).masked_fill(~p.shared_ok[:, None, :, None, :], float("-inf"))
        m = torch.maximum(m, s_sh.amax(-1))

    # chunk partials [.., chunks, Dh + 1] = p @ [v | 1], one bf16 matmul per chunk of CHUNK positions
    C = CHUNK
    e_tail = torch.exp(s_tail - m[..., None]).to(dt).view(B, Hkv, T, G, p.W // C, C).transpose(3, 4)
    v1 = torch.cat([vt, ones.expand(B, Hkv, T, p.W, 1)], -1).view(B, Hkv, T, p.W // C, C, Dh + 1)
    parts = [(e_tail @ v1).transpose(3, 4)]                                        # [B, Hkv, T, G, Wc, Dh+1]
    if p.n_shared:
        S = p.n_shared
        e_sh = torch.exp(s_sh - m[..., None]).to(dt).view(B, Hkv, T * G, S // C, C).transpose(2, 3)
        vs = vs.masked_fill(~(p.shared_ok.any(1))[:, None, :, None], 0)            # [B, Hkv, S, Dh]
        vs1 = torch.cat([vs, ones.expand(B, Hkv, S, 1)], -1).view(B, Hkv, S // C, C, Dh + 1)
        sh = (e_sh @ vs1).transpose(2, 3).reshape(B, Hkv, T, G, S // C, Dh + 1)   # [B, Hkv, T, G, Sc, Dh+1]
        parts.insert(0, sh)
    total = torch.cumsum(torch.cat(parts, 4).double(), 4)[..., -1, :]             # in position order
    out = (total[..., :Dh] / total[..., Dh:]).to(dt)                               # [B, Hkv, T, G, Dh]
    return out.permute(0, 2, 1, 3, 4).reshape(B, T, Hq, Dh)


def tree_attention(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, tree_mask, sm_scale=None, *,
                   window=None, check_values=True):
    """The twin's signature (`mtp_triton.reference.tree_attention`): plan + attention for one layer."""
    if check_values:
        from .reference import _checks
        _checks("tree_attention").check_tree_attention_inputs(q, k_cache, v_cache, block_table, cache_lens, k_tree,
                                                              v_tree, tree_mask)
    return attention(q, k_cache, v_cache, k_tree, v_tree, plan(block_table, cache_lens, tree_mask, k_cache.shape[1],
                                                               window), sm_scale)
