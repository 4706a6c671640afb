"""Confidence pruning (RuntimeConfig.prune_below, sizing.Pruner): each step verifies only the drafted nodes whose path
probability under the heads reaches a threshold; the output stays the target's own."""
import pytest
import torch

import mtp_triton as mt
from mtp_triton.drafters import HeadsDrafter, OracleDrafter
from mtp_triton.ops import get_ops
from mtp_triton.sizing import Pruner
from mtp_triton.tree import get_tree
from hf_models import hf_greedy, make_hf
from test_heads import token_heads


@pytest.fixture(scope="module")
def case():
    hf = make_hf("gqa-hd16-v203-untied-L2")
    model = mt.LlamaEngine.from_hf(hf)
    prompts = [[5, 17, 33, 42, 90, 1], [7, 8, 9]]
    return model, prompts, hf_greedy(hf, prompts, 24)


def draft(drafter, hidden, roots, tree, min_prob=None):
    """The drafter's tokens [A, T] on `tree`, and with min_prob their path probabilities [A, T]."""
    _, tokens, prob, _ = drafter.draft(None, roots, hidden, tree, min_prob=min_prob)
    return tokens if min_prob is None else (tokens, prob)


def _path_probs(tree, node_prob):
    """[A, T] node probabilities -> path probabilities, by walking up the parents (the naive way)."""
    out = node_prob.clone()
    for i in range(1, tree.size):
        out[:, i] = out[:, int(tree.parents[i])] * node_prob[:, i]
    return out


def test_pruner_keeps_a_subtree_per_row_and_their_union():
    tree = get_tree("medusa-16")
    g = torch.Generator().manual_seed(0)
    A, T = 3, tree.size
    node = torch.rand(A, T, generator=g)
    node[:, 0] = 1.0
    prob = _path_probs(tree, node)
    tokens = torch.randint(0, 100, (A, T), generator=g)
    sub, sub_tokens, sub_parents = Pruner(0.1)(tree, tokens, prob, tree.parents)
    keep = prob >= 0.1
    union = [i for i in range(T) if keep[:, i].any()]
    assert list(sub.paths) == [tree.paths[i] for i in union]
    assert torch.equal(sub_tokens, tokens[:, union])
    assert sub_parents.shape == (A, sub.size)
    for a in range(A):
        for j, i in enumerate(union):
            assert (int(sub_parents[a, j]) >= 0) == (j > 0 and bool(keep[a, i])), (a, i)
            if j > 0 and keep[a, i]:                         # a kept node's parent is kept too, at its new index
                assert sub.paths[int(sub_parents[a, j])] == tree.paths[i][:-1]


def test_pruner_edges():
    tree = get_tree("chain-4")
    tokens = torch.arange(5)[None]
    prob = torch.tensor([[1.0, 0.9, 0.5, 0.3, 0.2]])
    sub, toks, par = Pruner(0.4)(tree, tokens, prob, tree.parents)
    assert sub.paths == ((), (0,), (0, 0)) and toks.tolist() == [[0, 1, 2]] and torch.equal(par, sub.parents)
    sub, toks, _ = Pruner(1.0)(tree, tokens, prob, tree.parents)   # only the root: a serial step
    assert sub.size == 1 and toks.tolist() == [[0]]
    off = torch.tensor([[-1, 0, -1, 2, 3]])                  # node 2 switched off (a depth limit): so is all below it
    sub, _, _ = Pruner(0.1)(tree, tokens, prob, off)
    assert sub.paths == ((), (0,))
    prob_bad = torch.tensor([[1.0, 0.05, 0.5, 0.3, 0.2]])    # a non-monotone input still gives a subtree
    assert Pruner(0.1)(tree, tokens, prob_bad, tree.parents)[0].size == 1
    for bad in (0, 0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="min_prob"):
            Pruner(bad)


@pytest.mark.parametrize("bad", [0, 0.0, 1.01, -1, "0.1", True])
def test_bad_prune_setting(bad):
    with pytest.raises(ValueError, match="prune_below"):
        mt.RuntimeConfig(prune_below=bad)


