"""The distillation recipe's pieces on the tiny model: draft vocabulary, the cache, tau simulation against real
decoding, and a whole (tiny) `train_heads distill` run whose heads decode losslessly."""
import json
import os

import pytest
import torch

import mtp_triton as mt
from mtp_lab.training import distill, replay
from mtp_lab.training.answers import write_answers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "data", "tiny-stdlib-llama")
TEXTS = ["def add(a, b):\n    return", "import os\n\ndef list_files(path):\n", "class Stack:\n    def __init__(self):\n",
         "for i in range(10):\n    print(", "def fib(n):\n    if n < 2:\n"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = mt.load_model(TINY, device="cpu")
    tok = mt.load_tokenizer(TINY)
    heads = mt.load_heads(os.path.join(TINY, "heads"))
    rows = [dict(id=f"p{i}", category="code", text=t) for i, t in enumerate(TEXTS)]
    path = str(tmp_path_factory.mktemp("answers") / "answers.jsonl")
    write_answers(model, tok, rows, path, max_new_tokens=40, sample_share=0.0, batch=8, progress=False)
    return model, tok, heads, distill.read_answers(path)


def reading_heads(plain, root=True, token_inputs=0, seed=0, dtype=torch.float32):
    """`plain`'s residual blocks, plus random root (and path) projections strong enough to change the drafts."""
    D, g = plain.hidden_size, torch.Generator().manual_seed(seed)
    heads = mt.MTPHeads(plain.num_heads, D, root_input=root, token_inputs=token_inputs, dtype=dtype)
    with torch.no_grad():
        heads.res_weight.copy_(plain.res_weight)
        heads.res_bias.copy_(plain.res_bias)
        heads.root_proj.copy_(0.3 * torch.randn(D, D, generator=g) / D ** 0.5)
        if token_inputs:
            heads.token_proj.copy_(0.3 * torch.randn(token_inputs, D, D, generator=g) / D ** 0.5)
    return heads


def decoded_tau(model, heads, rows, tree):
    """Tokens per step of real greedy MTP runs over the answer rows (each must reproduce its answer exactly)."""
    emitted = steps = 0
    for r in rows:
        res = mt.generate(model, [r["prompt_ids"]], len(r["answer_ids"]), heads=heads, tree=tree,
                          runtime=mt.RuntimeConfig(size_by_cost=False))    # the whole tree, as simulated
        assert res.tokens[0] == r["answer_ids"]
        emitted += res.stats.new_tokens - 1
        steps += sum(res.stats.accept_len_histogram)
    return emitted / steps


def test_draft_vocab_is_the_most_frequent_tokens_increasing():
    rows = [dict(answer_ids=[5, 5, 5, 7, 7, 9, 11]), dict(answer_ids=[7, 3])]
    assert distill.draft_vocab(rows, 2).tolist() == [5, 7]
    assert distill.draft_vocab(rows, 3, always=[0]).tolist() == [0, 5, 7]
    assert distill.coverage(rows, torch.tensor([5, 7])) == pytest.approx(6 / 9)


def test_cache_targets_line_up(tiny):
    model, _, heads, rows = tiny
    tmap = torch.arange(model.config.vocab_size)
    cache = replay.build_cache(model, rows, tmap, top_k=4, num_heads=3)
    n = sum(len(r["answer_ids"]) for r in rows)
    assert cache["x"].shape == (n, model.config.hidden_size)
    assert cache["root"].tolist() == [t for r in rows for t in r["answer_ids"]]      # the token after each x
    # greedy answers: the base's greedy token at every answer position is the answer's own next token
    want = torch.tensor([t for r in rows for t in r["answer_ids"]])
    assert (cache["greedy"] == want).float().mean() > 0.99
    # head h has a target at position j iff j + h + 1 is still in the same answer
    first = len(rows[0]["answer_ids"])
    assert cache["ok"][first - 1].tolist() == [False, False, False]
    assert cache["ok"][first - 2].tolist() == [True, False, False]
    assert torch.allclose(cache["tgt_p"].float().sum(-1), torch.ones(n), atol=1e-2)


@pytest.mark.parametrize("inputs", ["medusa", "root", "root+tokens"])
def test_simulated_tau_matches_real_decoding(tiny, inputs):
    # the simulation and the decoder must agree on what the heads read, the root token and the path included
    model, _, heads, rows = tiny
    if inputs != "medusa":
        heads = reading_heads(heads, token_inputs=2 if inputs == "root+tokens" else 0)
    heads.token_map = None
    tmap = torch.arange(model.config.vocab_size)
    cache = replay.build_cache(model, rows, tmap, top_k=1, num_heads=heads.num_heads)
    heads.token_map = tmap
    ranks = replay.head_ranks(heads, model, cache)
    heads.token_map = None
    for name in ("chain-2", "medusa-16"):
        tree = mt.get_tree(name, heads.num_heads)
        sim = replay.simulate_tau(ranks, replay.lengths_of(rows), tree)
        assert sim == pytest.approx(decoded_tau(model, heads, rows, tree), rel=0.03), name


def test_tiny_distill_run_end_to_end(tmp_path):
    from mtp_lab.train_heads import main
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(dict(id=f"p{i}", category="code", text=t)) + "\n"
                               for i, t in enumerate(TEXTS)))
    out = tmp_path / "heads"
    info = main(["distill", "--model", TINY, "--prompts", str(prompts), "--heldout", str(prompts),
                 "--heldout-chat", str(prompts), "--work", str(tmp_path / "work"), "--out", str(out),
                 "--answers-by", "engine", "--num-heads", "3", "--vocab", "512", "--max-new-tokens", "24",
                 "--eval-new-tokens", "24", "--minutes", "0.05", "--batch", "64", "--threads", "1",
                 "--budgets", "1,2,4", "--token-inputs", "2"])
    heads = mt.load_heads(str(out))
    assert heads.num_heads == 3 and heads.token_map.numel() <= 512 and heads.tree is not None
    assert heads.token_inputs == 2 and heads.token_proj.abs().sum() > 0             # Q was trained
    assert info["steps"] > 0 and set(info["heldout"]) == {"templated", "chat"}
    assert info["cache"] == dict(fresh=True, rows_added=info["answers"])     # the card's vocabulary sentence reads it
    model = mt.load_model(TINY, device="cpu")
    tok = mt.load_tokenizer(TINY)
    ids = [tok(t)["input_ids"] for t in TEXTS[:2]]
    assert mt.generate(model, ids, 16, heads=heads).tokens == mt.generate(model, ids, 16, mtp=False).tokens


