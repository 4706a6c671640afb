"""Tiled KV append into the paged cache, all layers in one launch — Triton.

Input checks live here so this file can be copied alone (torch + triton only); the
PyTorch twin in ``mtp_triton.reference`` imports them, so both reject the same inputs.
"""
import torch


def check_kv_append_inputs(k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, accept_nodes, accept_len):
    """k_cache, v_cache [L, NB, BS, Hkv, Dh]; block_table [B, max_blocks] int32; cache_lens [B] int32;
    k_tree, v_tree [L, B, T, Hkv, Dh]; accept_nodes [B, T] int64; accept_len [B] int64 in [0, T).

    Node accept_nodes[b, j] (j = 0..accept_len[b]) goes to position cache_lens[b] + j, so the block
    table must hold cache_lens + accept_len + 1 tokens, and those nodes must be in [0, T).
    """
    who = "kv_append"
    named = dict(k_cache=k_cache, v_cache=v_cache, block_table=block_table, cache_lens=cache_lens,
                 k_tree=k_tree, v_tree=v_tree, accept_nodes=accept_nodes, accept_len=accept_len)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if len({t.device for t in named.values()}) != 1:
        raise ValueError(f"{who}: all tensors must be on one device")
    if k_cache.dim() != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{who}: k_cache/v_cache must both be [L, NB, BS, Hkv, Dh], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    L, NB, BS, Hkv, Dh = k_cache.shape
    if k_tree.dim() != 5 or k_tree.shape != v_tree.shape or k_tree.shape[0] != L or k_tree.shape[3:] != (Hkv, Dh):
        raise ValueError(f"{who}: k_tree/v_tree must be [{L}, B, T, {Hkv}, {Dh}], got "
                         f"{tuple(k_tree.shape)} and {tuple(v_tree.shape)}")
    B, T = k_tree.shape[1], k_tree.shape[2]
    if len({k_cache.dtype, v_cache.dtype, k_tree.dtype, v_tree.dtype}) != 1:
        raise TypeError(f"{who}: caches and tree buffers must share one dtype")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype != torch.int32:
        raise ValueError(f"{who}: block_table must be int32 [{B}, max_blocks], got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if tuple(cache_lens.shape) != (B,) or cache_lens.dtype != torch.int32:
        raise ValueError(f"{who}: cache_lens must be int32 [{B}]")
    if tuple(accept_nodes.shape) != (B, T) or accept_nodes.dtype != torch.int64:
        raise ValueError(f"{who}: accept_nodes must be int64 [{B}, {T}], got {accept_nodes.dtype} "
                         f"{tuple(accept_nodes.shape)}")
    if tuple(accept_len.shape) != (B,) or accept_len.dtype != torch.int64:
        raise ValueError(f"{who}: accept_len must be int64 [{B}]")
    for name, t in named.items():
        if not t.is_contiguous():
            raise ValueError(f"{who}: {name} must be contiguous (call .contiguous())")
    if bool((accept_len < 0).any()) or bool((accept_len >= T).any()):
        raise ValueError(f"{who}: accept_len must be in [0, T={T})")
    j = torch.arange(T, device=accept_nodes.device)
    live = j[None, :] <= accept_len[:, None]
    nodes = accept_nodes[live]
    if bool((nodes < 0).any()) or bool((nodes >= T).any()):
        raise ValueError(f"{who}: accept_nodes[b, :accept_len[b] + 1] must be node ids in [0, T={T})")
    if bool((cache_lens < 0).any()):
        raise ValueError(f"{who}: cache_lens must be >= 0")
    need = cache_lens.long() + accept_len + 1
    if int(need.max()) > block_table.shape[1] * BS:
        raise ValueError(f"{who}: block_table has room for {block_table.shape[1] * BS} tokens, but the "
                         f"append needs {int(need.max())}")
    blocks_used = (need + BS - 1) // BS
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = block_table[cols[None, :] < blocks_used[:, None]]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= NB):
        raise ValueError(f"{who}: block_table entries in use must be in [0, {NB})")
