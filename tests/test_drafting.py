"""fused_draft (Triton) vs its PyTorch twin `mtp_triton.reference.fused_draft`.

Odd shapes on purpose: vocab not a multiple of the tile, D not a power of two, H = 1 and 5, top_k = 1 .. 16 and
top_k = V, a last vocab tile with fewer ids than top_k, integer-valued inputs whose logits tie exactly, NaN padding
around the inputs and NaN-filled buffers handed to the kernel; a shared LM head [V, D] and one LM head per head
[H, V, D]; a draft vocabulary (token_map) of V' ids.
"""
import doctest

import pytest
import torch

from conftest import DEVICE, assert_close, poison

import mtp_triton.kernels.drafting as drafting
from mtp_triton import reference
from mtp_triton.kernels.drafting import _fused_draft, fused_draft

# (dtype, logprob atol): loads are upcast and everything accumulates in fp32, so under the interpreter the only
# difference from the reference is summation order (~1e-5 at these sizes). On a GPU, fp16/bf16 weights use the
# split hi+lo tensor-core dot (z kept to ~16 bits), hence the looser half-precision rows. fp64 is computed in fp32.
TOLERANCES = [(torch.float32, 1e-4), (torch.float16, 1e-3), (torch.bfloat16, 1e-3), (torch.float64, 1e-4)]

# tiles small enough that every loop runs several times and ends on a partial tile (all dims >= 16: valid on GPU)
SMALL_TILES = dict(BLOCK_B=16, BLOCK_N=16, BLOCK_K=32, BLOCK_R=16, BLOCK_V=16, BLOCK_D=32,
                   MERGE_R=8, CHUNK=32, CHUNK_T=4)


def make_inputs(B, H, D, V, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, D, generator=g)
    res_weight = torch.randn(H, D, D, generator=g) / D ** 0.5
    res_bias = torch.randn(H, D, generator=g) * 0.1
    lm_head = torch.randn(V, D, generator=g) / D ** 0.25
    return [t.to(dtype=dtype, device=DEVICE) for t in (hidden, res_weight, res_bias, lm_head)]


def per_head_lm(H, V, D, dtype=torch.float32, seed=0):
    """[H, V, D]: every head its own LM head (as FasterDecoding's Medusa checkpoints)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(H, V, D, generator=g) / D ** 0.25).to(dtype=dtype, device=DEVICE)


def draft_vocab(V_full, V_draft, seed=0):
    """A sorted random subset of V_draft ids out of V_full (a draft vocabulary's token_map)."""
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randperm(V_full, generator=g)[:V_draft]).values.to(DEVICE)


def assert_same_draft(ids, logp, inputs, top_k, atol, what, token_map=None):
    """Kernel vs reference: logprobs within atol everywhere; ids equal wherever the reference's logit at that
    rank is separated by more than 2*atol from its neighbours (incl. rank top_k + 1), i.e. not a near-tie."""
    ref_ids, ref_logp = reference.fused_draft(*inputs, top_k, token_map=token_map)
    assert ids.dtype == torch.int64 and logp.dtype == torch.float32, f"{what}: dtypes {ids.dtype}, {logp.dtype}"
    assert ids.shape == ref_ids.shape, f"{what}: shape {tuple(ids.shape)} != {tuple(ref_ids.shape)}"
    assert_close(logp, ref_logp, atol=atol, rtol=1e-5, what=f"{what} logprobs")
    V = inputs[3].shape[-2]
    ext = reference.fused_draft(*inputs, min(top_k + 1, V))[1].double()      # [B, H, top_k (+1)]
    if ext.shape[-1] == top_k:
        ext = torch.cat([ext, torch.full_like(ext[..., :1], -float("inf"))], dim=-1)
    gap_prev = torch.cat([torch.full_like(ext[..., :1], float("inf")), ext[..., :-2] - ext[..., 1:-1]], dim=-1)
    gap_next = ext[..., :-1] - ext[..., 1:]
    clear = (gap_prev > 2 * atol) & (gap_next > 2 * atol)
    bad = (ids != ref_ids) & clear
    assert not bad.any(), f"{what}: ids differ at {bad.nonzero()[:5].tolist()} (kernel {ids[bad][:5].tolist()}, " \
                          f"reference {ref_ids[bad][:5].tolist()})"


