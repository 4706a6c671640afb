"""Target distributions for sampling: temperature, then top-p (nucleus), on the target's logits."""
import torch


def logits_to_probs(logits, temperature=1.0, top_p=1.0):
    """logits [..., V] -> probs [..., V] (fp32 or fp64): softmax(logits / temperature), then top-p.

    top-p keeps the smallest set of most-probable ids whose mass reaches top_p (the id that crosses
    the threshold is kept; ties in probability keep the lower id first) and renormalises.
    """
    if temperature <= 0:
        raise ValueError("logits_to_probs: temperature must be > 0 (use greedy decoding for 0)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    x = logits.double() if logits.dtype == torch.float64 else logits.float()
    probs = torch.softmax(x / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p          # mass strictly before each id
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
