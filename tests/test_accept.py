"""Tree acceptance kernels (greedy and lossless sampling) vs the references, plus a statistical test
that tree acceptance emits tokens distributed exactly as the target distribution."""
import pytest
import torch

from conftest import DEVICE

from mtp_triton import reference
from mtp_triton.kernels.accept import _tree_accept_sample, tree_accept, tree_accept_sample
from mtp_triton.tree import Tree

BUSHY = Tree.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])   # T = 9
PARENTS_BUSHY = BUSHY.parents.tolist()          # [-1, 0, 0, 0, 1, 1, 2, 4, 5]


@pytest.fixture
def sentinel_alloc(monkeypatch):
    """torch.empty returns sentinel-filled ints / NaN floats, so an output the kernel skips is visible."""
    empty = torch.empty

    def filled(*a, **k):
        t = empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-(2 ** 31) + 7)

    monkeypatch.setattr(torch, "empty", filled)


def assert_same(got, want, what=""):
    for name, g, w in zip(("accept_len", "accept_nodes", "next_token"), got, want):
        assert g.dtype == torch.int64 and g.shape == w.shape, f"{what} {name}: {g.dtype} {tuple(g.shape)}"
        assert torch.equal(g.cpu(), w.cpu()), f"{what} {name}:\n kernel    {g.tolist()}\n reference {w.tolist()}"


def t64(x):
    return torch.tensor(x, dtype=torch.int64, device=DEVICE)


# ---------------------------------------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [tree_accept, reference.tree_accept], ids=["triton", "reference"])
def test_greedy_hand_cases(fn, sentinel_alloc):
    p = t64(PARENTS_BUSHY)
    #               node: 0  1  2  3  4  5  6  7  8
    draft = t64([[0, 4, 6, 8, 1, 2, 3, 5, 7],      # no match: target[0] = 9 is not drafted
                 [0, 4, 6, 8, 1, 2, 3, 5, 7],      # full path 0-1-4-7 (4 == t[0], 1 == t[1], 5 == t[4])
                 [0, 4, 4, 8, 1, 2, 3, 5, 7],      # tie at depth 1 (nodes 1, 2 both 4): lowest index wins,
                 [0, 5, 4, 8, 1, 2, 7, 5, 7]])     # ...and depth beats index (node 6 at depth 2 via node 2)
    target = t64([[9, 9, 9, 9, 9, 9, 9, 9, 9],
                  [4, 1, 9, 9, 5, 9, 9, 3, 9],
                  [4, 9, 9, 9, 9, 9, 9, 9, 9],
                  [4, 9, 7, 9, 9, 9, 11, 9, 9]])
    accept_len, nodes, nxt = fn(draft, p, target)
    assert accept_len.tolist() == [0, 3, 1, 2]
    assert nodes.tolist() == [[0, -1, -1, -1, -1, -1, -1, -1, -1],
                              [0, 1, 4, 7, -1, -1, -1, -1, -1],
                              [0, 1, -1, -1, -1, -1, -1, -1, -1],
                              [0, 2, 6, -1, -1, -1, -1, -1, -1]]
    assert nxt.tolist() == [9, 3, 9, 11]


@pytest.mark.parametrize("fn", [tree_accept, reference.tree_accept], ids=["triton", "reference"])
def test_greedy_unused_nodes_and_per_sequence_parents(fn, sentinel_alloc):
    """Parent -1 marks an unused (padding) node: never accepted even if its token matches. parents [B, T]."""
    parents = t64([[-1, 0, 1, -1, -1],             # chain of 2, two padding nodes
                   [-1, 0, 0, 2, -1]])             # a branch, one padding node
    draft = t64([[0, 3, 4, 3, 3],
                 [0, 2, 3, 4, 3]])
    target = t64([[3, 4, 6, 0, 0],
                  [3, 0, 0, 4, 0]])                # seq 1: node 2 (3 == t[0]), node 3 (4 != t[2] = 0)
    accept_len, nodes, nxt = fn(draft, parents, target)
    assert accept_len.tolist() == [2, 1]
    assert nodes.tolist() == [[0, 1, 2, -1, -1], [0, 2, -1, -1, -1]]
    assert nxt.tolist() == [6, 0]


