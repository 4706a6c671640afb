"""The MTP module (mtp_module.py) and its drafter (drafters_mtp.py): training forward = decoding step, lossless
decoding with the dynamic tree, files, bad input."""
import json
import os

import pytest
import torch

import mtp_triton as mt
from mtp_triton.drafters_mtp import ModuleDrafter
from mtp_triton.generate import causal_chains
from mtp_triton.mtp_module import MTPModule, load_module
from mtp_triton.packed import packing_applies
from hf_models import make_hf

PROMPTS = [[5, 17, 33, 42, 90, 1], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.fixture(scope="module")
def model():
    return mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"))


def random_module(model, seed=0, token_map=None, scale=0.3, **draft):
    """A module with random (not identity-like) weights, so its drafts disagree with the model now and then (more
    often, and with trees of other shapes from row to row, the larger `scale`)."""
    return perturbed(MTPModule.from_target(model, token_map, draft or None).to(model.dtype), seed, scale)


def perturbed(m, seed, scale):
    """m with seeded noise of `scale` / sqrt(fan-in) added to every matrix, in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale / p.shape[1] ** 0.5)
    return m.eval()


@torch.no_grad()
def _hidden(model, seq):
    tokens, positions, mask, _ = causal_chains([seq], model.device)
    h, _, _ = model.forward_tree(tokens, positions, mask, model.new_cache([len(seq)]), torch.arange(1),
                                 mt.ops.get_ops("torch"), exact=False)
    return h                                                                         # [1, S, D]


@torch.no_grad()
def test_unroll_is_the_decoding_step(model):
    """Training's unrolled forward and the engine's paged-cache step compute the same module: step 0 over a sequence
    is one causal chain through the cache, and step 1 at index m is a depth-1 tree node at m reading f^(0)_{m-1}
    and attending to the cache entries < m and itself."""
    mod = random_module(model)
    seq = [3, 9, 27, 81, 40, 120, 7, 77, 5]
    S = len(seq) - 1
    h = _hidden(model, seq)[:, :S]                                                   # h_0 .. h_{S-1}
    nxt = torch.tensor([seq[1:]])                                                    # x_1 .. x_S
    embed = model.embed_tokens.weight
    f0, f1 = mod.unroll(embed, h, nxt, 2)
    ops, eng = mt.ops.get_ops("torch"), mod.engine(model)
    u = mod.inputs(embed, h, nxt)
    tokens, positions, mask, _ = causal_chains([list(range(S))], model.device)
    g, _, _ = eng.forward_tree(None, positions, mask, eng.new_cache([S]), torch.arange(1), ops, exact=False, embeds=u)
    torch.testing.assert_close(g, f0, rtol=1e-9, atol=1e-9)
    for m in (1, 4, S - 1):                                                          # a depth-1 node at index m
        cache = eng.new_cache([S + 1])
        _, k, v = eng.forward_tree(None, positions[:, :m], mask[:, :m, :m], cache, torch.arange(1), ops, exact=False,
                                   embeds=u[:, :m])
        nodes = torch.arange(m)[None]
        ops.kv_append(cache.k, cache.v, cache.block_table, cache.cache_lens, k, v, nodes, torch.tensor([m - 1]))
        cache.cache_lens += m
        node = mod.inputs(embed, f0[:, m - 1:m], nxt[:, m:m + 1])
        out, _, _ = eng.forward_tree(None, torch.tensor([[m]]), torch.ones(1, 1, dtype=torch.bool), cache,
                                     torch.arange(1), ops, exact=False, embeds=node)
        torch.testing.assert_close(out[:, 0], f1[:, m], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("runtime", [None, mt.RuntimeConfig(fallback_threshold=1.0, fallback_window=1,
                                                           fallback_steps=2)])
def test_greedy_is_serial(model, runtime):
    """Greedy MTP with the module and its dynamic tree emits the serial tokens (batch of 3, lengths differ); with a
    fallback after every step that missed a draft, serial steps (depth 0) come between, whose pairs the module
    commits with the next step that drafts."""
    serial = mt.generate(model, PROMPTS, 30, mtp=False).tokens
    mod = random_module(model, depth=3, top_k=4, beam=2, nodes=9)
    res = mt.generate(model, PROMPTS, 30, heads=mod, runtime=runtime)
    assert res.tokens == serial
    assert res.stats.verified_nodes_per_step <= 9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 2, 4, 6])
def test_batches_verify_the_union_of_the_rows_trees(model, dtype, batch):
    """At batch B the step verifies the union of the rows' dynamic trees, up to B (nodes - 1) + 1 nodes: the cache
    has room for it (one-token blocks, so no rounding hides a short cache), and the output is the serial one for
    prompts of mixed lengths. (Before the cache was sized for `nodes`, this raised 'block_table has room for ...'.)"""
    m = model if dtype == torch.float32 else mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"), dtype=dtype)
    prompts = (PROMPTS + [[100, 3, 64], [150, 151, 2, 9, 44, 45, 46], [199]])[:batch]
    serial = mt.generate(m, prompts, 12, mtp=False, block_size=1).tokens
    mod = random_module(m, scale=3.0, depth=3, top_k=4, beam=2, nodes=9)
    res = mt.generate(m, prompts, 12, drafter=ModuleDrafter(mod, m, mt.ops.get_ops("torch", m.device)),
                      runtime=dict(size_by_cost=False), block_size=1)
    assert res.tokens == serial


def test_the_module_accepts_where_it_predicts_well(model):
    """A module that reproduces the model's own next hidden state (an oracle stand-in) gets drafts accepted: the
    dynamic tree, the cache and observe() line up (a module whose pairs were off by one would accept ~nothing)."""
    serial = mt.generate(model, [PROMPTS[0]], 24, mtp=False).tokens
    mod = random_module(model, depth=3, top_k=6, beam=3, nodes=16)
    res = mt.generate(model, [PROMPTS[0]], 24, heads=mod)
    assert res.tokens == serial
    # untrained: some acceptance by chance over a 203-token vocabulary with 6 candidates is expected but small;
    # the real check of alignment is the trained module's acceptance (the demo); here: the statistics add up
    s = res.stats
    assert s.new_tokens == 24 and s.steps >= 1 and 1 >= s.accept_rate_per_depth[0] >= 0


def test_dynamic_tree_is_a_subtree_within_budget(model):
    """Each row's kept nodes: at most `nodes`, their ancestors kept too, path probabilities falling with depth."""
    mod = random_module(model, depth=4, top_k=5, beam=3, nodes=12)
    ops = mt.ops.get_ops("torch")
    d = ModuleDrafter(mod, model, ops)
    from mtp_triton.generate import prefill
    cache = model.new_cache([len(p) + 8 for p in PROMPTS])
    last, every = prefill(model, PROMPTS, cache, ops, all_hidden=True)
    roots = model.logits(last).argmax(-1)
    d.start(PROMPTS, every, roots, [len(p) + 40 for p in PROMPTS], 16)
    tree, tokens, prob, parents = d.draft_dynamic(torch.arange(3), roots, [4, 2, 0])
    assert parents.shape == tokens.shape == prob.shape == (3, tree.size)
    on = parents >= 0
    on[:, 0] = True
    for a, limit in enumerate([4, 2, 0]):
        assert int(on[a].sum()) <= 12
        assert int(tree.depth[on[a]].max()) <= limit
        for i in on[a].nonzero()[:, 0].tolist()[1:]:
            p = int(tree.parents[i])
            assert on[a, p] and prob[a, i] <= prob[a, p]
    assert bool((tokens[:, 0] == roots).all())


@torch.no_grad()
@pytest.mark.parametrize("mapped", [False, True], ids=["full-vocab", "draft-vocab"])
def test_cpu_scores_through_the_packed_rows_match_the_drafting_twin(mapped):
    """With the twins on a CPU an fp32 module scores L x on L prepacked (packed.py); the token ids and log
    probabilities are those of the drafting kernel family's twin (`fused_draft` with the ResBlock off) on the same
    rows, up to the matmul's last bits (no ties in random scores), with and without a draft vocabulary."""
    ops = mt.ops.get_ops("torch")
    m32 = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"), dtype=torch.float32)
    if not packing_applies(torch.float32) or ops.numerics(m32.device, m32.dtype).draft_bf16:
        pytest.skip("this CPU does not pack fp32 weights, or drafts an fp32 model in bf16")
    token_map = torch.arange(0, m32.config.vocab_size, 3) if mapped else None
    d = ModuleDrafter(random_module(m32, token_map=token_map), m32, ops)
    assert callable(d.lm)                                                   # the packed rows
    x = torch.randn(5, m32.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ids, logp = d._score(x, 4)
    want_ids, want_logp = ops.fused_draft(x, None, None, d.lm.w, 4, token_map=token_map, check_values=False)
    assert torch.equal(ids, want_ids[:, 0])
    torch.testing.assert_close(logp, want_logp[:, 0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_serial_steps_commit_later_as_one_chain(model):
    """Steps at depth 0 (fallback) draft nothing and commit nothing; the next drafting step commits their
    pairs joined per sequence into one chain, which leaves the module's cache and output as committing step by step
    does (rows may drop out in between: here sequence 1 skips the second step)."""
    mod = random_module(model, depth=3, top_k=4, beam=2, nodes=9)
    ops = mt.ops.get_ops("torch")
    from mtp_triton.generate import prefill
    cache = model.new_cache([len(p) + 8 for p in PROMPTS])
    last, every = prefill(model, PROMPTS, cache, ops, all_hidden=True)
    roots = model.logits(last).argmax(-1)
    now, later = ModuleDrafter(mod, model, ops), ModuleDrafter(mod, model, ops)
    for d in (now, later):
        d.start(PROMPTS, every, roots, [len(p) + 40 for p in PROMPTS], 16)
    g = torch.Generator().manual_seed(1)
    D = model.config.hidden_size
    for rows in ([0, 1, 2], [0, 2], [0, 1, 2]):
        A, rows = len(rows), torch.tensor(rows)
        h = torch.randn(A, 1, D, generator=g)
        tokens, bonus = torch.randint(0, 203, (A, 1), generator=g), torch.randint(0, 203, (A,), generator=g)
        for d in (now, later):
            d.observe(rows, h, tokens, torch.zeros(A, 1, dtype=torch.int64), torch.zeros(A, dtype=torch.int64), bonus)
        now.draft_dynamic(rows, tokens[:, 0], [1] * A)                            # commits this step's pairs
        tree, *_ = later.draft_dynamic(rows, tokens[:, 0], [0] * A)               # a serial step: commits nothing
        assert tree.size == 1
    assert len(later.pending) == 3
    later.draft_dynamic(torch.arange(3), roots, [1] * 3)
    assert later.pending == [] and later.cache.cache_lens.tolist() == now.cache.cache_lens.tolist()
    torch.testing.assert_close(later.f, now.f, rtol=1e-5, atol=1e-5)


def test_sampling_ready_and_batch_rows_independent(model):
    """A prompt's greedy output does not depend on its batch-mates (the module's cache rows stay apart)."""
    mod = random_module(model, depth=3, top_k=4, beam=2, nodes=8)
    alone = [mt.generate(model, [p], 20, heads=mod).tokens[0] for p in PROMPTS]
    assert mt.generate(model, PROMPTS, 20, heads=mod).tokens == alone


def test_save_load_round_trip(model, tmp_path):
    mod = random_module(model, token_map=torch.tensor([1, 5, 9, 100, 202]), depth=2, top_k=3, beam=2, nodes=6)
    mod.save(str(tmp_path / "m"), recipe="test")
    back = load_module(str(tmp_path / "m"), dtype=model.dtype)
    assert back.draft == mod.draft and back.meta["recipe"] == "test"
    assert back.token_map.tolist() == [1, 5, 9, 100, 202]
    for (k, a), (_, b) in zip(mod.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    assert mt.generate(model, PROMPTS, 12, heads=back).tokens == mt.generate(model, PROMPTS, 12, mtp=False).tokens


def test_bad_module_files_and_arguments(model, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_module(str(tmp_path))
    mod = random_module(model)
    mod.save(str(tmp_path / "m"))
    meta = json.load(open(tmp_path / "m" / "module.json"))
    meta["config"]["hidden_size"] = 48
    json.dump(meta, open(tmp_path / "m" / "module.json", "w"))
    with pytest.raises(ValueError, match="does not match"):
        load_module(str(tmp_path / "m"))
    (tmp_path / "m" / "module.json").write_text("{torn")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_module(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="beam must be an int"):
        ModuleDrafter(mod, model, mt.ops.get_ops("torch"), beam=0)
    with pytest.raises(ValueError, match="dynamic tree"):
        mt.generate(model, PROMPTS, 4, heads=mod, tree="chain-2")
    other = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2", hidden_size=48))
    with pytest.raises(ValueError, match="hidden size"):
        mt.generate(other, PROMPTS, 4, heads=mod)


def test_load_drafter_recognises_both_formats(model, tmp_path):
    mod = random_module(model)
    mod.save(str(tmp_path / "m"))
    mt.init_heads(model, 2).save(str(tmp_path / "h"))
    assert isinstance(mt.load_drafter(str(tmp_path / "m")), MTPModule)
    assert isinstance(mt.load_drafter(str(tmp_path / "h")), mt.MTPHeads)
    assert not os.path.exists(tmp_path / "h" / "module.json")


def test_the_training_recipe_runs_end_to_end(tmp_path):
    """`train_heads mtp` on the tiny model: answers file -> hidden-state cache -> a few unrolled steps -> a module
    folder that loads and decodes losslessly, with its records (curve, accuracy by depth, command)."""
    from cli_helpers import ROOT, run_cli
    model_dir = os.path.join(ROOT, "data", "tiny-stdlib-llama")
    tiny = mt.load_model(model_dir)
    prompts = [[5, 17, 33, 42, 90, 1], [7, 8, 9, 10], [11, 12, 13, 14, 15], [3, 4], [21, 22, 23]]
    answers = mt.generate(tiny, prompts, 12, mtp=False).tokens
    with open(tmp_path / "answers.jsonl", "w") as f:
        for i, (p, a) in enumerate(zip(prompts, answers)):
            f.write(json.dumps(dict(id=f"p{i}", mode="greedy", prompt_ids=p, answer_ids=a)) + "\n")
    out = tmp_path / "module"
    r = run_cli("train_heads", "mtp", "--model", model_dir, "--answers", tmp_path / "answers.jsonl", "--vocab-from",
                "", "--work", tmp_path / "work", "--out", out, "--steps", "3", "--batch", "2", "--val-share", "0.2",
                "--unroll", "2", "--threads", "1", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.load(open(out / "records" / "train_mtp.json"))
    assert info["steps"] == 3 and info["rows"] == 5 and len(info["val_accuracy_by_depth"]) == 4
    assert info["command"].startswith("python -m mtp_lab train_heads mtp")
    assert (out / "records" / "train_mtp_curve.csv").exists()
    mod = mt.load_drafter(str(out))
    assert isinstance(mod, MTPModule) and mod.meta["recipe"] == "mtp"
    assert mt.generate(tiny, prompts, 10, heads=mod).tokens == mt.generate(tiny, prompts, 10, mtp=False).tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_module_on_the_gpu_kernels_is_lossless():
    """The module's path with the Triton kernels (tree_attention and kv_append on its cache, fused_draft with the
    ResBlock off): greedy output equals serial decoding (fp32: bf16 on a GPU has no batch-invariant mode)."""
    for dtype in (torch.float32,):
        gpu = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"), device="cuda", dtype=dtype)
        mod = random_module(mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2")), depth=3, top_k=4, beam=2,
                            nodes=8).to("cuda", dtype)
        serial = mt.generate(gpu, PROMPTS, 24, mtp=False, kernels="triton").tokens
        assert mt.generate(gpu, PROMPTS, 24, heads=mod, kernels="triton").tokens == serial
