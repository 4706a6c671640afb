"""The PyTorch references against independent naive computations (the references are the spec)."""
import pytest
import torch
import torch.nn.functional as F

from mtp_triton import reference as ref
from mtp_triton.sampling import logits_to_probs
from mtp_triton.tree import Tree
from conftest import assert_close


def test_fused_draft_vs_per_head_loop():
    g = torch.Generator().manual_seed(0)
    B, H, D, V, k = 3, 5, 24, 203, 7
    x = torch.randn(B, D, generator=g)
    W, b = torch.randn(H, D, D, generator=g) / 5, torch.randn(H, D, generator=g)
    lm = torch.randn(V, D, generator=g)
    ids, lp = ref.fused_draft(x, W, b, lm, k)
    for h in range(H):
        z = x + F.silu(F.linear(x, W[h], b[h]))
        logits = F.linear(z, lm)
        top = torch.topk(logits, k)
        assert torch.equal(ids[:, h], top.indices)
        assert_close(lp[:, h], torch.log_softmax(logits, -1).gather(1, top.indices), 1e-5, 1e-5)


def test_fused_draft_ties_lower_id_first():
    D = 4
    lm = torch.zeros(9, D)
    lm[[2, 5, 7]] = 1.0                              # three ids with the same logit
    ids, _ = ref.fused_draft(torch.ones(1, D), torch.zeros(1, D, D), torch.zeros(1, D), lm, 4)
    assert ids[0, 0].tolist()[:3] == [2, 5, 7]


@pytest.mark.parametrize("bad,match", [
    (dict(top_k=0), "top_k"), (dict(top_k=300), "top_k"), (dict(lm=torch.randn(10, 5)), "lm_head"),
    (dict(W=torch.randn(2, 8, 8).transpose(1, 2)), "contiguous"), (dict(x=torch.ones(2, 8, dtype=torch.int64)), "floating"),
])
def test_fused_draft_bad_input(bad, match):
    args = dict(x=torch.randn(2, 8), W=torch.randn(2, 8, 8), b=torch.randn(2, 8), lm=torch.randn(10, 8), top_k=3)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        ref.fused_draft(args["x"], args["W"], args["b"], args["lm"], args["top_k"])