@pytest.mark.parametrize("fn", [tree_accept, reference.tree_accept], ids=["triton", "reference"])
def test_greedy_long_chain(fn, sentinel_alloc):
    """A 40-deep chain (pointer jumping needs all log2(64) rounds): fully accepted, and cut at node 35."""
    T = 40
    parents = t64(list(range(-1, T - 1)))
    target = torch.arange(T, device=DEVICE)[None].repeat(2, 1) + 100
    draft = torch.cat([t64([[0]] * 2), target[:, :-1]], dim=1)          # draft[i] = target[i - 1]: all match
    draft[1, 35] = -5
    accept_len, nodes, nxt = fn(draft, parents, target)
    assert accept_len.tolist() == [39, 34]
    assert nodes[0].tolist() == list(range(T)) and nodes[1].tolist() == list(range(35)) + [-1] * 5
    assert nxt.tolist() == [139, 134]


@pytest.mark.parametrize("T,B,shared", [(1, 3, True), (9, 37, True), (9, 11, False), (40, 5, False)],
                         ids=["T1-B3", "T9-B37-shared", "T9-B11-per-seq", "T40-B5-deep"])
def test_greedy_random_matches_reference(T, B, shared, sentinel_alloc):
    """Random trees (deep chains too: pointer jumping past 16 levels) and tokens from a tiny vocab,
    so that long accepted paths and ties are common."""
    g = torch.Generator().manual_seed(T * 100 + B)
    def rand_parents():
        par = [-1] + [int(torch.randint(max(0, i - 3), i, (1,), generator=g)) for i in range(1, T)]
        return par
    parents = t64(rand_parents()) if shared else t64([rand_parents() for _ in range(B)])
    V = 3
    target = torch.randint(0, V, (B, T), generator=g)
    par = parents.cpu().expand(B, T).clamp(min=0)
    # drafts copy the target after their parent 85 % of the time: long accepted paths and many ties
    draft = torch.where(torch.rand(B, T, generator=g) < 0.85, target.gather(1, par),
                        torch.randint(0, V, (B, T), generator=g))
    draft, target = draft.to(DEVICE), target.to(DEVICE)
    want = reference.tree_accept(draft, parents, target)
    assert_same(tree_accept(draft, parents, target), want, "greedy")
    if T == 40:
        assert int(want[0].max()) > 16, "the test should reach past 16 levels"


# ---------------------------------------------------------------------------------------------------------
# sampling: same random numbers -> same decisions as the reference
# ---------------------------------------------------------------------------------------------------------
def random_sample_case(B, tree_parents, V, dtype, seed, peaked=True):
    """Target probs with a few likely tokens; drafts mostly sampled from the parent's target (so that
    acceptance happens at several depths), some repeated among siblings."""
    g = torch.Generator().manual_seed(seed)
    parents = t64(tree_parents)
    T = parents.shape[-1]
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * (3.0 if peaked else 1.0)
    probs = torch.softmax(logits, -1)
    par = parents.cpu().expand(B, T).clamp(min=0)
    parent_probs = probs.gather(1, par[:, :, None].expand(B, T, V))
    draft = torch.multinomial(parent_probs.reshape(B * T, V), 1, generator=g).view(B, T)
    draft[:, 0] = 0
    u_accept = torch.rand(B, T, generator=g, dtype=torch.float64)
    u_sample = torch.rand(B, generator=g, dtype=torch.float64)
    to = lambda x, dt=None: x.to(device=DEVICE, dtype=dt or x.dtype)
    return to(draft), parents, to(probs, dtype), to(u_accept, torch.float32), to(u_sample, torch.float32)