CASES = [  # (B, H, D, V, top_k)
    (1, 1, 48, 203, 1),
    (3, 5, 48, 1007, 10),
    (1, 5, 40, 1007, 10),
    (3, 1, 40, 203, 10),
    (2, 3, 48, 203, 16),
]


@pytest.mark.parametrize("B,H,D,V,top_k", CASES, ids=[f"B{b}-H{h}-D{d}-V{v}-k{k}" for b, h, d, v, k in CASES])
def test_matches_reference(B, H, D, V, top_k):
    inputs = make_inputs(B, H, D, V)
    ids, logp = fused_draft(*inputs, top_k)
    assert_same_draft(ids, logp, inputs, top_k, atol=1e-4, what=f"B{B}-H{H}-D{D}-V{V}-k{top_k}")


def test_small_tiles_every_loop_partial():
    """R = 34 rows over 3 row tiles, V = 199 over 13 vocab tiles (the last holds 7 ids < top_k = 10), D = 72 over
    3 d-chunks, 130 merge candidates over 5 chunks, 13 tiles' log-sum-exp over 4 chunks, merge rows 8 at a time."""
    B, H, D, V, top_k = 17, 2, 72, 199, 10
    inputs = make_inputs(B, H, D, V, seed=1)
    ids, logp = _fused_draft(*inputs, top_k, **SMALL_TILES)
    assert_same_draft(ids, logp, inputs, top_k, atol=1e-4, what="small tiles")


def test_logprobs_are_log_softmax_of_lm_head():
    """With zero ResBlocks z = hidden, so the answer is plain torch: topk / log_softmax of hidden @ lm_head.T."""
    B, H, D, V, top_k = 2, 2, 40, 203, 10
    hidden, res_weight, res_bias, lm_head = make_inputs(B, H, D, V, seed=2)
    res_weight.zero_()
    res_bias.zero_()
    ids, logp = fused_draft(hidden, res_weight, res_bias, lm_head, top_k)
    logits = hidden @ lm_head.T                                          # [B, V]
    expect = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logits, top_k, dim=-1).indices                      # random floats: no ties
    for h in range(H):
        assert torch.equal(ids[:, h], top), f"head {h}: ids {ids[:, h].tolist()} != topk {top.tolist()}"
        assert_close(logp[:, h], expect.gather(-1, ids[:, h]), atol=1e-5, rtol=1e-5, what=f"head {h} logprobs")


def test_ties_go_to_the_lower_id():
    """Integer inputs make logits exact integers, so many ids tie, across tiles and inside one tile; rows copied
    from the best row make the top tie for sure. Expected order: logit descending, then id ascending."""
    B, H, D, V, top_k = 3, 2, 40, 203, 10
    g = torch.Generator().manual_seed(3)
    hidden = torch.randint(-2, 3, (B, D), generator=g).float().to(DEVICE)
    lm_head = torch.randint(-1, 2, (V, D), generator=g).float().to(DEVICE)
    best = int((hidden[0] @ lm_head.T).argmax())
    for dup in (0, 5, 17, 150, 202):                                     # same tile as 0, other tiles, last id
        lm_head[dup] = lm_head[best]
    res_weight = torch.zeros(H, D, D, device=DEVICE)
    res_bias = torch.zeros(H, D, device=DEVICE)
    inputs = (hidden, res_weight, res_bias, lm_head)
    ids, logp = _fused_draft(*inputs, top_k, **SMALL_TILES)
    ref_ids, _ = reference.fused_draft(*inputs, top_k)
    assert torch.equal(ids, ref_ids), f"ids {ids[0, 0].tolist()} != reference {ref_ids[0, 0].tolist()}"
    logits = (hidden @ lm_head.T).round().long()                         # exact integers
    expect = sorted(range(V), key=lambda v: (-int(logits[0, v]), v))[:top_k]
    assert ids[0, 0].tolist() == expect
    assert ids[0, 0, 0].item() == min(0, best)                           # id 0 copies the best row


