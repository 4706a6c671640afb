"""Tree acceptance (greedy and lossless sampling) — Triton.

Input checks live here so this file can be copied alone (torch + triton only); the
PyTorch twin in ``mtp_triton.reference`` imports them, so both reject the same inputs.
"""
import torch


def check_parents(parents, B, T, who="tree_accept"):
    """parents [T] or [B, T] int64: parents[.., 0] = -1; for i > 0, -1 (unused node) or 0 <= p < i.

    An unused node (parent -1) can have no used children. Returns parents expanded to [B, T].
    """
    if not isinstance(parents, torch.Tensor) or parents.dtype != torch.int64:
        raise TypeError(f"{who}: parents must be an int64 tensor")
    if parents.dim() == 1:
        parents = parents.unsqueeze(0).expand(B, -1)
    if tuple(parents.shape) != (B, T):
        raise ValueError(f"{who}: parents must be [{T}] or [{B}, {T}], got {tuple(parents.shape)}")
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


def check_tree_accept_inputs(draft_tokens, parents, target_tokens):
    """draft_tokens [B, T] int64; parents [T] or [B, T] int64; target_tokens [B, T] int64."""
    B, T = _check_tokens(draft_tokens)
    if not isinstance(target_tokens, torch.Tensor) or target_tokens.dtype != torch.int64 or \
            tuple(target_tokens.shape) != (B, T):
        raise ValueError(f"tree_accept: target_tokens must be int64 [{B}, {T}]")
    if len({draft_tokens.device, parents.device, target_tokens.device}) != 1:
        raise ValueError("tree_accept: all tensors must be on one device")
    return check_parents(parents, B, T)


def check_tree_accept_sample_inputs(draft_tokens, parents, target_probs, u_accept, u_sample):
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
    if T > 1 and (bool((draft_tokens[:, 1:] < 0).any()) or bool((draft_tokens[:, 1:] >= V).any())):
        raise ValueError(f"{who}: draft token ids must be in [0, V={V})")
    return check_parents(parents, B, T, who)