@pytest.mark.parametrize("B,V,dtype,per_seq", [(24, 7, torch.float32, False), (16, 300, torch.float32, True),
                                                (12, 50, torch.float64, False), (12, 33, torch.float16, False),
                                                (8, 10, torch.bfloat16, True)],
                         ids=["V7-fp32", "V300-fp32-per-seq", "V50-fp64", "V33-fp16", "V10-bf16-per-seq"])
def test_sample_matches_reference(B, V, dtype, per_seq, sentinel_alloc):
    parents = PARENTS_BUSHY if not per_seq else [PARENTS_BUSHY if b % 2 else
                                                 [-1, 0, 1, 2, 0, 4, -1, -1, -1] for b in range(B)]
    args = random_sample_case(B, parents, V, dtype, seed=V + B)
    want = reference.tree_accept_sample(*args)
    assert_same(tree_accept_sample(*args), want, "sample")
    assert len(set(want[0].tolist())) > 1, "the case should accept different depths"


@pytest.mark.parametrize("fn", [tree_accept_sample, reference.tree_accept_sample], ids=["triton", "reference"])
def test_sample_boundary_conventions(fn, sentinel_alloc):
    """Dyadic numbers make every sum exact, so the conventions themselves are pinned down:
    accept iff u * total < p(x) (strict); a rejected sibling's token is removed before the next try
    (including a repeated token); the residual draw is the first id whose cdf > u * total."""
    parents = t64([-1, 0, 0, 0])                   # root with three children
    draft = t64([[0, 1, 1, 3]] * 4)                # node 2 repeats node 1's token
    p = torch.tensor([0.25, 0.25, 0.0, 0.5], dtype=torch.float32)
    probs = p.expand(4, 4, 4).contiguous().to(DEVICE)
    u_accept = torch.tensor([[0, 0.25, 0.0, 0.99],  # 0.25*1 == p(1): rejected (strict); node 2 sees p(1) = 0;
                             [0, 0.24, 0.0, 0.0],   # node 3: 0.99 * 0.75 < 0.5? no -> all rejected
                             [0, 0.5, 0.0, 0.5],    # node 3: 0.5 * 0.75 = 0.375 < 0.5 -> accepted
                             [0, 0.5, 0.0, 0.99]], dtype=torch.float32, device=DEVICE)
    u_sample = torch.tensor([1 / 3, 0.0, 0.5, 0.99], dtype=torch.float32, device=DEVICE)
    accept_len, nodes, nxt = fn(draft, parents, probs, u_accept, u_sample)
    assert accept_len.tolist() == [0, 1, 1, 0]
    assert nodes.tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [0, 3, -1, -1], [0, -1, -1, -1]]
    # row 0 and 3: residual [0.25, 0, 0, 0] (tokens 1 and 3 rejected) -> token 0 whatever u;
    # rows 1, 2 end at leaves: residual = p; u = 0 -> first id with mass (0); u = 0.5: cdf 0.25,0.5,0.5,1 -> 3
    assert nxt.tolist() == [0, 0, 3, 0]


@pytest.mark.parametrize("fn", [tree_accept_sample, reference.tree_accept_sample], ids=["triton", "reference"])
def test_sample_zero_mass_tail(fn):
    """Ids with zero mass are never drawn: u near 1 lands on the last id with mass, not on the zero tail;
    an all-zero row (outside the contract) gives the last id, as the reference defines it."""
    parents = t64([-1])
    probs = torch.tensor([[[0.5, 0.5, 0.0, 0.0]], [[0.0, 0.0, 0.0, 0.0]]], device=DEVICE)
    u = torch.tensor([0.9999999, 0.3], device=DEVICE)
    _, _, nxt = fn(t64([[0], [0]]), parents, probs, torch.zeros(2, 1, device=DEVICE), u)
    assert nxt.tolist() == [1, 3]                  # all-zero row: the last id, as the reference defines it


