"""Tree-masked attention over a paged KV cache — Triton.

Input checks live here so this file can be copied alone (torch + triton only); the
PyTorch twin in ``mtp_triton.reference`` imports them, so both reject the same inputs.
"""
import torch


def check_tree_attention_inputs(q, k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, tree_mask):
    """Validate ``tree_attention`` arguments (shapes, dtypes, devices, and the mask/table values).

    q [B, T, Hq, Dh]; k_cache, v_cache [NB, BS, Hkv, Dh]; block_table [B, max_blocks] int32;
    cache_lens [B] int32; k_tree, v_tree [B, T, Hkv, Dh]; tree_mask [T, T] or [B, T, T] bool.
    The block table must hold room for cache_lens + T tokens (the step appends up to T).
    Returns the mask expanded to [B, T, T].
    """
    named = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, cache_lens=cache_lens,
                 k_tree=k_tree, v_tree=v_tree, tree_mask=tree_mask)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tree_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise ValueError(f"tree_attention: all tensors must be on one device, got {sorted(map(str, devices))}")
    if q.dim() != 4:
        raise ValueError(f"tree_attention: q must be [B, T, Hq, Dh], got {tuple(q.shape)}")
    B, T, Hq, Dh = q.shape
    if B < 1 or T < 1:
        raise ValueError(f"tree_attention: empty batch or tree (B={B}, T={T})")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"tree_attention: k_cache/v_cache must both be [NB, BS, Hkv, Dh], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    NB, BS, Hkv, Dh_c = k_cache.shape
    if Dh_c != Dh:
        raise ValueError(f"tree_attention: head dim of q ({Dh}) and cache ({Dh_c}) differ")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"tree_attention: Hq ({Hq}) must be a multiple of Hkv ({Hkv}) (GQA)")
    if tuple(k_tree.shape) != (B, T, Hkv, Dh) or k_tree.shape != v_tree.shape:
        raise ValueError(f"tree_attention: k_tree/v_tree must be [{B}, {T}, {Hkv}, {Dh}], got "
                         f"{tuple(k_tree.shape)} and {tuple(v_tree.shape)}")
    if not q.is_floating_point() or len({q.dtype, k_cache.dtype, v_cache.dtype, k_tree.dtype, v_tree.dtype}) != 1:
        raise TypeError("tree_attention: q, k_cache, v_cache, k_tree, v_tree must share one floating dtype, got "
                        f"{[str(t.dtype) for t in (q, k_cache, v_cache, k_tree, v_tree)]}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype != torch.int32:
        raise ValueError(f"tree_attention: block_table must be int32 [{B}, max_blocks], got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if tuple(cache_lens.shape) != (B,) or cache_lens.dtype != torch.int32:
        raise ValueError(f"tree_attention: cache_lens must be int32 [{B}], got {cache_lens.dtype} "
                         f"{tuple(cache_lens.shape)}")
    if tree_mask.dtype != torch.bool or tree_mask.shape[-2:] != (T, T) or tree_mask.dim() not in (2, 3) or (
            tree_mask.dim() == 3 and tree_mask.shape[0] != B):
        raise ValueError(f"tree_attention: tree_mask must be bool [{T}, {T}] or [{B}, {T}, {T}], got "
                         f"{tree_mask.dtype} {tuple(tree_mask.shape)}")
    for name in ("q", "k_cache", "v_cache", "k_tree", "v_tree", "block_table", "cache_lens"):
        if not named[name].is_contiguous():
            raise ValueError(f"tree_attention: {name} must be contiguous (call .contiguous())")
    mask = tree_mask.expand(B, T, T)
    eye = torch.eye(T, dtype=torch.bool, device=mask.device)
    if not bool(mask[:, eye].all()):
        raise ValueError("tree_attention: tree_mask must be reflexive (every node sees itself)")
    if bool(mask.triu(1).any()):
        raise ValueError("tree_attention: tree_mask must be lower-triangular (a node sees only earlier nodes)")
    if bool((cache_lens < 0).any()):
        raise ValueError("tree_attention: cache_lens must be >= 0")
    if int((cache_lens.long() + T).max()) > block_table.shape[1] * BS:
        raise ValueError(f"tree_attention: block_table has room for {block_table.shape[1] * BS} tokens, but "
                         f"cache_lens + T needs {int((cache_lens.long() + T).max())}")
    needed = (cache_lens.long() + BS - 1) // BS  # blocks actually read per sequence
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = block_table[cols[None, :] < needed[:, None]]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= NB):
        raise ValueError(f"tree_attention: block_table entries in use must be in [0, {NB})")
    return mask