def _poisoned(case):
    """Inputs with a non-finite value where a corrupt checkpoint or an overflowing activation would put one."""
    B, H, D, V = 3, 3, 40, 203
    hidden, res_weight, res_bias, lm_head = make_inputs(B, H, D, V, seed=4)
    if case == "nan-hidden-row":
        hidden[1, 7] = float("nan")                  # row 1, every head: all logits NaN
    elif case == "nan-head-weight":
        res_weight[2, 5, 9] = float("nan")           # head 2, every row: all logits NaN
    elif case == "inf-lm-row":
        lm_head[7].zero_()
        lm_head[7, 0] = float("inf")                 # logit of id 7 = +inf or -inf by the sign of z[0]
    elif case == "nan-lm-row":
        lm_head[150, 3] = float("nan")               # id 150 (another vocab tile) NaN in every row
    return hidden, res_weight, res_bias, lm_head


@pytest.mark.parametrize("case", ["nan-hidden-row", "nan-head-weight", "inf-lm-row", "nan-lm-row"])
def test_poisoned_rows_give_the_twins_valid_ids(case):
    """A NaN or inf in a hidden state or a weight: both twins rank NaN as -inf and +inf highest, so every row still
    gets top_k valid, distinct ids, the same in both (the kernel once returned id 2**32 - 1 here, which the engine's
    embedding lookup then read out of bounds). Logprobs are non-finite exactly where the twin's are, else close."""
    inputs = _poisoned(case)
    top_k, V = 10, inputs[3].shape[0]
    ids, logp = _fused_draft(*inputs, top_k, **SMALL_TILES)
    ref_ids, ref_logp = reference.fused_draft(*inputs, top_k)
    assert bool(((ids >= 0) & (ids < V)).all()), f"{case}: ids out of range {ids.max().item()}"
    assert bool((ids.sort(-1).values.diff(dim=-1) > 0).all()), f"{case}: repeated ids"
    assert torch.equal(ids, ref_ids), f"{case}: ids {ids.tolist()} != twin {ref_ids.tolist()}"
    finite = torch.isfinite(ref_logp)
    assert torch.equal(torch.isfinite(logp), finite), f"{case}: finite logprobs differ"
    assert not finite.all(), f"{case}: the poison reached no logprob (the case tests nothing)"
    assert_close(logp[finite], ref_logp[finite], atol=1e-4, rtol=1e-5, what=f"{case} logprobs")


def test_overflowing_fp64_head_gives_valid_ids():
    """An fp64 head scaled by 1e200 is finite in fp64 (the twin) but inf / NaN in the kernel's fp32 accumulation:
    the two rank differently, yet the kernel's ids are still valid and distinct."""
    hidden, res_weight, res_bias, lm_head = make_inputs(2, 2, 40, 203, dtype=torch.float64, seed=5)
    ids, _ = _fused_draft(hidden, res_weight * 1e200, res_bias, lm_head * 1e200, 10, **SMALL_TILES)
    assert bool(((ids >= 0) & (ids < 203)).all()) and bool((ids.sort(-1).values.diff(dim=-1) > 0).all())


PAD = 64                                        # poisoned elements on each side of an input


def in_poison(clean):
    """Each tensor copied into the middle of a poisoned buffer: [(buffer, view)] (an out-of-bounds load reads
    NaN, or the int sentinel)."""
    padded = []
    for t in clean:
        buf = poison((t.numel() + 2 * PAD,), t.dtype)
        view = buf[PAD: PAD + t.numel()].view(t.shape)
        view.copy_(t)
        padded.append((buf, view))
    return padded


def padding_untouched(padded):
    """True if no launch wrote into the poison around any input."""
    for buf, view in padded:
        pad = torch.cat([buf[:PAD], buf[PAD + view.numel():]])
        untouched = torch.isnan(pad) if pad.is_floating_point() else pad == -(2 ** 31) + 7
        if not untouched.all():
            return False
    return True


def poison_launcher_buffers(monkeypatch):
    """Every buffer the launcher allocates starts poisoned; returns the list their sizes are recorded in."""
    sizes = []

    def poisoned_empty(shape, dtype, device):
        sizes.append(torch.Size(shape).numel())
        return poison(shape, dtype, device)

    monkeypatch.setattr(drafting, "_empty", poisoned_empty)
    return sizes


