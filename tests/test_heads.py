"""MTP heads: the math of forward, save/load round trip, init_heads, and clear errors for bad files."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from conftest import assert_close
from mtp_triton.heads import MTPHeads, init_heads, load_heads
from mtp_lab.train_heads import build_llama, head_z


@pytest.fixture(scope="module")
def tiny_model():
    # odd sizes on purpose: D = 36 (head_dim 18), V = 97
    return build_llama(vocab_size=97, layers=1, hidden=36, q_heads=2, kv_heads=1, intermediate=50, max_pos=64)


def random_heads(H, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads = MTPHeads(H, D)
    with torch.no_grad():
        heads.res_weight.copy_(torch.randn(H, D, D, generator=g) / D ** 0.5)
        heads.res_bias.copy_(torch.randn(H, D, generator=g))
    return heads


@pytest.mark.parametrize("H,D,lead", [(1, 8, (5,)), (3, 37, (2, 7)), (5, 16, ())], ids=lambda v: str(v))
def test_forward_is_residual_silu(H, D, lead):
    # z_h = x + silu(W_h x + b_h), computed head by head in float64
    heads = random_heads(H, D)
    x = torch.randn(*lead, D)
    z = heads(x)
    assert z.shape == (*lead, H, D)
    W, b = heads.res_weight.detach().double(), heads.res_bias.detach().double()
    for h in range(H):
        want = x.double() + torch.nn.functional.silu(x.double() @ W[h].T + b[h])
        assert_close(z[..., h, :], want, atol=1e-5, rtol=1e-5, what=f"head {h}")
        assert_close(head_z(heads, x, h), want, atol=1e-5, rtol=1e-5, what=f"head_z {h}")


def test_zero_heads_are_identity():
    # Medusa's initialisation: W = 0, b = 0 -> silu(0) = 0 -> every head returns x (starts as the LM head)
    heads = MTPHeads(4, 12)
    x = torch.randn(3, 12)
    assert torch.equal(heads(x), x.unsqueeze(-2).expand(3, 4, 12))


def test_save_load_round_trip(tmp_path):
    heads = random_heads(3, 37, seed=5)
    heads.save(str(tmp_path / "h"), recipe="test", note="odd D")
    for where in (tmp_path / "h", tmp_path / "h" / "heads.safetensors"):   # the folder or the file
        back = load_heads(str(where))
        assert back.num_heads == 3 and back.hidden_size == 37
        assert torch.equal(back.res_weight, heads.res_weight) and torch.equal(back.res_bias, heads.res_bias)
        x = torch.randn(4, 37)
        assert torch.equal(back(x), heads(x))
    meta = json.loads((tmp_path / "h" / "heads.json").read_text())
    assert meta["num_heads"] == 3 and meta["hidden_size"] == 37 and meta["recipe"] == "test"


def test_load_dtype(tmp_path):
    random_heads(2, 16).save(str(tmp_path))
    assert load_heads(str(tmp_path), dtype=torch.bfloat16).res_weight.dtype == torch.bfloat16


def test_init_heads_not_identity_and_seeded(tiny_model):
    heads = init_heads(tiny_model, num_heads=4, seed=0)
    D = tiny_model.config.hidden_size
    assert heads.num_heads == 4 and heads.hidden_size == D
    x = torch.randn(6, D)
    z = heads(x)
    for h in range(4):
        assert (z[:, h] - x).abs().max() > 1e-2, f"head {h} is (close to) the identity"
    for h in range(1, 4):
        assert not torch.allclose(z[:, 0], z[:, h]), "heads should differ from each other"
    # the heads change the LM head's choice somewhere, or they would be useless for tests
    lm = tiny_model.lm_head
    assert (lm(z).argmax(-1) != lm(x).argmax(-1)[:, None]).any()
    assert torch.equal(init_heads(tiny_model, 4, seed=0).res_weight, heads.res_weight)
    assert not torch.equal(init_heads(tiny_model, 4, seed=1).res_weight, heads.res_weight)


def test_constructor_rejects_empty():
    with pytest.raises(ValueError, match="num_heads"):
        MTPHeads(0, 8)
    with pytest.raises(ValueError, match="hidden_size"):
        MTPHeads(2, 0)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="heads.safetensors"):
        load_heads(str(tmp_path))


@pytest.mark.parametrize("tensors,match", [
    ({"res_weight": torch.zeros(2, 8, 8)}, "res_bias"),                                        # missing tensor
    ({"res_weight": torch.zeros(2, 8, 8), "res_bias": torch.zeros(2, 8), "x": torch.zeros(1)}, "res_bias"),
    ({"res_weight": torch.zeros(2, 8, 9), "res_bias": torch.zeros(2, 8)}, "bad shapes"),       # W not square
    ({"res_weight": torch.zeros(2, 8, 8), "res_bias": torch.zeros(3, 8)}, "bad shapes"),       # H mismatch
    ({"res_weight": torch.zeros(8, 8), "res_bias": torch.zeros(8)}, "bad shapes"),             # no head axis
], ids=["missing-bias", "extra-tensor", "W-not-square", "bias-H-mismatch", "W-2d"])
def test_bad_files(tmp_path, tensors, match):
    save_file(tensors, os.path.join(tmp_path, "heads.safetensors"))
    with pytest.raises(ValueError, match=match):
        load_heads(str(tmp_path))


# ---- per-head LM heads, draft vocabulary, stored tree ------------------------------------------------------
def test_save_load_round_trip_with_lm_heads_vocab_and_tree(tmp_path):
    heads = MTPHeads(3, 20, vocab_size=53, token_map=[0, 4, 5, 17, 52], tree=[(0,), (1,), (0, 0), (0, 0, 0)])
    with torch.no_grad():
        heads.lm_head.normal_()
        heads.res_weight.normal_()
    heads.save(str(tmp_path), note="x")
    back = load_heads(str(tmp_path))
    assert back.vocab_size == 53 and torch.equal(back.lm_head, heads.lm_head)
    assert back.token_map.dtype == torch.int64 and back.token_map.tolist() == [0, 4, 5, 17, 52]
    assert back.tree == ((0,), (1,), (0, 0), (0, 0, 0))
    meta = json.loads((tmp_path / "heads.json").read_text())
    assert meta["vocab_size"] == 53 and meta["draft_vocab_size"] == 5 and meta["tree"][3] == [0, 0, 0]
    assert MTPHeads(2, 8).tree is None and MTPHeads(2, 8).token_map is None and MTPHeads(2, 8).lm_head is None


@pytest.mark.parametrize("token_map,match", [
    ([3, 2, 5], "strictly increasing"), ([1, 1, 2], "strictly increasing"), ([-1, 2], ">= 0"),
    ([], "non-empty"), ([0.0, 1.0], "integer"), ([[0, 1]], "1-D"), ([0, 60], "outside the vocabulary of 53"),
], ids=["decreasing", "repeated", "negative", "empty", "float", "2d", "beyond-V"])
def test_bad_token_map(token_map, match):
    with pytest.raises(ValueError, match=match):
        MTPHeads(2, 8, vocab_size=53, token_map=torch.tensor(token_map))


def test_bad_tree_refused_at_construction_and_load(tmp_path):
    with pytest.raises(ValueError, match="deeper than the 2 heads"):
        MTPHeads(2, 8, tree=[(0,), (0, 0), (0, 0, 0)])
    MTPHeads(2, 8, tree=[(0,), (0, 0)]).save(str(tmp_path))
    meta = json.loads((tmp_path / "heads.json").read_text())
    (tmp_path / "heads.json").write_text(json.dumps(dict(meta, tree=[[0], [1, 0]])))     # (1,) is missing
    with pytest.raises(ValueError, match=r"heads.json: tree: Tree: path \(1, 0\) has no parent"):
        load_heads(str(tmp_path))
    (tmp_path / "heads.json").write_text(json.dumps(dict(meta, num_heads=3)))
    with pytest.raises(ValueError, match="says 3 heads"):
        load_heads(str(tmp_path))


def test_draft_weights_shared_head(tiny_model):
    heads = init_heads(tiny_model, 3)
    W = tiny_model.lm_head.weight
    lm, tm = heads.draft_weights(W)
    assert tm is None and lm.data_ptr() == W.data_ptr()                   # the model's head itself, no copy
    heads.token_map = [1, 5, 6, 40, 96]
    lm, tm = heads.draft_weights(W)
    assert tm.tolist() == [1, 5, 6, 40, 96] and torch.equal(lm, W.detach()[tm])


def test_draft_weights_per_head_cached_until_weights_change():
    heads = MTPHeads(2, 8, vocab_size=11, token_map=[0, 3, 10])
    with torch.no_grad():
        heads.lm_head.normal_()
    W = torch.randn(11, 8, dtype=torch.float64)
    lm, tm = heads.draft_weights(W)
    assert lm.shape == (2, 3, 8) and lm.dtype == torch.float64                  # the model's dtype
    assert torch.equal(lm, heads.lm_head.detach().double()[:, [0, 3, 10]])
    again = heads.draft_weights(W)
    assert again[0] is lm and again[1] is tm                                     # computed once
    with torch.no_grad():
        heads.lm_head[1, 3] += 1.0                                               # an in-place update ...
    lm2, _ = heads.draft_weights(W)
    assert lm2 is not lm and torch.equal(lm2[1, 1], heads.lm_head[1, 3].detach().double())   # ... is seen
    heads.token_map = [2, 3]
    assert heads.draft_weights(W)[0].shape == (2, 2, 8)


def test_draft_weights_errors():
    heads = MTPHeads(2, 8, vocab_size=11)
    with pytest.raises(ValueError, match="11 rows but the model's vocabulary is 12"):
        heads.draft_weights(torch.zeros(12, 8))
    with pytest.raises(ValueError, match=r"must be \[V, 8\]"):
        heads.draft_weights(torch.zeros(11, 9))
    shared = MTPHeads(2, 8, token_map=[0, 20])
    with pytest.raises(ValueError, match="outside the model's vocabulary 11"):
        shared.draft_weights(torch.zeros(11, 8))


# ---- FasterDecoding's Medusa checkpoints -------------------------------------------------------------------
class ResBlock(torch.nn.Module):
    """Medusa's residual block, x + SiLU(Linear(D, D)(x)), rebuilt from its description so the test writes the
    state dict layout that medusa/model/medusa_model.py (FasterDecoding/Medusa) saves."""

    def __init__(self, D):
        super().__init__()
        self.linear = torch.nn.Linear(D, D)
        self.act = torch.nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def medusa_heads_module(H, D, V, seed=0, dtype=torch.float64):
    """nn.ModuleList([nn.Sequential(ResBlock(D), nn.Linear(D, V, bias=False)) ...]) with random weights."""
    torch.manual_seed(seed)
    m = torch.nn.ModuleList([torch.nn.Sequential(ResBlock(D), torch.nn.Linear(D, V, bias=False)) for _ in range(H)])
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)
    return m.to(dtype)


def write_medusa(folder, module, fmt):
    os.makedirs(folder, exist_ok=True)
    file = os.path.join(folder, f"medusa_lm_head.{fmt}")
    if fmt == "pt":
        torch.save(module.state_dict(), file)
    else:
        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, file)
    return file


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_medusa_checkpoint_loads_and_matches_its_modules(tmp_path, fmt):
    H, D, V = 3, 20, 37
    module = medusa_heads_module(H, D, V)
    assert sorted(module.state_dict())[:3] == ["0.0.linear.bias", "0.0.linear.weight", "0.1.weight"]
    file = write_medusa(str(tmp_path), module, fmt)
    for where in (str(tmp_path), file):                                     # the folder or the file
        heads = load_heads(where)
        assert (heads.num_heads, heads.hidden_size, heads.vocab_size) == (H, D, V)
        assert heads.res_weight.dtype == torch.float64 and heads.tree is None and heads.token_map is None
        x = torch.randn(5, D, dtype=torch.float64)
        z = heads(x)                                                        # [5, H, D]
        for h in range(H):
            want = module[h](x)                                             # [5, V] Medusa's logits
            assert_close(z[:, h] @ heads.lm_head[h].T, want, atol=1e-10, rtol=1e-10, what=f"{fmt} head {h}")
    # with a draft vocabulary the rows to score are pre-gathered, and row r is token token_map[r]
    heads.token_map = torch.tensor([0, 2, 3, 11, 20, 36])
    lm, tm = heads.draft_weights(torch.zeros(V, D, dtype=torch.float64))
    for h in range(H):
        logits = module[h](x)
        assert torch.equal(tm[(z[:, h] @ lm[h].T).argmax(-1)], tm[logits[:, tm].argmax(-1)])


class NotATensor:
    pass


def test_medusa_pt_is_never_fully_unpickled(tmp_path):
    torch.save({"0.0.linear.weight": NotATensor()}, str(tmp_path / "medusa_lm_head.pt"))
    with pytest.raises(ValueError, match=r"weights_only=True\) refused it"):
        load_heads(str(tmp_path))


@pytest.mark.parametrize("case,match", [
    ("two-resblocks", "head 0 has 2 ResBlocks"), ("extra-key", "unexpected keys"), ("gap", "are not 0..1"),
    ("no-lm-head", "expected 0.linear.weight, 0.linear.bias and 1.weight"),
])
def test_bad_medusa_files(tmp_path, case, match):
    sd = {k: v.clone() for k, v in medusa_heads_module(2, 8, 13).state_dict().items()}
    if case == "two-resblocks":                 # medusa_num_layers = 2: two blocks, then the LM head at index 2
        sd = {"0.0.linear.weight": sd["0.0.linear.weight"], "0.0.linear.bias": sd["0.0.linear.bias"],
              "0.1.linear.weight": sd["0.0.linear.weight"].clone(), "0.1.linear.bias": sd["0.0.linear.bias"].clone(),
              "0.2.weight": sd["0.1.weight"]}
    elif case == "extra-key":
        sd["lm_head.weight"] = sd["0.1.weight"].clone()
    elif case == "gap":
        sd = {k.replace("1.", "2.", 1) if k.startswith("1.") else k: v for k, v in sd.items()}
    else:
        sd.pop("1.1.weight")
        sd = {k: v for k, v in sd.items() if k.startswith("1.")}
        sd = {k.replace("1.", "0.", 1): v for k, v in sd.items()}
    save_file(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=match):
        load_heads(str(tmp_path))


def test_other_formats_refused(tmp_path):
    f = tmp_path / "medusa_lm_head.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="unsupported format"):
        load_heads(str(f))
    with pytest.raises(FileNotFoundError, match="medusa_lm_head.safetensors / medusa_lm_head.pt"):
        load_heads(str(tmp_path))


# ---- decoding with Medusa heads and Medusa's own trees -----------------------------------------------------
# mc_sim_7b_63, written out from medusa/model/medusa_choices.py in FasterDecoding/Medusa
# (https://github.com/FasterDecoding/Medusa/blob/main/medusa/model/medusa_choices.py): 63 paths of top-k ranks.
MC_SIM_7B_63 = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
                [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8],
                [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0],
                [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0],
                [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1],
                [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0]]


def test_medusa_choice_set_is_a_tree():
    from mtp_triton import Tree
    tree = Tree.from_choices(MC_SIM_7B_63)
    assert (tree.size, tree.max_depth, tree.top_k) == (64, 4, 10)
    assert all(tree.paths[int(p)] == path[:-1] for p, path in zip(tree.parents[1:], tree.paths[1:]))
    assert MTPHeads(4, 8, tree=MC_SIM_7B_63).tree[0] == (0,)


@pytest.fixture(scope="module")
def medusa_case(tmp_path_factory):
    """A tiny Llama, Medusa heads for it written to disk, and transformers' greedy continuation."""
    import mtp_triton as mt
    from hf_models import hf_greedy, make_hf
    hf = make_hf("gqa-hd16-v203-untied-L2")
    model = mt.LlamaEngine.from_hf(hf)
    folder = str(tmp_path_factory.mktemp("medusa"))
    write_medusa(folder, medusa_heads_module(4, model.config.hidden_size, model.config.vocab_size, seed=2), "pt")
    prompts = [[5, 17, 33, 42, 90, 1], [7, 8, 9]]
    return model, load_heads(folder), prompts, hf_greedy(hf, prompts, 24)