def test_path_probabilities_are_the_heads_probabilities(case):
    """Drafter.draft(min_prob=...) returns prod over the path of the heads' probabilities of each node's token."""
    model, _, _ = case
    D, V = model.config.hidden_size, model.config.vocab_size
    ops = get_ops("torch", model.device)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, D, generator=g).to(model.dtype)
    roots = torch.tensor([3, 77])
    tree = get_tree("medusa-16")
    # Medusa heads (one hidden state, all heads at once): node i's probability is head depth_i - 1's at rank_i
    heads = mt.init_heads(model, 4, seed=1)
    drafter = HeadsDrafter(heads, model, ops, draft_dtype=model.dtype)
    tokens, prob = draft(drafter, hidden, roots, tree, min_prob=1e-9)
    assert torch.equal(tokens, draft(drafter, hidden, roots, tree))
    lm, tm = heads.draft_weights(model.lm_head.weight)
    _, logp = mt.reference.fused_draft(hidden, drafter.res_weight, drafter.res_bias, lm, tree.top_k, token_map=tm)
    node = torch.ones(2, tree.size, dtype=torch.float64)
    node[:, 1:] = logp[:, tree.depth[1:] - 1, tree.rank[1:]].double().exp()
    torch.testing.assert_close(prob.double(), _path_probs(tree, node), rtol=1e-5, atol=1e-12)
    # heads that read their path: probabilities fall along every path, tokens as without pruning
    seq = HeadsDrafter(token_heads(4, D, 2, seed=3, scale=30.0), model, ops, draft_dtype=model.dtype)
    tokens, prob = draft(seq, hidden, roots, tree, min_prob=1e-12)
    assert torch.equal(tokens, draft(seq, hidden, roots, tree))
    assert (prob[:, 1:] <= prob[:, tree.parents[1:]]).all() and (prob > 0).all() and (prob[:, 0] == 1).all()


def test_sequential_drafting_stops_where_no_path_is_confident(case, monkeypatch):
    model, _, _ = case
    D = model.config.hidden_size
    seq = HeadsDrafter(token_heads(4, D, 2, seed=3, scale=30.0), model, get_ops("torch", model.device), draft_dtype=model.dtype)
    calls = []
    real = seq._draft
    monkeypatch.setattr(seq, "_draft", lambda *a: calls.append(1) or real(*a))
    hidden = torch.randn(1, D, generator=torch.Generator().manual_seed(2)).to(model.dtype)
    tree = get_tree("chain-4")
    _, prob = draft(seq, hidden, torch.tensor([5]), tree, min_prob=1.0)  # nothing below the root can reach 1
    assert len(calls) == 1 and (prob[0, 2:] == 0).all()


@pytest.mark.parametrize("kind", ["medusa", "path"])
@pytest.mark.parametrize("min_prob", [1e-3, 0.02])
def test_pruned_decoding_is_lossless_and_verifies_fewer_nodes(case, kind, min_prob):
    model, prompts, ref = case
    D = model.config.hidden_size
    heads = mt.init_heads(model, 4, seed=2) if kind == "medusa" else token_heads(4, D, 2, seed=3, scale=30.0)
    full = mt.generate(model, prompts, 24, heads=heads, tree="medusa-16",
                       runtime=mt.RuntimeConfig(size_by_cost=False))       # the whole tree every step
    res = mt.generate(model, prompts, 24, heads=heads, tree="medusa-16",
                      runtime=mt.RuntimeConfig(prune_below=min_prob))
    assert res.tokens == ref == full.tokens                  # batch 2: rows keep different nodes
    assert res.stats.tree_size == full.stats.verified_nodes_per_step == 17
    assert 1 <= res.stats.verified_nodes_per_step < 17
    assert res.stats.tokens_per_step <= full.stats.tokens_per_step


