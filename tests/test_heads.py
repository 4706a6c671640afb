"""MTP heads: the math of forward, save/load round trip, init_heads, and clear errors for bad files."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from conftest import assert_close
from mtp_triton.heads import MTPHeads, init_heads, load_heads
from mtp_triton.train_heads import build_llama, head_z


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