def test_root_projection_gradient_in_one_pass_equals_the_summed_loss():
    # train() computes x' = x + P e_root once per step, back-propagates head by head to x', then once through P:
    # the gradients must be those of the plain sum of the heads' losses
    torch.manual_seed(0)
    N, D, V, H, K = 200, 16, 50, 3, 4
    cache = dict(x=torch.randn(N, D), root=torch.randint(0, V, (N,)), ok=torch.rand(N, H) > 0.2,
                 tgt_idx=torch.randint(0, V, (N, K)).int(), tgt_p=torch.softmax(torch.randn(N, K), -1))
    cache["ok"][-H:] = False
    embed, sub = torch.randn(V, D), torch.randn(V, D).bfloat16()
    heads = mt.MTPHeads(H, D, root_input=True)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    i = torch.arange(N - H)

    def inputs():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return replay.head_inputs(heads, embed, cache, i, torch.float32)

    xp = inputs()
    x = xp.detach().requires_grad_(True)
    for h in range(H):
        (distill.head_loss(heads, sub, cache, i, x, h) / H).backward()
    xp.backward(x.grad)
    split = [p.grad.clone() for p in heads.parameters()]
    heads.zero_grad()
    xp = inputs()
    sum(distill.head_loss(heads, sub, cache, i, xp, h) / H for h in range(H)).backward()
    for got, p in zip(split, heads.parameters()):
        assert torch.allclose(got, p.grad, atol=1e-6), "P's gradient"


