"""Tree attention over a paged cache: Triton kernel vs the PyTorch reference vs a dense SDPA computation.

Every case builds a paged cache whose unused blocks and unused slots are NaN, with a shuffled block
table, so a kernel that reads past a sequence's cache (or past the block it should use) returns NaN.
Outputs are allocated NaN-filled (see `nan_alloc`), so a row the kernel forgets to write fails too.
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, assert_close, on_cpu, poison

from mtp_triton import reference
from mtp_triton.kernels import tree_attention as ta
from mtp_triton.kernels.tree_attention import _tree_attention, tree_attention
from mtp_triton.tree import Tree


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def make_case(cache_lens, tree, Hq, Hkv, Dh, BS, dtype=torch.float32, seed=0, per_seq_masks=None):
    """Random q / tree K/V and a paged cache (NaN outside the cached tokens, shuffled block table).

    per_seq_masks: optional list of B [T, T] masks (different trees per sequence) instead of tree.mask.
    """
    g = torch.Generator().manual_seed(seed)
    B = len(cache_lens)
    T = tree.size if tree is not None else per_seq_masks[0].shape[0]
    max_blocks = max((n + T + BS - 1) // BS for n in cache_lens) + 1      # room for the step, and a spare
    NB = B * max_blocks + 2                                               # 2 blocks nobody uses
    perm = torch.randperm(NB, generator=g)
    block_table = perm[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    k_cache = poison((NB, BS, Hkv, Dh), torch.float32, "cpu")
    v_cache = poison((NB, BS, Hkv, Dh), torch.float32, "cpu")
    for b, n in enumerate(cache_lens):                                    # fill only the cached tokens
        for pos in range(n):
            blk, slot = int(block_table[b, pos // BS]), pos % BS
            k_cache[blk, slot] = torch.randn(Hkv, Dh, generator=g)
            v_cache[blk, slot] = torch.randn(Hkv, Dh, generator=g)
    q = torch.randn(B, T, Hq, Dh, generator=g)
    k_tree = torch.randn(B, T, Hkv, Dh, generator=g)
    v_tree = torch.randn(B, T, Hkv, Dh, generator=g)
    mask = tree.mask if per_seq_masks is None else torch.stack(per_seq_masks)
    to = dict(device=DEVICE)
    return dict(q=q.to(dtype=dtype, **to), k_cache=k_cache.to(dtype=dtype, **to), v_cache=v_cache.to(dtype=dtype, **to),
                block_table=block_table.to(**to), cache_lens=torch.tensor(cache_lens, dtype=torch.int32, **to),
                k_tree=k_tree.to(dtype=dtype, **to), v_tree=v_tree.to(dtype=dtype, **to), tree_mask=mask.to(**to))


def dense_sdpa(c, sm_scale=None):
    """Independent check: gather each sequence's cache position by position, then masked SDPA (fp32)."""
    q, kc, vc, bt, lens = c["q"], c["k_cache"], c["v_cache"], c["block_table"], c["cache_lens"]
    B, T, Hq, Dh = q.shape
    BS, Hkv = kc.shape[1], kc.shape[2]
    mask = c["tree_mask"].expand(B, T, T)
    out = torch.empty(B, T, Hq, Dh, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(lens[b])
        pos = torch.arange(n, device=q.device)
        blocks = bt[b].long()[pos // BS]
        k = torch.cat([kc[blocks, pos % BS], c["k_tree"][b]]).float()    # [n + T, Hkv, Dh]
        v = torch.cat([vc[blocks, pos % BS], c["v_tree"][b]]).float()
        k = k.transpose(0, 1).repeat_interleave(Hq // Hkv, dim=0)        # [Hq, n + T, Dh]
        v = v.transpose(0, 1).repeat_interleave(Hq // Hkv, dim=0)
        visible = torch.cat([torch.ones(T, n, dtype=torch.bool, device=q.device), mask[b]], dim=1)
        o = F.scaled_dot_product_attention(q[b].float().transpose(0, 1), k, v, attn_mask=visible, scale=sm_scale)
        out[b] = o.transpose(0, 1)
    return out


def brute_force(c, window=None, sm_scale=None):
    """The definition, one node at a time in fp64: node i of sequence b sits at p_i = cache_len + depth_i
    (depth_i = |tree_mask[b, i]| - 1) and sees cache position j iff p_i - j < window, ancestor a iff
    p_i - p_a < window (no window: all of them)."""
    q, kc, vc, bt, lens = c["q"], c["k_cache"], c["v_cache"], c["block_table"], c["cache_lens"]
    B, T, Hq, Dh = q.shape
    BS, Hkv = kc.shape[1], kc.shape[2]
    mask = c["tree_mask"].expand(B, T, T).cpu()
    W = float("inf") if window is None else window
    scale = Dh ** -0.5 if sm_scale is None else sm_scale
    out = torch.empty(B, T, Hq, Dh, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        depth = [int(mask[b, i].sum()) - 1 for i in range(T)]
        for i in range(T):
            p_i = n + depth[i]
            keys = [(kc[int(bt[b, j // BS]), j % BS], vc[int(bt[b, j // BS]), j % BS]) for j in range(n) if p_i - j < W]
            keys += [(c["k_tree"][b, a], c["v_tree"][b, a]) for a in range(T)
                     if mask[b, i, a] and (n + depth[i]) - (n + depth[a]) < W]
            k = torch.stack([kv[0] for kv in keys]).double().cpu().repeat_interleave(Hq // Hkv, dim=1)  # [S, Hq, Dh]
            v = torch.stack([kv[1] for kv in keys]).double().cpu().repeat_interleave(Hq // Hkv, dim=1)
            p = torch.softmax(torch.einsum("hd,shd->hs", q[b, i].double().cpu(), k) * scale, dim=-1)   # [Hq, S]
            out[b, i] = torch.einsum("hs,shd->hd", p, v)
    return out.to(q.device)


def poison_outside_window(c, window):
    """NaN into every cache position no node can see (j < cache_len - window + 1, the root's reach): a kernel
    that reads them, or lets them into its sums, returns NaN."""
    BS = c["k_cache"].shape[1]
    for b, n in enumerate(c["cache_lens"].tolist()):
        for j in range(max(0, n - window + 1)):
            blk = int(c["block_table"][b, j // BS])
            c["k_cache"][blk, j % BS] = float("nan")
            c["v_cache"][blk, j % BS] = float("nan")
    return c


@pytest.fixture
def nan_alloc(monkeypatch):
    """Make torch.empty / empty_like return NaN-filled float tensors while the test runs."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


BUSHY = Tree.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])   # T = 9
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}

# (id, cache_lens, tree, Hq, Hkv, Dh, BS, dtype)
CASES = [
    ("B3-bushy9-GQA2-Dh24-BS16-fp32", [0, 17, 45], BUSHY, 4, 2, 24, 16, torch.float32),
    ("B2-chain4-MHA3-Dh16-BS32-fp32", [33, 1], Tree.chain(4), 3, 3, 16, 32, torch.float32),
    ("B4-T1-GQA4-Dh16-BS16-fp32", [0, 5, 31, 64], Tree.root_only(), 4, 1, 16, 16, torch.float32),
    ("B2-bushy9-GQA3-Dh80-BS16-fp16", [19, 0], BUSHY, 3, 1, 80, 16, torch.float16),
    ("B2-chain2-GQA2-Dh24-BS32-bf16", [40, 9], Tree.chain(2), 4, 2, 24, 32, torch.bfloat16),
]


# ---------------------------------------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_lens,tree,Hq,Hkv,Dh,BS,dtype", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_reference_and_sdpa(cache_lens, tree, Hq, Hkv, Dh, BS, dtype, nan_alloc):
    c = make_case(cache_lens, tree, Hq, Hkv, Dh, BS, dtype)
    out = tree_attention(**c)
    assert out.dtype == dtype and out.shape == c["q"].shape
    atol, rtol = TOL[dtype]
    assert_close(out, reference.tree_attention(**c), atol, rtol, "kernel vs reference")
    assert_close(out, dense_sdpa(c), atol, rtol, "kernel vs dense SDPA")


def test_reference_matches_sdpa():
    """The reference itself against the dense computation (the kernel tests lean on it)."""
    c = make_case([0, 21, 50], BUSHY, 4, 2, 16, 16)
    assert_close(reference.tree_attention(**c), dense_sdpa(c), 1e-5, 1e-5, "reference vs dense SDPA")


def test_per_sequence_masks_and_sm_scale(nan_alloc):
    """tree_mask [B, T, T]: a chain for one sequence, a star for the other; a custom sm_scale."""
    chain, star = Tree.chain(4).mask, Tree.from_choices([(0,), (1,), (2,), (3,)]).mask      # both T = 5
    c = make_case([12, 35], None, 4, 2, 16, 16, per_seq_masks=[chain, star])
    out = tree_attention(**c, sm_scale=0.3)
    assert_close(out, reference.tree_attention(**c, sm_scale=0.3), 2e-5, 2e-5, "per-sequence masks")
    assert_close(out, dense_sdpa(c, sm_scale=0.3), 2e-5, 2e-5, "per-sequence masks vs SDPA")


@pytest.mark.parametrize("num_splits,block_m,block_n", [(3, None, None), (2, 16, 16), (1, 16, 64), (5, 16, 16)],
                         ids=["split3", "split2-M16-N16", "split1-M16-N64", "split5-bucket8-M16-N16"])
def test_split_kv_and_small_tiles(num_splits, block_m, block_n, nan_alloc):
    """Split-KV (flash-decoding) with an empty split for short caches; query tiles that cut a node's G
    heads apart (G * T = 27 rows in 16-row tiles); key tiles smaller and larger than a block."""
    c = make_case([0, 50, 7], BUSHY, 3, 1, 24, 32)
    out = _tree_attention(**c, num_splits=num_splits, block_m=block_m, block_n=block_n)
    assert_close(out, reference.tree_attention(**c), 2e-5, 2e-5, f"splits={num_splits}")
    assert_close(out, dense_sdpa(c), 2e-5, 2e-5, f"splits={num_splits} vs SDPA")


# ---------------------------------------------------------------------------------------------------------
# the split-KV heuristic (a pure function of the launch shape)
# ---------------------------------------------------------------------------------------------------------
LLAMA2, LLAMA3 = (32, 32, 128), (32, 8, 128)          # Hq, Hkv, Dh


def _splits(programs, sms, capacity, T, model, **kw):
    Hq, Hkv, Dh = model
    return ta.choose_num_splits(programs, sms, capacity, T, Hq, Hkv, Dh, torch.bfloat16, **kw)


def test_splits_fill_whole_waves():
    """64 programs on 132 SMs, 2 resident per SM (a 264-program wave): 4 splits make 256 programs, 0.97 of a
    wave; the old cdiv(2 * SMs, programs) = 5 made 320, 1.21 waves (the second one mostly idle)."""
    S = _splits(64, 132, 8192, 1, LLAMA2, programs_per_sm=2)
    assert S == 4
    for programs in (1, 7, 32, 50, 100, 200):
        for sms, k in ((132, 1), (132, 3), (108, 2)):
            S = _splits(programs, sms, 32768, 1, LLAMA3, programs_per_sm=k)
            wave = sms * k
            busy = programs * S / (wave * -(-programs * S // wave))      # fraction of the waves' slots used
            few = programs * ta.MAX_NUM_SPLITS < wave                           # even 32 splits leave SMs idle
            if programs >= wave:
                assert S == 1, (programs, sms, k, S)                        # a full grid is not split
            else:
                assert 1 <= S <= ta.MAX_NUM_SPLITS, (programs, k, S)
                assert busy >= 0.8 or few and S >= 0.9 * ta.MAX_NUM_SPLITS, (programs, k, S)


def test_splits_short_context_and_full_grid():
    # 512 cached tokens (a 528-token table): 4 splits of 132 tokens, each at least two 64-key tiles
    assert _splits(32, 132, 528, 1, LLAMA2, programs_per_sm=1) == 4
    assert _splits(32, 132, 528, 1, LLAMA2, programs_per_sm=1, min_split_tokens=64) == 4   # 4 x 32 = a wave
    assert _splits(32, 132, 200, 1, LLAMA2) == 1                                          # < 2 x 128 tokens
    # a grid that already fills a wave is never split
    assert _splits(264, 132, 8192, 1, LLAMA2, programs_per_sm=2) == 1
    assert _splits(8 * 32, 132, 8192, 64, LLAMA2, programs_per_sm=1) == 1


@pytest.mark.parametrize("model", [LLAMA2, LLAMA3], ids=["llama2-7b", "llama3-8b"])
def test_splits_bound_partial_traffic(model):
    """T = 64 at 8k context, batch 1 (32 programs of 64-row tiles, 1 per SM): the fp32 partials (write + read)
    stay within MAX_PARTIAL_FRACTION of the KV bytes; at 512 context they would outweigh the cache: no split."""
    Hq, Hkv, Dh = model
    for capacity, expect_split in ((8256, True), (576, False)):
        S = _splits(32, 132, capacity, 64, model, programs_per_sm=1)
        kv = capacity * Hkv * Dh * 2 * 2
        partials = S * 64 * Hq * (Dh + 1) * 4 * 2 if S > 1 else 0
        assert partials <= ta.MAX_PARTIAL_FRACTION * kv
        assert (S > 1) == expect_split, (capacity, S)
    assert _splits(32, 132, 8256, 64, model, programs_per_sm=1, max_partial_fraction=0.0) == 1


def test_splits_refuse_bad_arguments():
    with pytest.raises(ValueError, match="programs"):
        _splits(0, 132, 1024, 1, LLAMA2)
    c = make_case([3], Tree.chain(1), 2, 1, 16, 16)
    for bad in (0, ta.MAX_NUM_SPLITS + 1):
        with pytest.raises(ValueError, match="num_splits"):
            _tree_attention(**c, num_splits=bad)


@pytest.mark.parametrize("block_m,block_n", [(None, None), (32, 16)], ids=["default-tiles", "M32-N16"])
def test_prefill_causal(block_m, block_n, nan_alloc):
    """The engine's prefill: no cache, a causal mask over many nodes, several query tiles (G = 3, so with
    32-row tiles a tile spans nodes 10..21 and must read tree keys past the first 16-key tile)."""
    T = 45
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    c = make_case([0], None, 3, 1, 16, 16, per_seq_masks=[causal])
    c["tree_mask"] = c["tree_mask"][0]                                   # the [T, T] form
    out = _tree_attention(**c, block_m=block_m, block_n=block_n)
    assert_close(out, reference.tree_attention(**c), 2e-5, 2e-5, "prefill")
    assert_close(out, dense_sdpa(c), 2e-5, 2e-5, "prefill vs SDPA")


# ---------------------------------------------------------------------------------------------------------
# sliding window (Mistral): p_i - j < W for cache positions, p_i - p_a < W for ancestors
# ---------------------------------------------------------------------------------------------------------
# (id, window, cache_lens, tree, Hq, Hkv, Dh, BS, dtype, block_m, block_n, num_splits)
WINDOW_CASES = [
    ("W1-B4-bushy9-GQA3-Dh24-BS16", 1, [0, 5, 37, 64], BUSHY, 6, 2, 24, 16, torch.float32, None, None, None),
    ("W2-B2-chain4-MHA4-Dh16-BS8", 2, [3, 40], Tree.chain(4), 4, 4, 16, 8, torch.float32, None, None, None),
    ("W7-B4-bushy9-GQA3-Dh24-BS16-M16-N16-split3", 7, [0, 5, 37, 64], BUSHY, 6, 2, 24, 16, torch.float32,
     16, 16, 3),
    ("W7-B5-T1-GQA4-Dh16-BS16", 7, [0, 6, 7, 8, 50], Tree.root_only(), 4, 1, 16, 16, torch.float32,
     None, None, None),
    ("W16-B2-chain4-GQA2-Dh20-BS16-N16-split2", 16, [33, 1], Tree.chain(4), 4, 2, 20, 16, torch.float32,
     None, 16, 2),
    ("W1000-B2-bushy9-GQA3-Dh80-BS16-fp16", 1000, [19, 0], BUSHY, 3, 1, 80, 16, torch.float16, None, None, None),
    ("W5-B2-chain2-GQA2-Dh24-BS32-bf16", 5, [40, 9], Tree.chain(2), 4, 2, 24, 32, torch.bfloat16, None, None, None),
]


@pytest.mark.parametrize("window,cache_lens,tree,Hq,Hkv,Dh,BS,dtype,block_m,block_n,num_splits",
                         [c[1:] for c in WINDOW_CASES], ids=[c[0] for c in WINDOW_CASES])
def test_window_matches_reference_and_brute_force(window, cache_lens, tree, Hq, Hkv, Dh, BS, dtype, block_m,
                                                  block_n, num_splits, nan_alloc):
    """Every cache position outside all windows is NaN: the kernel must neither read it nor let it in."""
    c = poison_outside_window(make_case(cache_lens, tree, Hq, Hkv, Dh, BS, dtype), window)
    out = _tree_attention(**c, window=window, num_splits=num_splits, block_m=block_m, block_n=block_n)
    atol, rtol = TOL[dtype]
    assert out.dtype == dtype
    assert_close(out, reference.tree_attention(**c, window=window), atol, rtol, "kernel vs reference")
    assert_close(out, brute_force(c, window), atol, rtol, "kernel vs brute force")
    assert_close(reference.tree_attention(**c, window=window).double(), brute_force(c, window),
                 *TOL[dtype], "reference vs brute force")
    if tree.size > 1:   # the public entry point (default tiles and splits) on the same case
        assert_close(tree_attention(**c, window=window), brute_force(c, window), atol, rtol, "tree_attention")


def test_window_per_sequence_masks_and_sm_scale(nan_alloc):
    chain, star = Tree.chain(4).mask, Tree.from_choices([(0,), (1,), (2,), (3,)]).mask      # both T = 5
    c = poison_outside_window(make_case([12, 35], None, 4, 2, 16, 16, per_seq_masks=[chain, star]), 3)
    out = tree_attention(**c, sm_scale=0.3, window=3)
    assert_close(out, reference.tree_attention(**c, sm_scale=0.3, window=3), 2e-5, 2e-5, "reference")
    assert_close(out, brute_force(c, 3, sm_scale=0.3), 2e-5, 2e-5, "brute force")


@pytest.mark.parametrize("window,block_m,block_n", [(7, 16, 16), (16, 32, 16), (40, None, None), (1, None, None)],
                         ids=["W7-M16-N16", "W16-M32-N16", "W40-default-tiles", "W1-default-tiles"])
def test_window_prefill_causal(window, block_m, block_n, nan_alloc):
    """The engine's prefill: no cache, two prompts (45 and 20 tokens, the short one padded with nodes that see
    only themselves, as generate.prefill builds it), a causal window; query tiles past the first skip the
    tree tiles that lie wholly before their window."""
    T, lens = 45, [45, 20]
    idx = torch.arange(T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    masks = [(causal & (idx[None, :] < n) & (idx[:, None] < n)) | torch.eye(T, dtype=torch.bool) for n in lens]
    c = make_case([0, 0], None, 3, 1, 16, 16, per_seq_masks=masks)
    out = _tree_attention(**c, window=window, block_m=block_m, block_n=block_n)
    assert_close(out, reference.tree_attention(**c, window=window), 2e-5, 2e-5, "prefill vs reference")
    assert_close(out, brute_force(c, window), 2e-5, 2e-5, "prefill vs brute force")


def _record_interpreter(monkeypatch):
    """Record, under the interpreter, every address a masked load reads and the number of tl.dot calls."""
    interp = pytest.importorskip("triton.runtime.interpreter")
    builder = getattr(interp, "InterpreterBuilder", None)
    if DEVICE != "cpu" or not all(hasattr(builder, f) for f in ("create_masked_load", "create_dot")):
        pytest.skip("needs Triton's interpreter (InterpreterBuilder.create_masked_load / create_dot)")
    seen = dict(addresses=[], dots=0)
    load, dot = builder.create_masked_load, builder.create_dot

    def masked_load(self, ptrs, mask, *a, **k):
        seen["addresses"].append(ptrs.data[mask.data].ravel().copy())
        return load(self, ptrs, mask, *a, **k)

    def count_dot(self, *a, **k):
        seen["dots"] += 1
        return dot(self, *a, **k)

    monkeypatch.setattr(builder, "create_masked_load", masked_load)
    monkeypatch.setattr(builder, "create_dot", count_dot)
    return seen


def test_window_skips_tiles_outside_every_window(monkeypatch):
    """300 cached tokens, window 8, 16-key tiles: the kernel must load only positions some node can see
    (>= cache_len - W + 1) and run only the tiles that hold them, not loop over the other ~18 masked."""
    W, BN, lens = 8, 16, [300, 3]
    c = make_case(lens, Tree.chain(2), 2, 1, 16, 16)
    seen = _record_interpreter(monkeypatch)
    _tree_attention(**c, window=W, block_n=BN, num_splits=1)
    loaded = torch.from_numpy(__import__("numpy").concatenate(seen["addresses"]).astype("int64"))
    monkeypatch.undo()
    k = c["k_cache"]
    row = k[0, 0].numel() * k.element_size()                            # bytes per (block, slot)
    rel = loaded - k.data_ptr()
    slots = rel[(rel >= 0) & (rel < k.numel() * k.element_size())] // row        # block * BS + slot
    owner = {int(blk) * 16 + s: (b, j * 16 + s) for b in range(2) for j, blk in enumerate(c["block_table"][b])
             for s in range(16)}
    pos = {owner[int(x)] for x in slots.unique()}
    want = {(b, j) for b, n in enumerate(lens) for j in range(max(0, n - W + 1), n)}
    assert pos == want, f"cache positions loaded {sorted(pos - want)[:5]} beyond, {sorted(want - pos)[:5]} missing"
    # programs: B * Hkv = 2, one query tile each; sequence 0: 300 - 8 + 1 = 293 -> tiles 288.. (1 tile) + 1 tree
    # tile, sequence 1: 1 cache tile + 1 tree tile; 2 dots per tile (QK^T, PV)
    assert seen["dots"] == 2 * (2 + 2), seen["dots"]


def test_window_larger_than_context_is_no_window():
    c = make_case([0, 21, 50], BUSHY, 4, 2, 16, 16)
    for fn in (tree_attention, reference.tree_attention):
        assert torch.equal(fn(**c, window=50 + BUSHY.size), fn(**c)), fn.__module__


def test_window_on_a_mask_that_is_not_a_tree(nan_alloc):
    """The definition counts mask rows, whatever they hold: node 2 sees node 1 but not its parent 0
    (depths 0, 1, 1); node 3 sees 0 and 2 (depth 2). The kernel follows the same definition."""
    m = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    c = make_case([9, 30], None, 4, 2, 16, 16, per_seq_masks=[m, Tree.chain(3).mask])
    for W in (1, 2, 3):
        out = tree_attention(**c, window=W)
        assert_close(out, reference.tree_attention(**c, window=W), 2e-5, 2e-5, f"W{W} vs reference")
        assert_close(out, brute_force(c, W), 2e-5, 2e-5, f"W{W} vs brute force")


BAD_WINDOW = {"zero": (0, ValueError, ">= 1"), "negative": (-3, ValueError, ">= 1"),
              "float": (2.5, TypeError, "int"), "bool": (True, TypeError, "int")}


@pytest.mark.parametrize("fn", [tree_attention, reference.tree_attention], ids=["triton", "reference"])
@pytest.mark.parametrize("name", list(BAD_WINDOW))
def test_bad_window(name, fn):
    window, exc, match = BAD_WINDOW[name]
    c = make_case([3, 20], Tree.chain(2), 4, 2, 16, 16)
    with pytest.raises(exc, match=match):
        fn(**c, window=window)


# ---------------------------------------------------------------------------------------------------------
# bad input: the kernel and the reference refuse the same things
# ---------------------------------------------------------------------------------------------------------
def _bad(name):
    c = make_case([3, 20], Tree.chain(2), 4, 2, 16, 16)
    if name == "not-lower-triangular":
        m = c["tree_mask"].clone()
        m[0, 2] = True
        c["tree_mask"] = m
    elif name == "not-reflexive":
        m = c["tree_mask"].clone()
        m[1, 1] = False
        c["tree_mask"] = m
    elif name == "Hq-not-multiple-of-Hkv":
        c["q"] = torch.randn(2, 3, 3, 16, device=DEVICE)
    elif name == "block-table-too-short":
        c["block_table"] = c["block_table"][:, :1].contiguous()          # 16 slots < 20 + 3
    elif name == "cache-lens-int64":
        c["cache_lens"] = c["cache_lens"].long()
    return c


BAD = {"not-lower-triangular": "lower-triangular", "not-reflexive": "reflexive",
       "Hq-not-multiple-of-Hkv": "multiple of Hkv", "block-table-too-short": "room for",
       "cache-lens-int64": "cache_lens must be int32"}


@pytest.mark.parametrize("fn", [tree_attention, reference.tree_attention], ids=["triton", "reference"])
@pytest.mark.parametrize("name", list(BAD))
def test_bad_input(name, fn):
    with pytest.raises(ValueError, match=BAD[name]):
        fn(**_bad(name))


# ---------------------------------------------------------------------------------------------------------
# block tables: entries in use are real, unshared blocks; unused ones (-1) are never followed
# ---------------------------------------------------------------------------------------------------------
def _table_case():
    """cache_lens 20 and 37 in 16-token blocks: 2 and 3 entries in use of 4 columns."""
    return make_case([20, 37], Tree.chain(2), 4, 2, 16, 16)


@pytest.mark.parametrize("fn", [tree_attention, reference.tree_attention], ids=["triton", "reference"])
def test_table_entries_in_use_must_be_unshared_blocks(fn):
    c = _table_case()
    shared = dict(c, block_table=c["block_table"].clone())
    shared["block_table"][1, 2] = shared["block_table"][0, 0]           # sequence 1 reads sequence 0's block
    with pytest.raises(ValueError, match="in use twice"):
        fn(**shared)
    bad = dict(c, block_table=c["block_table"].clone())
    bad["block_table"][0, 1] = -1                                       # sequence 0's second block: gone
    with pytest.raises(ValueError, match=r"entries in use must be in \[0, \d+\): block_table\[0, 1\] = -1"):
        fn(**bad)
    # entries past a sequence's blocks are not read: -1, an id out of range, another row's id are all fine
    loose = dict(c, block_table=c["block_table"].clone())
    loose["block_table"][0, 2:] = torch.tensor([10 ** 6, int(c["block_table"][1, 0])], dtype=torch.int32)
    loose["block_table"][1, 3] = -1
    assert torch.equal(fn(**loose), fn(**c))


def test_unchecked_bad_entries_are_skipped_by_triton_and_raise_in_the_twin():
    """check_values=False, sequence 0's third block is -1 (and sequence 1's cache runs past the table): the
    twin raises IndexError (it used to clamp -1 to block 0, silently); Triton leaves those positions out,
    reading nothing outside the cache (a slice of a NaN-guarded buffer). The twin's part runs on CPU copies
    (`on_cpu`)."""
    c = make_case([40, 9], Tree.chain(2), 4, 2, 16, 16)                  # 3 and 1 blocks in use
    c["block_table"][0, 2] = -1                                          # positions 32..39 have no block
    with pytest.raises(IndexError):
        reference.tree_attention(**on_cpu(c), check_values=False)
    NB = c["k_cache"].shape[0]
    guarded = {n: poison((NB + 2,) + tuple(c[n].shape[1:]), c[n].dtype) for n in ("k_cache", "v_cache")}
    for n in guarded:
        guarded[n][1: NB + 1] = c[n]
    ours = dict(c, k_cache=guarded["k_cache"][1: NB + 1], v_cache=guarded["v_cache"][1: NB + 1])
    out = tree_attention(**ours, check_values=False)
    cut = dict(c, cache_lens=torch.tensor([32, 9], dtype=torch.int32, device=DEVICE))   # what is left to see
    assert_close(out, reference.tree_attention(**cut), 2e-5, 2e-5, "positions with no block left out")
    # a cache_len past the table's width (2 columns = 32 tokens): the positions past it are left out
    c = make_case([16, 40], Tree.chain(2), 4, 2, 16, 16)
    c["block_table"] = c["block_table"][:, :2].contiguous()
    with pytest.raises(IndexError):
        reference.tree_attention(**on_cpu(c), check_values=False)
    out = tree_attention(**c, check_values=False)
    cut = dict(c, cache_lens=torch.tensor([16, 32], dtype=torch.int32, device=DEVICE))
    assert_close(out, reference.tree_attention(**cut, check_values=False), 2e-5, 2e-5, "past the table's width")


def test_docstring_example_runs():
    """The module's example (a hand-computed row, a window, the split heuristic) runs as written."""
    if DEVICE != "cpu":
        pytest.skip("the example uses CPU tensors (Triton's interpreter)")
    import doctest
    result = doctest.testmod(ta)
    assert result.attempted >= 10 and result.failed == 0, result


def test_fp64_refused_by_kernel():
    c = make_case([3], Tree.chain(1), 2, 1, 16, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match="fp64|float64"):
        tree_attention(**c)
    assert reference.tree_attention(**c).dtype == torch.float64          # the reference handles fp64


# ---------------------------------------------------------------------------------------------------------
# GPU: real tensor-core dots (bf16 / fp16), realistic sizes, the split heuristic
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("cache_lens,Hq,Hkv", [([1000, 0, 3000, 77], 32, 8), ([8191], 32, 32)],
                         ids=["B4-GQA4", "B1-MHA-split"])
@pytest.mark.parametrize("window", [None, 700], ids=["no-window", "W700"])
def test_gpu_llama_shapes(cache_lens, Hq, Hkv, dtype, window):
    tree = Tree.from_choices(Tree.from_accuracies([[0.6 * 0.75 ** h * 0.5 ** r for r in range(10)]
                                                   for h in range(4)], 63).paths[1:])
    c = make_case(cache_lens, tree, Hq, Hkv, 128, 16, dtype)
    out = tree_attention(**c, window=window)
    tol = {torch.float16: 2e-2, torch.bfloat16: 4e-2, torch.float32: 1e-4}[dtype]
    assert_close(out, reference.tree_attention(**c, window=window), tol, tol, "GPU vs reference")


@pytest.mark.gpu
def test_gpu_batch_and_capacity_do_not_recompile(monkeypatch):
    """The split count is a run-time argument: new batch sizes and cache capacities (which change the split
    count) reuse the compiled kernels; only SPLIT (split or not) and the combine's bucket are constexprs."""
    cache = getattr(ta._tree_attention_kernel, "device_caches", None)
    if cache is None:
        pytest.skip("this Triton has no JITFunction.device_caches")
    chosen, choose = [], ta.choose_num_splits
    monkeypatch.setattr(ta, "choose_num_splits", lambda *a, **k: chosen.append(choose(*a, **k)) or chosen[-1])
    before = sum(len(entry[0]) for entry in cache.values())
    for B in (1, 2, 3, 5, 8):
        for n in (40, 300, 1000, 4000):
            c = make_case([n] * B, Tree.chain(3), 8, 2, 128, 16, torch.bfloat16)
            tree_attention(**c, check_values=False)
    new = sum(len(entry[0]) for entry in cache.values()) - before
    assert len(set(chosen)) > 2, f"the cases should need several split counts, got {sorted(set(chosen))}"
    assert new <= 2, f"{new} new variants of _tree_attention_kernel for split counts {sorted(set(chosen))}"


# ---------------------------------------------------------------------------------------------------------
# the batch-invariant variant (exact=True)
# ---------------------------------------------------------------------------------------------------------
EXACT_CASES = [c[:7] + (None, None) for c in CASES] + [
    ("W7-B4-bushy9-GQA3-Dh24-BS16-N16", [0, 5, 37, 64], BUSHY, 6, 2, 24, 16, 7, 16),
    ("W1-B2-chain4-MHA4-Dh16-BS8", [3, 40], Tree.chain(4), 4, 4, 16, 8, 1, None),
    ("B2-chain4-GQA5-Dh20-BS5-N16", [33, 1], Tree.chain(4), 10, 2, 20, 5, None, 16),
]


@pytest.mark.parametrize("cache_lens,tree,Hq,Hkv,Dh,BS,window,block_n", [c[1:] for c in EXACT_CASES],
                         ids=[c[0] for c in EXACT_CASES])
def test_exact_matches_reference_and_brute_force(cache_lens, tree, Hq, Hkv, Dh, BS, window, block_n, nan_alloc):
    """The exact variant computes the same function (positions outside every window are NaN: never read)."""
    dtype = next(c[7] for c in CASES if c[1] == cache_lens) if window is None and block_n is None else torch.float32
    c = make_case(cache_lens, tree, Hq, Hkv, Dh, BS, dtype)
    if window is not None:
        c = poison_outside_window(c, window)
    out = _tree_attention(**c, window=window, block_n=block_n, exact=True)
    atol, rtol = TOL[dtype]
    assert out.dtype == dtype and out.shape == c["q"].shape
    assert_close(out, reference.tree_attention(**c, window=window), atol, rtol, "exact kernel vs reference")
    assert_close(out, brute_force(c, window), atol, rtol, "exact kernel vs brute force")


def test_exact_per_sequence_masks_and_sm_scale(nan_alloc):
    chain, star = Tree.chain(4).mask, Tree.from_choices([(0,), (1,), (2,), (3,)]).mask      # both T = 5
    c = make_case([12, 35], None, 4, 2, 16, 16, per_seq_masks=[chain, star])
    out = tree_attention(**c, sm_scale=0.3, exact=True)
    assert_close(out, reference.tree_attention(**c, sm_scale=0.3), 2e-5, 2e-5, "per-sequence masks")


def _as_serial_step(c, tree, b, i, window):
    """Node i of sequence b as a serial step computes it: its ancestors written into the cache after the cached
    tokens, then a one-node step (the node itself as the tree)."""
    BS = c["k_cache"].shape[1]
    n = int(c["cache_lens"][b])
    anc = [j for j in range(tree.size) if tree.mask[i, j] and j != i]
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    for d, j in enumerate(anc):
        blk = int(c["block_table"][b, (n + d) // BS])
        kc[blk, (n + d) % BS], vc[blk, (n + d) % BS] = c["k_tree"][b, j], c["v_tree"][b, j]
    one = lambda t: t[b:b + 1, i:i + 1].contiguous()                               # noqa: E731
    return tree_attention(one(c["q"]), kc, vc, c["block_table"][b:b + 1].contiguous(),
                          c["cache_lens"][b:b + 1] + len(anc), one(c["k_tree"]), one(c["v_tree"]),
                          torch.ones(1, 1, dtype=torch.bool, device=kc.device), window=window, exact=True)[0, 0]


@pytest.mark.parametrize("window", [None, 9], ids=["no-window", "W9"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_exact_tree_step_is_bit_identical_to_serial_steps(window, dtype):
    """What exact=True is for: every node's output has the bits of the serial step that would compute it (on a GPU
    with Llama-2-7B's head shape, in bf16). In the interpreter the dots are fp32, so there only the fp32 case can
    fail (the plain kernel fails it: its sums run in another order); the bf16 output rounds the difference away."""
    Hq, Hkv, Dh = (32, 32, 128) if DEVICE == "cuda" else (6, 2, 16)
    c = make_case([5, 70, 33], BUSHY, Hq, Hkv, Dh, 16, dtype)
    out = tree_attention(**c, window=window, exact=True)
    for b in range(3):
        for i in range(BUSHY.size):
            assert torch.equal(out[b, i], _as_serial_step(c, BUSHY, b, i, window)), (b, i)


def test_twin_exact_plans_once_per_step_and_replans_on_change():
    """The twin's exact=True: the plan + attention of tree_attention_ref, with the twin's input checks (window
    included). Its plan is kept for the next call (the next layer of a step) only while block_table, cache_lens and
    tree_mask are equal: a change in place must give the output a fresh plan gives. It expects the blocks a sequence
    owns to hold no NaN (the engine's caches never do), so the poison is zeroed."""
    from mtp_triton.kernels import tree_attention_ref as twin
    c = {k: v.nan_to_num() if v.is_floating_point() else v
         for k, v in make_case([5, 40], BUSHY, 4, 2, 16, 16, torch.bfloat16).items()}
    fresh = lambda c: twin.attention(c["q"], c["k_cache"], c["v_cache"], c["k_tree"], c["v_tree"],      # noqa: E731
                                     twin.plan(c["block_table"], c["cache_lens"], c["tree_mask"], 16))
    assert torch.equal(reference.tree_attention(**c, exact=True), fresh(c))
    c["cache_lens"] += 30                                                   # in place: same tensor, new values
    assert torch.equal(reference.tree_attention(**c, exact=True), fresh(c))
    c["tree_mask"] = Tree.chain(BUSHY.size - 1).mask.to(c["q"].device)
    assert torch.equal(reference.tree_attention(**c, exact=True), fresh(c))
    for bad in (0, True):
        with pytest.raises((ValueError, TypeError)):
            reference.tree_attention(**c, exact=True, window=bad, check_values=False)
