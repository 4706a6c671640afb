"""Fused multi-head drafting (Medusa-style heads + shared LM head + per-head top-k) — Triton.

Input checks live here so this file can be copied alone (torch + triton only); the
PyTorch twin in ``mtp_triton.reference`` imports them, so both reject the same inputs.
"""
import torch


def check_fused_draft_inputs(hidden, res_weight, res_bias, lm_head, top_k):
    """Validate ``fused_draft`` arguments; raise ValueError/TypeError with a clear message.

    hidden [B, D]; res_weight [H, D, D]; res_bias [H, D]; lm_head [V, D]; 1 <= top_k <= V.
    """
    tensors = dict(hidden=hidden, res_weight=res_weight, res_bias=res_bias, lm_head=lm_head)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fused_draft: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"fused_draft: {name} must be a floating tensor, got {t.dtype}")
    if hidden.dim() != 2:
        raise ValueError(f"fused_draft: hidden must be [B, D], got shape {tuple(hidden.shape)}")
    B, D = hidden.shape
    if res_weight.dim() != 3 or res_weight.shape[1:] != (D, D):
        raise ValueError(f"fused_draft: res_weight must be [H, {D}, {D}], got {tuple(res_weight.shape)}")
    H = res_weight.shape[0]
    if H < 1:
        raise ValueError("fused_draft: need at least one head (res_weight.shape[0] >= 1)")
    if tuple(res_bias.shape) != (H, D):
        raise ValueError(f"fused_draft: res_bias must be [{H}, {D}], got {tuple(res_bias.shape)}")
    if lm_head.dim() != 2 or lm_head.shape[1] != D:
        raise ValueError(f"fused_draft: lm_head must be [V, {D}], got {tuple(lm_head.shape)}")
    V = lm_head.shape[0]
    if B < 1 or V < 1:
        raise ValueError(f"fused_draft: empty input (B={B}, V={V})")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= V:
        raise ValueError(f"fused_draft: top_k must be an int in [1, V={V}], got {top_k!r}")
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"fused_draft: all tensors must be on one device, got {sorted(map(str, devices))}")
    dtypes = {res_weight.dtype, res_bias.dtype}
    if len(dtypes) != 1:
        raise TypeError(f"fused_draft: res_weight and res_bias must share a dtype, got {sorted(map(str, dtypes))}")
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"fused_draft: {name} must be contiguous (call .contiguous())")
