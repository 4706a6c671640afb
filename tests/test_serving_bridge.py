"""Our kernels on caches laid out the way serving engines lay them out (see docs/serving-engines.md).

* vLLM (FlashAttention / tree-attention backends): one tensor per layer, [2, num_blocks, block_size, num_kv_heads,
  head_size]; block tables padded with the null block 0; tokens written through slot_mapping = block * block_size
  + offset.
* SGLang: a token-level KV pool, k_buffer[layer] [size + page_size, num_kv_heads, head_dim] (slot 0 is the padding
  slot), and req_to_token [max_requests, max_context] holding each token's pool slot.

Both run through `tree_attention` and `kv_append` (Triton kernels, in the interpreter on CPU, and their PyTorch
twins) on VIEWS of those tensors, and both are checked against attention and writes computed from the engines'
own addressing rules (slot mapping / req_to_token). Every slot no sequence owns is NaN, so a stray read shows.
"""
import pytest
import torch

import mtp_triton as mt
from mtp_triton import reference
from mtp_triton.tree import Tree

from conftest import assert_close

Hq, Hkv, Dh = 4, 2, 24                                   # GQA 2:1, head dim not a power of two
TREE = Tree.from_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])        # T = 6, depth 3
IMPLS = {"triton": lambda: (mt.tree_attention, mt.kv_append), "twin": lambda: (reference.tree_attention,
                                                                                reference.kv_append)}


def attention_by_slots(q, k_pool, v_pool, slots, k_tree, v_tree, mask):
    """Ground truth from token slots alone: q [T, Hq, Dh] over pool rows `slots` [n] then the tree (fp64)."""
    k = torch.cat([k_pool[slots], k_tree]).double()                       # [n + T, Hkv, Dh]
    v = torch.cat([v_pool[slots], v_tree]).double()
    T, n = q.shape[0], len(slots)
    visible = torch.cat([torch.ones(T, n, dtype=torch.bool), mask], dim=1)  # [T, n + T]: SGLang's full custom_mask
    k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
    s = torch.einsum("thd,shd->hts", q.double(), k) * Dh ** -0.5
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", p, v)


def step_inputs(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, Dh, generator=g)
    k_tree, v_tree = torch.randn(2, B, T, Hkv, Dh, generator=g).unbind(0)
    return q, k_tree.contiguous(), v_tree.contiguous()


# ---- vLLM ----------------------------------------------------------------------------------------------------
def vllm_slot_mapping(block_table, positions, block_size):
    """vLLM's addressing: slot = block_table[req, pos // block_size] * block_size + pos % block_size."""
    blocks = block_table.long().gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def vllm_to_ours(block_table, cache_lens, T, block_size):
    """vLLM pads a block table with the null block 0; ours marks entries a sequence does not use with -1."""
    used = (cache_lens.long() + T + block_size - 1) // block_size                    # [B] blocks in use this step
    cols = torch.arange(block_table.shape[1])
    return torch.where(cols[None, :] < used[:, None], block_table, -1).to(torch.int32).contiguous()


