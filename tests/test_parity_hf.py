"""Greedy decoding on our engine == transformers' generate(do_sample=False), token for token (fp64)."""
import pytest
import torch

import mtp_triton as mt
from mtp_triton.drafters import OracleDrafter
from hf_models import CONFIGS, FAMILY_CONFIGS, hf_greedy, make_hf

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


# ---- the other families: Qwen2 / Qwen2.5 (q/k/v bias), Qwen3 (q/k norm, explicit head_dim), Mistral (window) ----
# Prompts of 12+ tokens, so that a sliding window of 8 (or 5, 6) already cuts the cache at the first new token.
FAMILY_PROMPTS = [[5, 17, 33, 42, 90, 1, 3, 8, 21, 13, 55, 34], [int(x) for x in torch.arange(40, 57) % 97],
                  [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


@pytest.fixture(scope="module", params=sorted(FAMILY_CONFIGS))
def family_case(request):
    hf = make_hf(request.param)
    model = mt.LlamaEngine.from_hf(hf)
    assert model.config.model_type == FAMILY_CONFIGS[request.param][0]
    return request.param, hf, model, hf_greedy(hf, FAMILY_PROMPTS, N)


def test_family_serial_matches_hf(family_case):
    _, _, model, ref = family_case
    assert mt.generate(model, FAMILY_PROMPTS, N, mtp=False).tokens == ref
    assert mt.generate(model, FAMILY_PROMPTS[:1], N, mtp=False).tokens == ref[:1]


@pytest.mark.parametrize("tree", ["chain-4", "medusa-16"])
def test_family_mtp_random_heads_matches_hf(family_case, tree):
    _, _, model, ref = family_case
    heads = mt.init_heads(model, num_heads=4, seed=3)
    assert mt.generate(model, FAMILY_PROMPTS, N, heads=heads, tree=tree).tokens == ref


def test_family_mtp_long_accepted_runs_match_hf(family_case):
    """Whole chains of 8 accepted drafts: tree nodes deeper than the window must not see the oldest ones."""
    _, _, model, ref = family_case
    drafter = OracleDrafter(ref, [1.0] * 8, model.config.vocab_size, seed=0)
    res = mt.generate(model, FAMILY_PROMPTS, N, drafter=drafter, tree="chain-8")
    assert res.tokens == ref and res.stats.tokens_per_step > 4


@pytest.mark.parametrize("name,no_window", [("mistral-win8-gqa-hd16-v203-L2", dict(sliding_window=None)),
                                            ("mistral-win5-mha-hd20-v131-L1", dict(sliding_window=None)),
                                            ("qwen2-swa6-layer1-L2", dict(use_sliding_window=False))])
def test_the_window_matters(name, no_window):
    """Without the window transformers decodes differently, so the parity tests above fail if it is ignored."""
    hf, plain = make_hf(name), make_hf(name, **no_window)                # same seed: same weights
    ref, ref_plain = hf_greedy(hf, FAMILY_PROMPTS, N), hf_greedy(plain, FAMILY_PROMPTS, N)
    assert all(a != b for a, b in zip(ref, ref_plain))
    assert mt.generate(mt.LlamaEngine.from_hf(plain), FAMILY_PROMPTS, N, mtp=False).tokens == ref_plain


def test_sliding_window_with_triton_kernels_matches_hf():
    """The same window through the Triton kernel (interpreter on CPU, fp32: the kernel has no fp64)."""
    hf = make_hf("mistral-win5-mha-hd20-v131-L1", dtype=torch.float32)
    model = mt.LlamaEngine.from_hf(hf)
    prompts, n = FAMILY_PROMPTS[:2], 12
    ref = hf_greedy(hf, prompts, n)
    assert mt.generate(model, prompts, n, mtp=False, kernels="triton").tokens == ref
    drafter = OracleDrafter(ref, [1.0, 1.0, 1.0], model.config.vocab_size)
    res = mt.generate(model, prompts, n, drafter=drafter, tree="chain-3", kernels="triton")
    assert res.tokens == ref and res.stats.tokens_per_step > 2
