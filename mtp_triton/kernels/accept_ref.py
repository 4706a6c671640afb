"""The specification of `accept.py`: its PyTorch twins (`tree_accept`, `tree_accept_sample`, same signatures, same
results) and the input checks both share. Torch only; the kernel file imports its checks from here, so copy the two
files together. The twins are the kernel docstring's rules as plain loops over the tree (sums in fp32, fp64 for fp64
probabilities); the kernels reach the same decisions from the same random numbers.
"""
import torch


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
    """draft_tokens [B, T] int64; parents [T] or [B, T]; target_probs [B, T, V] float, finite and >= 0 (rows
    need not be normalised); u_accept [B, T] float in [0, 1) (entry 0 unused); u_sample [B] float in [0, 1).
    `values=False` skips every check that reads values (host syncs on a GPU)."""
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
    if V < 1:
        raise ValueError(f"{who}: empty vocabulary (target_probs.shape[2] = 0)")
    if values and T > 1 and (bool((draft_tokens[:, 1:] < 0).any()) or bool((draft_tokens[:, 1:] >= V).any())):
        raise ValueError(f"{who}: draft token ids must be in [0, V={V})")
    if values and (not bool(torch.isfinite(target_probs).all()) or bool((target_probs < 0).any())):
        raise ValueError(f"{who}: target_probs must be finite and >= 0 (found negative, NaN or inf values)")
    for name, u in ((("u_accept", u_accept[:, 1:]), ("u_sample", u_sample)) if values else ()):
        if not bool(((u >= 0) & (u < 1)).all()):
            raise ValueError(f"{who}: {name} must hold uniforms in [0, 1) (found values outside, or NaN)")
    return check_parents(parents, B, T, who, values)


def _jumps(parents):
    """parents [B, T] (-1 = root or unused) -> [up_0, up_1, ...]: up_r [B, T] the 2^r-th ancestor of every node
    (the root, and a node past it, is its own; an unused node too), for r < ceil(log2 T): enough for any depth."""
    T = parents.shape[1]
    up = [torch.where(parents >= 0, parents, torch.arange(T, device=parents.device))]
    for _ in range(1, (T - 1).bit_length()):
        up.append(up[-1].gather(1, up[-1]))
    return up


def _all_along(x, up):
    """x [B, T] bool -> [B, T]: x of the node and of every ancestor (pointer jumping: round r folds in the 2^r nodes
    above those folded so far). With x = (the node has a parent) summed instead of and-ed, this is the depth."""
    for u in up:
        x = x & x.gather(1, u)
    return x


def _node_depths(parents, up):
    """parents [B, T] -> depth [B, T] (root 0; unused nodes 0): each round adds the distance to the 2^r-th ancestor."""
    depth = (parents >= 0).long()
    for u in up:
        depth = depth + depth.gather(1, u)
    return depth


def _path_to(depth, up, last):
    """Root-to-`last` node path per sequence, padded with -1: accept_len [B], accept_nodes [B, T]. The node at
    depth k is `last`'s ancestor accept_len - k levels up: jumps of 2^r for each bit r of that distance."""
    B, T = depth.shape
    accept_len = depth.gather(1, last[:, None])[:, 0]
    dist = accept_len[:, None] - torch.arange(T, device=depth.device)           # [B, T]
    node = last[:, None].expand(B, T)
    for r, u in enumerate(up):
        node = torch.where((dist >> r) & 1 == 1, u.gather(1, node), node)
    return accept_len, torch.where(dist >= 0, node, -1)


def tree_accept(draft_tokens, parents, target_tokens, *, check_values=True):
    """Greedy tree acceptance (Medusa / SpecInfer).

    Node i > 0 is accepted iff its parent p is accepted and draft_tokens[i] == target_tokens[p];
    the root is always accepted; a node with parent -1 is unused. The deepest accepted node n
    (ties: lowest index) ends the accepted path; the bonus token is target_tokens[n].
    Here: a node matches iff it is the root or draft_tokens[i] == target_tokens[parent[i]], and is accepted iff it
    and all its ancestors match; paths and depths by pointer jumping over the parents (ceil(log2 T) rounds).
    draft_tokens [B, T] int64; parents [T] or [B, T] int64; target_tokens [B, T] int64.
    returns accept_len [B] int64, accept_nodes [B, T] int64 (path from root, -1 padded), next_token [B] int64.
    """
    parents = check_tree_accept_inputs(draft_tokens, parents, target_tokens, values=check_values)
    up = _jumps(parents)
    root = torch.arange(parents.shape[1], device=parents.device) == 0
    match = root | ((parents >= 0) & (draft_tokens == target_tokens.gather(1, parents.clamp(min=0))))
    depth = _node_depths(parents, up)
    score = torch.where(_all_along(match, up), depth, -1)
    last = torch.argmax(score, dim=1)          # first index among the deepest accepted nodes
    accept_len, accept_nodes = _path_to(depth, up, last)
    next_token = target_tokens.gather(1, last[:, None])[:, 0]
    return accept_len, accept_nodes, next_token


def sample_from_probs(probs, u):
    """Inverse-CDF sampling: the first id whose cumulative probability exceeds u * sum(probs).

    probs [B, V] (need not be normalised; >= 0); u [B] in [0, 1). returns ids [B] int64.
    """
    cdf = torch.cumsum(probs.to(torch.promote_types(probs.dtype, torch.float32)), dim=-1)
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
    parents = check_tree_accept_sample_inputs(draft_tokens, parents, target_probs, u_accept, u_sample,
                                              values=check_values)
    B, T = draft_tokens.shape
    acc = torch.promote_types(target_probs.dtype, torch.float32)
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