def test_nan_padding_and_no_logits_buffer(monkeypatch):
    """Inputs are views into NaN-filled buffers (an out-of-bounds load gives NaN); every buffer the launcher
    allocates starts NaN / sentinel-filled (an element it forgets to write shows up); and no buffer is as large as
    the [B, H, V] logits."""
    B, H, D, V, top_k = 3, 5, 40, 1007, 10
    clean = make_inputs(B, H, D, V, seed=4)
    padded = in_poison(clean)
    sizes = poison_launcher_buffers(monkeypatch)
    ids, logp = _fused_draft(*[v for _, v in padded], top_k, **SMALL_TILES)
    assert_same_draft(ids, logp, clean, top_k, atol=1e-4, what="poisoned")
    assert ((ids >= 0) & (ids < V)).all(), "ids out of range (an unwritten sentinel?)"
    assert padding_untouched(padded), "padding was written"
    assert max(sizes) < B * H * V, f"a buffer of {max(sizes)} elements: the logits ({B * H * V}) were materialised?"


@pytest.mark.parametrize("dtype,atol", TOLERANCES, ids=[str(d).replace("torch.", "") for d, _ in TOLERANCES])
def test_weight_dtypes(dtype, atol):
    B, H, D, V, top_k = 3, 4, 40, 203, 10
    inputs = make_inputs(B, H, D, V, dtype=dtype, seed=5)
    ids, logp = fused_draft(*inputs, top_k)
    assert_same_draft(ids, logp, inputs, top_k, atol=atol, what=str(dtype))


def test_fp32_hidden_with_bf16_weights():
    B, H, D, V, top_k = 2, 3, 48, 203, 10
    hidden, res_weight, res_bias, lm_head = make_inputs(B, H, D, V, dtype=torch.bfloat16, seed=6)
    inputs = (hidden.float(), res_weight, res_bias, lm_head)
    ids, logp = fused_draft(*inputs, top_k)
    assert_same_draft(ids, logp, inputs, top_k, atol=1e-3, what="fp32 hidden, bf16 weights")


def _bad(name):
    B, H, D, V = 2, 3, 40, 50
    x, w, b, lm = make_inputs(B, H, D, V)
    cases = {
        "hidden-D-mismatch": ((x[:, :-1].contiguous(), w, b, lm, 4), ValueError, "res_weight must be"),
        "lm_head-D-mismatch": ((x, w, b, lm[:, :-1].contiguous(), 4), ValueError, "lm_head must be"),
        "bias-shape": ((x, w, b[:, :-1].contiguous(), lm, 4), ValueError, "res_bias must be"),
        "hidden-3d": ((x[None], w, b, lm, 4), ValueError, "hidden must be"),
        "top_k-gt-V": ((x, w, b, lm, V + 1), ValueError, "top_k"),
        "top_k-zero": ((x, w, b, lm, 0), ValueError, "top_k"),
        "top_k-float": ((x, w, b, lm, 2.0), ValueError, "top_k"),
        "lm_head-noncontiguous": ((x, w, b, lm.T.contiguous().T, 4), ValueError, "contiguous"),
        "res_weight-noncontiguous": ((x, w.transpose(1, 2), b, lm, 4), ValueError, "contiguous"),
        "hidden-int": ((x.long(), w, b, lm, 4), TypeError, "floating"),
        "lm_head-fp8": ((x, w, b, lm.to(torch.float8_e4m3fn), 4), TypeError, "supported"),
        "bias-dtype-differs": ((x, w, b.half(), lm, 4), TypeError, "share a dtype"),
        "not-a-tensor": ((x.tolist(), w, b, lm, 4), TypeError, "torch.Tensor"),
    }
    return cases[name]


BAD = ["hidden-D-mismatch", "lm_head-D-mismatch", "bias-shape", "hidden-3d", "top_k-gt-V", "top_k-zero",
       "top_k-float", "lm_head-noncontiguous", "res_weight-noncontiguous", "hidden-int", "lm_head-fp8",
       "bias-dtype-differs", "not-a-tensor"]


@pytest.mark.parametrize("twin", ["triton", "torch"])
@pytest.mark.parametrize("case", BAD)
def test_bad_inputs_raise_in_both_twins(twin, case):
    args, exc, match = _bad(case)
    fn = fused_draft if twin == "triton" else reference.fused_draft
    with pytest.raises(exc, match=match):
        fn(*args)


