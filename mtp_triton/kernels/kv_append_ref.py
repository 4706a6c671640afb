"""The specification of `kv_append.py`: its PyTorch twin (`kv_append`, same signature, same effect on the caches) and
the input checks both share. Torch only; the kernel file imports its checks from here, so copy the two files together.
"""
import torch


def check_kv_append_inputs(k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, accept_nodes, accept_len,
                           values=True):
    """k_cache, v_cache [L, NB, BS, Hkv, Dh]; block_table [B, max_blocks] int32; cache_lens [B] int32;
    k_tree, v_tree [L, B, T, Hkv, Dh]; accept_nodes [B, T] int64; accept_len [B] int64 in [0, T).

    Node accept_nodes[b, j] (j = 0..accept_len[b]) goes to position cache_lens[b] + j, so those nodes must be
    in [0, T) and the entries in use, the first ceil((cache_lens[b] + accept_len[b] + 1) / BS) of row b,
    must be block ids in [0, NB) (unused entries are -1), no block id in use twice.
    Returns the most tokens any sequence appends, max(accept_len) + 1 (0 when B == 0).
    The value checks cost one host sync in all (one .tolist()), not one per check.
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
    if B == 0:
        return 0
    if not values:
        return T                                                         # an upper bound on accept_len + 1
    # Value checks, all computed on the tensors' device and brought back in ONE sync.
    j = torch.arange(T, device=accept_nodes.device)
    live = j[None, :] <= accept_len[:, None]                             # [B, T] tokens to write
    nodes = torch.where(live, accept_nodes, 0)
    need = cache_lens.long() + accept_len + 1                            # [B] tokens after the append
    blocks_used = torch.div(need + BS - 1, BS, rounding_mode="floor")    # [B] table entries in use
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    in_use = cols[None, :] < blocks_used[:, None]                        # [B, max_blocks]
    ids = block_table.long()
    bad_ids = in_use & ((ids < 0) | (ids >= NB))                         # -1 (no block) or out of range
    unused = -1 - torch.arange(ids.numel(), device=ids.device).view_as(ids)   # distinct, all < 0
    ranked = torch.where(in_use, ids, unused).flatten().sort().values
    bad_len, bad_node, bad_cache_len, need_max, bad_block, shared, max_accept = torch.stack([
        ((accept_len < 0) | (accept_len >= T)).any().long(),
        ((nodes < 0) | (nodes >= T)).any().long(),
        (cache_lens < 0).any().long(),
        need.max(),
        bad_ids.any().long(),
        ((ranked[1:] == ranked[:-1]) & (ranked[1:] >= 0)).any().long(),  # a block id in use twice
        accept_len.max(),
    ]).tolist()
    if bad_len:
        raise ValueError(f"{who}: accept_len must be in [0, T={T})")
    if bad_node:
        raise ValueError(f"{who}: accept_nodes[b, :accept_len[b] + 1] must be node ids in [0, T={T})")
    if bad_cache_len:
        raise ValueError(f"{who}: cache_lens must be >= 0")
    if need_max > block_table.shape[1] * BS:
        raise ValueError(f"{who}: block_table has room for {block_table.shape[1] * BS} tokens, but the "
                         f"append needs {need_max}")
    if bad_block:
        b, c = bad_ids.nonzero()[0].tolist()
        raise ValueError(f"{who}: block_table entries in use must be in [0, {NB}): block_table[{b}, {c}] = "
                         f"{int(ids[b, c])}, but sequence {b} needs {int(blocks_used[b])} blocks for "
                         f"{int(need[b])} tokens (-1 marks an entry with no block: give the sequence more blocks)")
    if shared:
        first = {}
        for b, c in in_use.nonzero().tolist():
            seen = first.setdefault(int(ids[b, c]), (b, c))
            if seen != (b, c):
                raise ValueError(f"{who}: block id {int(ids[b, c])} is in use twice, at block_table{list(seen)} "
                                 f"and block_table{[b, c]}: no two sequences (or positions) may share a block")
    return max_accept + 1


def kv_append(k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, accept_nodes, accept_len, *,
              check_values=True):
    """Copy the root's and accepted nodes' K/V into the paged cache, every layer, in place.

    For layer l, sequence b and j = 0..accept_len[b]: node n = accept_nodes[b, j] goes to position
    pos = cache_lens[b] + j, i.e. block block_table[b, pos // BS], slot pos % BS.
    k_cache, v_cache [L, NB, BS, Hkv, Dh]; k_tree, v_tree [L, B, T, Hkv, Dh]. cache_lens is not changed.
    check_values=False trusts the values: an entry in use that is not a block id in [0, NB) (-1 = no
    block) or a column past the table's width raises IndexError here (on CPU; a device-side assert on
    CUDA) where the Triton kernel drops the token; an entry naming another sequence's block is written
    there, overwriting its K/V, as by the kernel. check_values=True refuses both with a ValueError. An accept_len
    outside [0, T) is refused too; unchecked, what happens is unspecified.
    """
    check_kv_append_inputs(k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, accept_nodes, accept_len,
                           values=check_values)
    NB, BS = k_cache.shape[1:3]
    B, T = accept_nodes.shape
    dev = k_cache.device
    # entry j of row b: path entry min(j, accept_len[b]), so entries past the path repeat its last write (same
    # value, same slot) and no host read is needed to know how many there are
    j = torch.minimum(torch.arange(T, device=dev), accept_len[:, None])          # [B, T]
    pos = cache_lens[:, None] + j                                                  # [B, T] positions written
    seq = torch.arange(B, device=dev)[:, None]                                     # [B, 1]
    blocks = block_table[seq, pos // BS]                         # past the table's width: IndexError
    blocks = blocks.masked_fill(blocks < 0, NB)                  # -1 must not wrap to the last block: IndexError
    slots, nodes = pos % BS, accept_nodes.gather(1, j)
    k_cache[:, blocks, slots] = k_tree[:, seq, nodes]
    v_cache[:, blocks, slots] = v_tree[:, seq, nodes]
