"""MTP draft heads (Medusa-style), sharing the model's LM head.

Head h reads the target's final-norm hidden state x at a position t and proposes the token at t + h + 2
(the LM head itself gives t + 1):
    z_h = x + silu(W_h x + b_h),   logits_h = lm_head @ z_h                   (Cai et al. 2024, Medusa)
W_h starts at zero in training (each head starts as the LM head), so `init_heads` draws small random
weights instead, for tests that need heads that disagree with the model.

Files: a folder with `heads.safetensors` (res_weight [H, D, D], res_bias [H, D]) and `heads.json`.
"""
import json
import os

import torch
from torch import nn
from safetensors.torch import load_file, save_file


class MTPHeads(nn.Module):
    def __init__(self, num_heads, hidden_size, dtype=torch.float32, device=None):
        super().__init__()
        if num_heads < 1 or hidden_size < 1:
            raise ValueError(f"MTPHeads: need num_heads >= 1 and hidden_size >= 1, got {num_heads}, {hidden_size}")
        self.res_weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size, dtype=dtype, device=device))
        self.res_bias = nn.Parameter(torch.zeros(num_heads, hidden_size, dtype=dtype, device=device))

    @property
    def num_heads(self):
        return self.res_weight.shape[0]

    @property
    def hidden_size(self):
        return self.res_weight.shape[1]

    def forward(self, x):
        """x [..., D] -> z [..., H, D] (the inputs of the shared LM head)."""
        pre = torch.einsum("...d,hed->...he", x, self.res_weight) + self.res_bias
        return x.unsqueeze(-2) + nn.functional.silu(pre)

    def save(self, path, **meta):
        os.makedirs(path, exist_ok=True)
        save_file({"res_weight": self.res_weight.detach().contiguous().cpu(),
                   "res_bias": self.res_bias.detach().contiguous().cpu()},
                  os.path.join(path, "heads.safetensors"))
        info = {"num_heads": self.num_heads, "hidden_size": self.hidden_size, "format": "mtp_triton.heads/1"}
        info.update(meta)
        with open(os.path.join(path, "heads.json"), "w") as f:
            json.dump(info, f, indent=2)


def load_heads(path, device=None, dtype=None):
    """Load heads saved by `MTPHeads.save` / the training script (a folder or its heads.safetensors)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(folder, "heads.safetensors")
    if not os.path.exists(file):
        raise FileNotFoundError(f"load_heads: no heads.safetensors in {folder!r}")
    tensors = load_file(file)
    if set(tensors) != {"res_weight", "res_bias"}:
        raise ValueError(f"load_heads: {file} must hold res_weight and res_bias, found {sorted(tensors)}")
    w, b = tensors["res_weight"], tensors["res_bias"]
    if w.dim() != 3 or w.shape[1] != w.shape[2] or tuple(b.shape) != (w.shape[0], w.shape[1]):
        raise ValueError(f"load_heads: bad shapes res_weight {tuple(w.shape)}, res_bias {tuple(b.shape)}")
    heads = MTPHeads(w.shape[0], w.shape[1], dtype=dtype or w.dtype, device=device)
    with torch.no_grad():
        heads.res_weight.copy_(w)
        heads.res_bias.copy_(b)
    return heads.eval()


def init_heads(model, num_heads=4, seed=0, scale=1.0):
    """Random (non-identity) heads for `model` (an mtp_triton model or anything with .hidden_size)."""
    D = model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(num_heads, D, D, generator=g, dtype=torch.float64) * (scale / D ** 0.5)
    b = torch.randn(num_heads, D, generator=g, dtype=torch.float64) * 0.1 * scale
    p = next(iter(model.parameters()))
    heads = MTPHeads(num_heads, D, dtype=p.dtype, device=p.device)
    with torch.no_grad():
        heads.res_weight.copy_(w)
        heads.res_bias.copy_(b)
    return heads.eval()
