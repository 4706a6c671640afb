"""The TorchScript layer (mtp_triton/scripted.py): it runs where it should, and every output has the Python layer's
bits, in every family the engine supports, serial and tree steps, batches, and the drafters that run it."""
import pytest
import torch

import mtp_triton as mt
from mtp_triton import scripted
from mtp_triton.eagle3 import Eagle3Module
from mtp_triton.generate import prefill
from mtp_triton.ops import get_ops
from mtp_triton.packed import packing_applies
from mtp_triton.tree import PRESETS, Tree
from hf_models import make_hf

MODELS = ["gqa-hd16-v203-untied-L2", "qwen2-gqa-hd16-v203-untied-L2", "qwen3-mha-hd10-v97-tied-bias-L2",
          "mistral-win5-mha-hd20-v131-L1", "qwen2-swa6-layer1-L2", "llama-biases"]
PROMPTS = [[5, 17, 33, 42, 90, 1] * 6, [7, 8, 9], list(range(10, 47))]


def _model(name, dtype=torch.float32):
    if not packing_applies(dtype):
        pytest.skip(f"this CPU cannot pack {dtype} weights (packing_applies is False): the layer never runs")
    if not scripted.available():
        pytest.skip("torch.jit.script fails in this torch: the engine runs its Python layer")
    if name == "llama-biases":                      # a bias on every linear layer: q/k/v, o and the MLP's
        hf = make_hf(MODELS[0], attention_bias=True, mlp_bias=True)
        with torch.no_grad():
            for pname, p in hf.named_parameters():
                if pname.endswith(".bias"):         # transformers starts them at 0, which would hide a lost bias
                    p.normal_(0.0, 0.2)
        return mt.LlamaEngine.from_hf(hf, dtype=dtype)
    return mt.LlamaEngine.from_hf(make_hf(name), dtype=dtype)


def _counted(monkeypatch):
    """Count the calls the engine makes to the TorchScript function."""
    calls = [0]
    real = scripted.scripted_layer()

    def spy(*args):
        calls[0] += 1
        return real(*args)
    monkeypatch.setattr(scripted, "scripted_layer", lambda: spy)
    return calls


def _step(model, tree, on, lens=(40, 23)):
    """(h, k_tree, v_tree, logits) of one verify step over `tree` for two sequences of different cache lengths."""
    model.script_layers = on
    ops = get_ops("torch")
    cache = model.new_cache([n + tree.size for n in lens])
    prefill(model, [list(range(3, 3 + n)) for n in lens], cache, ops)
    tokens = (torch.arange(tree.size)[None] * 7 + torch.tensor([[50], [11]])) % model.config.vocab_size
    positions = cache.cache_lens.long()[:, None] + tree.depth[None]
    h, k, v = model.forward_tree(tokens, positions, tree.mask, cache, torch.arange(2), ops)
    return h, k, v, model.logits(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("tree", ["chain-1", "medusa-16"])
def test_a_step_has_the_python_layers_bits(name, tree, dtype, monkeypatch):
    model = _model(name, dtype)
    tree = Tree.from_choices(PRESETS[tree])
    python = _step(model, tree, False)
    calls = _counted(monkeypatch)
    for _ in range(3):                              # TorchScript's profiling executor optimises after a few calls
        got = _step(model, tree, True)
        for a, b in zip(python, got):
            assert torch.equal(a, b)
    assert calls[0] == 3 * 2 * model.config.num_hidden_layers       # the prefill and the step, every layer


def test_it_runs_only_on_a_plain_packed_step(monkeypatch):
    model = _model(MODELS[0])
    calls = _counted(monkeypatch)
    tree = Tree.from_choices(PRESETS["chain-1"])
    model.pack_weights = False
    _step(model, tree, True)                                        # nn.Linear weights
    model.pack_weights = True
    _step(model, tree, False)                                       # switched off
    cache = model.new_cache([8])
    model.script_layers = True
    with torch.no_grad():
        model.forward_tree(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), torch.tril(torch.ones(2, 2, dtype=bool)),
                           cache, torch.arange(1), get_ops("torch"), exact=True)      # the exact mode
    assert calls[0] == 0


@pytest.mark.parametrize("name", MODELS[:3])
def test_greedy_decoding_is_unchanged(name):
    model = _model(name)
    heads = mt.init_heads(model, num_heads=3, seed=1)
    out = {}
    for on in (False, True):
        model.script_layers = on
        out[on] = (mt.generate(model, PROMPTS, 20, mtp=False).tokens,
                   mt.generate(model, PROMPTS, 20, heads=heads, tree="medusa-16").tokens)
    assert out[True] == out[False] and out[True][0] == out[True][1]


@torch.no_grad()
def test_the_attention_input_a_has_the_python_layers_bits(monkeypatch):
    """EAGLE-3's block projects q, k, v from a = [RMSNorm(E x); RMSNorm(u)] (`layer`'s a, D_a = 2D)."""
    from mtp_triton import model as engine
    from mtp_triton.kernels.tree_attention_ref import plain_plan
    model = _model(MODELS[0])
    cfg, T = model.config, 5
    mod = Eagle3Module.from_target(model, torch.arange(0, 203, 2), (0, 1, 2))
    eng = mod.engine(model)
    cache = eng.new_cache([12 + T])
    cache.cache_lens[0] = 12
    torch.manual_seed(1)
    cache.k.normal_(), cache.v.normal_()
    x, a = torch.randn(1, T, cfg.hidden_size), torch.randn(1, T, 2 * cfg.hidden_size)
    tree = Tree.from_choices(PRESETS["medusa-16"]).mask[:T, :T]
    keys = plain_plan(cache.block_table, cache.cache_lens, tree, cache.k.shape[1], cache.block_size)
    cos, sin = eng.rope(12 + torch.arange(T)[None])
    packed = engine.packed_layers(eng).layer(0)
    args = (x, cos, sin, eng.layers[0], packed, cache.k[0], cache.v[0], keys, a)
    calls = _counted(monkeypatch)
    for want, got in zip(engine.layer(*args), scripted.layer(*args)):
        assert torch.equal(want, got)
    assert calls[0] == 1


def test_eagle3_drafts_are_unchanged():
    """EAGLE-3's block attends from [E x; u] (the layer's `a`) in its own one-layer engine: the same drafts either way."""
    model = _model(MODELS[0])
    torch.manual_seed(0)
    mod = Eagle3Module.from_target(model, torch.arange(0, 203, 2), (0, 1, 2), dict(depth=3, top_k=4, beam=2, nodes=8))
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    runs = {}
    for on in (False, True):
        model.script_layers = on
        r = mt.generate(model, PROMPTS, 16, drafter=mod, runtime=dict(size_by_cost=False))
        runs[on] = (r.tokens, r.stats.steps, r.stats.accept_len_histogram)
    assert runs[True] == runs[False]
