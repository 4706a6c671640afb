"""Tree acceptance (greedy and lossless sampling) — Triton.

After the target model scored every tree node in one forward, acceptance decides how much of the tree
survives. Greedy acceptance is one program per sequence reading O(T) numbers; sampling reads the B*T*V
target probabilities once over a wide grid, then one program per sequence reads O(T * V / 2048) numbers.
Both cost microseconds; what they save is the host round-trip and the Python loop over the batch.

Greedy (Medusa / SpecInfer): node i > 0 is accepted iff its parent p is accepted and
draft_tokens[i] == target_tokens[p]. The deepest accepted node n (lowest index among equals) ends the
path; the bonus token is target_tokens[n]. "Accepted" is an AND over the root-to-node path and the depth
is a path length, so both are computed with pointer jumping (list ranking): log2(T) rounds of
`x[i] <- x[i] (op) x[anc[i]], anc[i] <- anc[anc[i]]`, the gathers done with a one-hot [T, T] compare.

Sampling (SpecInfer, Miao et al. 2023; EAGLE, Li et al. 2024), lossless at any temperature: walk from the
root; at node n with target distribution p = target_probs[n], try n's children c in index order: accept
c (token x) iff u_accept[c] < p(x) / sum(p); on rejection set p(x) = 0 and try the next sibling with the
renormalised p. If every child is rejected (or n is a leaf), the bonus token is drawn from the residual
p by inverse CDF with u_sample. The emitted token at each depth is distributed exactly as p: a sibling's
token x is emitted with probability p(x) whether or not x was drafted (sampling without replacement).

How the kernels avoid O(V x T) work. Only sums over V are needed, and removing a rejected token x only
subtracts p(x): with p_cur[c] = p(x_c), or 0 if an earlier sibling had the same token, the renormaliser
seen by child c is sum(p) - sum_{earlier siblings c'} p_cur[c']. And what happens at node n depends only
on n's own row, so every node's "first accepted child" is computed at once, before the walk:
  1. `_tree_accept_sums_kernel`, grid (B*T, V-chunk groups): sums[b, n, c] = sum of p_n over chunk c
     (CHUNK ids) and nnz[b, n, c] = its count of ids with p > 0, and the same per group of CPP chunks.
     Reads target_probs once: B*T*V*4 bytes (fp32), spread over every SM (8.2 MB at T = 64, V = 32000:
     ~2 us at 4 TB/s).
  2. `_tree_accept_walk_kernel`, one program per sequence: sum(p_n) of every node from its group sums;
     the accept test of every child from T gathered p(x) values; next[n] = first accepted child; the
     walk follows next[] in registers. At the last node n, the residual's group and chunk masses are the
     stored sums minus the mass of n's (all rejected) children's tokens in them (an item has mass iff its
     nnz minus those tokens with p > 0 is > 0: exact integers). Inverse CDF coarse to fine: the first
     group whose cumulative mass exceeds u_sample * total, the first such chunk in it, and only that
     chunk's CHUNK ids are read, with n's children's tokens zeroed.
A zero-mass id is never drawn: the scan takes the first id with mass whose cdf exceeds the threshold,
else the last id with mass in the chunk (V - 1 if the residual has no mass at all, as the reference).

Exactness: the random numbers are inputs, so kernel and twin (`accept_ref.py`) make the
same decisions; the comparison u * total < p(x) is done in fp64 as the reference does (a Python float
product), and sums are fp32 (fp64 for fp64 probs). They may differ only when a random number falls
within fp32 rounding (~1e-7 of the row's mass) of a decision boundary, where the two sum in different
orders: the reference sums the row with the rejected ids zeroed, the kernel sums chunk sums and subtracts
the rejected p(x) (so a chunk's residual is known to ~1e-7 of that chunk's mass).
Invalid values (negative, NaN or inf probabilities, u outside [0, 1)) are refused under check_values;
with check_values=False they give unspecified results (kernel and reference may then differ).

Its specification, `accept_ref.py` beside it (torch only), holds the PyTorch twins and the input checks
imported below (so both reject the same inputs): copy the two files together.

Example:
    >>> parents = torch.tensor([-1, 0, 0, 1])           # root, two children, a grandchild under node 1
    >>> draft = torch.tensor([[0, 5, 7, 9]])
    >>> target = torch.tensor([[5, 9, 3, 4]])            # target's choice after each node
    >>> tree_accept(draft, parents, target)             # accepts 1 (5 == target[0]) and 3 (9 == target[1])
    (tensor([2]), tensor([[ 0,  1,  3, -1]]), tensor([4]))
"""
import torch
import triton
import triton.language as tl

