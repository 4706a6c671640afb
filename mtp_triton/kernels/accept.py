"""Tree acceptance (greedy and lossless sampling) — Triton.

After the target model scored every tree node in one forward, acceptance decides how much of the tree
survives. Both kernels run one program per sequence and read only O(T + V) numbers, so they cost
microseconds; what they save is the host round-trip and the Python loop over the batch.

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
The sibling scan is vectorised: with p_cur[c] = p(x_c), or 0 if an earlier sibling had the same token,
the renormaliser seen by child c is sum(p) - sum_{earlier siblings c'} p_cur[c'].

Exactness: the random numbers are inputs, so kernel and reference (`mtp_triton.reference`) make the
same decisions; the comparison u * total < p(x) is done in fp64 as the reference does (a Python float
product), and sums are fp32 (fp64 for fp64 probs). They may differ only when a random number falls
within fp32 rounding (~1e-7 relative) of a decision boundary, where the two sum in different orders.

Input checks live here so this file can be copied alone (torch + triton only); the
PyTorch twin in ``mtp_triton.reference`` imports them, so both reject the same inputs.

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


def check_parents(parents, B, T, who="tree_accept", values=True):
    """parents [T] or [B, T] int64: parents[.., 0] = -1; for i > 0, -1 (unused node) or 0 <= p < i.

    An unused node (parent -1) can have no used children. Returns parents expanded to [B, T].
    """
    if not isinstance(parents, torch.Tensor) or parents.dtype != torch.int64:
        raise TypeError(f"{who}: parents must be an int64 tensor")
    if parents.dim() == 1:
        parents = parents.unsqueeze(0).expand(B, -1)
    if tuple(parents.shape) != (B, T):
        raise ValueError(f"{who}: parents must be [{T}] or [{B}, {T}], got {tuple(parents.shape)}")
    if not values:
        return parents
    if bool((parents[:, 0] != -1).any()):
        raise ValueError(f"{who}: parents[.., 0] must be -1 (node 0 is the root)")
    idx = torch.arange(T, device=parents.device)
    if bool((parents >= idx).any()) or bool((parents < -1).any()):
        raise ValueError(f"{who}: parents[i] must be -1 or in [0, i) (parents come before children)")
    if T > 1:
        p = parents[:, 1:]
        used = torch.ones(B, T, dtype=torch.bool, device=parents.device)
        used[:, 1:] = p >= 0
        parent_used = used.gather(1, p.clamp(min=0))
        if bool((used[:, 1:] & ~parent_used).any()):
            raise ValueError(f"{who}: a node's parent is an unused node (parent -1)")
    return parents


def _check_tokens(draft_tokens, B_T=None, who="tree_accept"):
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dtype != torch.int64 or draft_tokens.dim() != 2:
        raise TypeError(f"{who}: draft_tokens must be int64 [B, T]")
    B, T = draft_tokens.shape
    if B < 1 or T < 1:
        raise ValueError(f"{who}: empty draft_tokens {tuple(draft_tokens.shape)}")
    return B, T


def check_tree_accept_inputs(draft_tokens, parents, target_tokens, values=True):
    """draft_tokens [B, T] int64; parents [T] or [B, T] int64; target_tokens [B, T] int64."""
    B, T = _check_tokens(draft_tokens)
    if not isinstance(target_tokens, torch.Tensor) or target_tokens.dtype != torch.int64 or \
            tuple(target_tokens.shape) != (B, T):
        raise ValueError(f"tree_accept: target_tokens must be int64 [{B}, {T}]")
    if len({draft_tokens.device, parents.device, target_tokens.device}) != 1:
        raise ValueError("tree_accept: all tensors must be on one device")
    return check_parents(parents, B, T, values=values)


def check_tree_accept_sample_inputs(draft_tokens, parents, target_probs, u_accept, u_sample, values=True):
    """draft_tokens [B, T] int64; parents [T] or [B, T]; target_probs [B, T, V] float (rows sum to 1);
    u_accept [B, T] float in [0, 1) (entry 0 unused); u_sample [B] float in [0, 1)."""
    who = "tree_accept_sample"
    B, T = _check_tokens(draft_tokens, who=who)
    if not isinstance(target_probs, torch.Tensor) or not target_probs.is_floating_point() or \
            target_probs.dim() != 3 or target_probs.shape[:2] != (B, T):
        raise ValueError(f"{who}: target_probs must be float [{B}, {T}, V]")
    if not isinstance(u_accept, torch.Tensor) or not u_accept.is_floating_point() or tuple(u_accept.shape) != (B, T):
        raise ValueError(f"{who}: u_accept must be float [{B}, {T}]")
    if not isinstance(u_sample, torch.Tensor) or not u_sample.is_floating_point() or tuple(u_sample.shape) != (B,):
        raise ValueError(f"{who}: u_sample must be float [{B}]")
    if len({t.device for t in (draft_tokens, parents, target_probs, u_accept, u_sample)}) != 1:
        raise ValueError(f"{who}: all tensors must be on one device")
    for name, t in dict(target_probs=target_probs, u_accept=u_accept, u_sample=u_sample).items():
        if not t.is_contiguous():
            raise ValueError(f"{who}: {name} must be contiguous")
    V = target_probs.shape[2]
    if values and T > 1 and (bool((draft_tokens[:, 1:] < 0).any()) or bool((draft_tokens[:, 1:] >= V).any())):
        raise ValueError(f"{who}: draft token ids must be in [0, V={V})")
    return check_parents(parents, B, T, who, values)


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
def _tree_accept_sample_kernel(draft_ptr, parents_ptr, probs_ptr, u_accept_ptr, u_sample_ptr,
                               accept_len_ptr, accept_nodes_ptr, next_ptr, T, V, stride_pb,
                               BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)           # one program per sequence
    idx = tl.arange(0, BLOCK_T)                 # [T] node ids
    valid = idx < T
    par = tl.load(parents_ptr + b * stride_pb + idx, mask=valid, other=-1)
    draft = tl.load(draft_ptr + b * T + idx, mask=valid & (idx > 0), other=0)     # [T] token ids
    u_acc = tl.load(u_accept_ptr + b * T + idx, mask=valid, other=1.0).to(tl.float64)
    earlier = idx[None, :] < idx[:, None]                                 # [c, c']: c' comes before c
    same_token = draft[:, None] == draft[None, :]                         # [c, c']
    probs_b = probs_ptr + b * T * V                                       # target_probs[b] [T, V]

    node = b * 0                                # current node (int64), starts at the root
    depth = node.to(tl.int32)
    path = tl.where(idx == 0, 0, -1).to(tl.int64)
    going = node == 0
    while going:
        row = probs_b + node * V
        total = tl.zeros([BLOCK_V], ACC)
        for v0 in range(0, V, BLOCK_V):                                   # sum(p) over vocab tiles
            v = v0 + tl.arange(0, BLOCK_V)
            total += tl.load(row + v, mask=v < V, other=0.0).to(ACC)
        total = tl.sum(total, axis=0)
        child = valid & (par == node)                                     # [T] children of node
        p_x = tl.load(row + draft, mask=child, other=0.0).to(ACC)         # p(x_c)
        # a sibling repeating an earlier sibling's token sees p(x) = 0 (that x was already rejected)
        dup = tl.max(tl.where(earlier & same_token & child[None, :], 1, 0), axis=1) > 0
        p_cur = tl.where(child & ~dup, p_x, 0.0)
        # if c is tried, every earlier sibling was rejected: its renormaliser lost their p_cur
        removed = tl.sum(tl.where(earlier, p_cur[None, :], 0.0), axis=1)
        total_c = total - removed
        accept = child & (total_c > 0) & (u_acc * total_c.to(tl.float64) < p_cur.to(tl.float64))
        first = tl.min(tl.where(accept, idx, BLOCK_T), axis=0)          # the first accepted sibling
        going = first < BLOCK_T
        node = tl.where(going, first, node).to(tl.int64)
        depth = depth + going.to(tl.int32)
        path = tl.where(going & (idx == depth), first, path)

    # bonus token: residual p at the last node (its children, all rejected, zeroed), by inverse CDF
    row = probs_b + node * V
    child = valid & (par == node)
    carry = tl.zeros([1], ACC)
    last_nz = tl.full([1], -1, tl.int64)
    for v0 in range(0, V, BLOCK_V):                                       # pass 1: residual total
        v = v0 + tl.arange(0, BLOCK_V)
        p = tl.load(row + v, mask=v < V, other=0.0).to(ACC)
        rejected = tl.max(tl.where((v[:, None] == draft[None, :]) & child[None, :], 1, 0), axis=1) > 0
        p = tl.where(rejected, 0.0, p)
        carry += tl.sum(p, axis=0)
        last_nz = tl.maximum(last_nz, tl.max(tl.where(p > 0, v, -1), axis=0))
    thresh = tl.load(u_sample_ptr + b).to(ACC) * carry
    carry = tl.zeros([1], ACC)
    found = tl.full([1], V, tl.int64)
    for v0 in range(0, V, BLOCK_V):                                       # pass 2: first id with cdf > thresh
        v = v0 + tl.arange(0, BLOCK_V)
        p = tl.load(row + v, mask=v < V, other=0.0).to(ACC)
        rejected = tl.max(tl.where((v[:, None] == draft[None, :]) & child[None, :], 1, 0), axis=1) > 0
        p = tl.where(rejected, 0.0, p)
        cdf = carry + tl.cumsum(p, axis=0)
        found = tl.minimum(found, tl.min(tl.where((cdf > thresh) & (v < V), v, V), axis=0))
        carry += tl.sum(p, axis=0)
    # an id with zero mass cannot be drawn: clamp to the last id with mass (V - 1 if there is none)
    token = tl.minimum(found, tl.where(last_nz >= 0, last_nz, V - 1))
    tl.store(accept_nodes_ptr + b * T + idx, path, mask=valid)
    tl.store(accept_len_ptr + b, depth.to(tl.int64))
    tl.store(next_ptr + b + tl.arange(0, 1), token)


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
    next_token [B] int64 — exactly as `mtp_triton.reference.tree_accept`.
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


def tree_accept_sample(draft_tokens, parents, target_probs, u_accept, u_sample, *, check_values=True):
    """Lossless tree acceptance at temperature > 0 (Triton): sibling-wise rejection, then residual sampling.

    draft_tokens [B, T] int64; parents [T] or [B, T] int64; target_probs [B, T, V] float (already after
    temperature / top-p; rows need not be normalised); u_accept [B, T] uniforms in [0, 1) (entry 0
    unused); u_sample [B] uniforms in [0, 1). Returns accept_len [B], accept_nodes [B, T], next_token [B]
    (int64), the same decisions as `mtp_triton.reference.tree_accept_sample` for the same random numbers.
    Sums in fp32 (fp64 for fp64 target_probs), the acceptance comparison in fp64.
    """
    check_tree_accept_sample_inputs(draft_tokens, parents, target_probs, u_accept, u_sample, values=check_values)
    B, T, V = target_probs.shape
    parents, stride_pb = _parents_arg(parents, B, T)
    dev = draft_tokens.device
    accept_len = torch.empty(B, dtype=torch.int64, device=dev)
    accept_nodes = torch.empty(B, T, dtype=torch.int64, device=dev)
    next_token = torch.empty(B, dtype=torch.int64, device=dev)
    _check_backend(dev)
    interp = _interpreting()
    block_v = min(triton.next_power_of_2(V), 128 if interp else 1024)
    _tree_accept_sample_kernel[(B,)](
        draft_tokens.contiguous(), parents, target_probs, u_accept, u_sample,
        accept_len, accept_nodes, next_token, T, V, stride_pb,
        BLOCK_T=_block_t(T), BLOCK_V=block_v,
        ACC=tl.float64 if target_probs.dtype == torch.float64 else tl.float32)
    return accept_len, accept_nodes, next_token
