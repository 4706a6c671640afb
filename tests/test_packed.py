"""Prepacked weights (mtp_triton/packed.py): bf16 packing changes no bit, fp32 packing stays within rounding of
nn.Linear, a changed weight is packed again, and decoding is unchanged (bf16: bitwise; fp32: the same tokens)."""
import pytest
import torch

import mtp_triton as mt
from mtp_triton.generate import prefill
from mtp_triton.ops import get_ops
from mtp_triton.packed import packed_layers, packed_linear, packing_applies
from mtp_triton.tree import PRESETS, Tree
from hf_models import make_hf

PROMPTS = [[5, 17, 33, 42, 90, 1] * 6, [7, 8, 9], list(range(10, 47))]


def _model(dtype):
    if not packing_applies(dtype):
        pytest.skip(f"this CPU cannot pack {dtype} weights as packed.py needs (packing_applies is False)")
    return mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"), dtype=dtype)


def _verify(model, tree, packed):
    """Hidden states and logits of one verify step over `tree` after a 40-token prefill, packed or not."""
    model.pack_weights = packed
    ops = get_ops("torch")
    cache = model.new_cache([40 + tree.size])
    prefill(model, [list(range(3, 43))], cache, ops)
    tokens = torch.arange(tree.size)[None] + 50
    positions = cache.cache_lens.long()[:, None] + tree.depth[None]
    h, k, v = model.forward_tree(tokens, positions, tree.mask, cache, torch.arange(1), ops)
    return h, k, model.logits(h)


@pytest.mark.parametrize("tree", ["chain-1", "medusa-16"])
def test_bf16_packing_changes_no_bit(tree):
    model = _model(torch.bfloat16)
    tree = Tree.from_choices(PRESETS[tree])
    plain, packed = _verify(model, tree, False), _verify(model, tree, True)
    with torch.no_grad():
        assert packed_layers(model) is not None
    for a, b in zip(plain, packed):
        assert torch.equal(a, b)


def test_fp32_packing_is_within_rounding():
    model = _model(torch.float32)
    tree = Tree.from_choices(PRESETS["medusa-16"])
    for a, b in zip(_verify(model, tree, False), _verify(model, tree, True)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_decoding_is_unchanged_by_packing(dtype):
    model = _model(dtype)
    heads = mt.init_heads(model, num_heads=4, seed=2)
    model.pack_weights = False
    serial = mt.generate(model, PROMPTS, 24, mtp=False).tokens
    model.pack_weights = True
    assert mt.generate(model, PROMPTS, 24, mtp=False).tokens == serial
    assert mt.generate(model, PROMPTS, 24, heads=heads, tree="medusa-16").tokens == serial


@torch.no_grad()
def test_a_changed_weight_is_packed_again():
    model = _model(torch.bfloat16)
    first = packed_layers(model)
    assert packed_layers(model) is first                                    # reused while nothing changes
    model.layers[0].q_proj.weight.mul_(2)                                   # in place: the version counter moves
    second = packed_layers(model)
    assert second is not first
    x = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    q = second.qkv[0](x)[:, :model.layers[0].q_proj.out_features]
    assert torch.equal(q, model.layers[0].q_proj(x))
    model.pack_weights = False
    assert packed_layers(model) is None


def test_other_dtypes_and_devices_are_not_packed():
    assert not packing_applies(torch.float16) and not packing_applies(torch.float64)
    model = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"), dtype=torch.float64)
    assert packed_layers(model) is None


def test_packing_is_an_inference_path():
    """With autograd recording, the engine's nn.Linear layers run (gradients reach the parameters), and a packed
    function handed an input that needs gradients computes the plain matmul."""
    model = _model(torch.bfloat16)
    with torch.no_grad():
        assert packed_layers(model) is not None
    assert packed_layers(model) is None
    h = torch.randn(2, model.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    model.logits(h).float().sum().backward()
    assert h.grad is not None and model.lm_head.weight.grad is not None
    f = packed_linear(model.lm_head.weight.detach())
    x = torch.randn(2, model.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    f(x).float().sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("token_inputs", [0, 2])
def test_the_drafter_drafts_on_packed_weights_with_the_same_tokens(token_inputs):
    """HeadsDrafter's bf16 path multiplies by prepacked ResBlocks, root/path projections and LM head: the same draft
    tokens and probabilities as the plain matmuls, for parallel heads (propose) and heads with path inputs
    (draft_tree)."""
    from mtp_triton.drafters import HeadsDrafter, bf16_draft
    model = _model(torch.bfloat16)
    D = model.config.hidden_size
    g = torch.Generator().manual_seed(3)
    heads = mt.MTPHeads(3, D, root_input=True, token_inputs=token_inputs)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / D ** 0.5)
    d = HeadsDrafter(heads, model, get_ops("torch"))
    assert d.fused_draft is bf16_draft and not isinstance(d.lm_rows, torch.Tensor)
    x = torch.randn(3, D).to(torch.bfloat16)
    roots = torch.tensor([5, 9, 100])
    tree = mt.get_tree("medusa-16", 3)
    run = (lambda: d.draft_tree(x, roots, tree, min_prob=0.0)) if token_inputs else (
        lambda: d.propose(x, 4, roots=roots, probs=True))
    with torch.no_grad():
        packed = run()
        d.lm_rows = d.lm_head
        d.res_rows = d.res_weight
        d.root_rows = lambda e: e @ d.root_proj.T
        d.proj_rows = [lambda e, q=q: e @ q.T for q in (d.token_proj if token_inputs else [])]
        plain = run()
    assert all(torch.equal(a, b) for a, b in zip(packed, plain))


@pytest.mark.parametrize("k,n", [(576, 960), (576, 576), (576, 3072), (1536, 576)])
def test_packed_rows_round_alike_in_every_call_of_the_exact_mode(k, n):
    """What bf16 MTP == serial stands on, for a packed layer of SmolLM2's shapes: through `invariant.linear`, a row
    alone (a serial step) gets the bits it gets among 2 .. 40 others (tree steps). A 1-row packed matmul does not
    always (bf16 1536 -> 576 on the CPU this was first written on), which is why `linear` hands it one row alone only
    where the layer's probe passed (`one_row_exact`); both cases are checked, the probe's verdict forced each way."""
    if not packing_applies(torch.bfloat16):
        pytest.skip("this CPU cannot pack bf16 weights")
    from mtp_triton import invariant
    x, w = invariant.order_sensitive(41, k, n, torch.bfloat16, seed=k + n)   # the summation order shows
    f = packed_linear(w)
    probed = f.one_row_exact
    with torch.no_grad():
        for f.one_row_exact in {probed, False}:
            for m in (2, 9, 25, 33, 41):
                many = invariant.linear(f, x[:m])
                for i in range(m):
                    assert torch.equal(invariant.linear(f, x[i:i + 1])[0], many[i]), (m, i, f.one_row_exact)