@pytest.mark.parametrize("tree", ["medusa-16", "mc_sim_7b_63"])
def test_medusa_heads_decode_losslessly(medusa_case, tree):
    import mtp_triton as mt
    model, heads, prompts, ref = medusa_case
    heads.token_map = None
    t = mt.Tree.from_choices(MC_SIM_7B_63) if tree == "mc_sim_7b_63" else tree
    assert mt.generate(model, prompts, 24, heads=heads, tree=t).tokens == ref
    heads.token_map = torch.arange(0, model.config.vocab_size, 3)              # a draft vocabulary: still lossless
    assert mt.generate(model, prompts, 24, heads=heads, tree=t).tokens == ref


def test_generate_drafts_with_the_heads_own_lm_heads(medusa_case, monkeypatch):
    import mtp_triton as mt
    model, heads, prompts, ref = medusa_case
    heads.token_map = torch.arange(0, model.config.vocab_size, 2)
    want_lm, want_tm = heads.draft_weights(model.lm_head.weight)              # [4, 102, D], [102]
    seen, real = [], mt.reference.fused_draft

    def spy(hidden, res_weight, res_bias, lm_head, top_k, **kw):
        seen.append((lm_head, kw.get("token_map")))
        return real(hidden, res_weight, res_bias, lm_head, top_k, **kw)

    monkeypatch.setattr(mt.reference, "fused_draft", spy)
    assert mt.generate(model, prompts, 24, heads=heads, tree="chain-2", kernels="torch").tokens == ref
    # the heads' own LM heads (their first 2, all a chain-2 tree reaches: same storage) and their token_map
    assert seen and all(lm.data_ptr() == want_lm.data_ptr() and tuple(lm.shape) == (2, *want_lm.shape[1:])
                        and tm is want_tm for lm, tm in seen)