def random_parents(T, kind, g):
    """A tree of T nodes: "deep" (parents within 3 indices: long chains), "bushy" (parents among the first
    quarter: wide sibling sets), "star" (every node a child of the root)."""
    if kind == "star":
        return [-1] + [0] * (T - 1)
    lo = (lambda i: max(0, i - 3)) if kind == "deep" else (lambda i: 0)
    hi = (lambda i: i) if kind == "deep" else (lambda i: max(1, min(i, (T + 3) // 4)))
    return [-1] + [int(torch.randint(lo(i), hi(i), (1,), generator=g)) for i in range(1, T)]


def sparse_probs(probs, keep, g):
    """Zero all but a random `keep` fraction of each row's ids (as top-p would), keeping the row's argmax."""
    mask = torch.rand(probs.shape, generator=g) < keep
    mask |= probs == probs.amax(-1, keepdim=True)
    return probs * mask


ODD = [  # (B, T, V, tree, dtype, sparse)
    (3, 1, 37, "deep", torch.float32, False),          # T = 1: a serial step, the bonus is a plain sample
    (4, 2, 1, "deep", torch.float32, False),           # V = 1: every draft is accepted (p(x) / sum = 1)
    (5, 2, 37, "deep", torch.float32, True),
    (3, 17, 1000, "bushy", torch.float32, True),
    (2, 17, 5000, "deep", torch.float64, False),
    (2, 64, 1000, "bushy", torch.float32, False),
    (2, 64, 5000, "star", torch.bfloat16, True),
    (2, 64, 37, "deep", torch.float16, False),
]


@pytest.mark.parametrize("B,T,V,tree,dtype,sparse", ODD,
                         ids=[f"B{b}-T{t}-V{v}-{k}-{str(d)[6:]}{'-sparse' if sp else ''}" for b, t, v, k, d, sp in ODD])
def test_sample_odd_shapes_match_reference(B, T, V, tree, dtype, sparse, sentinel_alloc):
    """Same random numbers -> same decisions, on odd trees and vocabularies (V = 1, not a multiple of any
    chunk, several chunk groups), with zero-mass ids (top-p style) in half the cases."""
    g = torch.Generator().manual_seed(T * 1000 + V)
    parents = [random_parents(T, tree, g) for _ in range(B)]
    draft, par, probs, u_accept, u_sample = random_sample_case(B, parents, V, torch.float64, seed=T + V)
    if sparse:
        probs = sparse_probs(probs.cpu(), 0.3, g).to(DEVICE)
    probs = probs.to(dtype)
    args = (draft, par, probs, u_accept, u_sample)
    want = reference.tree_accept_sample(*args)
    assert_same(tree_accept_sample(*args), want, "sample")
    if V == 1:
        assert want[0].tolist() == [1] * B and want[2].tolist() == [0] * B


# tiny chunks: 1000 ids = 63 chunks of 16 in 16 groups of 4 (the last group and chunk partial)
TINY_CHUNKS = dict(CHUNK=16, CPP=4, RPP=8)


@pytest.mark.parametrize("T,tree", [(9, "bushy"), (64, "star")], ids=["T9-bushy", "T64-star"])
def test_sample_tiny_chunks_match_reference(T, tree, sentinel_alloc):
    """Every level of the coarse-to-fine residual search sees many items and partial last items."""
    B, V = 4, 1000
    g = torch.Generator().manual_seed(T)
    parents = [random_parents(T, tree, g) for _ in range(B)]
    args = list(random_sample_case(B, parents, V, torch.float32, seed=T, peaked=False))
    args[2] = sparse_probs(args[2].cpu(), 0.5, g).to(DEVICE)
    want = reference.tree_accept_sample(*args)
    assert_same(_tree_accept_sample(*args, **TINY_CHUNKS), want, "tiny chunks")


@pytest.mark.parametrize("fn", ["triton", "reference"])
def test_sample_residual_chunk_emptied_by_rejections(fn):
    """The target's mass sits on 5 ids; the root's three children draft ids 500, 501, 502, the only ids with mass
    in their chunk [496, 512) and group [448, 512). When all are rejected that chunk's residual is exactly 0, but
    its stored sum minus the rejected mass need not be (another summation order): here it is +6e-8 under the
    interpreter, and the last u puts the threshold inside that sliver. Only the exact counts of ids with mass
    keep the draw off the emptied chunk (without them the kernel drew id 999, which has no mass)."""
    V, n = 1000, 24
    p = torch.zeros(V, dtype=torch.float32)
    p[3], p[900] = 0.1, 0.25
    p[[500, 501, 502]] = torch.tensor([0.09830883890390396, 0.1346805840730667, 0.25448256731033325])
    parents = t64([-1, 0, 0, 0])
    draft = t64([[0, 500, 501, 502]] * n)
    probs = p.expand(n, 4, V).contiguous().to(DEVICE)
    u_accept = torch.full((n, 4), 0.999, device=DEVICE)                 # every draft rejected
    u_sample = torch.cat([torch.linspace(0, 0.9999, n - 1), torch.tensor([0.2857142984867096])]).to(DEVICE)
    want = reference.tree_accept_sample(draft, parents, probs, u_accept, u_sample)
    got = _tree_accept_sample(draft, parents, probs, u_accept, u_sample, **TINY_CHUNKS) if fn == "triton" else want
    assert_same(got, want, "emptied chunk")
    assert got[0].tolist() == [0] * n
    assert set(got[2].tolist()) == {3, 900}, "only ids with residual mass may be drawn"


def test_sample_inputs_inside_nan_padding(sentinel_alloc):
    """target_probs, u_accept, u_sample are views into NaN-filled buffers: a read past a row, a chunk or the
    vocabulary would turn a sum into NaN and change the decisions; the padding stays untouched."""
    B, T, V = 3, 9, 300
    args = list(random_sample_case(B, PARENTS_BUSHY, V, torch.float32, seed=5))
    want = reference.tree_accept_sample(*args)
    bufs = []
    for i in (2, 3, 4):
        t = args[i]
        buf = torch.full((t.numel() + 2 * 64,), float("nan"), dtype=t.dtype, device=DEVICE)
        buf[64: 64 + t.numel()].copy_(t.flatten())
        args[i] = buf[64: 64 + t.numel()].view(t.shape)
        bufs.append(buf)
    for over in ({}, dict(CHUNK=16, CPP=4, RPP=4)):
        assert_same(_tree_accept_sample(*args, **over), want, f"padded {over}")
    for buf in bufs:
        assert torch.isnan(buf[:64]).all() and torch.isnan(buf[-64:]).all(), "padding was written"


# ---------------------------------------------------------------------------------------------------------
# invalid values: refused by both under check_values
# ---------------------------------------------------------------------------------------------------------
BAD_PROBS = {"negative": -1e-3, "nan": float("nan"), "inf": float("inf"), "-inf": -float("inf")}


@pytest.mark.parametrize("fn", [tree_accept_sample, reference.tree_accept_sample], ids=["triton", "reference"])
@pytest.mark.parametrize("bad", list(BAD_PROBS))
def test_invalid_probs_refused(fn, bad):
    """One negative / NaN / inf probability anywhere (here at a node off the accepted path) is refused with a
    ValueError; check_values=False skips the (host-syncing) check and returns well-formed outputs."""
    args = list(random_sample_case(2, PARENTS_BUSHY, 20, torch.float32, seed=6))
    args[2] = args[2].clone()
    args[2][1, 7, 13] = BAD_PROBS[bad]
    with pytest.raises(ValueError, match="target_probs must be finite and >= 0"):
        fn(*args)
    accept_len, nodes, nxt = fn(*args, check_values=False)
    assert accept_len.shape == (2,) and nodes.shape == (2, 9) and nxt.shape == (2,)


@pytest.mark.parametrize("fn", [tree_accept_sample, reference.tree_accept_sample], ids=["triton", "reference"])
@pytest.mark.parametrize("which,value", [("u_accept", 1.0), ("u_accept", -0.1), ("u_accept", float("nan")),
                                         ("u_sample", 1.5), ("u_sample", float("nan"))],
                         ids=["u_accept-1", "u_accept-neg", "u_accept-nan", "u_sample-1.5", "u_sample-nan"])
def test_invalid_uniforms_refused(fn, which, value):
    args = list(random_sample_case(2, PARENTS_BUSHY, 20, torch.float32, seed=7))
    i = 3 if which == "u_accept" else 4
    args[i] = args[i].clone()
    args[i].view(-1)[-1] = value
    with pytest.raises(ValueError, match=f"{which} must hold uniforms in \\[0, 1\\)"):
        fn(*args)
    fn(*args, check_values=False)                                        # skipped: no error


@pytest.mark.parametrize("fn", [tree_accept_sample, reference.tree_accept_sample], ids=["triton", "reference"])
def test_unused_u_accept_entry_is_not_checked(fn):
    """u_accept[:, 0] (the root has no test) may hold anything."""
    args = list(random_sample_case(2, PARENTS_BUSHY, 20, torch.float32, seed=8))
    args[3] = args[3].clone()
    args[3][:, 0] = float("nan")
    assert_same(fn(*args), reference.tree_accept_sample(*args), "root u ignored")


# ---------------------------------------------------------------------------------------------------------
# statistics: tree acceptance is lossless
# ---------------------------------------------------------------------------------------------------------
def chi2_pvalue(counts, probs):
    """Pearson chi-square goodness of fit; p-value = Q(df / 2, chi2 / 2) (regularised upper gamma)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    keep = probs > 0
    assert int(counts[~keep].sum()) == 0, "a zero-probability outcome was emitted"
    expected = probs[keep] * counts.sum()
    assert float(expected.min()) >= 5, "too few trials for the chi-square approximation"
    chi2 = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), chi2 / 2))


V_STAT = 6
# root; depth 1: nodes 1, 2, 3 (node 3 repeats node 1's token); depth 2: 4, 5 under node 1, 6 under node 2
STAT_PARENTS = [-1, 0, 0, 0, 1, 1, 2]
STAT_DRAFT = [0, 2, 0, 2, 1, 3, 5]


def stat_problem(N, seed):
    """N independent trials of one step. The target's next-token law after token x is cond[x]; the root's is
    p_root. Node c's target distribution is cond[draft[c]] (the law after its own token)."""
    g = torch.Generator().manual_seed(seed)
    p_root = torch.tensor([0.1, 0.25, 0.3, 0.05, 0.2, 0.1], dtype=torch.float64)
    cond = torch.softmax(0.7 * torch.randn(V_STAT, V_STAT, generator=g, dtype=torch.float64), -1)   # [x, next]
    draft = torch.tensor(STAT_DRAFT)
    node_probs = torch.cat([p_root[None], cond[draft[1:]]]).float()      # [T, V]
    T = len(STAT_PARENTS)
    probs = node_probs.expand(N, T, V_STAT).contiguous()
    u_accept = torch.rand(N, T, generator=g)
    u_sample = torch.rand(N, generator=g)
    u_next = torch.rand(N, generator=g)           # the next step's draw, for paths that stop at depth 0
    return (draft.expand(N, T).contiguous(), torch.tensor(STAT_PARENTS), probs, u_accept, u_sample), \
        p_root, cond, u_next


def emitted_first_two(result, draft, cond, u_next):
    """The first two tokens the decoder emits: accepted drafts, then the bonus, then (if the step emitted
    only one token) the next step's token, drawn from cond[t1] as a T = 1 step would."""
    accept_len, nodes, nxt = result
    n1 = nodes[:, 1].clamp(min=0)
    t1 = torch.where(accept_len >= 1, draft.gather(1, n1[:, None])[:, 0], nxt)
    n2 = nodes[:, 2].clamp(min=0)
    next_step = reference.sample_from_probs(cond[t1].float(), u_next)
    t2 = torch.where(accept_len >= 2, draft.gather(1, n2[:, None])[:, 0],
                     torch.where(accept_len == 1, nxt, next_step))
    return t1, t2


def test_lossless_statistics_reference():
    """Emitted tokens at depth 1 ~ p_root and the joint (t1, t2) ~ p_root(t1) cond[t1](t2), chi-square at
    p > 1e-3 (fixed seed, so deterministic), while a slightly wrong law is rejected (the test has power)."""
    N = 20000
    args, p_root, cond, u_next = stat_problem(N, seed=1)
    result = reference.tree_accept_sample(*args)
    t1, t2 = emitted_first_two(result, args[0], cond, u_next)
    c1 = torch.bincount(t1, minlength=V_STAT)
    c12 = torch.bincount(t1 * V_STAT + t2, minlength=V_STAT ** 2)
    assert chi2_pvalue(c1, p_root) > 1e-3
    assert chi2_pvalue(c12, p_root[:, None] * cond) > 1e-3
    wrong = p_root.clone()
    wrong[2] -= 0.03
    wrong[3] += 0.03
    assert chi2_pvalue(c1, wrong) < 1e-3, "the chi-square test should detect a 3-point shift"
    # a depth-1 draft is accepted exactly when the emitted token is one of the drafted ones: p(2) + p(0) = 0.4
    assert abs(float((result[0] >= 1).double().mean()) - 0.4) < 0.02 and (result[0] == 2).any()


def test_lossless_statistics_kernel():
    """The Triton kernel on fewer trials: the depth-1 emitted token ~ p_root."""
    N = 300 if DEVICE == "cpu" else 20000
    args, p_root, cond, u_next = stat_problem(N, seed=2)
    args = tuple(a.to(DEVICE) for a in args)
    result = tuple(r.cpu() for r in tree_accept_sample(*args))
    t1, _ = emitted_first_two(result, args[0].cpu(), cond, u_next)
    assert chi2_pvalue(torch.bincount(t1, minlength=V_STAT), p_root) > 1e-3


# ---------------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------------
BAD_PARENTS = {"parent-not-before-child": ([-1, 0, 2], "in \\[0, i\\)"),
               "root-has-parent": ([0, 0, 1], "must be -1"),
               "child-of-unused-node": ([-1, -1, 1], "unused node"),
               "wrong-length": ([-1, 0], "must be \\[3\\]")}


@pytest.mark.parametrize("fn", ["triton", "reference"])
@pytest.mark.parametrize("name", list(BAD_PARENTS))
def test_bad_parents(name, fn):
    par, msg = BAD_PARENTS[name]
    draft = t64([[0, 1, 2]])
    greedy = tree_accept if fn == "triton" else reference.tree_accept
    sample = tree_accept_sample if fn == "triton" else reference.tree_accept_sample
    with pytest.raises(ValueError, match=msg):
        greedy(draft, t64(par), t64([[1, 2, 3]]))
    probs = torch.full((1, 3, 4), 0.25, device=DEVICE)
    with pytest.raises(ValueError, match=msg):
        sample(draft, t64(par), probs, torch.rand(1, 3, device=DEVICE), torch.rand(1, device=DEVICE))


@pytest.mark.parametrize("fn", [tree_accept_sample, reference.tree_accept_sample], ids=["triton", "reference"])
def test_bad_sample_inputs(fn):
    draft, par = t64([[0, 5]]), t64([-1, 0])
    probs = torch.full((1, 2, 4), 0.25, device=DEVICE)
    with pytest.raises(ValueError, match="draft token ids"):
        fn(draft, par, probs, torch.rand(1, 2, device=DEVICE), torch.rand(1, device=DEVICE))
    with pytest.raises(ValueError, match="u_sample"):
        fn(t64([[0, 1]]), par, probs, torch.rand(1, 2, device=DEVICE), torch.rand(2, device=DEVICE))