def _paged(B, lens, Hkv, Dh, BS, T, g, shuffle=True):
    """A random paged cache + its contiguous twin (per sequence), with a shuffled block table."""
    cap = [l + T for l in lens]
    nblk = [(c + BS - 1) // BS for c in cap]
    NB = sum(nblk) + 3
    perm = torch.randperm(NB, generator=g) if shuffle else torch.arange(NB)
    table = torch.zeros(B, max(nblk), dtype=torch.int32)
    k_cache = torch.full((NB, BS, Hkv, Dh), float("nan"))     # NaN where nothing was written
    v_cache = torch.full((NB, BS, Hkv, Dh), float("nan"))
    dense_k, dense_v, start = [], [], 0
    for b in range(B):
        blocks = perm[start:start + nblk[b]]
        start += nblk[b]
        table[b, : nblk[b]] = blocks.int()
        k = torch.randn(lens[b], Hkv, Dh, generator=g)
        v = torch.randn(lens[b], Hkv, Dh, generator=g)
        for p in range(lens[b]):
            k_cache[blocks[p // BS], p % BS] = k[p]
            v_cache[blocks[p // BS], p % BS] = v[p]
        dense_k.append(k)
        dense_v.append(v)
    return k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), dense_k, dense_v


@pytest.mark.parametrize("lens,BS,Hq,Hkv", [([0, 5, 37], 16, 4, 2), ([33], 32, 2, 2), ([1, 16], 16, 6, 1)])
def test_tree_attention_vs_dense_sdpa(lens, BS, Hq, Hkv):
    g = torch.Generator().manual_seed(1)
    tree = Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    B, T, Dh = len(lens), tree.size, 8
    k_cache, v_cache, table, cache_lens, dk, dv = _paged(B, lens, Hkv, Dh, BS, T, g)
    q = torch.randn(B, T, Hq, Dh, generator=g)
    kt, vt = torch.randn(B, T, Hkv, Dh, generator=g), torch.randn(B, T, Hkv, Dh, generator=g)
    out = ref.tree_attention(q, k_cache, v_cache, table, cache_lens, kt, vt, tree.mask)
    for b in range(B):
        k = torch.cat([dk[b], kt[b]]).repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)   # [Hq, n+T, Dh]
        v = torch.cat([dv[b], vt[b]]).repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)
        mask = torch.cat([torch.ones(T, lens[b], dtype=torch.bool), tree.mask], dim=1)
        want = F.scaled_dot_product_attention(q[b].transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)
        assert_close(out[b], want, 1e-5, 1e-5, what=f"seq {b}")


def test_tree_attention_bad_input():
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache, table, lens, _, _ = _paged(1, [4], 2, 8, 16, 3, g)
    q, kt = torch.randn(1, 3, 4, 8), torch.randn(1, 3, 2, 8)
    mask = Tree.chain(2).mask
    with pytest.raises(ValueError, match="lower-triangular"):
        ref.tree_attention(q, k_cache, v_cache, table, lens, kt, kt, mask | mask.T)
    with pytest.raises(ValueError, match="reflexive"):
        ref.tree_attention(q, k_cache, v_cache, table, lens, kt, kt, mask & ~torch.eye(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple"):
        ref.tree_attention(torch.randn(1, 3, 3, 8), k_cache, v_cache, table, lens, kt, kt, mask)
    with pytest.raises(ValueError, match="room"):
        ref.tree_attention(q, k_cache, v_cache, table, torch.tensor([15], dtype=torch.int32), kt, kt, mask)


def test_tree_accept_cases():
    tree = Tree.from_choices([(0,), (1,), (0, 0), (1, 0)])       # nodes: 0 root, 1 (0), 2 (1), 3 (0,0), 4 (1,0)
    draft = torch.tensor([[9, 5, 6, 7, 8]] * 4)
    target = torch.tensor([
        [1, 1, 1, 1, 1],      # no match
        [5, 7, 2, 3, 4],      # node 1 then node 3 accepted (full path)
        [6, 9, 8, 3, 4],      # node 2 then node 4
        [5, 0, 2, 3, 4],      # node 1 only
    ])
    n, nodes, nxt = ref.tree_accept(draft, tree.parents, target)
    assert n.tolist() == [0, 2, 2, 1]
    assert nodes.tolist() == [[0, -1, -1, -1, -1], [0, 1, 3, -1, -1], [0, 2, 4, -1, -1], [0, 1, -1, -1, -1]]
    assert nxt.tolist() == [1, 3, 4, 0]


def test_tree_accept_unused_nodes_and_ties():
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, -1]])     # sequence 1 uses only node 1
    draft = torch.tensor([[0, 4, 4, 2], [0, 4, 4, 2]])            # siblings 1 and 2 both match: lower id wins
    target = torch.tensor([[4, 2, 3, 3], [4, 2, 3, 3]])
    n, nodes, nxt = ref.tree_accept(draft, parents, target)
    assert n.tolist() == [2, 1] and nodes[0, :3].tolist() == [0, 1, 3] and nxt.tolist() == [3, 2]
    with pytest.raises(ValueError, match="parents"):
        ref.tree_accept(draft, torch.tensor([-1, 0, 2, 1]), target)


def test_tree_accept_sample_reduces_to_inverse_cdf_without_drafts():
    probs = torch.tensor([[[0.1, 0.6, 0.3]]])
    for u, want in [(0.05, 0), (0.5, 1), (0.69, 1), (0.71, 2)]:
        _, _, nxt = ref.tree_accept_sample(torch.zeros(1, 1, dtype=torch.int64), torch.tensor([-1]), probs,
                                           torch.zeros(1, 1), torch.tensor([u]))
        assert nxt.item() == want


def test_tree_accept_sample_rejection_renormalises():
    # root children: node 1 (token 1), node 2 (token 2). p = [0.2, 0.5, 0.3].
    probs = torch.tensor([[[0.2, 0.5, 0.3], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])
    parents, draft = torch.tensor([-1, 0, 0]), torch.tensor([[0, 1, 2]])
    n, _, nxt = ref.tree_accept_sample(draft, parents, probs, torch.tensor([[0.0, 0.49, 0.0]]), torch.tensor([0.5]))
    assert n.item() == 1 and nxt.item() == 0       # node 1 accepted (0.49 < 0.5), bonus from node 1's p
    # reject node 1 (u=0.6); node 2 then has p(2) = 0.3 / 0.5 = 0.6: accepted for u = 0.59, rejected for 0.61
    n, nodes, nxt = ref.tree_accept_sample(draft, parents, probs, torch.tensor([[0, 0.6, 0.59]]), torch.tensor([0.]))
    assert n.item() == 1 and nodes[0, 1].item() == 2 and nxt.item() == 2
    n, _, nxt = ref.tree_accept_sample(draft, parents, probs, torch.tensor([[0, 0.6, 0.61]]), torch.tensor([0.99]))
    assert n.item() == 0 and nxt.item() == 0       # residual = only token 0 left


def test_kv_append_positions_and_nothing_else():
    g = torch.Generator().manual_seed(2)
    L, NB, BS, Hkv, Dh, B, T = 2, 7, 4, 2, 3, 2, 5
    k = torch.randn(L, NB, BS, Hkv, Dh, generator=g)
    v = torch.randn(L, NB, BS, Hkv, Dh, generator=g)
    k0, v0 = k.clone(), v.clone()
    table = torch.tensor([[5, 1, 3], [0, 6, 2]], dtype=torch.int32)
    lens = torch.tensor([3, 6], dtype=torch.int32)
    kt, vt = torch.randn(L, B, T, Hkv, Dh, generator=g), torch.randn(L, B, T, Hkv, Dh, generator=g)
    nodes = torch.tensor([[0, 2, 4, -1, -1], [0, -1, -1, -1, -1]])
    n = torch.tensor([2, 0])
    ref.kv_append(k, v, table, lens, kt, vt, nodes, n)
    want_k, want_v = k0.clone(), v0.clone()
    for b, (pos0, nn) in enumerate([(3, 3), (6, 1)]):
        for j in range(nn):
            pos = pos0 + j
            blk, slot = table[b, pos // BS], pos % BS
            want_k[:, blk, slot], want_v[:, blk, slot] = kt[:, b, nodes[b, j]], vt[:, b, nodes[b, j]]
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert lens.tolist() == [3, 6]
    with pytest.raises(ValueError, match="room"):
        ref.kv_append(k, v, table, torch.tensor([11, 0], dtype=torch.int32), kt, vt, nodes, n)
    with pytest.raises(ValueError, match="accept_nodes"):
        ref.kv_append(k, v, table, lens, kt, vt, torch.full((B, T), 7), n)


def test_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert_close(logits_to_probs(logits, 1.0, 0.7), torch.tensor([[0.625, 0.375, 0.0, 0.0]]), 1e-6, 1e-6)
    assert_close(logits_to_probs(logits, 1.0, 0.5), torch.tensor([[1.0, 0.0, 0.0, 0.0]]), 1e-6, 1e-6)
    assert_close(logits_to_probs(logits, 1.0, 1.0), torch.tensor([[0.5, 0.3, 0.15, 0.05]]), 1e-6, 1e-6)
    with pytest.raises(ValueError):
        logits_to_probs(logits, 0.0)


def test_check_values_false_skips_only_value_checks():
    """check_values=False (the engine's GPU hot loop) skips checks that read values, never shape checks."""
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache, table, lens, _, _ = _paged(1, [4], 2, 8, 16, 3, g)
    q, kt = torch.randn(1, 3, 4, 8), torch.randn(1, 3, 2, 8)
    bad_mask = torch.ones(3, 3, dtype=torch.bool)                       # not lower-triangular
    with pytest.raises(ValueError, match="lower-triangular"):
        ref.tree_attention(q, k_cache, v_cache, table, lens, kt, kt, bad_mask)
    ref.tree_attention(q, k_cache, v_cache, table, lens, kt, kt, bad_mask, check_values=False)
    with pytest.raises(ValueError, match="k_tree"):
        ref.tree_attention(q, k_cache, v_cache, table, lens, kt[:, :2], kt, bad_mask, check_values=False)
    with pytest.raises(ValueError, match="parents"):
        ref.tree_accept(torch.zeros(1, 3, dtype=torch.long), torch.tensor([-1, 2, 0]), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="target_tokens"):
        ref.tree_accept(torch.zeros(1, 3, dtype=torch.long), torch.tensor([-1, 0, 0]), torch.zeros(1, 2, dtype=torch.long),
                        check_values=False)