def test_pruning_with_the_policy_and_bad_combinations(case):
    model, prompts, ref = case
    heads = mt.init_heads(model, 4, seed=2)
    rt = mt.RuntimeConfig(prune_below=1e-3, fallback_threshold=0.5, fallback_window=2, fallback_steps=2)
    assert mt.generate(model, prompts, 24, heads=heads, tree="medusa-16", runtime=rt).tokens == ref
    oracle = OracleDrafter(ref, [0.9] * 4, model.config.vocab_size)
    with pytest.raises(ValueError, match="reports probabilities"):
        mt.generate(model, prompts, 8, drafter=oracle, runtime=mt.RuntimeConfig(prune_below=0.1))
    with pytest.raises(ValueError, match="cuda_graph"):       # on a CPU: no CUDA graphs at all
        mt.generate(model, prompts, 8, heads=heads, runtime=mt.RuntimeConfig(prune_below=0.1), cuda_graph=True)
    # serial decoding ignores the setting
    assert mt.generate(model, prompts, 24, mtp=False, runtime=mt.RuntimeConfig(prune_below=0.5)).tokens == ref


def test_prune_command_on_the_tiny_model(tmp_path, capsys):
    """`python -m mtp_lab prune` end to end (the tiny model, short): rows for every prompt and configuration, all
    identical to serial; a bad threshold is refused before any compute."""
    import csv
    from mtp_lab.bundle import EMBEDDED
    from mtp_lab.bench.pruning import main
    out = tmp_path / "prune"
    args = ["--model", EMBEDDED, "--per-category", "1", "--max-new-tokens", "6", "--out", str(out)]
    assert main(args + ["--thresholds", "0.05,0.5"]) == 0
    rows = list(csv.DictReader(open(out / "prune.csv")))
    assert {r["config"] for r in rows} == {"serial", "mtp", "mtp p>=0.05", "mtp p>=0.5"}
    assert all(r["identical_to_serial"] == "True" for r in rows) and (out / "prune.png").exists()
    assert "| mtp p>=0.5 |" in capsys.readouterr().out
    assert main(args + ["--thresholds", "1.5"]) == 2
    assert "prune_below" in capsys.readouterr().err


def test_prune_keeps_finished_prompts_on_ctrl_c_and_resumes(tmp_path, monkeypatch, capsys):
    """Rows are appended as each prompt finishes: Ctrl-C in the 2nd prompt keeps the 1st prompt's rows, exits 130
    with one line saying how to go on; --resume then runs only the 2nd and 3rd prompts."""
    import csv
    import json
    from mtp_lab.bench import ab, pruning
    from mtp_lab.bundle import EMBEDDED
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(dict(text=f"def f{k}(x):", category=f"c{k}")) + "\n" for k in range(3)))
    out = tmp_path / "prune"
    args = ["--model", EMBEDDED, "--prompts", str(prompts), "--per-category", "1", "--max-new-tokens", "4",
            "--thresholds", "0.5", "--out", str(out)]
    real, calls = ab.generate, []

    def interrupt_at(n):
        def gen(*a, **kw):
            calls.append(1)
            if len(calls) == n:
                raise KeyboardInterrupt
            return real(*a, **kw)
        return gen
    monkeypatch.setattr(ab, "generate", interrupt_at(3 + 3 + 1))     # warm-up 3, prompt 1, then in prompt 2
    capsys.readouterr()
    try:
        assert pruning.main(args) == 130
    except KeyboardInterrupt:
        pytest.fail("prune let the KeyboardInterrupt through instead of keeping the rows and exiting 130")
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "--resume" in err and "prune.csv" in err
    first = list(csv.DictReader(open(out / "prune.csv")))
    assert [r["config"] for r in first] == ["serial", "mtp", "mtp p>=0.5"] and first[0]["category"] == "c0"

    calls.clear()
    monkeypatch.setattr(ab, "generate", interrupt_at(0))             # count only
    assert pruning.main(args + ["--resume"]) == 0
    assert len(calls) == 3 + 2 * 3                                        # warm-up, then the 2 prompts not done
    rows = list(csv.DictReader(open(out / "prune.csv")))
    keys = [(r["prompt_hash"], r["config"]) for r in rows]
    assert len(rows) == 9 and len(set(keys)) == 9 and all(r["identical_to_serial"] == "True" for r in rows)
    assert "(3 rows kept from earlier runs)" in capsys.readouterr().out