# ---------------------------------------------------------------------------------------------------------
# one LM head per head [H, V, D]
# ---------------------------------------------------------------------------------------------------------
PER_HEAD = [  # (B, H, D, V, top_k, tiles)
    (3, 5, 40, 203, 10, "default"),
    (1, 2, 48, 1007, 4, "default"),
    (17, 2, 72, 199, 10, "small"),          # 17 rows per head over 2 row tiles, 13 vocab tiles, last one partial
]


@pytest.mark.parametrize("B,H,D,V,top_k,tiles", PER_HEAD,
                         ids=[f"B{b}-H{h}-D{d}-V{v}-k{k}-{t}" for b, h, d, v, k, t in PER_HEAD])
def test_per_head_lm_head(B, H, D, V, top_k, tiles):
    """lm_head [H, V, D]: head h ranks with lm_head[h]. Matches the reference, and each head equals a one-head
    draft with its own LM head (so the kernel cannot be mixing up heads' weights or rows)."""
    hidden, res_weight, res_bias, _ = make_inputs(B, H, D, V, seed=8)
    lm_head = per_head_lm(H, V, D, seed=9)
    inputs = (hidden, res_weight, res_bias, lm_head)
    over = SMALL_TILES if tiles == "small" else {}
    ids, logp = _fused_draft(*inputs, top_k, **over)
    assert_same_draft(ids, logp, inputs, top_k, atol=1e-4, what="per-head")
    for h in range(H):
        one_ids, one_logp = _fused_draft(hidden, res_weight[h:h + 1], res_bias[h:h + 1], lm_head[h], top_k, **over)
        assert torch.equal(ids[:, h], one_ids[:, 0]), f"head {h}: ids differ from a one-head draft"
        assert_close(logp[:, h], one_logp[:, 0], atol=1e-5, rtol=1e-5, what=f"head {h} logprobs")


def test_per_head_lm_head_differs_from_shared():
    """The per-head path really reads lm_head[h]: with head 1's LM head = head 0's negated, head 1's top id is
    head 0's bottom id (and a shared head would give equal ids for equal z)."""
    B, H, D, V, top_k = 2, 2, 40, 203, 3
    hidden, _, _, lm0 = make_inputs(B, H, D, V, seed=10)
    res_weight = torch.zeros(H, D, D, device=DEVICE)
    res_bias = torch.zeros(H, D, device=DEVICE)                          # z_h = hidden for both heads
    lm_head = torch.stack([lm0, -lm0])                                   # [H, V, D]
    ids, _ = fused_draft(hidden, res_weight, res_bias, lm_head, top_k)
    logits = hidden @ lm0.T                                              # [B, V], random: no ties
    assert torch.equal(ids[:, 0], logits.topk(top_k).indices)
    assert torch.equal(ids[:, 1], (-logits).topk(top_k).indices)


# ---------------------------------------------------------------------------------------------------------
# draft vocabulary: token_map [V'] + lm_head rows of those ids
# ---------------------------------------------------------------------------------------------------------
MAPS = [  # (B, H, D, V_full, V_draft, top_k, per_head, tiles)
    (3, 5, 40, 5000, 203, 10, False, "default"),     # V' = 203: not a multiple of the tile
    (17, 2, 72, 1000, 199, 10, False, "small"),      # 13 vocab tiles of 16, the last with 7 rows < top_k
    (2, 3, 48, 300, 37, 37, True, "small"),          # top_k == V', per-head LM heads of the draft rows
    (1, 1, 40, 64, 1, 1, False, "default"),          # a one-token draft vocabulary
]


@pytest.mark.parametrize("B,H,D,V_full,V_draft,top_k,per_head,tiles", MAPS,
                         ids=[f"B{b}-H{h}-D{d}-V{vf}-Vd{vd}-k{k}-{'ph' if ph else 'shared'}-{t}"
                              for b, h, d, vf, vd, k, ph, t in MAPS])