@pytest.fixture
def vllm_batch():
    """Two requests (19 and 5 cached tokens) in a vLLM-style cache: per layer [2, NB, BS, Hkv, Dh], BS = 16."""
    L, NB, BS, T = 2, 9, 16, TREE.size
    g = torch.Generator().manual_seed(1)
    kv_caches = [torch.full((2, NB, BS, Hkv, Dh), float("nan")) for _ in range(L)]   # NaN = owned by nobody
    block_table = torch.tensor([[3, 7, 0, 0], [5, 0, 0, 0]], dtype=torch.int32)     # 0 = vLLM's null block
    cache_lens = torch.tensor([19, 5], dtype=torch.int32)
    for b in range(2):                                        # the cached tokens, written by their slot mapping
        pos = torch.arange(int(cache_lens[b]))[None]
        slots = vllm_slot_mapping(block_table[b:b + 1], pos, BS)[0]
        for layer in kv_caches:
            layer.view(2, NB * BS, Hkv, Dh)[:, slots] = torch.randn(2, len(slots), Hkv, Dh, generator=g)
    return kv_caches, block_table, cache_lens, BS, T


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_vllm_per_layer_caches_tree_attention(vllm_batch, impl):
    kv_caches, vllm_table, cache_lens, BS, T = vllm_batch
    tree_attention, _ = IMPLS[impl]()
    table = vllm_to_ours(vllm_table, cache_lens, T, BS)
    assert table.tolist() == [[3, 7, -1, -1], [5, -1, -1, -1]]
    q, k_tree, v_tree = step_inputs(2, T)
    for layer in kv_caches:
        key_cache, value_cache = layer.unbind(0)                                     # views, as vLLM's backends
        assert key_cache.data_ptr() == layer.data_ptr() and key_cache.is_contiguous()
        out = tree_attention(q, key_cache, value_cache, table, cache_lens, k_tree, v_tree, TREE.mask)
        twin = reference.tree_attention(q, key_cache, value_cache, table, cache_lens, k_tree, v_tree, TREE.mask)
        assert_close(out, twin, atol=1e-5, rtol=1e-5, what=f"{impl} vs twin")
        for b in range(2):                                                          # vs vLLM's own addressing
            slots = vllm_slot_mapping(vllm_table[b:b + 1], torch.arange(int(cache_lens[b]))[None], BS)[0]
            want = attention_by_slots(q[b], key_cache.reshape(-1, Hkv, Dh), value_cache.reshape(-1, Hkv, Dh),
                                      slots, k_tree[b], v_tree[b], TREE.mask)
            assert_close(out[b], want, atol=1e-5, rtol=1e-5, what=f"{impl} seq {b} vs slot mapping")