def test_token_inputs_are_teacher_forced_and_get_gradients():
    # head h at position i reads the answer's tokens i + 1 .. i + h (cache["root"]) as its path, nearest first
    torch.manual_seed(0)
    N, D, V, H, K = 60, 8, 30, 4, 3
    cache = dict(x=torch.randn(N, D), root=torch.randint(0, V, (N,)), ok=torch.ones(N, H, dtype=torch.bool),
                 tgt_idx=torch.randint(0, V, (N, K)).int(), tgt_p=torch.softmax(torch.randn(N, K), -1))
    embed, sub = torch.randn(V, D), torch.randn(V, D).bfloat16()
    heads = mt.MTPHeads(H, D, root_input=True, token_inputs=2)
    with torch.no_grad():
        heads.token_proj.normal_(0, 0.3)
    i = torch.arange(N - H)
    x = replay.head_inputs(heads, embed, cache, i, torch.float32)
    for h in range(H):
        want = x.clone()
        for q in range(min(h, 2)):
            want = want + embed[cache["root"][i + h - q]] @ heads.token_proj[q].T
        assert torch.allclose(replay.path_inputs(heads, embed, cache, i, x, h), want, atol=1e-5)
    heads.zero_grad()
    loss = sum(distill.head_loss(heads, sub, cache, i, replay.path_inputs(heads, embed, cache, i, x, h), h)
               for h in range(H))
    loss.backward()
    assert heads.token_proj.grad[0].abs().sum() > 0 and heads.token_proj.grad[1].abs().sum() > 0


def test_extended_cache_equals_one_built_at_once(tiny):
    model, _, _, rows = tiny
    tmap = torch.arange(model.config.vocab_size)
    whole = replay.build_cache(model, rows, tmap, top_k=4, num_heads=3)
    old = replay.build_cache(model, rows[:3], tmap, top_k=4, num_heads=3)
    del old["keys"], old["root"]                        # a cache from before keys and roots were stored
    ext, added = replay.extend_cache(model, old, rows, num_heads=3)
    assert added == 2 and ext["keys"] == whole["keys"] == [f"{r['id']}/greedy" for r in rows]
    for f in ("x", "tgt_p"):
        assert torch.allclose(ext[f].float(), whole[f].float(), atol=1e-3), f
    for f in ("tgt_idx", "greedy", "ok", "root"):
        assert torch.equal(ext[f], whole[f]), f
    assert replay.extend_cache(model, ext, rows, num_heads=3)[1] == 0                # nothing left to add
    with pytest.raises(ValueError, match="not in the answer rows"):
        replay.extend_cache(model, whole, rows[1:], num_heads=3)
    with pytest.raises(ValueError, match="built for 3 heads"):
        replay.extend_cache(model, whole, rows, num_heads=4)
    bad = dict(whole)
    bad.pop("keys")
    bad["x"] = bad["x"][:-1]                            # no prefix of the answers has this many tokens
    with pytest.raises(ValueError, match="no prefix"):
        replay.extend_cache(model, bad, rows, num_heads=3)


def test_simulated_tau_is_exact_for_a_bf16_engine_on_the_cpu(tmp_path):
    # a bf16 engine on a CPU drafts with drafters.bf16_draft, the math head_ranks measures with: the simulated tau
    # of a tree is the tokens per step a real greedy run takes (up to the last bits of the hidden states: the cache
    # comes from one teacher-forced forward, decoding from tree steps)
    from mtp_triton.drafters import HeadsDrafter, bf16_draft
    from mtp_triton.ops import get_ops
    model = mt.load_model(TINY, device="cpu", dtype=torch.bfloat16)
    tok = mt.load_tokenizer(TINY)
    assert HeadsDrafter(mt.load_heads(os.path.join(TINY, "heads")), model, get_ops("torch", "cpu")).fused_draft \
        is bf16_draft
    rows = [dict(id=f"p{i}", category="code", text=t) for i, t in enumerate(TEXTS)]
    path = str(tmp_path / "answers.jsonl")
    write_answers(model, tok, rows, path, max_new_tokens=40, sample_share=0.0, batch=8, progress=False)
    rows = distill.read_answers(path)
    heads = reading_heads(mt.load_heads(os.path.join(TINY, "heads")), token_inputs=2, seed=1, dtype=torch.bfloat16)
    heads.token_map = torch.arange(model.config.vocab_size)
    cache = replay.build_cache(model, rows, heads.token_map, top_k=1, num_heads=heads.num_heads)
    ranks = replay.head_ranks(heads, model, cache)
    for name in ("chain-3", "medusa-16"):
        tree = mt.get_tree(name, heads.num_heads)
        assert replay.simulate_tau(ranks, replay.lengths_of(rows), tree) == pytest.approx(
            decoded_tau(model, heads, rows, tree), rel=0.03), name


