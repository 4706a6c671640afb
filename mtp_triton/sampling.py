"""The target's choice after a node: greedy argmax at temperature 0, else a sample from temperature + top-p."""
import math

import torch

from .reference import sample_from_probs


def check_temperature(temperature, top_p=1.0):
    """Refuse what would silently give NaN probabilities: non-numbers, NaN, inf, negative values."""
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def check_seed(seed):
    """None, or an integer-like (int, numpy or 0-d torch integer) in [0, 2**64): -> None or an int; else ValueError.

    One seed drives one generator shared by the whole batch: a sampled prompt's tokens depend on the prompts beside
    it in the batch (and on the tree), although each is distributed as the target. For samples that depend on a
    prompt alone, run it alone with its own seed."""
    if seed is None:
        return None
    if isinstance(seed, torch.Tensor):
        if seed.dim() != 0 or seed.is_floating_point() or seed.is_complex() or seed.dtype == torch.bool:
            raise ValueError(f"seed must be None or an int in [0, 2**64), got a {seed.dtype} tensor of shape "
                             f"{tuple(seed.shape)}")
        seed = seed.item()
    if isinstance(seed, bool) or not hasattr(seed, "__index__"):
        raise ValueError(f"seed must be None or an int in [0, 2**64), got {seed!r} ({type(seed).__name__})")
    value = seed.__index__()
    if not 0 <= value < 2 ** 64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {value}")
    return value


def logits_to_probs(logits, temperature=1.0, top_p=1.0):
    """logits [..., V] -> probs [..., V] (fp32 or fp64): softmax(logits / temperature), then top-p.

    The max logit is subtracted before dividing, so any temperature > 0 is safe: one too small to resolve the
    logits' differences gives the limit (all mass on the argmax, shared between exact ties), never NaN. A
    temperature below the logits' dtype's smallest normal number (1.2e-38 in fp32) would be 0 in that dtype (0 / 0 =
    NaN at the argmax): the division then runs in fp64, by max(temperature, 2.2e-308), whose result is already the
    limit for fp32 logits, and the probabilities come back in the logits' precision.
    top-p keeps the smallest set of most-probable ids whose mass reaches top_p (the id that crosses the
    threshold is kept; ties in probability keep the lower id first) and renormalises.
    """
    check_temperature(temperature, top_p)
    if temperature == 0:
        raise ValueError("logits_to_probs: temperature must be > 0 (use greedy decoding for 0)")
    x = logits.double() if logits.dtype == torch.float64 else logits.float()
    dtype = x.dtype
    if temperature < torch.finfo(dtype).tiny:                           # 0 in x's dtype: divide in fp64
        x, temperature = x.double(), max(temperature, torch.finfo(torch.float64).tiny)
    x = (x - x.amax(dim=-1, keepdim=True)) / temperature                # <= 0; -inf only far below the max
    probs = torch.softmax(x, dim=-1).to(dtype)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p          # mass strictly before each id
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class Sampler:
    """What the target would emit after each node. Greedy: argmax over fp32 logits (as transformers). Sampling: the
    uniforms come from one seeded generator on the model's device, so a run is reproducible from its seed."""

    def __init__(self, temperature=0.0, top_p=1.0, seed=None, device="cpu"):
        check_temperature(temperature, top_p)
        seed = check_seed(seed)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.greedy = temperature == 0
        self.gen = None
        if not self.greedy:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(seed if seed is not None else torch.seed())

    def probs(self, logits):
        return logits_to_probs(logits, self.temperature, self.top_p)

    def uniform(self, shape, like, dtype=None):
        return torch.rand(shape, generator=self.gen, device=like.device, dtype=dtype or like.dtype)

    def choose(self, logits):
        """logits [..., V] -> token ids [...] (used for the first token, after prefill)."""
        if self.greedy:
            return logits.float().argmax(-1)
        probs = self.probs(logits)
        u = self.uniform(probs.shape[:-1], probs, torch.float32).reshape(-1)
        return sample_from_probs(probs.reshape(-1, probs.shape[-1]), u).view(probs.shape[:-1])
