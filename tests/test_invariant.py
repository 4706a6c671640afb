"""The exact mode: batch-invariant linear layers (invariant.py) and attention (the twin's tree_attention(exact=True)):
a node's bf16 output is bit-identical whether its ancestors are cached (serial decoding) or tree nodes (an MTP step),
so bf16 MTP emits exactly the serial tokens."""
import pytest
import torch

import mtp_triton as mt
from mtp_triton import invariant as inv
from mtp_triton import reference as ref
from mtp_triton.tree import PRESETS, Tree
from conftest import DEVICE
from hf_models import make_hf

DT = torch.bfloat16


def test_this_machine_has_row_invariant_bf16_matmuls():
    """The property the exact mode stands on (see invariant.py); if a CPU lacks it, bf16 MTP == serial is not assured."""
    assert inv.matmul_is_row_invariant(DT)


@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 34, 64, 65, 97])
def test_linear_rounds_every_row_as_a_two_row_call(n):
    """invariant.linear hands the matmul 2..32 rows at a time: each of its rows has the bits of a 2-row call (on AMX
    CPUs a plain 33-row bf16 matmul does not; a 1-row one does not on any CPU seen)."""
    g = torch.Generator().manual_seed(n)
    w = (torch.randn(1536, 576, generator=g) * 0.05).to(DT)
    x = torch.randn(n + 1, 576, generator=g).to(DT)
    f = lambda v: torch.nn.functional.linear(v, w)
    out = inv.linear(f, x[:n].view(1, n, 576))
    assert out.shape == (1, n, 1536)
    for i in range(n):
        assert torch.equal(out[0, i], f(x[i:i + 2])[0]), i


def test_order_sensitive_inputs_show_a_change_of_summation_order():
    """The probes' inputs: summing x @ w.T over k in two halves instead of at once (fp32 sums, bf16 out) changes most
    outputs, where on random inputs the bf16 rounding hides nearly every such change."""
    x, w = inv.order_sensitive(8, 576, 64, DT)
    whole = (x.float() @ w.float().T).to(DT)
    halves = (x[:, :288].float() @ w[:, :288].float().T + x[:, 288:].float() @ w[:, 288:].float().T).to(DT)
    assert (whole != halves).float().mean() > 0.3
    assert torch.equal(inv.order_sensitive(8, 576, 64, DT)[0], x)                  # seeded