def test_generate_uses_the_tree_stored_with_the_heads(medusa_case):
    import mtp_triton as mt
    model, heads, prompts, ref = medusa_case
    heads.tree = [(0,), (1,), (0, 0)]
    res = mt.generate(model, prompts, 24, heads=heads)                       # tree=None: the stored one
    assert res.tokens == ref and res.stats.tree_size == 4
    assert mt.generate(model, prompts, 24, heads=heads, tree="chain-2").stats.tree_size == 3   # an explicit tree wins


# ---- heads that read the root token: x' = x + P e_root --------------------------------------------------------
def root_heads(H, D, seed=0):
    heads = random_heads(H, D, seed)
    heads.root_proj = torch.nn.Parameter(torch.randn(D, D, generator=torch.Generator().manual_seed(seed + 1)) / D)
    return heads


def test_root_input_forward_math():
    heads = root_heads(3, 20, seed=4)
    x, e = torch.randn(5, 20), torch.randn(5, 20)
    P, W, b = (t.detach().double() for t in (heads.root_proj, heads.res_weight, heads.res_bias))
    xp = x.double() + e.double() @ P.T
    for h in range(3):
        assert_close(heads(x, e)[:, h], xp + torch.nn.functional.silu(xp @ W[h].T + b[h]), atol=1e-5, rtol=1e-5,
                     what=f"head {h}")
    with pytest.raises(ValueError, match="root_emb"):
        heads(x)
    zero = MTPHeads(3, 20, root_input=True)                  # P = 0 (training's start): the Medusa heads
    with torch.no_grad():
        zero.res_weight.copy_(heads.res_weight)
        zero.res_bias.copy_(heads.res_bias)
    assert torch.equal(zero(x, e), random_heads(3, 20, seed=4)(x))


