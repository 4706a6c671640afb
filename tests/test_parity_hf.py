"""Greedy decoding on our engine == transformers' generate(do_sample=False), token for token (fp64)."""
import pytest
import torch

import mtp_triton as mt
from mtp_triton.drafters import OracleDrafter
from hf_models import CONFIGS, hf_greedy, make_hf

PROMPTS_B3 = [[5, 17, 33, 42, 90, 1], [7, 8, 9], [int(x) for x in torch.arange(10, 37) % 90]]
N = 48


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request):
    hf = make_hf(request.param)
    model = mt.LlamaEngine.from_hf(hf)
    ref = hf_greedy(hf, PROMPTS_B3, N)
    return request.param, hf, model, ref


def test_serial_batch1_matches_hf(case):
    _, _, model, ref = case
    for p, r in zip(PROMPTS_B3, ref):
        assert mt.generate(model, [p], N, mtp=False).tokens == [r]


def test_serial_batch3_matches_hf(case):
    _, _, model, ref = case
    res = mt.generate(model, PROMPTS_B3, N, mtp=False)
    assert res.tokens == ref
    assert res.stats.tokens_per_step == 1.0


@pytest.mark.parametrize("tree", ["chain-2", "chain-4", "medusa-16", "medusa-64"])
def test_mtp_random_heads_matches_hf(case, tree):
    _, _, model, ref = case
    heads = mt.init_heads(model, num_heads=4, seed=3)
    assert mt.generate(model, PROMPTS_B3, N, heads=heads, tree=tree).tokens == ref


@pytest.mark.parametrize("tree,profile", [("chain-4", [0.9, 0.8, 0.7, 0.6]), ("medusa-16", [0.6, 0.5, 0.5, 0.4]),
                                          ("chain-8", [1.0] * 8)])
def test_mtp_high_acceptance_matches_hf(case, tree, profile):
    """A synthetic drafter that is often right exercises long accepted runs, EOS-free truncation at N."""
    _, _, model, ref = case
    drafter = OracleDrafter(ref, profile, model.config.vocab_size, seed=0)
    res = mt.generate(model, PROMPTS_B3, N, drafter=drafter, tree=tree)
    assert res.tokens == ref
    assert res.stats.tokens_per_step > 1.5


def test_batch1_each_prompt_mtp(case):
    _, _, model, ref = case
    heads = mt.init_heads(model, num_heads=4, seed=1)
    for p, r in zip(PROMPTS_B3, ref):
        assert mt.generate(model, [p], N, heads=heads, tree="medusa-16").tokens == [r]


def test_eos_matches_hf():
    hf = make_hf("gqa-hd16-v203-untied-L2")
    model = mt.LlamaEngine.from_hf(hf)
    free = hf_greedy(hf, PROMPTS_B3, N)
    eos = free[0][10]                      # a token the first sequence emits: HF stops there
    ref = hf_greedy(hf, PROMPTS_B3, N, eos_token_id=eos)
    assert len(ref[0]) <= 11 and ref[0][-1] == eos
    assert mt.generate(model, PROMPTS_B3, N, mtp=False, eos_token_id=eos).tokens == ref
    drafter = OracleDrafter(free, [1.0] * 8, model.config.vocab_size)
    assert mt.generate(model, PROMPTS_B3, N, drafter=drafter, tree="chain-8", eos_token_id=eos).tokens == ref


def test_load_model_from_saved_checkpoint(tmp_path):
    hf = make_hf("mha-hd32-v311-tied-L1")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = mt.load_model(str(tmp_path), device="cpu")
    assert model.dtype == torch.float64
    ref = hf_greedy(hf, PROMPTS_B3[:1], 24)
    assert mt.generate(model, PROMPTS_B3[:1], 24, mtp=False).tokens == ref


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        mt.load_model(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="safetensors"):
        mt.load_model(str(tmp_path))