def _case(ns, tree, Hq=9, Hkv=3, Dh=64, BS=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(ns), tree.size
    per = max((n + T + BS - 1) // BS for n in ns) + 1
    NB = B * per + 2
    k_cache, v_cache = (torch.randn(NB, BS, Hkv, Dh, generator=g).to(DT) for _ in range(2))
    bt = torch.randperm(NB, generator=g)[:B * per].view(B, per).int()
    q = torch.randn(B, T, Hq, Dh, generator=g).to(DT)
    k_tree, v_tree = (torch.randn(B, T, Hkv, Dh, generator=g).to(DT) for _ in range(2))
    return q, k_cache, v_cache, bt, torch.tensor(ns, dtype=torch.int32), k_tree, v_tree


def _serial_equivalent(case, tree, b, i, window):
    """Node i of sequence b as a serial step would compute it: its ancestors written into the cache, T = 1."""
    q, k_cache, v_cache, bt, cl, k_tree, v_tree = case
    BS = k_cache.shape[1]
    anc = [j for j in range(tree.size) if tree.mask[i, j] and j != i]
    kc, vc = k_cache.clone(), v_cache.clone()
    n = int(cl[b])
    for d, j in enumerate(anc):
        p = n + d
        blk = int(bt[b, p // BS])
        kc[blk, p % BS], vc[blk, p % BS] = k_tree[b, j], v_tree[b, j]
    return ref.tree_attention(q[b:b + 1, i:i + 1].contiguous(), kc, vc, bt[b:b + 1].contiguous(),
                              torch.tensor([n + len(anc)], dtype=torch.int32, device=q.device),
                              k_tree[b:b + 1, i:i + 1].contiguous(), v_tree[b:b + 1, i:i + 1].contiguous(),
                              torch.ones(1, 1, dtype=torch.bool, device=q.device),
                              window=window, exact=True)[0, 0]


@pytest.mark.parametrize("ns", [[0], [5], [31], [32], [33], [63], [100, 7, 64]], ids=str)
@pytest.mark.parametrize("tree_name", ["chain-4", "medusa-16"])
@pytest.mark.parametrize("window", [None, 8])
def test_tree_step_is_bit_identical_to_serial_steps(ns, tree_name, window):
    tree = Tree.from_choices(PRESETS[tree_name])
    case = _case(ns, tree)
    out = ref.tree_attention(*case, tree.mask, window=window, exact=True)
    for b in range(len(ns)):
        for i in range(tree.size):
            assert torch.equal(out[b, i], _serial_equivalent(case, tree, b, i, window)), (b, i)


def test_close_to_the_fp32_twin():
    tree = Tree.from_choices(PRESETS["medusa-16"])
    q, kc, vc, bt, cl, kt, vt = _case([70, 3], tree, Hq=4, Hkv=2, Dh=24)
    out = ref.tree_attention(q, kc, vc, bt, cl, kt, vt, tree.mask, exact=True).float()
    want = ref.tree_attention(q.float(), kc.float(), vc.float(), bt, cl, kt.float(), vt.float(), tree.mask)
    assert (out - want).abs().max() < 3e-2                      # bf16 probabilities and chunk partials


def test_nan_in_slots_nobody_sees_is_ignored():
    tree = Tree.from_choices(PRESETS["chain-2"])
    q, kc, vc, bt, cl, kt, vt = _case([40], tree, Hq=4, Hkv=2, Dh=16)
    used = {int(x) for x in bt[0, :3]}
    for blk in range(kc.shape[0]):
        if blk not in used:
            kc[blk], vc[blk] = float("nan"), float("nan")
    assert not torch.isnan(ref.tree_attention(q, kc, vc, bt, cl, kt, vt, tree.mask, exact=True)).any()


@pytest.mark.parametrize("tree", ["chain-4", "medusa-16", "medusa-64"])
def test_bf16_mtp_equals_serial_end_to_end(tree):
    """A bf16 model on CPU decodes in exact mode: MTP with random heads emits the serial tokens, batch 3."""
    model = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"), dtype=DT)
    heads = mt.init_heads(model, num_heads=4, seed=2)
    prompts = [[5, 17, 33, 42, 90, 1] * 6, [7, 8, 9], list(range(10, 47))]
    serial = mt.generate(model, prompts, 40, mtp=False).tokens
    assert mt.generate(model, prompts, 40, heads=heads, tree=tree).tokens == serial


def test_the_cpu_engine_attends_through_the_twin(monkeypatch):
    """kernels="torch" (and "auto" on a CPU) runs every layer's attention through the twin's own pieces, the ones
    `reference.tree_attention` is made of: the exact `attention` on the step's `plan` in bf16, `plain_attention` on
    its `plain_plan` in fp32 (no private attention in the engine; on packed weights the fp32 layer runs from
    TorchScript, scripted.py, whose calls are `plain_attention`'s: tests/test_scripted.py), each step planned once for
    all layers."""
    import mtp_triton.kernels.tree_attention_ref as twin
    import mtp_triton.model as engine
    from mtp_triton import scripted
    assert engine.attention is twin.attention and engine.plain_attention is twin.plain_attention
    seen, plans = [], []
    for name, exact in (("attention", True), ("plain_attention", False)):
        real = getattr(twin, name)
        monkeypatch.setattr(engine, name, lambda *a, real=real, exact=exact, **kw: seen.append(exact) or real(*a, **kw))
    real_layer = scripted.scripted_layer()
    monkeypatch.setattr(scripted, "scripted_layer", lambda: lambda *a: seen.append(False) or real_layer(*a))
    for name in ("plan", "plain_plan"):
        real = getattr(twin, name)
        monkeypatch.setattr(engine, name, lambda *a, real=real, **kw: plans.append(1) or real(*a, **kw))
    for dtype, exact in ((DT, True), (torch.float32, False)):
        model = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"), dtype=dtype)
        seen.clear(), plans.clear()
        mt.generate(model, [[5, 17, 33]], 3, mtp=False)
        L = model.config.num_hidden_layers
        decode = seen[L:]                                                   # after the prefill's (exact=False)
        assert decode and len(decode) % L == 0 and set(decode) == {exact}, (dtype, seen)
        assert len(plans) == len(seen) // L                                 # one plan per forward, not per layer


# ---- the same guarantees on a GPU, where the exact path is the PyTorch twins' (kernels="torch") ----
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_premises_hold(dtype):
    """Padded linear pieces, padded norms, the attention's matmuls and cumsums: each row rounds alike in every call."""
    report = inv.row_invariance(dtype, "cuda")
    assert all(report.values()), report


@pytest.mark.gpu
@pytest.mark.parametrize("ns", [[5], [33], [100, 7, 64]], ids=str)
@pytest.mark.parametrize("window", [None, 8])
def test_gpu_tree_step_is_bit_identical_to_serial_steps(ns, window):
    tree = Tree.from_choices(PRESETS["medusa-16"])
    case = tuple(t.cuda() for t in _case(ns, tree, Hq=32, Hkv=32, Dh=128))        # Llama-2-7B's heads (G = 1)
    out = ref.tree_attention(*case, tree.mask.cuda(), window=window, exact=True)
    for b in range(len(ns)):
        for i in range(tree.size):
            assert torch.equal(out[b, i], _serial_equivalent(case, tree, b, i, window)), (b, i)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gqa-hd16-v203-untied-L2", "gqa-hd64-v97-llama3rope-L3"])
def test_gpu_bf16_mtp_equals_serial_end_to_end(name):
    """kernels="torch" on a GPU in bf16 is the exact path: MTP emits the serial tokens, batch 3; and a CUDA graph,
    which that path cannot be captured in, is refused with a clear error."""
    model = mt.LlamaEngine.from_hf(make_hf(name), dtype=DT, device="cuda")
    heads = mt.init_heads(model, num_heads=4, seed=2)
    prompts = [[5, 17, 33, 42, 90, 1] * 6, [7, 8, 9], list(range(10, 47))]
    serial = mt.generate(model, prompts, 40, mtp=False, kernels="torch").tokens
    for tree in ("chain-4", "medusa-64"):
        assert mt.generate(model, prompts, 40, heads=heads, tree=tree, kernels="torch").tokens == serial, tree
    with pytest.raises(ValueError, match="cuda_graph=True needs the Triton kernels"):
        mt.generate(model, prompts, 4, mtp=False, kernels="torch", cuda_graph=True)


@pytest.mark.parametrize("name,cuda_graph", [
    ("gqa-hd16-v203-untied-L2", False),
    pytest.param("gqa-hd64-v97-llama3rope-L3", False, marks=pytest.mark.gpu),
    pytest.param("gqa-hd16-v203-untied-L2", True, marks=pytest.mark.gpu),
    pytest.param("gqa-hd64-v97-llama3rope-L3", True, marks=pytest.mark.gpu)])
def test_bf16_triton_mtp_equals_serial_end_to_end(name, cuda_graph):
    """kernels="triton" in bf16 runs tree_attention's batch-invariant variant and `invariant.linear`: MTP emits the
    serial tokens, batch 3, with and without the verify step as a CUDA graph. A CPU runs Triton's interpreter on a
    shorter run, whose fp32 dots cannot show a rounding difference: there it only shows that the path runs."""
    model = mt.LlamaEngine.from_hf(make_hf(name), dtype=DT, device=DEVICE)
    heads = mt.init_heads(model, num_heads=4, seed=2)
    prompts = [[5, 17, 33, 42, 90, 1] * 6, [7, 8, 9], list(range(10, 47))]
    n, tree = (24, "medusa-16") if DEVICE == "cuda" else (10, "medusa-8")      # the interpreter: small
    kw = dict(kernels="triton", cuda_graph=cuda_graph)
    serial = mt.generate(model, prompts, n, mtp=False, **kw).tokens
    assert mt.generate(model, prompts, n, heads=heads, tree=tree, **kw).tokens == serial
