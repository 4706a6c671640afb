"""The decoding loop: bad input, the drafter argument, runtime features (fallback, per-sequence depth), stats,
sampling."""
import math

import pytest
import torch

import mtp_triton as mt
from mtp_triton.drafters import OracleDrafter
from hf_models import make_hf

PROMPTS = [[5, 17, 33, 42, 90, 1], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.fixture(scope="module")
def model():
    return mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"))


@pytest.fixture(scope="module")
def serial(model):
    return mt.generate(model, PROMPTS, 40, mtp=False).tokens


# ---- bad input: a clear error, nothing silently corrupted ----
@pytest.mark.parametrize("prompts,match", [
    ([[]], "empty"),
    ([], "non-empty"),
    ([[1, 2, 203]], "out of range"),
    ([[1, -1]], "out of range"),
    ([[0] * 513], "context length"),
    ([["a"]], "int token ids"),
    (torch.zeros(2, 3), "int64"),
])
def test_bad_prompts(model, prompts, match):
    with pytest.raises(ValueError, match=match):
        mt.generate(model, prompts, 4)


def test_bad_lengths_and_args(model):
    with pytest.raises(ValueError, match="max_new_tokens"):
        mt.generate(model, [[1, 2]], 0)
    with pytest.raises(ValueError, match="exceeds the context"):
        mt.generate(model, [[1] * 500], 20)
    with pytest.raises(ValueError, match="kernels"):
        mt.generate(model, [[1, 2]], 2, kernels="cuda")
    with pytest.raises(ValueError, match="temperature"):
        mt.generate(model, [[1, 2]], 2, temperature=-1.0)
    with pytest.raises(ValueError, match="exceeds the 2 heads"):
        mt.generate(model, [[1, 2]], 2, heads=mt.init_heads(model, 2), tree="chain-4")
    with pytest.raises(ValueError, match="unknown tree preset"):
        mt.generate(model, [[1, 2]], 2, heads=mt.init_heads(model, 2), tree="bushy-9")


def test_wrong_head_size(model):
    heads = mt.MTPHeads(2, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="hidden size"):
        mt.generate(model, [[1, 2]], 2, heads=heads)


def test_prompt_tensor_and_max_new_tokens_1(model, serial):
    res = mt.generate(model, torch.tensor([PROMPTS[0]]), 1, heads=mt.init_heads(model, 4))
    assert res.tokens == [serial[0][:1]]


def test_eos_as_first_token(model, serial):
    eos = serial[1][0]
    res = mt.generate(model, PROMPTS, 40, heads=mt.init_heads(model, 4), eos_token_id=eos)
    assert res.tokens[1] == [eos]
    for toks, ref in zip(res.tokens, serial):
        cut = ref.index(eos) + 1 if eos in ref else len(ref)
        assert toks == ref[:cut]


# ---- runtime features ----
def test_mtp_switch_off_equals_serial(model, serial):
    heads = mt.init_heads(model, 4)
    res = mt.generate(model, PROMPTS, 40, heads=heads, mtp=False)
    assert res.tokens == serial and res.stats.tree_size == 1


def test_fallback_to_serial_when_acceptance_is_low(model, serial):
    drafter = OracleDrafter(serial, [0.0] * 4, 203)
    rt = mt.RuntimeConfig(fallback_threshold=0.2, fallback_window=3, fallback_steps=5)
    res = mt.generate(model, PROMPTS, 40, drafter=drafter, tree="chain-4", runtime=rt)
    assert res.tokens == serial
    assert res.stats.fallback_count >= 3
    off = mt.generate(model, PROMPTS, 40, drafter=drafter, tree="chain-4")
    assert off.stats.fallback_count == 0


def test_per_sequence_depth_masks(model, serial):
    """Sequences at different depths in one batch: the one whose drafts are always wrong falls back to serial steps
    (depth 0) while the others draft the whole tree, so the step's parents switch nodes off per row."""
    truth = [serial[0], [(t + 1) % 203 for t in serial[1]], serial[2]]        # sequence 1: drafts never right
    drafter = OracleDrafter(truth, [1.0] * 4, 203)
    rt = mt.RuntimeConfig(fallback_threshold=0.5, fallback_window=1, fallback_steps=3)
    res = mt.generate(model, PROMPTS, 40, drafter=drafter, tree="medusa-16", runtime=rt)
    assert res.tokens == serial
    assert res.stats.fallback_count >= 2 and res.stats.accept_len_histogram[0] >= 1


def test_drafter_argument_takes_heads_modules_and_drafters(model, serial):
    """drafter= takes MTP heads, an MTP module or a drafters.Drafter; heads= is its older name (one of them)."""
    from mtp_triton.drafters import HeadsDrafter
    from mtp_triton.ops import get_ops
    from test_mtp_module import random_module
    heads = mt.init_heads(model, 4, seed=1)
    kw = dict(tree="medusa-16")
    want = mt.generate(model, PROMPTS, 12, heads=heads, **kw)
    for drafter in (heads, HeadsDrafter(heads, model, get_ops("auto", model.device))):
        got = mt.generate(model, PROMPTS, 12, drafter=drafter, **kw)
        assert got.tokens == want.tokens == [t[:12] for t in serial]
        assert got.stats.accept_len_histogram == want.stats.accept_len_histogram
    mod = random_module(model, depth=2, top_k=3, beam=2, nodes=5)
    assert mt.generate(model, PROMPTS, 12, drafter=mod).tokens == mt.generate(model, PROMPTS, 12, heads=mod).tokens
    assert mt.generate(model, PROMPTS, 12, drafter=heads, mtp=False).stats.tree_size == 1
    with pytest.raises(ValueError, match="not both"):
        mt.generate(model, PROMPTS, 4, drafter=heads, heads=heads)
    with pytest.raises(ValueError, match="drafter must be"):
        mt.generate(model, PROMPTS, 4, drafter="medusa")


def test_stats_fields(model, serial):
    res = mt.generate(model, PROMPTS, 40, drafter=OracleDrafter(serial, [0.7] * 4, 203), tree="medusa-16")
    s = res.stats
    for k in ["steps", "new_tokens", "tokens_per_step", "accept_rate_per_depth", "accept_len_histogram",
              "fallback_count", "time_draft_s", "time_verify_s", "time_accept_s", "time_append_s", "ttft_s",
              "itl_p50_s", "itl_p95_s", "itl_p99_s", "tokens_per_s", "peak_memory_bytes", "energy_j"]:
        assert hasattr(s, k) and k in s.as_dict()           # attributes (the API), and the CSV-row dict
    assert s.new_tokens == 120
    assert sum(s.accept_len_histogram) * s.tokens_per_step == pytest.approx(120 - 3)
    assert s.itl_p50_s <= s.itl_p95_s <= s.itl_p99_s
    assert s.energy_j is None and s.peak_memory_bytes > 0
    assert 1 >= s.accept_rate_per_depth[0] >= s.accept_rate_per_depth[-1] >= 0


# ---- sampling: MTP sampling is distributed exactly as serial sampling ----
@torch.no_grad()
def _exact_pair_probs(model, prompt, temperature):
    """P(t2, t3) — the 2nd and 3rd new tokens — by enumeration over the tiny vocab."""
    from mtp_triton.generate import prefill
    from mtp_triton.sampling import logits_to_probs
    ops = mt.ops.get_ops("torch")

    def dist(seq):
        h = prefill(model, [seq], model.new_cache([len(seq) + 1]), ops)
        return logits_to_probs(model.logits(h), temperature)[0].double()

    V = model.config.vocab_size
    probs = torch.zeros(V, V, dtype=torch.float64)
    p1 = dist(prompt)
    for t1 in range(V):
        p2 = dist(prompt + [t1])
        for t2 in range(V):
            probs[t2] += p1[t1] * p2[t2] * dist(prompt + [t1, t2])
    return probs


@pytest.fixture(scope="module")
def peaked():
    """A 6-token model with a peaked, prefix-dependent target (random init alone is near uniform)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=6, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    small = LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        small.lm_head.weight.mul_(20.0)
    model = mt.LlamaEngine.from_hf(small)
    prompt, temp = [1, 4, 2], 0.9
    return model, prompt, temp, _exact_pair_probs(model, prompt, temp).flatten()


def _chi2_vs_exact(model, prompt, temp, exact, tree, n=3000, runtime=None, heads=None):
    """Chi-square of the (2nd, 3rd) new-token pairs of n MTP samples against the exact law, and its limit."""
    heads = mt.init_heads(model, 3, seed=0) if heads is None else heads
    res = mt.generate(model, [prompt] * n, 3, heads=heads, tree=tree, temperature=temp, seed=123, runtime=runtime)
    assert res.stats.accept_rate_per_depth[0] > 0.1          # acceptance really happened
    if runtime is not None and runtime.prune_below is not None:   # pruning really happened
        assert 1 < res.stats.verified_nodes_per_step < res.stats.tree_size
    counts = torch.zeros(36, dtype=torch.float64)
    for t in res.tokens:
        counts[t[1] * 6 + t[2]] += 1
    expected = exact * n
    keep = expected >= 5
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    # Wilson-Hilferty upper quantile for p = 1e-4 (z = 3.72): a correct sampler fails ~1 in 10^4 seeds
    limit = df * (1 - 2 / (9 * df) + 3.72 * math.sqrt(2 / (9 * df))) ** 3
    return chi2, limit, counts[~keep].sum(), expected[~keep].sum()


@pytest.mark.parametrize("tree", ["medusa-16", "chain-2"])
def test_sampling_is_distribution_preserving(peaked, tree):
    """MTP samples (2nd and 3rd tokens, jointly) fit the exact target law (chi-square, fixed seed)."""
    chi2, limit, rare, rare_expected = _chi2_vs_exact(*peaked, tree)
    assert chi2 < limit, f"{tree}: chi2 {chi2:.1f} > {limit:.1f}"
    assert rare <= max(20, 3 * rare_expected)


def test_sampling_with_confidence_pruning_is_distribution_preserving(peaked):
    """Pruning picks the verified nodes from the drafter's probabilities only, so sampling stays exact."""
    chi2, limit, rare, rare_expected = _chi2_vs_exact(*peaked, "medusa-16", runtime=mt.RuntimeConfig(prune_below=0.05))
    assert chi2 < limit, f"chi2 {chi2:.1f} > {limit:.1f}"
    assert rare <= max(20, 3 * rare_expected)


def test_sampling_with_the_mtp_module_is_distribution_preserving(peaked):
    """The MTP module's dynamic tree (drawn from its own probabilities, per row) keeps sampling exact too."""
    model = peaked[0]
    mod = mt.MTPModule.from_target(model, draft=dict(depth=2, top_k=3, beam=2, nodes=6)).to(model.dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():     # random weights: the identity-like start re-predicts the root, rarely accepted here
        for p in mod.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 2.0 / p.shape[1] ** 0.5)
    chi2, limit, rare, rare_expected = _chi2_vs_exact(*peaked, None, heads=mod,       # its whole tree, every step
                                                      runtime=mt.RuntimeConfig(size_by_cost=False))
    assert chi2 < limit, f"chi2 {chi2:.1f} > {limit:.1f}"
    assert rare <= max(20, 3 * rare_expected)


def test_sampling_check_catches_a_broken_acceptance(peaked, monkeypatch):
    """The same check fails when acceptance is subtly wrong (uniforms halved: drafts over-accepted)."""
    real = mt.reference.tree_accept_sample
    monkeypatch.setattr(mt.reference, "tree_accept_sample",
                        lambda d, p, probs, ua, us, **kw: real(d, p, probs, ua * 0.5, us, **kw))
    chi2, limit, _, _ = _chi2_vs_exact(*peaked, "medusa-16")
    assert chi2 > limit


def test_sampling_seed_reproducible(model):
    """The same seed and the same verified trees give the same samples. On a CPU the default sizes each step's tree
    by measured costs (timing-dependent, so the random numbers can be spent on other trees): pinned off here."""
    kw = dict(temperature=1.0, top_p=0.9, seed=7, runtime=mt.RuntimeConfig(size_by_cost=False))
    a = mt.generate(model, PROMPTS, 12, heads=mt.init_heads(model, 4), **kw)
    b = mt.generate(model, PROMPTS, 12, heads=mt.init_heads(model, 4), **kw)
    assert a.tokens == b.tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("drafter", ["heads", "oracle"])
def test_greedy_batches_of_mixed_lengths_are_serial_for_every_drafter(batch, dtype, drafter):
    """Batch 1-6, prompts of different lengths, fp32 and bf16 (the exact path), one-token cache blocks: the heads' and
    the synthetic oracle's MTP output is the serial output (the MTP module's: test_mtp_module's union test)."""
    m = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"), dtype=dtype)
    prompts = (PROMPTS + [[100, 3, 64], [150, 151, 2, 9, 44, 45, 46], [199]])[:batch]
    serial = mt.generate(m, prompts, 10, mtp=False, block_size=1).tokens
    if drafter == "heads":
        d = mt.init_heads(m, num_heads=3, seed=1)
        res = mt.generate(m, prompts, 10, drafter=d, tree="medusa-16", block_size=1)
    else:
        d = OracleDrafter(serial, [0.9, 0.6, 0.3], m.config.vocab_size, seed=2)
        res = mt.generate(m, prompts, 10, drafter=d, tree="chain-3", block_size=1)
    assert res.tokens == serial
