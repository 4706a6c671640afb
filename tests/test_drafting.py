"""fused_draft (Triton) vs its PyTorch twin `mtp_triton.reference.fused_draft`.

Odd shapes on purpose: vocab not a multiple of the tile, D not a power of two, H = 1 and 5, top_k = 1 .. 16,
a last vocab tile with fewer ids than top_k, integer-valued inputs whose logits tie exactly, NaN padding around the
inputs and NaN-filled buffers handed to the kernel.
"""
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


def assert_same_draft(ids, logp, inputs, top_k, atol, what):
    """Kernel vs reference: logprobs within atol everywhere; ids equal wherever the reference's logit at that
    rank is separated by more than 2*atol from its neighbours (incl. rank top_k + 1), i.e. not a near-tie."""
    ref_ids, ref_logp = reference.fused_draft(*inputs, top_k)
    assert ids.dtype == torch.int64 and logp.dtype == torch.float32, f"{what}: dtypes {ids.dtype}, {logp.dtype}"
    assert ids.shape == ref_ids.shape, f"{what}: shape {tuple(ids.shape)} != {tuple(ref_ids.shape)}"
    assert_close(logp, ref_logp, atol=atol, rtol=1e-5, what=f"{what} logprobs")
    V = inputs[3].shape[0]
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


def test_nan_padding_and_no_logits_buffer(monkeypatch):
    """Inputs are views into NaN-filled buffers (an out-of-bounds load gives NaN); every buffer the launcher
    allocates starts NaN / sentinel-filled (an element it forgets to write shows up); and no buffer is as large as
    the [B, H, V] logits."""
    B, H, D, V, top_k = 3, 5, 40, 1007, 10
    clean = make_inputs(B, H, D, V, seed=4)
    padded = []
    for t in clean:
        buf = poison((t.numel() + 2 * 64,), t.dtype)
        view = buf[64: 64 + t.numel()].view(t.shape)
        view.copy_(t)
        padded.append((buf, view))
    sizes = []

    def poisoned_empty(shape, dtype, device):
        sizes.append(torch.Size(shape).numel())
        return poison(shape, dtype, device)

    monkeypatch.setattr(drafting, "_empty", poisoned_empty)
    ids, logp = _fused_draft(*[v for _, v in padded], top_k, **SMALL_TILES)
    assert_same_draft(ids, logp, clean, top_k, atol=1e-4, what="poisoned")
    assert ((ids >= 0) & (ids < V)).all(), "ids out of range (an unwritten sentinel?)"
    for buf, view in padded:
        assert torch.isnan(buf[:64]).all() and torch.isnan(buf[64 + view.numel():]).all(), "padding was written"
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


def test_bench_rows_and_plot(tmp_path):
    """The benchmark runs at a tiny size, stamps every row with env_info(), checks itself against the reference,
    and plots from the rows (also after a CSV round trip)."""
    from mtp_triton.bench import drafting as bench
    from mtp_triton.bench.common import append_rows, read_rows

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