def test_token_map(B, H, D, V_full, V_draft, top_k, per_head, tiles):
    """token_map: ranking over the V' draft rows, ids mapped back to the full vocabulary, logprobs = log_softmax
    over the draft rows. Checked against the reference and against the same draft without a map (ids = map[row])."""
    hidden, res_weight, res_bias, lm_full = make_inputs(B, H, D, V_full, seed=11)
    token_map = draft_vocab(V_full, V_draft, seed=12)
    lm_head = per_head_lm(H, V_full, D, seed=13)[:, token_map].contiguous() if per_head else lm_full[token_map]
    inputs = (hidden, res_weight, res_bias, lm_head)
    over = SMALL_TILES if tiles == "small" else {}
    ids, logp = _fused_draft(*inputs, top_k, token_map=token_map, **over)
    assert_same_draft(ids, logp, inputs, top_k, atol=1e-4, what="token_map", token_map=token_map)
    rows, row_logp = _fused_draft(*inputs, top_k, **over)
    assert torch.equal(ids, token_map[rows]), "ids must be token_map[row]"
    assert torch.equal(logp, row_logp), "the map must not change the logprobs"
    assert torch.isin(ids, token_map).all()
    if top_k == V_draft:                                                 # every draft id exactly once per row
        assert torch.equal(ids.sort(-1).values, token_map.expand(B, H, V_draft))
        assert_close(logp.double().exp().sum(-1), torch.ones(B, H, dtype=torch.float64, device=ids.device), atol=1e-5,
                     what="probabilities over the draft vocabulary")


def test_token_map_ties_go_to_the_lower_id():
    """Integer inputs tie exactly: the tie rule stays "lower token id first" after the map (it is increasing)."""
    B, H, D, V_full, top_k = 2, 2, 40, 400, 10
    g = torch.Generator().manual_seed(14)
    hidden = torch.randint(-2, 3, (B, D), generator=g).float().to(DEVICE)
    lm_full = torch.randint(-1, 2, (V_full, D), generator=g).float().to(DEVICE)
    token_map = draft_vocab(V_full, 203, seed=15)
    lm_head = lm_full[token_map]
    lm_head[[3, 40, 202]] = lm_head[int((hidden[0] @ lm_head.T).argmax())].clone()   # a tie at the top
    res_weight = torch.zeros(H, D, D, device=DEVICE)
    res_bias = torch.zeros(H, D, device=DEVICE)
    ids, _ = _fused_draft(hidden, res_weight, res_bias, lm_head, top_k, token_map=token_map, **SMALL_TILES)
    ref_ids, _ = reference.fused_draft(hidden, res_weight, res_bias, lm_head, top_k, token_map=token_map)
    assert torch.equal(ids, ref_ids)
    logits = (hidden @ lm_head.T).round().long()                         # [B, V'] exact integers
    expect = sorted(range(len(token_map)), key=lambda r: (-int(logits[0, r]), int(token_map[r])))[:top_k]
    assert ids[0, 0].tolist() == token_map[expect].tolist()


# ---------------------------------------------------------------------------------------------------------
# check_values, bad token maps
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("twin", ["triton", "torch"])
def test_check_values_false_skips_only_value_checks(twin):
    """check_values=False: same results on good input; a non-increasing map is then not refused (kernel and
    twin still agree: both map rows); shape / dtype errors are still raised."""
    fn = fused_draft if twin == "triton" else reference.fused_draft
    B, H, D, V = 2, 3, 40, 50
    inputs = make_inputs(B, H, D, V, seed=16)
    token_map = draft_vocab(1000, V, seed=17)
    ids, logp = fn(*inputs, 5, token_map=token_map, check_values=False)
    ref_ids, ref_logp = fn(*inputs, 5, token_map=token_map)
    assert torch.equal(ids, ref_ids) and torch.equal(logp, ref_logp)
    shuffled = token_map.flip(0)
    with pytest.raises(ValueError, match="strictly increasing"):
        fn(*inputs, 5, token_map=shuffled)
    ids, _ = fn(*inputs, 5, token_map=shuffled, check_values=False)
    other = reference.fused_draft if twin == "triton" else fused_draft
    assert torch.equal(ids, other(*inputs, 5, token_map=shuffled, check_values=False)[0])
    with pytest.raises(ValueError, match="token_map must be"):
        fn(*inputs, 5, token_map=token_map[:-1], check_values=False)
    with pytest.raises(ValueError, match="top_k"):
        fn(*inputs, V + 1, check_values=False)