def test_root_input_round_trip_and_bad_files(tmp_path):
    heads = root_heads(2, 12, seed=1)
    heads.save(str(tmp_path / "h"))
    back = load_heads(str(tmp_path / "h"))
    assert back.root_input and torch.equal(back.root_proj, heads.root_proj)
    assert json.loads((tmp_path / "h" / "heads.json").read_text())["root_input"] is True
    assert load_heads(str(tmp_path / "h"), dtype=torch.bfloat16).root_proj.dtype == torch.bfloat16
    random_heads(2, 12).save(str(tmp_path / "plain"))
    meta = json.loads((tmp_path / "plain" / "heads.json").read_text())
    assert "root_input" not in meta and not load_heads(str(tmp_path / "plain")).root_input
    meta["root_input"] = True                                # the metadata promises a tensor the file lacks
    (tmp_path / "plain" / "heads.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="root_input"):
        load_heads(str(tmp_path / "plain"))
    save_file({"res_weight": torch.zeros(2, 12, 12), "res_bias": torch.zeros(2, 12), "root_proj": torch.zeros(12, 5)},
              str(tmp_path / "heads.safetensors"))
    with pytest.raises(ValueError, match="root_proj"):
        load_heads(str(tmp_path / "heads.safetensors"))


def test_root_input_heads_draft_from_the_root_and_decode_losslessly(medusa_case):
    import mtp_triton as mt
    from mtp_triton.drafters import HeadsDrafter
    from mtp_triton.ops import get_ops
    model, _, prompts, ref = medusa_case
    D = model.config.hidden_size
    heads = root_heads(4, D, seed=3)
    heads.root_proj.data *= 40                              # strong enough that the root changes the drafts
    drafter = HeadsDrafter(heads, model, get_ops("torch", model.device), draft_dtype=model.dtype)
    dt = model.dtype
    hidden = torch.randn(3, D, generator=torch.Generator().manual_seed(0)).to(dt)
    roots = torch.tensor([1, 50, 99])
    ids = drafter.propose(hidden, 4, roots=roots)
    lm, _ = heads.draft_weights(model.lm_head.weight)
    xp = hidden + model.embed_tokens.weight[roots] @ heads.root_proj.detach().to(dt).T
    want, _ = mt.reference.fused_draft(xp, heads.res_weight.detach().to(dt), heads.res_bias.detach().to(dt), lm, 4)
    assert torch.equal(ids, want)
    assert not torch.equal(ids, drafter.propose(hidden, 4, roots=torch.tensor([2, 3, 4])))
    with pytest.raises(ValueError, match="roots"):
        drafter.propose(hidden, 4)
    for tree in ("chain-2", "medusa-16"):
        assert mt.generate(model, prompts, 24, heads=heads, tree=tree).tokens == ref


# ---- heads that read the drafted tokens of their path: s_h = x' + sum_q Q_q e(y_{h-q}) ------------------------
def token_heads(H, D, Q, seed=0, root=True, scale=1.0):
    heads = MTPHeads(H, D, root_input=root, token_inputs=Q)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        heads.res_weight.copy_(torch.randn(H, D, D, generator=g) / D ** 0.5)
        heads.res_bias.copy_(0.1 * torch.randn(H, D, generator=g))
        if root:
            heads.root_proj.copy_(torch.randn(D, D, generator=g) / D)
        heads.token_proj.copy_(scale * torch.randn(Q, D, D, generator=g) / D ** 0.5)
    return heads.eval()


def test_token_input_forward_math():
    H, D, Q = 4, 20, 2
    heads = token_heads(H, D, Q, seed=5)
    x, e, path = torch.randn(3, D), torch.randn(3, D), torch.randn(3, H - 1, D)
    P, W, b, Qp = (t.detach().double() for t in (heads.root_proj, heads.res_weight, heads.res_bias, heads.token_proj))
    xp = x.double() + e.double() @ P.T
    z = heads(x, e, path)
    for h in range(H):
        s = xp.clone()
        for q in range(min(h, Q)):                           # y_{h-q}: path index h - q - 1
            s = s + path[:, h - q - 1].double() @ Qp[q].T
        assert_close(z[:, h], s + torch.nn.functional.silu(s @ W[h].T + b[h]), atol=1e-5, rtol=1e-5, what=f"head {h}")
    with pytest.raises(ValueError, match="path_emb"):
        heads(x, e)
    with pytest.raises(ValueError, match="token_inputs"):
        MTPHeads(3, 8, token_inputs=3)                       # head 2 has only 2 drafted tokens before it


def test_token_input_round_trip_and_bad_files(tmp_path):
    heads = token_heads(3, 12, 2, seed=1)
    heads.save(str(tmp_path / "h"))
    back = load_heads(str(tmp_path / "h"))
    assert back.token_inputs == 2 and torch.equal(back.token_proj, heads.token_proj) and back.root_input
    assert json.loads((tmp_path / "h" / "heads.json").read_text())["token_inputs"] == 2
    meta = json.loads((tmp_path / "h" / "heads.json").read_text())
    meta["token_inputs"] = 1                                  # the metadata disagrees with the tensor
    (tmp_path / "h" / "heads.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="token_inputs"):
        load_heads(str(tmp_path / "h"))
    save_file({"res_weight": torch.zeros(2, 12, 12), "res_bias": torch.zeros(2, 12), "token_proj": torch.zeros(2, 12, 12)},
              str(tmp_path / "heads.safetensors"))           # Q = 2 with 2 heads: head 1 has one drafted token
    with pytest.raises(ValueError, match="token_proj"):
        load_heads(str(tmp_path / "heads.safetensors"))


def naive_tree_draft(heads, model, hidden, roots, tree):
    """Node by node, in float64-free plain torch: each child's token from its parent's path, through heads.forward."""
    import mtp_triton as mt
    dt = model.dtype
    lm, tm = heads.draft_weights(model.lm_head.weight)
    E = model.embed_tokens.weight
    tokens = roots[:, None].repeat(1, tree.size)
    for i in range(1, tree.size):
        p, d, r = int(tree.parents[i]), int(tree.depth[i]), int(tree.rank[i])
        chain, a = [], p
        while a > 0:                                         # the path's nodes y_1 .. y_{d-1}
            chain.append(a)
            a = int(tree.parents[a])
        chain = chain[::-1]
        for b in range(roots.shape[0]):
            x = hidden[b] + E[roots[b]] @ heads.root_proj.detach().to(dt).T
            s = x
            for q in range(min(d - 1, heads.token_inputs)):
                s = s + E[tokens[b, chain[d - 2 - q]]] @ heads.token_proj[q].detach().to(dt).T
            ids, _ = mt.reference.fused_draft(s[None], heads.res_weight[d - 1:d].detach().to(dt),
                                              heads.res_bias[d - 1:d].detach().to(dt), lm, r + 1, token_map=tm)
            tokens[b, i] = ids[0, 0, r]
    return tokens


@pytest.mark.parametrize("tree", ["chain-4", "medusa-16", [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 2)]])
def test_token_input_heads_draft_per_node_and_decode_losslessly(medusa_case, tree):
    import mtp_triton as mt
    from mtp_triton.drafters import HeadsDrafter
    from mtp_triton.ops import get_ops
    from mtp_triton.tree import get_tree
    model, _, prompts, ref = medusa_case
    D = model.config.hidden_size
    heads = token_heads(4, D, 2, seed=3, scale=30.0)         # strong enough that the path changes the drafts
    heads.token_map = torch.arange(0, model.config.vocab_size, 2)   # and through a draft vocabulary
    drafter = HeadsDrafter(heads, model, get_ops("torch", model.device), draft_dtype=model.dtype)
    assert drafter.sequential
    t = get_tree(tree)
    hidden = torch.randn(3, D, generator=torch.Generator().manual_seed(0)).to(model.dtype)
    roots = torch.tensor([1, 50, 99])
    got = drafter.draft_tree(hidden, roots, t)
    assert torch.equal(got, naive_tree_draft(heads, model, hidden, roots, t))
    if t.max_depth > 1:                                       # siblings' children differ: the path matters
        flat = token_heads(4, D, 2, seed=3, scale=0.0)       # the same heads, blind to the path
        flat.token_map = heads.token_map
        assert not torch.equal(got, HeadsDrafter(flat, model, get_ops("torch", model.device), draft_dtype=model.dtype).draft_tree(hidden, roots, t))
    with pytest.raises(ValueError, match="draft_tree"):
        drafter.propose(hidden, 4, roots=roots)
    assert mt.generate(model, prompts, 24, heads=heads, tree=tree).tokens == ref


def test_token_input_tree_draft_with_the_triton_kernel_equals_its_twin(tiny_model):
    # the same per-depth calls through the Triton fused_draft (the interpreter on a CPU) and through the PyTorch twin
    import mtp_triton as mt
    from mtp_triton.drafters import HeadsDrafter
    from mtp_triton.ops import get_ops
    model = mt.LlamaEngine.from_hf(tiny_model.float())
    D, V = model.config.hidden_size, model.config.vocab_size
    heads = token_heads(3, D, 2, seed=7, scale=10.0)
    heads.token_map = torch.arange(1, V, 3)                  # an odd-sized draft vocabulary
    tree = mt.Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 1, 1)])
    hidden = torch.randn(2, D, generator=torch.Generator().manual_seed(1)).to(model.dtype)
    roots = torch.tensor([3, V - 1])
    got = HeadsDrafter(heads, model, get_ops("triton", model.device), draft_dtype=model.dtype).draft_tree(hidden, roots, tree)
    want = HeadsDrafter(heads, model, get_ops("torch", model.device), draft_dtype=model.dtype).draft_tree(hidden, roots, tree)
    assert torch.equal(got, want)