from .accept_ref import check_tree_accept_inputs, check_tree_accept_sample_inputs


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _tree_accept_kernel(draft_ptr, parents_ptr, target_ptr, accept_len_ptr, accept_nodes_ptr, next_ptr,
                        T, stride_pb, BLOCK_T: tl.constexpr, LOG_T: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)           # one program per sequence
    idx = tl.arange(0, BLOCK_T)                 # [T] node ids
    valid = idx < T
    par = tl.load(parents_ptr + b * stride_pb + idx, mask=valid, other=-1)          # [T] -1: root/unused
    draft = tl.load(draft_ptr + b * T + idx, mask=valid, other=0)
    target_at_parent = tl.load(target_ptr + b * T + par, mask=valid & (par >= 0), other=0)
    # the local test on the edge parent -> i; the root always passes
    ok = ((idx == 0) | ((par >= 0) & (draft == target_at_parent))).to(tl.int32)
    dep = (par >= 0).to(tl.int32)               # edge length to the parent
    anc = tl.where(par >= 0, par, idx)          # jump pointer; the root and unused nodes point at themselves

    # pointer jumping: after k rounds, ok[i] = AND of the tests on the 2^k edges above i, dep[i] = their
    # count, anc[i] = the 2^k-th ancestor (clamped at the root). Depth < BLOCK_T = 2^LOG_T.
    for _ in tl.static_range(LOG_T):
        jump = anc[:, None] == idx[None, :]                               # [T, T] one-hot: row i -> anc[i]
        ok = ok * tl.sum(tl.where(jump, ok[None, :], 0), axis=1)
        dep = dep + tl.sum(tl.where(jump, dep[None, :], 0), axis=1)
        anc = tl.sum(tl.where(jump, anc[None, :], 0), axis=1)

    score = tl.where(ok != 0, dep, -1)
    accept_len = tl.max(score, axis=0)                                    # depth of the deepest accepted node
    last = tl.min(tl.where(score == accept_len, idx, BLOCK_T), axis=0)    # ties: the lowest index

    # walk back up from `last`, writing the path from its end: path[depth] = node
    path = tl.where(idx == accept_len, last, -1).to(tl.int64)
    cur = last.to(tl.int64)
    for k in range(accept_len):
        cur = tl.sum(tl.where(idx == cur, par, 0), axis=0)               # cur <- parents[cur]
        path = tl.where(idx == accept_len - 1 - k, cur, path)
    tl.store(accept_nodes_ptr + b * T + idx, path, mask=valid)
    tl.store(accept_len_ptr + b, accept_len.to(tl.int64))
    tl.store(next_ptr + b, tl.load(target_ptr + b * T + last))


@triton.jit
def _tree_accept_sums_kernel(probs_ptr, sums_ptr, nnz_ptr, gsums_ptr, gnnz_ptr, R, V, NC, NG,
                             RPP: tl.constexpr, CPP: tl.constexpr, CHUNK: tl.constexpr, ACC: tl.constexpr):
    """Mass and support of every chunk and group of every row (r = b * T + n, one target distribution):

        sums[r, c]  = sum_{v in chunk c} p[r, v]      nnz[r, c]  = #{v in chunk c: p[r, v] > 0}
        gsums[r, g] = sum of its CPP chunks' sums     gnnz[r, g] = sum of their nnz
    Chunk c holds ids [c * CHUNK, (c + 1) * CHUNK); group g = one program's CPP chunks; RPP rows per program.
    """
    r = tl.program_id(0).to(tl.int64) * RPP + tl.arange(0, RPP)            # [RPP] rows
    g = tl.program_id(1).to(tl.int64)                                      # this program's group
    c = g * CPP + tl.arange(0, CPP)                                        # [CPP] chunk ids
    v = c[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]                  # [CPP, CHUNK] token ids
    p = tl.load(probs_ptr + r[:, None, None] * V + v[None, :, :],
                mask=(r[:, None, None] < R) & (v[None, :, :] < V), other=0.0).to(ACC)   # [RPP, CPP, CHUNK]
    s = tl.sum(p, axis=2)                                                  # [RPP, CPP]
    n = tl.sum((p > 0).to(tl.int32), axis=2)
    keep = (r[:, None] < R) & (c[None, :] < NC)
    tl.store(sums_ptr + r[:, None] * NC + c[None, :], s, mask=keep)
    tl.store(nnz_ptr + r[:, None] * NC + c[None, :], n, mask=keep)
    tl.store(gsums_ptr + r * NG + g, tl.sum(s, axis=1), mask=r < R)
    tl.store(gnnz_ptr + r * NG + g, tl.sum(n, axis=1), mask=r < R)