def _bad_map(name):
    V = 50
    good = draft_vocab(1000, V, seed=18)
    cases = {
        "repeated-id": (torch.cat([good[:10], good[9:-1]]), ValueError, "strictly increasing"),
        "decreasing": (good.flip(0), ValueError, "strictly increasing"),
        "negative": (good - int(good[0]) - 1, ValueError, "in \\[0, "),
        "too-large": (good + 2 ** 31, ValueError, "in \\[0, "),
        "int32": (good.int(), TypeError, "int64"),
        "float": (good.float(), TypeError, "int64"),
        "not-a-tensor": (good.tolist(), TypeError, "int64"),
        "wrong-length": (good[:-1], ValueError, "token_map must be \\[50\\]"),
        "2d": (good[None], ValueError, "token_map must be \\[50\\]"),
        "noncontiguous": (torch.stack([good, good], 1)[:, 0], ValueError, "contiguous"),
    }
    return cases[name]


BAD_MAPS = ["repeated-id", "decreasing", "negative", "too-large", "int32", "float", "not-a-tensor", "wrong-length",
            "2d", "noncontiguous"]


@pytest.mark.parametrize("twin", ["triton", "torch"])
@pytest.mark.parametrize("case", BAD_MAPS)
def test_bad_token_map_rejected_by_both_twins(twin, case):
    token_map, exc, match = _bad_map(case)
    fn = fused_draft if twin == "triton" else reference.fused_draft
    inputs = make_inputs(2, 3, 40, 50)
    with pytest.raises(exc, match=match):
        fn(*inputs, 4, token_map=token_map)


@pytest.mark.parametrize("twin", ["triton", "torch"])
def test_bad_per_head_lm_head_shape(twin):
    fn = fused_draft if twin == "triton" else reference.fused_draft
    hidden, res_weight, res_bias, _ = make_inputs(2, 3, 40, 50)
    for lm in (per_head_lm(2, 50, 40), per_head_lm(3, 50, 39), per_head_lm(3, 50, 40)[None]):
        with pytest.raises(ValueError, match="lm_head must be"):
            fn(hidden, res_weight, res_bias, lm, 4)


def test_nan_padding_per_head_and_token_map(monkeypatch):
    """As test_nan_padding_and_no_logits_buffer, with per-head LM heads and a draft vocabulary: inputs inside
    NaN / sentinel padding, every launcher buffer poisoned, no [B, H, V'] buffer."""
    B, H, D, V_draft, top_k = 3, 4, 40, 203, 10
    hidden, res_weight, res_bias, _ = make_inputs(B, H, D, V_draft, seed=19)
    clean = [hidden, res_weight, res_bias, per_head_lm(H, V_draft, D, seed=20), draft_vocab(3000, V_draft, seed=21)]
    padded = in_poison(clean)
    sizes = poison_launcher_buffers(monkeypatch)
    views = [v for _, v in padded]
    ids, logp = _fused_draft(*views[:4], top_k, token_map=views[4], **SMALL_TILES)
    assert_same_draft(ids, logp, clean[:4], top_k, atol=1e-4, what="poisoned per-head + map", token_map=clean[4])
    assert torch.isin(ids, clean[4]).all(), "ids outside the draft vocabulary (an unwritten sentinel?)"
    assert padding_untouched(padded), "padding was written"
    assert max(sizes) < B * H * V_draft, f"a buffer of {max(sizes)} elements: the logits were materialised?"


def test_module_docstring_example_runs():
    """The module docstring's example is a doctest (CI also runs it with --doctest-modules)."""
    if DEVICE != "cpu":
        pytest.skip("the example uses CPU tensors (Triton's interpreter)")
    result = doctest.testmod(drafting, verbose=False)
    assert result.attempted >= 10 and result.failed == 0, result


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,V", [(1, 4, 32000), (8, 5, 128256)], ids=["B1-H4-V32000", "B8-H5-V128256"])
def test_llama_shapes_bf16_gpu(B, H, V):
    """Llama-7B-like shapes in bf16 on the GPU: results vs the reference, and no [B, H, V] buffer (peak memory)."""
    D, top_k = 4096, 10
    inputs = make_inputs(B, H, D, V, dtype=torch.bfloat16, seed=7)
    fused_draft(*inputs, top_k)                                          # compile outside the memory window
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ids, logp = fused_draft(*inputs, top_k)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < B * H * V * 4, f"fused_draft allocated {extra} bytes, as much as fp32 logits"
    assert_same_draft(ids, logp, inputs, top_k, atol=2e-3, what=f"B{B}-H{H}-V{V}")