def test_retree_chooses_and_stores_a_tree_without_touching_the_weights(tmp_path, tiny):
    """`train_heads retree`: answers of the tuning sets choose the tree (tree_from_ranks + the speed rule), tau is
    reported on every set, heads.json gets the tree and table, heads.safetensors stays byte-identical."""
    from mtp_lab.train_heads import main
    model, _, _, rows = tiny
    heads = reading_heads(mt.load_heads(os.path.join(TINY, "heads")), token_inputs=1)
    heads.token_map = distill.draft_vocab(rows, 256)
    heads.tree = [(0,)]
    folder = tmp_path / "heads"
    heads.save(str(folder), recipe="distill")
    weights = (folder / "heads.safetensors").read_bytes()
    files = {}
    for name, texts in (("tune", TEXTS[:3]), ("report", TEXTS[3:])):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(dict(id=f"{name}{i}", category=["a", "b"][i % 2], text=t)) + "\n"
                                       for i, t in enumerate(texts)))
    argv = ["retree", "--model", TINY, "--heads", str(folder), "--tune", str(files["tune"]), "--report",
            str(files["report"]), "--work", str(tmp_path / "work"), "--max-new-tokens", "24", "--budgets", "1,2,4",
            "--reps", "1", "--threads", "1"]
    with pytest.raises(ValueError, match="must not be used to choose"):
        main(argv + ["--never-tune", str(files["tune"])])
    info = main(argv + ["--min-speedup", "0.01", "--never-tune", os.path.join(ROOT, "data", "chat",
                                                                              "heldout_chat.jsonl")])
    # (every candidate qualifies: the most accepting one wins)
    meta = json.loads((folder / "heads.json").read_text())
    assert (folder / "heads.safetensors").read_bytes() == weights
    assert meta["tuning_by"] == "retree" and [r["budget"] for r in meta["tuning"]] == [1, 2, 4]
    best = max(meta["tuning"], key=lambda r: (r["tau_simulated"], r["predicted_speedup"]))
    assert meta["tree"] == best["choices"] and info["tree_nodes"] == best["nodes"]
    assert info["previous_tree_nodes"] == 2 and set(info["tau"]) == {"tune", "report"}
    assert set(info["tau"]["report"]) == {"a", "b", "all"}
    # the chosen tree's tau on the tuning set is the table's simulated tau (the same ranks, the same answers)
    assert info["tau"]["tune"]["all"]["chosen"] == pytest.approx(best["tau_simulated"])
    stored = mt.load_heads(str(folder))
    assert [list(c) for c in stored.tree] == best["choices"]
    ids = [r["prompt_ids"] for r in rows[:2]]
    assert mt.generate(model, ids, 16, heads=stored).tokens == mt.generate(model, ids, 16, mtp=False).tokens
    assert os.path.exists(folder / "records" / "retree.json")


def test_retree_guard_compares_prompt_texts_not_file_names():
    """A tuning set is refused when it shares a prompt with a protected set, however the prompt is cased or spaced
    and whatever the files are called; sets with no prompt in common pass, and the message names both files."""
    from mtp_lab.training.retree import normalise, refuse_protected_prompts
    held = {"held.jsonl": [dict(id="h1", text="How do I sort a list?"), dict(id="h2", text="Write a poem.")]}
    assert normalise("  HOW do i\n sort a  LIST?") == normalise("How do I sort a list?")
    assert normalise("Straße") == normalise("STRASSE")                         # case-folded, not only lower-cased
    refuse_protected_prompts({"mine.jsonl": [dict(id="m1", text="How do I sort a dict?")]}, held)
    with pytest.raises(ValueError, match=r"mine\.jsonl shares 1 prompt.*held\.jsonl.*'m2' = 'h2'"):
        refuse_protected_prompts({"mine.jsonl": [dict(id="m1", text="x"), dict(id="m2", text="write A POEM.")]}, held)