@triton.jit
def _first_crossing(mass, has, item, carry, thresh, NONE):
    """Items in increasing order, mass[i] >= 0 (0 where not has[i]), cumulative mass carry + cumsum(mass):
    the first item with mass whose cumulative mass exceeds thresh, else the last item with mass, else NONE.
    Returns (that item, the cumulative mass before it)."""
    cum = carry + tl.cumsum(mass, axis=0)
    first = tl.min(tl.where(has & (cum > thresh), item, NONE), axis=0)
    last = tl.max(tl.where(has, item, -1), axis=0)
    pick = tl.where(first < NONE, first, tl.where(last >= 0, last, NONE))
    return pick, carry + tl.sum(tl.where(item < pick, mass, 0.0), axis=0)


@triton.jit
def _residual_mass(sums_ptr, nnz_ptr, item, n_items, rej_item, rej_p, rej_pos):
    """The residual's mass and support per item (group or chunk) of the last node's row: the stored sums and
    counts minus the rejected tokens' (rej_item[j] = the item holding rejected token j, -1: none)."""
    hit = item[:, None] == rej_item[None, :]                              # [items, T]
    cnt = tl.load(nnz_ptr + item, mask=item < n_items, other=0) - tl.sum(tl.where(hit, rej_pos[None, :], 0), 1)
    mass = tl.load(sums_ptr + item, mask=item < n_items, other=0.0) - tl.sum(tl.where(hit, rej_p[None, :], 0.0), 1)
    return tl.where(cnt > 0, tl.maximum(mass, 0.0), 0.0), cnt > 0