@pytest.mark.gpu
def test_llama_shapes_per_head_and_draft_vocab_bf16_gpu():
    """Per-head LM heads [H, V, D] and a top-8192 draft vocabulary at Llama-7B-like shapes, bf16, vs the reference."""
    B, H, D, V, top_k = 8, 5, 4096, 32000, 10
    hidden, res_weight, res_bias, _ = make_inputs(B, H, D, 16, dtype=torch.bfloat16, seed=22)
    lm_head = per_head_lm(H, V, D, dtype=torch.bfloat16, seed=23)
    inputs = (hidden, res_weight, res_bias, lm_head)
    ids, logp = fused_draft(*inputs, top_k)
    assert_same_draft(ids, logp, inputs, top_k, atol=2e-3, what="per-head B8-H5-V32000")
    token_map = draft_vocab(V, 8192, seed=24)
    inputs = (hidden, res_weight, res_bias, lm_head[0, token_map].contiguous())
    ids, logp = fused_draft(*inputs, top_k, token_map=token_map)
    assert_same_draft(ids, logp, inputs, top_k, atol=2e-3, what="draft vocab 8192", token_map=token_map)


def test_bench_rows_and_plot(tmp_path):
    """The benchmark runs at a tiny size, stamps every row with env_info(), checks itself against the reference,
    and plots from the rows (also after a CSV round trip)."""
    from mtp_lab.bench import drafting as bench
    from mtp_lab.bench.common import append_rows, read_rows

    rows = bench.run(shapes=[(1, 2, 40, 203)], top_k=4, dtype=torch.float32,
                     providers=["triton-fused", "torch-unfused"])
    assert [r["provider"] for r in rows] == ["triton-fused", "torch-unfused"]
    for r in rows:
        assert {"device", "torch", "triton", "commit", "timestamp"} <= r.keys()
        assert r["time_us"] > 0 and r["lm_head_bytes"] == 203 * 40 * 4
    fused = rows[0]
    assert fused["max_logprob_err"] < 1e-4 and fused["ids_agree"] == 1.0
    csv_path = tmp_path / "drafting.csv"
    append_rows(csv_path, rows)
    bench.plot(read_rows(csv_path), str(tmp_path / "drafting.png"))
    assert (tmp_path / "drafting.png").stat().st_size > 0


@pytest.mark.parametrize("B,D,V,top_k,tiles", [(1, 48, 203, 8, "default"), (7, 72, 199, 10, "small"),
                                               (3, 40, 37, 37, "small")])
def test_resblock_off_matches_reference(B, D, V, top_k, tiles):
    """res_weight = res_bias = None (the MTP module's scores): one "head" with z = x, the same as the twin, as zero
    ResBlocks, and as plain torch (topk / log_softmax of hidden @ lm_head.T); with a draft vocabulary too."""
    hidden, _, _, lm_head = make_inputs(B, 1, D, V, seed=21)
    token_map = draft_vocab(V + 50, V, seed=22)
    over = SMALL_TILES if tiles == "small" else {}
    ids, logp = _fused_draft(hidden, None, None, lm_head, top_k, token_map=token_map, **over)
    assert ids.shape == (B, 1, top_k)
    assert_same_draft(ids, logp, (hidden, None, None, lm_head), top_k, 1e-4, "resblock off", token_map)
    zero = torch.zeros(1, D, D, device=DEVICE), torch.zeros(1, D, device=DEVICE)
    z_ids, z_logp = _fused_draft(hidden, *zero, lm_head, top_k, token_map=token_map, **over)
    assert torch.equal(ids, z_ids)
    assert_close(logp, z_logp, atol=1e-5, what="resblock off vs zero resblock")
    plain = torch.log_softmax(hidden.double() @ lm_head.double().T, -1)
    assert_close(logp[:, 0], plain.gather(-1, torch.searchsorted(token_map, ids[:, 0])).float(), atol=1e-4,
                 what="resblock off vs plain torch")


@pytest.mark.parametrize("twin", ["triton", "torch"])
def test_resblock_half_off_is_refused(twin):
    hidden, w, b, lm_head = make_inputs(2, 1, 48, 203)
    fn = fused_draft if twin == "triton" else reference.fused_draft
    with pytest.raises(ValueError, match="both None"):
        fn(hidden, w, None, lm_head, 4)
