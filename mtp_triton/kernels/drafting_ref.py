"""The specification of `drafting.py`: its PyTorch twin (`fused_draft`, same signature, same results) and the input
checks both share. Torch only; the kernel file imports its checks from here, so copy the two files together. The twin
materialises the [B, H, V] logits, in fp32 (fp64 stays fp64), and ranks them by the kernel's rule (descending, ties
-> lower row, NaN lowest).
"""
import torch
import torch.nn.functional as F

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_TOKEN_ID = 2 ** 31 - 1     # token ids fit int32 in every vocabulary; a larger map entry is garbage


def check_fused_draft_inputs(hidden, res_weight, res_bias, lm_head, top_k, token_map=None, values=True):
    """Validate ``fused_draft`` arguments; raise ValueError/TypeError with a clear message.

    hidden [B, D]; res_weight [H, D, D]; res_bias [H, D]; lm_head [V, D] (shared) or [H, V, D] (one per head);
    1 <= top_k <= V; token_map None or int64 [V], strictly increasing ids in [0, 2^31 - 1]. `values=False` skips
    the checks that read token_map's values (a host sync on a GPU); shapes, dtypes and devices are always checked.
    """
    if (res_weight is None) != (res_bias is None):
        raise ValueError("fused_draft: res_weight and res_bias are both tensors, or both None (the ResBlock off)")
    tensors = dict(hidden=hidden, res_weight=res_weight, res_bias=res_bias, lm_head=lm_head)
    if res_weight is None:                       # the ResBlock switched off: one "head", z = x
        tensors = dict(hidden=hidden, lm_head=lm_head)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fused_draft: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"fused_draft: {name} must be a floating tensor, got {t.dtype}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"fused_draft: {name} has dtype {t.dtype}; supported: float16, bfloat16, float32, "
                            f"float64")
    if hidden.dim() != 2:
        raise ValueError(f"fused_draft: hidden must be [B, D], got shape {tuple(hidden.shape)}")
    B, D = hidden.shape
    if res_weight is not None and (res_weight.dim() != 3 or res_weight.shape[1:] != (D, D)):
        raise ValueError(f"fused_draft: res_weight must be [H, {D}, {D}], got {tuple(res_weight.shape)}")
    H = 1 if res_weight is None else res_weight.shape[0]
    if H < 1:
        raise ValueError("fused_draft: need at least one head (res_weight.shape[0] >= 1)")
    if res_bias is not None and tuple(res_bias.shape) != (H, D):
        raise ValueError(f"fused_draft: res_bias must be [{H}, {D}], got {tuple(res_bias.shape)}")
    if not ((lm_head.dim() == 2 and lm_head.shape[1] == D) or
            (lm_head.dim() == 3 and lm_head.shape[0] == H and lm_head.shape[2] == D)):
        raise ValueError(f"fused_draft: lm_head must be [V, {D}] (shared) or [{H}, V, {D}] (one per head), got "
                         f"{tuple(lm_head.shape)}")
    V = lm_head.shape[-2]
    if B < 1 or V < 1:
        raise ValueError(f"fused_draft: empty input (B={B}, V={V})")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= V:
        raise ValueError(f"fused_draft: top_k must be an int in [1, V={V}], got {top_k!r}")
    if token_map is not None:
        if not isinstance(token_map, torch.Tensor) or token_map.dtype != torch.int64:
            raise TypeError(f"fused_draft: token_map must be an int64 tensor, got "
                            f"{getattr(token_map, 'dtype', type(token_map).__name__)}")
        if tuple(token_map.shape) != (V,):
            raise ValueError(f"fused_draft: token_map must be [{V}] (one id per lm_head row), got "
                             f"{tuple(token_map.shape)}")
        tensors["token_map"] = token_map
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"fused_draft: all tensors must be on one device, got {sorted(map(str, devices))}")
    dtypes = {res_weight.dtype, res_bias.dtype} if res_weight is not None else {hidden.dtype}
    if len(dtypes) != 1:
        raise TypeError(f"fused_draft: res_weight and res_bias must share a dtype, got {sorted(map(str, dtypes))}")
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"fused_draft: {name} must be contiguous (call .contiguous())")
    if token_map is not None and values:
        if bool((token_map < 0).any()) or bool((token_map > MAX_TOKEN_ID).any()):
            raise ValueError(f"fused_draft: token_map ids must be in [0, {MAX_TOKEN_ID}]")
        if V > 1 and bool((token_map[1:] <= token_map[:-1]).any()):
            raise ValueError("fused_draft: token_map must be strictly increasing (sorted ids, no repeats), so that "
                             "ties still go to the lower id")


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
    check_fused_draft_inputs(hidden, res_weight, res_bias, lm_head, top_k, token_map, values=check_values)
    acc = torch.promote_types(hidden.dtype, torch.float32)               # fp32, or fp64 for fp64 inputs
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