@triton.jit
def _tree_accept_walk_kernel(draft_ptr, parents_ptr, probs_ptr, u_accept_ptr, u_sample_ptr,
                             sums_ptr, nnz_ptr, gsums_ptr, gnnz_ptr,
                             accept_len_ptr, accept_nodes_ptr, next_ptr, T, V, NC, NG, stride_pb,
                             BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, CPP: tl.constexpr,
                             CHUNK: tl.constexpr, ACC: tl.constexpr):
    """One sequence: all accept tests at once, the walk along next[], then the residual's inverse CDF
    (group -> chunk -> id) from the chunk sums of `_tree_accept_sums_kernel`."""
    b = tl.program_id(0).to(tl.int64)           # one program per sequence
    idx = tl.arange(0, BLOCK_T)                 # [T] node ids
    valid = idx < T
    # node ids and token ids as int32 (V < 2^31): the [T, T] and [CHUNK, T] compares below stay small
    par = tl.load(parents_ptr + b * stride_pb + idx, mask=valid, other=-1).to(tl.int32)   # [T] -1: root/unused
    draft = tl.load(draft_ptr + b * T + idx, mask=valid & (idx > 0), other=0).to(tl.int32)  # [T] token ids
    u_acc = tl.load(u_accept_ptr + b * T + idx, mask=valid, other=1.0).to(tl.float64)
    probs_b = probs_ptr + b * T * V                                       # target_probs[b] [T, V]

    # 1. every child's accept test, as if its parent were reached and its earlier siblings rejected
    child = valid & (par >= 0)                                            # [T] nodes with a parent
    p_x = tl.load(probs_b + par.to(tl.int64) * V + draft, mask=child, other=0.0).to(ACC)   # p_parent(x_c)
    g = tl.arange(0, BLOCK_G)
    gs = tl.load(gsums_ptr + (b * T + par[:, None]) * NG + g[None, :],
                 mask=child[:, None] & (g[None, :] < NG), other=0.0)      # [T, BLOCK_G] the parent's groups
    total_par = tl.sum(gs, axis=1)                                        # sum(p_parent)
    earlier = idx[None, :] < idx[:, None]                                 # [c, c']: c' comes before c
    sibling = (par[:, None] == par[None, :]) & child[None, :]             # [c, c']: same parent
    dup = tl.max(tl.where(earlier & sibling & (draft[:, None] == draft[None, :]), 1, 0), axis=1) > 0
    p_cur = tl.where(child & ~dup, p_x, 0.0)        # a repeated token was already rejected: p(x) = 0
    removed = tl.sum(tl.where(earlier & sibling, p_cur[None, :], 0.0), axis=1)   # earlier siblings' mass
    total_c = total_par - removed
    accept = child & (total_c > 0) & (u_acc * total_c.to(tl.float64) < p_cur.to(tl.float64))
    # next[n] = the first accepted child of n (BLOCK_T: none)
    nxt = tl.min(tl.where((par[None, :] == idx[:, None]) & accept[None, :], idx[None, :], BLOCK_T), axis=1)

    # 2. the walk: follow next[] from the root
    node = b * 0                                # int64 scalar, the root
    depth = node.to(tl.int32)
    path = tl.where(idx == 0, 0, -1).to(tl.int64)
    step = tl.min(tl.where(idx == 0, nxt, BLOCK_T), axis=0)
    while step < BLOCK_T:
        node = step.to(tl.int64)
        depth += 1
        path = tl.where(idx == depth, node, path)
        step = tl.min(tl.where(idx == node, nxt, BLOCK_T), axis=0)

    # 3. bonus token from the residual at the last node: p_node without its children's tokens (all rejected).
    #    Inverse CDF, coarse to fine: the group, then the chunk inside it, then the id inside that chunk.
    rej = valid & (par == node)                                           # [T] the last node's children
    once = rej & ~dup                                                     # each rejected token once
    rej_p = tl.where(once, p_x, 0.0)
    rej_pos = (once & (p_x > 0)).to(tl.int32)
    row = b * T + node
    mass, has = _residual_mass(gsums_ptr + row * NG, gnnz_ptr + row * NG, g, NG,
                               tl.where(once, draft // (CPP * CHUNK), -1), rej_p, rej_pos)
    thresh = tl.load(u_sample_ptr + b).to(ACC) * tl.sum(mass, axis=0)
    grp, carry = _first_crossing(mass, has, g, 0.0, thresh, NG)
    c = grp * CPP + tl.arange(0, CPP)                                     # [CPP] the group's chunks
    mass, has = _residual_mass(sums_ptr + row * NC, nnz_ptr + row * NC, c, NC,
                               tl.where(once, draft // CHUNK, -1), rej_p, rej_pos)
    chunk, carry = _first_crossing(mass, has, c, carry, thresh, NC)
    v = chunk * CHUNK + tl.arange(0, CHUNK)                               # [CHUNK] the chunk's ids
    p = tl.load(probs_b + node * V + v, mask=v < V, other=0.0).to(ACC)
    p = tl.where(tl.max(tl.where((v[:, None] == draft[None, :]) & rej[None, :], 1, 0), axis=1) > 0, 0.0, p)
    token, _ = _first_crossing(p, p > 0, v, carry, thresh, V)
    token = tl.where(token < V, token, V - 1)   # no mass left at all (outside the contract): the last id
    tl.store(accept_nodes_ptr + b * T + idx, path, mask=valid)
    tl.store(accept_len_ptr + b, depth.to(tl.int64))
    tl.store(next_ptr + b, token.to(tl.int64))


# ----------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------
def _interpreting():
    """True when these kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import time)."""
    return type(_tree_accept_kernel).__name__ == "InterpretedFunction"


def _check_backend(device):
    if device.type != "cuda" and not _interpreting():
        raise RuntimeError("tree_accept (Triton): tensors must be on a CUDA device, or run the kernels in Triton's "
                           "interpreter: call mtp_triton.use_interpreter() (or set TRITON_INTERPRET=1) before "
                           "importing them")


def _block_t(T):
    return max(16, triton.next_power_of_2(T))


def _parents_arg(parents, B, T):
    """parents [T] (shared: batch stride 0) or [B, T], contiguous, and its batch stride."""
    parents = parents.contiguous()
    return parents, (0 if parents.dim() == 1 else T)


def tree_accept(draft_tokens, parents, target_tokens, *, check_values=True):
    """Greedy tree acceptance (Triton), one program per sequence.

    Node i > 0 is accepted iff its parent p is accepted and draft_tokens[i] == target_tokens[p]; the root
    is always accepted; parent -1 marks an unused node. The deepest accepted node n (ties: lowest index)
    ends the path; the bonus token is target_tokens[n].
    draft_tokens [B, T] int64 (entry 0 ignored); parents [T] or [B, T] int64; target_tokens [B, T] int64.
    Returns accept_len [B] int64, accept_nodes [B, T] int64 (root 0, accepted nodes by depth, -1 padded),
    next_token [B] int64 — exactly as `accept_ref.tree_accept`.
    """
    check_tree_accept_inputs(draft_tokens, parents, target_tokens, values=check_values)
    B, T = draft_tokens.shape
    parents, stride_pb = _parents_arg(parents, B, T)
    dev = draft_tokens.device
    _check_backend(dev)
    accept_len = torch.empty(B, dtype=torch.int64, device=dev)
    accept_nodes = torch.empty(B, T, dtype=torch.int64, device=dev)
    next_token = torch.empty(B, dtype=torch.int64, device=dev)
    block_t = _block_t(T)
    _tree_accept_kernel[(B,)](draft_tokens.contiguous(), parents, target_tokens.contiguous(),
                              accept_len, accept_nodes, next_token, T, stride_pb,
                              BLOCK_T=block_t, LOG_T=block_t.bit_length() - 1)
    return accept_len, accept_nodes, next_token


def sample_config(B, T, V, device):
    """Chunking of the vocabulary: CHUNK ids per chunk (the final scan reads one chunk: CHUNK x T compares),
    CPP chunks per group (one summing program; the walk picks a group, then a chunk) with at most 64 groups,
    RPP rows per summing program (1 on a GPU; many under the interpreter, whose cost is per program)."""
    chunk = _p2(V, 16, 256)
    nc = triton.cdiv(V, chunk)
    cpp = max(_p2(nc, 1, 8), _p2(triton.cdiv(nc, 64), 1, 1 << 20))
    rpp = 1 if device.type == "cuda" else _p2(min(B * T, 16384 // (cpp * chunk)), 1, 1024)
    return dict(CHUNK=chunk, CPP=cpp, RPP=rpp, num_warps=8 if T > 16 else 4)


def _p2(n, lo, hi):
    """Next power of two of n, clamped to [lo, hi]."""
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def tree_accept_sample(draft_tokens, parents, target_probs, u_accept, u_sample, *, check_values=True):
    """Lossless tree acceptance at temperature > 0 (Triton): sibling-wise rejection, then residual sampling.

    draft_tokens [B, T] int64; parents [T] or [B, T] int64; target_probs [B, T, V] float (already after
    temperature / top-p; finite, >= 0, rows need not be normalised); u_accept [B, T] uniforms in [0, 1)
    (entry 0 unused); u_sample [B] uniforms in [0, 1). Returns accept_len [B], accept_nodes [B, T],
    next_token [B] (int64), the same decisions as `accept_ref.tree_accept_sample` for the same
    random numbers. Sums in fp32 (fp64 for fp64 target_probs), the acceptance comparison in fp64.
    Two launches: chunk sums of every row over a (B*T, V-chunk) grid, then one walk program per sequence.
    """
    check_tree_accept_sample_inputs(draft_tokens, parents, target_probs, u_accept, u_sample, values=check_values)
    return _tree_accept_sample(draft_tokens, parents, target_probs, u_accept, u_sample)


def _tree_accept_sample(draft_tokens, parents, target_probs, u_accept, u_sample, **overrides):
    """The launches; `overrides` replaces entries of `sample_config` (tests force tiny chunks)."""
    B, T, V = target_probs.shape
    parents, stride_pb = _parents_arg(parents, B, T)
    dev = draft_tokens.device
    _check_backend(dev)
    cfg = {**sample_config(B, T, V, dev), **overrides}
    acc = torch.float64 if target_probs.dtype == torch.float64 else torch.float32
    ACC = tl.float64 if acc == torch.float64 else tl.float32
    NC = triton.cdiv(V, cfg["CHUNK"])
    NG = triton.cdiv(NC, cfg["CPP"])
    sums = torch.empty(B, T, NC, dtype=acc, device=dev)                  # [B, T, NC] chunk masses
    nnz = torch.empty(B, T, NC, dtype=torch.int32, device=dev)           # [B, T, NC] ids with p > 0
    gsums = torch.empty(B, T, NG, dtype=acc, device=dev)                 # [B, T, NG] group masses
    gnnz = torch.empty(B, T, NG, dtype=torch.int32, device=dev)
    _tree_accept_sums_kernel[(triton.cdiv(B * T, cfg["RPP"]), NG)](
        target_probs, sums, nnz, gsums, gnnz, B * T, V, NC, NG,
        RPP=cfg["RPP"], CPP=cfg["CPP"], CHUNK=cfg["CHUNK"], ACC=ACC, num_warps=4)
    accept_len = torch.empty(B, dtype=torch.int64, device=dev)
    accept_nodes = torch.empty(B, T, dtype=torch.int64, device=dev)
    next_token = torch.empty(B, dtype=torch.int64, device=dev)
    _tree_accept_walk_kernel[(B,)](
        draft_tokens.contiguous(), parents, target_probs, u_accept, u_sample, sums, nnz, gsums, gnnz,
        accept_len, accept_nodes, next_token, T, V, NC, NG, stride_pb,
        BLOCK_T=_block_t(T), BLOCK_G=_p2(NG, 16, 1 << 20), CPP=cfg["CPP"], CHUNK=cfg["CHUNK"], ACC=ACC,
        num_warps=cfg["num_warps"])
    return accept_len, accept_nodes, next_token
