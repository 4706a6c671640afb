"""kv_append: the one-launch Triton append vs mtp_triton.reference.kv_append, element by element.

Every case compares the WHOLE caches (random values with NaN sprinkled in, or all NaN) bit for bit:
the written slots must hold the accepted nodes' rows, and every other element — other slots, other
sequences' blocks, blocks nobody owns, other layers — must be exactly what it was.
"""
import pytest
import torch
from conftest import DEVICE, on_cpu, poison

from mtp_triton import reference
from mtp_triton.kernels import kv_append as kv_mod

IMPLS = {"triton": kv_mod.kv_append, "reference": reference.kv_append}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_BITS = {4: torch.int32, 2: torch.int16, 1: torch.int8}


def bits(t):
    """Integer view, so that NaN == NaN in comparisons (and -0.0 != 0.0)."""
    return t.view(_BITS[t.element_size()])


def make_case(L, BS, Hkv, Dh, T, cache_lens, accept_len, dtype=torch.float32, fill="random", spare_blocks=3,
              seed=0):
    """Inputs for one append. Blocks are shuffled across sequences (non-contiguous ids), each sequence owns
    exactly the blocks it needs (the table is padded with -1), and `spare_blocks` blocks belong to nobody.
    accept_nodes is a path (root 0, then increasing node ids), -1 padded."""
    g = torch.Generator().manual_seed(seed)
    B = len(cache_lens)
    need = [c + a + 1 for c, a in zip(cache_lens, accept_len)]
    owned = [-(-n // BS) for n in need]
    NB = sum(owned) + spare_blocks
    perm = torch.randperm(NB, generator=g)
    block_table = torch.full((B, max(owned) + 1), -1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(owned):
        block_table[b, :n] = perm[k:k + n]
        k += n
    accept_nodes = torch.full((B, T), -1, dtype=torch.int64)
    accept_nodes[:, 0] = 0
    for b, a in enumerate(accept_len):
        accept_nodes[b, 1:a + 1] = (torch.randperm(T - 1, generator=g)[:a] + 1).sort().values

    def cache():
        if fill == "nan":
            return poison((L, NB, BS, Hkv, Dh), dtype)
        c = torch.randn(L, NB, BS, Hkv, Dh, generator=g)
        c[torch.rand(c.shape, generator=g) < 0.05] = float("nan")
        return c.to(DEVICE, dtype)

    return dict(
        k_cache=cache(), v_cache=cache(), block_table=block_table.to(DEVICE),
        cache_lens=torch.tensor(cache_lens, dtype=torch.int32, device=DEVICE),
        k_tree=torch.randn(L, B, T, Hkv, Dh, generator=g).to(DEVICE, dtype),
        v_tree=torch.randn(L, B, T, Hkv, Dh, generator=g).to(DEVICE, dtype),
        accept_nodes=accept_nodes.to(DEVICE), accept_len=torch.tensor(accept_len, dtype=torch.int64, device=DEVICE))


ARGS = ("k_cache", "v_cache", "block_table", "cache_lens", "k_tree", "v_tree", "accept_nodes", "accept_len")


def args_of(case):
    return [case[k] for k in ARGS]


def clone_case(case):
    return {k: v.clone() for k, v in case.items()}


def check_append(case, run):
    """Run `run(args)` on a copy of `case`; check it against the reference and against the contract."""
    ours, ref = clone_case(case), clone_case(case)
    run(args_of(ours))
    reference.kv_append(*args_of(ref))
    for name in ("k_cache", "v_cache"):
        assert torch.equal(bits(ours[name]), bits(ref[name])), f"{name} differs from the reference"
    # the contract directly: written slots hold the accepted rows, nothing else changed
    L, NB, BS = case["k_cache"].shape[:3]
    written = torch.zeros(NB, BS, dtype=torch.bool)
    for b in range(case["cache_lens"].shape[0]):
        for j in range(int(case["accept_len"][b]) + 1):
            pos = int(case["cache_lens"][b]) + j
            blk, slot, node = int(case["block_table"][b, pos // BS]), pos % BS, int(case["accept_nodes"][b, j])
            assert not written[blk, slot]
            written[blk, slot] = True
            for name, src in (("k_cache", "k_tree"), ("v_cache", "v_tree")):
                assert torch.equal(bits(ours[name][:, blk, slot]), bits(case[src][:, b, node])), \
                    f"{name}: seq {b}, token {j} (pos {pos}) is not node {node}"
    keep = ~written.to(case["k_cache"].device)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(bits(ours[name][:, keep]), bits(case[name][:, keep])), \
            f"{name}: elements outside the appended slots changed"
    for name in ARGS[2:]:   # inputs other than the caches (cache_lens included) are untouched
        assert torch.equal(ours[name], case[name]), f"{name} was modified"
    return ours


# (id, L, BS, Hkv, Dh, T, cache_lens, accept_len, fill)
CASES = [
    # mixed: seq 0 starts empty, seq 1 appends only the root, seq 2 accepts all 6 drafts across 3 blocks
    ("L2-B3-T7-BS4-H2-D24-mixed", 2, 4, 2, 24, 7, [0, 5, 11], [2, 0, 6], "random"),
    ("L1-B1-T1-BS16-H1-D8-root-only", 1, 16, 1, 8, 1, [9], [0], "random"),
    ("L3-B2-T9-BS3-H3-D40-full-accept", 3, 3, 3, 40, 9, [4, 2], [8, 8], "nan"),
    ("L2-B4-T5-BS8-H4-D17-accept0", 2, 8, 4, 17, 5, [7, 0, 8, 15], [0, 0, 0, 0], "random"),
    # the write starts exactly at a block boundary and ends exactly at one
    ("L2-B2-T6-BS5-H1-D33-boundaries", 2, 5, 1, 33, 6, [5, 7], [4, 2], "nan"),
]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("L,BS,Hkv,Dh,T,cache_lens,accept_len,fill", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_kv_append_matches_reference(L, BS, Hkv, Dh, T, cache_lens, accept_len, fill, dtype):
    case = make_case(L, BS, Hkv, Dh, T, cache_lens, accept_len, dtype, fill)
    check_append(case, lambda a: kv_mod.kv_append(*a))


@pytest.mark.parametrize("block", [16, 64], ids=["BLOCK16-5chunks", "BLOCK64-2chunks"])
def test_kv_append_row_chunks_and_loose_grid(block):
    """Rows of 72 elements cut into several programs (the last one masked), and a grid with max_tokens = T
    (larger than any accept length: the extra programs must exit without writing)."""
    case = make_case(L=2, BS=4, Hkv=3, Dh=24, T=7, cache_lens=[3, 10], accept_len=[3, 1], dtype=torch.float16)
    check_append(case, lambda a: kv_mod._launch_kv_append(*a, max_tokens=7, block=block))


def test_kv_append_is_idempotent_and_two_steps_compose():
    """Two consecutive steps (the second starts at cache_lens + accept_len + 1) equal two reference steps;
    running the same step twice changes nothing more."""
    case = make_case(L=2, BS=4, Hkv=2, Dh=8, T=5, cache_lens=[2, 6], accept_len=[4, 4], dtype=torch.float32)
    ours, ref = clone_case(case), clone_case(case)
    steps = [([2, 6], [2, 1]), ([5, 8], [1, 0])]
    for lens, acc in steps:
        for c in (ours, ref):
            c["cache_lens"] = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
            c["accept_len"] = torch.tensor(acc, dtype=torch.int64, device=DEVICE)
        kv_mod.kv_append(*args_of(ours))
        kv_mod.kv_append(*args_of(ours))
        reference.kv_append(*args_of(ref))
    for name in ("k_cache", "v_cache"):
        assert torch.equal(bits(ours[name]), bits(ref[name])), name


# ---------------------------------------------------------------- bad input: both twins, same errors

def _bad(case, **changes):
    c = clone_case(case)
    c.update(changes)
    return c


BAD = {
    "table-too-short": (ValueError, "room for", lambda c: _bad(c, block_table=c["block_table"][:, :1].contiguous())),
    "node-minus-one": (ValueError, "node ids", lambda c: _bad(c, accept_nodes=torch.where(
        torch.arange(c["accept_nodes"].shape[1], device=DEVICE) == 1, -1, c["accept_nodes"]))),
    "node-past-T": (ValueError, "node ids", lambda c: _bad(c, accept_nodes=torch.where(
        c["accept_nodes"] == c["accept_nodes"].max(), c["accept_nodes"].shape[1], c["accept_nodes"]))),
    "accept-len-T": (ValueError, "accept_len must be in", lambda c: _bad(c, accept_len=torch.full_like(
        c["accept_len"], c["k_tree"].shape[2]))),
    "v-cache-shape": (ValueError, "k_cache/v_cache", lambda c: _bad(c, v_cache=c["v_cache"][:, :-1].contiguous())),
    "tree-layers": (ValueError, "k_tree/v_tree", lambda c: _bad(c, k_tree=c["k_tree"][:1].contiguous(),
                                                                 v_tree=c["v_tree"][:1].contiguous())),
    "tree-heads": (ValueError, "k_tree/v_tree", lambda c: _bad(c, v_tree=c["v_tree"][:, :, :, :1].contiguous())),
    "nodes-shape": (ValueError, "accept_nodes must be", lambda c: _bad(c, accept_nodes=c["accept_nodes"][:, :-1]
                                                                        .contiguous())),
    "dtype-mix": (TypeError, "one dtype", lambda c: _bad(c, v_tree=c["v_tree"].half())),
    "table-int64": (ValueError, "block_table must be int32", lambda c: _bad(c, block_table=c["block_table"].long())),
    "block-id-NB": (ValueError, "entries in use", lambda c: _bad(c, block_table=torch.where(
        c["block_table"] == c["block_table"][0, 0], c["k_cache"].shape[1], c["block_table"]))),
    "negative-cache-len": (ValueError, "cache_lens must be >= 0", lambda c: _bad(c, cache_lens=c["cache_lens"] - 10)),
    "non-contiguous": (ValueError, "contiguous", lambda c: _bad(c, k_tree=c["k_tree"].transpose(3, 4)
                                                                 .contiguous().transpose(3, 4))),
}


@pytest.mark.parametrize("impl", list(IMPLS), ids=list(IMPLS))
@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
def test_kv_append_rejects_bad_input(bad, impl):
    case = make_case(L=2, BS=4, Hkv=2, Dh=6, T=5, cache_lens=[1, 6], accept_len=[3, 2])
    exc, match, mutate = BAD[bad]
    c = mutate(case)
    before = (c["k_cache"].clone(), c["v_cache"].clone())
    with pytest.raises(exc, match=match):
        IMPLS[impl](*args_of(c))
    assert torch.equal(bits(c["k_cache"]), bits(before[0])) and torch.equal(bits(c["v_cache"]), bits(before[1]))


# ---------------------------------------------------------------- block tables: -1 padding, per-sequence blocks

def _tiny_config():
    from mtp_triton.model import ModelConfig
    return ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=4)


def test_paged_cache_pads_unused_entries_with_minus_one():
    """Each row lists its own blocks, then -1: block 0 belongs to sequence 0, so it must not pad the others."""
    from mtp_triton.model import PagedKVCache
    cache = PagedKVCache(_tiny_config(), [5, 40, 9], block_size=4)           # 2, 10 and 3 blocks
    table = cache.block_table.tolist()
    assert [sum(x >= 0 for x in row) for row in table] == [2, 10, 3]
    assert all(x == -1 for row, n in zip(table, (2, 10, 3)) for x in row[n:]), table
    owned = sorted(x for row in table for x in row if x >= 0)
    assert owned == list(range(cache.k.shape[1])), "every block belongs to exactly one sequence"


def _paged_case(capacities, cache_lens, accept_len, T=4, BS=4):
    """A case on the engine's own PagedKVCache (capacities 5 and 40 tokens: 2 and 10 blocks)."""
    from mtp_triton.model import PagedKVCache
    cache = PagedKVCache(_tiny_config(), capacities, block_size=BS, device=DEVICE)
    g = torch.Generator().manual_seed(1)
    B, L = len(capacities), cache.k.shape[0]
    k = torch.randn(cache.k.shape, generator=g).to(DEVICE)
    nodes = torch.full((B, T), -1, dtype=torch.int64)
    for b, a in enumerate(accept_len):
        nodes[b, : a + 1] = torch.arange(a + 1)
    return dict(k_cache=k, v_cache=-k, block_table=cache.block_table,
                cache_lens=torch.tensor(cache_lens, dtype=torch.int32, device=DEVICE),
                k_tree=torch.randn(L, B, T, *cache.k.shape[3:], generator=g).to(DEVICE),
                v_tree=torch.randn(L, B, T, *cache.k.shape[3:], generator=g).to(DEVICE),
                accept_nodes=nodes.to(DEVICE), accept_len=torch.tensor(accept_len, device=DEVICE))


@pytest.mark.parametrize("impl", list(IMPLS), ids=list(IMPLS))
def test_append_past_a_sequences_own_blocks_is_refused(impl):
    """Sequence 0 owns 2 blocks (8 tokens); appending 3 tokens at position 6 needs a third. The table is
    wide enough (sequence 1 owns 10), so a width-based check passed, and with 0 padding the write went to
    block 0, sequence 0's own first block. Now the -1 there is refused and nothing is written."""
    c = _paged_case([5, 40], cache_lens=[6, 30], accept_len=[2, 1])
    before = clone_case(c)
    with pytest.raises(ValueError, match=r"entries in use must be in \[0, 12\): block_table\[0, 2\] = -1"):
        IMPLS[impl](*args_of(c))
    assert torch.equal(bits(c["k_cache"]), bits(before["k_cache"])) and torch.equal(c["v_cache"], before["v_cache"])
    fine = _paged_case([5, 40], cache_lens=[5, 30], accept_len=[2, 1])         # positions 5..7: its own blocks
    check_append(fine, lambda a: IMPLS[impl](*a))


def _share(case, b, col, with_b, with_col):
    table = case["block_table"].clone()
    table[b, col] = table[with_b, with_col]
    return _bad(case, block_table=table)


@pytest.mark.parametrize("impl", list(IMPLS), ids=list(IMPLS))
@pytest.mark.parametrize("where", ["two-sequences", "one-sequence"])
def test_shared_blocks_are_refused(where, impl):
    case = make_case(L=2, BS=4, Hkv=2, Dh=6, T=5, cache_lens=[1, 6], accept_len=[3, 2])   # 2 and 3 blocks in use
    c = _share(case, 1, 2, 0, 1) if where == "two-sequences" else _share(case, 1, 2, 1, 0)
    with pytest.raises(ValueError, match="in use twice"):
        IMPLS[impl](*args_of(c))
    # the same id in an entry no call uses (past a sequence's blocks) is not a conflict
    spare = _bad(case, block_table=case["block_table"].clone())
    spare["block_table"][0, 2] = spare["block_table"][1, 0]
    check_append(spare, lambda a: IMPLS[impl](*a))


def test_unchecked_bad_entries_drop_the_token_in_triton_and_raise_in_the_twin():
    """check_values=False with -1 in use (and a column past the table's width): the twin raises IndexError
    (torch indexing would silently wrap -1 to the last block); Triton drops those tokens and writes the
    others. The caches are slices of NaN-guarded buffers: nothing around them may change either. The twin's
    IndexError is checked on CPU copies (`on_cpu`)."""
    case = make_case(L=2, BS=4, Hkv=2, Dh=6, T=5, cache_lens=[1, 6], accept_len=[3, 2], spare_blocks=0)
    table = case["block_table"][:, :2].clone()                  # seq 0 owns blocks [a, -]: 4 tokens, seq 1 two
    table[0, 1] = -1
    bad = _bad(case, block_table=table.contiguous(), cache_lens=torch.tensor([2, 6], dtype=torch.int32,
                                                                             device=DEVICE))
    # seq 0 writes positions 2, 3 (block a), 4, 5 (column 1: -1); seq 1 writes 6, 7 (its column 1), 8 (column 2:
    # past the width)
    for accept in ([3, 1], [0, 2]):                           # only the -1, then only past the width
        with pytest.raises(IndexError):
            reference.kv_append(*args_of(on_cpu(_bad(bad, accept_len=torch.tensor(accept, device=DEVICE)))),
                                check_values=False)
    L, NB = bad["k_cache"].shape[:2]
    guarded = {}
    for name in ("k_cache", "v_cache"):
        buf = poison((L + 2, NB) + tuple(bad[name].shape[2:]), bad[name].dtype)
        buf[1: L + 1] = bad[name]
        guarded[name] = buf
    ours = dict(bad, k_cache=guarded["k_cache"][1: L + 1], v_cache=guarded["v_cache"][1: L + 1])
    kv_mod.kv_append(*args_of(ours), check_values=False)
    # what must have happened: the tokens with a block, appended by the checked twin
    ok = _bad(bad, accept_len=torch.tensor([1, 1], device=DEVICE))
    reference.kv_append(*args_of(ok))
    for name in ("k_cache", "v_cache"):
        assert torch.equal(bits(ours[name]), bits(ok[name])), f"{name}: the valid tokens, and only they"
        assert torch.isnan(guarded[name][0]).all() and torch.isnan(guarded[name][L + 1]).all(), \
            f"{name}: memory around the cache was written"


def test_docstring_example_runs():
    """The module's example (an append across a block boundary, then one refused past the blocks) runs."""
    if DEVICE != "cpu":
        pytest.skip("the example uses CPU tensors (Triton's interpreter)")
    import doctest
    result = doctest.testmod(kv_mod)
    assert result.attempted >= 9 and result.failed == 0, result


def test_check_returns_tokens_to_write():
    case = make_case(L=1, BS=4, Hkv=1, Dh=4, T=6, cache_lens=[0, 3, 9], accept_len=[1, 5, 0])
    assert kv_mod.check_kv_append_inputs(*args_of(case)) == 6


# ---------------------------------------------------------------- layout experiment and benchmarks

def test_layouts_are_bijective_and_triton_copy_matches_torch():
    from mtp_lab.bench import kv_layout as K
    B, cap, n = 3, 48, 9
    start = torch.tensor([0, 5, 39], dtype=torch.int32, device=DEVICE)
    for name in K.LAYOUTS:
        lay = K.Layout(name, B, cap, block_size=4, n_interleave=4, seed=1, device=DEVICE)
        rows = lay.rows(torch.arange(cap, device=DEVICE)[None].expand(B, -1))
        assert sorted(rows.flatten().tolist()) == list(range(B * cap)), f"{name}: not a bijection"
        cache = torch.randn(B * cap, 3, 20, device=DEVICE)
        idx = lay.rows(start.long()[:, None] + torch.arange(n, device=DEVICE)[None]).flatten()
        buf = poison((B, n, 3, 20), torch.float32)
        K.triton_copy(lay, cache, buf, start, write=False, block_n=4)
        assert torch.equal(buf.view(B * n, 60), cache.view(-1, 60)[idx]), f"{name}: read"
        src, ours, ref = torch.randn(B, n, 3, 20, device=DEVICE), cache.clone(), cache.clone()
        K.triton_copy(lay, ours, src, start, write=True, block_n=4)
        ref.view(-1, 60).index_copy_(0, idx, src.view(-1, 60))
        assert torch.equal(ours, ref), f"{name}: append"
    lay = K.Layout("interleaved", 1, 16, n_interleave=4)   # token p -> block p % 4, offset p // 4
    blocks = lay.block_table[0].long()
    assert lay.rows(torch.arange(16)[None])[0].tolist() == [int(blocks[p % 4]) * 4 + p // 4 for p in range(16)]


def test_benchmarks_produce_stamped_rows(tmp_path):
    from mtp_lab.bench import kv_append as bench_append
    from mtp_lab.bench import kv_layout as bench_layout
    from mtp_lab.bench.common import read_rows
    rows = bench_append.bench_kv_append(full=False, device=DEVICE, batches=(2,), accept_lens=(1,), T=4)
    assert {r["provider"] for r in rows} == set(bench_append.PROVIDERS)
    assert all(r["device"] and r["torch"] and r["gbps"] > 0 for r in rows)
    bench_append.plot(rows, tmp_path / "a.png")
    tiny = dict(B=2, capacity=64, heads=(1,), Dh=16, n_reads=(24,), n_new=3)
    rows2 = bench_layout.layout_rows(full=False, device=DEVICE, sizes=tiny)
    assert {(r["pattern"], r["layout"]) for r in rows2} == {(p, n) for p in ("read", "append")
                                                           for n in bench_layout.LAYOUTS}
    bench_layout.plot(rows2, tmp_path / "b.png")
    assert (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "b.png").stat().st_size > 0
    # the command lines append to a CSV and draw their plot next to it
    bench_append.main(["--out", str(tmp_path / "a.csv"), "--batches", "1", "--accept-lens", "0",
                       "--models", "tiny-cpu" if DEVICE == "cpu" else "llama-7b"])              # one model: 5 rows
    bench_layout.main(["--out", str(tmp_path / "b.csv")])
    assert len(read_rows(tmp_path / "a.csv")) == len(bench_append.PROVIDERS)
    assert {r["interpreter"] for r in read_rows(tmp_path / "a.csv")} == {str(DEVICE == "cpu")}
    assert (tmp_path / "a.png").exists() and (tmp_path / "b.png").exists()


def test_per_layer_baselines_match_reference():
    from mtp_lab.bench.kv_append import per_layer_append, vectorized_append
    case = make_case(L=3, BS=4, Hkv=2, Dh=5, T=6, cache_lens=[2, 9], accept_len=[5, 1])
    check_append(case, lambda a: per_layer_append(*a))
    check_append(case, lambda a: vectorized_append(*a))


# ---------------------------------------------------------------- GPU only

@pytest.mark.gpu
def test_kv_append_int64_offsets_gpu():
    """A cache past 2**31 elements per tensor: writes to the last blocks of the last layer must land there
    (int32 offsets would wrap around and hit the start of the cache)."""
    L, BS, Hkv, Dh = 2, 16, 8, 128
    NB = (2 ** 31) // (L * BS * Hkv * Dh) + 64                 # > 2**31 elements
    dt = torch.float16
    k_cache = torch.zeros(L, NB, BS, Hkv, Dh, dtype=dt, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    T = 4
    k_tree = torch.randn(L, 1, T, Hkv, Dh, dtype=dt, device="cuda")
    v_tree = torch.randn_like(k_tree)
    block_table = torch.tensor([[NB - 2, NB - 1]], dtype=torch.int32, device="cuda")
    cache_lens = torch.tensor([BS - 2], dtype=torch.int32, device="cuda")      # crosses into block NB - 1
    accept_nodes = torch.tensor([[0, 1, 2, 3]], device="cuda")
    accept_len = torch.tensor([3], device="cuda")
    kv_mod.kv_append(k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, accept_nodes, accept_len)
    torch.cuda.synchronize()
    assert torch.equal(k_cache[:, NB - 2, BS - 2:], k_tree[:, 0, :2])
    assert torch.equal(v_cache[:, NB - 1, :2], v_tree[:, 0, 2:])
    n_written = L * 4 * Hkv * Dh
    assert int(torch.count_nonzero(k_cache)) <= n_written and int(torch.count_nonzero(v_cache)) <= n_written
    assert int(torch.count_nonzero(k_cache[:, : NB - 2])) == 0