# accepted paths: root-(0,)-(0, 0)-(0, 0, 0) and root-(1,)
ACCEPT_NODES = torch.tensor([[0, 1, 3, 5, -1, -1], [0, 2, -1, -1, -1, -1]])
ACCEPT_LEN = torch.tensor([3, 1])


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_vllm_kv_append_equals_reshape_and_cache(vllm_batch, impl):
    """Per layer (vLLM allocates each layer's tensor on its own): kv_append on a 1-layer view of it writes what
    vLLM's reshape_and_cache_flash would write at slot_mapping for the root and the accepted nodes."""
    kv_caches, vllm_table, cache_lens, BS, T = vllm_batch
    _, kv_append = IMPLS[impl]()
    table = vllm_to_ours(vllm_table, cache_lens, T, BS)
    _, k_tree, v_tree = step_inputs(2, T, seed=2)
    k_tree, v_tree = torch.stack([k_tree, k_tree + 1]), torch.stack([v_tree, v_tree - 1])   # [L, B, T, Hkv, Dh]
    want = [layer.clone() for layer in kv_caches]
    for l, layer in enumerate(want):                                # reshape_and_cache: cache[slot] = token's K/V
        for b in range(2):
            n = int(ACCEPT_LEN[b]) + 1
            slots = vllm_slot_mapping(vllm_table[b:b + 1], (cache_lens[b] + torch.arange(n))[None].long(), BS)[0]
            nodes = ACCEPT_NODES[b, :n]
            layer.view(2, -1, Hkv, Dh)[0, slots] = k_tree[l, b, nodes]
            layer.view(2, -1, Hkv, Dh)[1, slots] = v_tree[l, b, nodes]
    for l, layer in enumerate(kv_caches):
        key_cache, value_cache = layer[0][None], layer[1][None]                    # [1, NB, BS, Hkv, Dh] views
        kv_append(key_cache, value_cache, table, cache_lens, k_tree[l:l + 1], v_tree[l:l + 1], ACCEPT_NODES,
                  ACCEPT_LEN)
    for l in range(len(kv_caches)):
        torch.testing.assert_close(kv_caches[l], want[l], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_one_allocation_all_layers_in_one_launch(vllm_batch, impl):
    """Owning the allocation as [2, L, NB, BS, Hkv, Dh] gives per-layer [2, NB, BS, Hkv, Dh] tensors that unbind
    into contiguous K and V exactly like vLLM's, and contiguous [L, ...] K and V for one kv_append launch."""
    kv_caches, vllm_table, cache_lens, BS, T = vllm_batch
    _, kv_append = IMPLS[impl]()
    raw = torch.stack([torch.stack([layer[0] for layer in kv_caches]), torch.stack([layer[1] for layer in kv_caches])])
    per_layer = [raw[:, l] for l in range(len(kv_caches))]                         # vLLM's per-layer shape
    assert all(k.is_contiguous() and v.is_contiguous() for k, v in (p.unbind(0) for p in per_layer))
    _, k_tree, v_tree = step_inputs(2, T, seed=2)
    k_tree, v_tree = torch.stack([k_tree, k_tree + 1]), torch.stack([v_tree, v_tree - 1])
    table = vllm_to_ours(vllm_table, cache_lens, T, BS)
    want = raw.clone()
    reference.kv_append(want[0], want[1], table, cache_lens, k_tree, v_tree, ACCEPT_NODES, ACCEPT_LEN)
    kv_append(raw[0], raw[1], table, cache_lens, k_tree, v_tree, ACCEPT_NODES, ACCEPT_LEN)   # all layers, 1 launch
    torch.testing.assert_close(raw, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(per_layer[1][0, 7, 3], k_tree[1, 0, 0])     # layer 1, seq 0's root: position 19 = block 7


# ---- SGLang --------------------------------------------------------------------------------------------------
def sglang_pool(page_size, L=2, seed=3):
    """k_buffer/v_buffer per layer [size + page_size, Hkv, Dh] (slot 0 = padding), req_to_token [4, 40] int32.

    Requests live at rows 2 and 0 of req_to_token with 7 and 3 cached tokens; pages are handed out in a shuffled
    order, so consecutive tokens sit in scattered slots. Slots for the tree's tokens are allocated up front, as
    SGLang allocates them before a verify forward. Unowned slots hold NaN."""
    g = torch.Generator().manual_seed(seed)
    pages = 32 // page_size
    size = pages * page_size
    k_buffer = [torch.full((size + page_size, Hkv, Dh), float("nan")) for _ in range(L)]
    v_buffer = [torch.full((size + page_size, Hkv, Dh), float("nan")) for _ in range(L)]
    req_to_token = torch.zeros(4, 40, dtype=torch.int32)
    free_pages = (torch.randperm(pages, generator=g) + 1).tolist()                 # page 0 holds the padding slot
    rows, lens = [2, 0], [7, 3]
    for r, n in zip(rows, lens):
        need = -(-(n + TREE.size) // page_size)
        slots = torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in free_pages[:need]])
        free_pages = free_pages[need:]
        req_to_token[r, :len(slots)] = slots.to(torch.int32)
        for kb, vb in zip(k_buffer, v_buffer):
            kb[slots[:n]] = torch.randn(n, Hkv, Dh, generator=g)
            vb[slots[:n]] = torch.randn(n, Hkv, Dh, generator=g)
    return k_buffer, v_buffer, req_to_token, torch.tensor(rows), torch.tensor(lens, dtype=torch.int32)


def sglang_to_ours(req_to_token, req_pool_indices, cache_lens, T, page_size):
    """Block table = the first slot of every page of the request's tokens, divided by page_size; -1 past use."""
    pages = req_to_token[req_pool_indices][:, ::page_size] // page_size           # [B, max_context / P]
    used = (cache_lens.long() + T + page_size - 1) // page_size
    cols = torch.arange(pages.shape[1])
    return torch.where(cols[None, :] < used[:, None], pages, -1).to(torch.int32).contiguous()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_sglang_pool_tree_attention_and_append(impl, page_size):
    tree_attention, kv_append = IMPLS[impl]()
    k_buffer, v_buffer, req_to_token, rows, cache_lens = sglang_pool(page_size)
    T = TREE.size
    table = sglang_to_ours(req_to_token, rows, cache_lens, T, page_size)
    q, k_tree, v_tree = step_inputs(2, T, seed=4)
    want_k, want_v = [kb.clone() for kb in k_buffer], [vb.clone() for vb in v_buffer]
    for l, (kb, vb) in enumerate(zip(k_buffer, v_buffer)):
        k_cache = kb.view(-1, page_size, Hkv, Dh)                                   # a view: [pages, P, Hkv, Dh]
        v_cache = vb.view(-1, page_size, Hkv, Dh)
        assert k_cache.data_ptr() == kb.data_ptr()
        out = tree_attention(q, k_cache, v_cache, table, cache_lens, k_tree, v_tree, TREE.mask)
        twin = reference.tree_attention(q, k_cache, v_cache, table, cache_lens, k_tree, v_tree, TREE.mask)
        assert_close(out, twin, atol=1e-5, rtol=1e-5, what=f"{impl} P{page_size} vs twin")
        for b, r in enumerate(rows.tolist()):                                   # vs req_to_token addressing
            slots = req_to_token[r, :int(cache_lens[b])].long()
            want = attention_by_slots(q[b], kb, vb, slots, k_tree[b], v_tree[b], TREE.mask)
            assert_close(out[b], want, atol=1e-5, rtol=1e-5, what=f"{impl} P{page_size} seq {b} vs req_to_token")
        # accepted path -> the pool slots req_to_token gives positions cache_len .. cache_len + accept_len
        kv_append(k_cache[None], v_cache[None], table, cache_lens, k_tree[None], v_tree[None], ACCEPT_NODES,
                  ACCEPT_LEN)
        for b, r in enumerate(rows.tolist()):
            n = int(ACCEPT_LEN[b]) + 1
            loc = req_to_token[r, int(cache_lens[b]):int(cache_lens[b]) + n].long()   # SGLang's out_cache_loc
            want_k[l][loc] = k_tree[b, ACCEPT_NODES[b, :n]]
            want_v[l][loc] = v_tree[b, ACCEPT_NODES[b, :n]]
        torch.testing.assert_close(kb, want_k[l], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(vb, want_v[l], rtol=0, atol=0, equal_nan=True)


# ---- acceptance: SGLang's first-child / next-sibling tree and vLLM's chain ----------------------------------
def sglang_links(parents):
    """Our parents [T] -> SGLang's retrive_next_token (first child) and retrive_next_sibling, -1 = none."""
    T = len(parents)
    first_child, next_sibling, last = [-1] * T, [-1] * T, {}
    for i in range(1, T):
        p = parents[i]
        if first_child[p] == -1:
            first_child[p] = i
        else:
            next_sibling[last[p]] = i
        last[p] = i
    return first_child, next_sibling


def greedy_walk(candidates, target, first_child, next_sibling):
    """The walk verify_tree_greedy makes: from the root, move to the child whose token is the target's choice."""
    node, path = 0, [0]
    while True:
        c = first_child[node]
        while c != -1 and candidates[c] != target[node]:
            c = next_sibling[c]
        if c == -1:
            return path, target[node]
        node = c
        path.append(c)


@pytest.mark.parametrize("choices", ["medusa-16", "chain-4"])
def test_tree_accept_is_sglang_greedy_walk(choices):
    tree = mt.get_tree(choices)
    parents = tree.parents.tolist()
    first_child, next_sibling = sglang_links(parents)
    g = torch.Generator().manual_seed(5)
    B, T = 6, tree.size
    draft = 100 + tree.rank[None].repeat(B, 1) + 10 * tree.depth[None]       # siblings differ (top-k ranks)
    target = torch.randint(100, 140, (B, T), generator=g)
    target[:, 0] = draft[:, 1]                                                # a root match, then chance
    for impl in (mt.tree_accept, reference.tree_accept):
        accept_len, accept_nodes, bonus = impl(draft, tree.parents, target)
        for b in range(B):
            path, nxt = greedy_walk(draft[b].tolist(), target[b].tolist(), first_child, next_sibling)
            assert accept_nodes[b, :len(path)].tolist() == path and int(accept_len[b]) == len(path) - 1
            assert int(bonus[b]) == nxt
