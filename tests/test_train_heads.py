"""Both training recipes end to end at tiny size, plus the pieces they rest on.

A tiny tokenizer (vocab 300) and a tiny Llama (1 layer, D = 32) are built offline from a few stdlib files;
`joint` trains base + 2 heads, then `frozen` distils 3 heads on that base (from the joint heads, with
self-generated sequences), soft and hard targets. Each run is a few dozen steps, well under a minute in all.
"""
import csv
import json
import os
import sysconfig

import pytest
import torch

from mtp_lab import corpus
from mtp_triton.heads import load_heads
from mtp_lab.train_heads import build_llama, greedy_continue, main, simulate_tau
from mtp_lab.training import frozen as frozen_recipe
from mtp_lab.training.loop import Loop
from mtp_triton.tree import Tree

FILES = ["textwrap.py", "json/decoder.py", "json/encoder.py", "shlex.py", "fnmatch.py", "colorsys.py"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    stdlib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(stdlib, f) for f in FILES]
    tok = corpus.train_tokenizer([open(f).read() for f in files], vocab_size=300)
    tok.save_pretrained(str(root / "tok"))
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as f:   # "third-party" prompts: here, two slices of a file not in FILES
        text = open(os.path.join(stdlib, "string.py")).read()
        for i in range(2):
            f.write(json.dumps({"id": f"p{i}", "source": "string.py", "text": text[1000 * i:1000 * i + 300]}) + "\n")
    return {"root": root, "files": files, "tok": str(root / "tok"), "prompts": str(prompts)}


def read_curve(path):
    with open(path) as f:
        return list(csv.DictReader(f))


TINY = ["--layers", "1", "--hidden", "32", "--q-heads", "2", "--kv-heads", "1", "--intermediate", "48",
        "--seq-len", "32", "--batch", "4", "--threads", "1", "--progress-interval", "100"]


@pytest.fixture(scope="module")
def joint_run(setup):
    out = str(setup["root"] / "model")
    metrics = main(["joint", "--tokenizer", setup["tok"], "--out", out, "--data", *setup["files"], *TINY,
                    "--steps", "40", "--num-heads", "2", "--lr", "1e-2", "--warmup", "5", "--head-frac", "0.5",
                    "--log-every", "5", "--eval-every", "20", "--val-windows", "4"])
    return out, metrics


def test_joint_recipe(joint_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, metrics = joint_run
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.hidden_size == 32 and model.config.vocab_size == len(tok) == 300
    assert model.generation_config.eos_token_id == tok.eos_token_id
    heads = load_heads(os.path.join(out, "heads_joint"))
    assert heads.num_heads == 2 and heads.hidden_size == 32
    assert metrics["steps"] == 40 and len(metrics["head_top1_real"]) == 2
    rows = read_curve(os.path.join(out, "train_joint_curve.csv"))
    train = [float(r["loss_ntp"]) for r in rows if r["loss_ntp"]]
    assert train[-1] < train[0] - 0.5, f"next-token loss did not fall: {train[0]:.3f} -> {train[-1]:.3f}"
    heads_loss = [float(r["loss_head1"]) for r in rows if r.get("loss_head1")]
    assert heads_loss[-1] < heads_loss[0], "head loss did not fall"
    assert metrics["val_ntp_loss"] < torch.log(torch.tensor(300.0)).item()    # better than uniform
    assert os.path.exists(os.path.join(out, "train_joint_curve.png"))


@pytest.mark.parametrize("targets", ["soft", "hard"])
def test_frozen_recipe(setup, joint_run, targets):
    model_dir, _ = joint_run
    out = str(setup["root"] / f"heads_{targets}")
    m = main(["frozen", "--model", model_dir, "--out", out, "--data", *setup["files"], "--targets", targets,
              "--num-heads", "3", "--init", os.path.join(model_dir, "heads_joint"), "--real-windows", "4",
              "--self-generated", "4", "--prompt-len", "8", "--seq-len", "32", "--batch", "4", "--steps", "30",
              "--lr", "1e-2", "--warmup", "3", "--log-every", "3", "--val-windows", "2", "--eval-generated", "2",
              "--eval-new-tokens", "16", "--eval-prompts", setup["prompts"], "--top-k", "4", "--threads", "1",
              "--progress-interval", "100"])
    heads = load_heads(out)
    assert heads.num_heads == 3 and m["init_heads"] == 2
    rows = read_curve(os.path.join(out, "train_frozen_curve.csv"))
    first = sum(float(rows[i]["loss"]) for i in range(2)) / 2
    last = sum(float(rows[-i]["loss"]) for i in (1, 2)) / 2
    assert last < first, f"{targets} distillation loss did not fall: {first:.4f} -> {last:.4f}"
    acc = json.load(open(os.path.join(out, "accuracy.json")))
    assert acc["format"] == "mtp_triton.accuracy/1" and acc["num_heads"] == 3 and acc["top_k"] == 4
    a = torch.tensor(acc["acc"])
    assert a.shape == (3, 4) and (a >= 0).all() and (a.sum(1) <= 1 + 1e-9).all()
    Tree.from_accuracies(a, 8)    # usable as the input of the tree builder
    g = m["heldout_greedy"]
    assert 1.0 <= g["tau_simulated"]["chain-2"]["tau"] <= 3.0 and 0 < g["distinct_ratio"] <= 1
    assert "chain-4" not in g["tau_simulated"]    # deeper than the 3 heads: skipped
    assert m["thirdparty_greedy"]["prompts"] == 2 and "tuned-16" in m["thirdparty_greedy"]["tau_simulated"]


@pytest.fixture
def loop_runs(monkeypatch):
    """Every Loop.run call: the loop's name, its recorder, and the step it starts from (> 0: resumed)."""
    calls, run = [], Loop.run

    def spy(self, step_fn, recorder=None, **hooks):
        calls.append({"desc": self.cfg.desc, "recorder": recorder, "start": self.step})
        return run(self, step_fn, recorder, **hooks)
    monkeypatch.setattr(Loop, "run", spy)
    return calls


def as_csv(rows):
    """Rows as they read back from the curve CSV (every column, strings, blanks for None / missing)."""
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    return [{k: "" if r.get(k) is None else str(r[k]) for k in keys} for r in rows]


def test_both_recipes_run_on_the_one_loop(setup, joint_run, tmp_path, loop_runs):
    # joint: 4 steps with a checkpoint, then the same checkpoint with a 6-step budget continues at step 4
    out, ckpt = str(tmp_path / "model"), str(tmp_path / "joint.ckpt")
    joint = ["joint", "--tokenizer", setup["tok"], "--out", out, "--data", *setup["files"], *TINY, "--num-heads", "2",
             "--log-every", "2", "--eval-every", "2", "--val-windows", "2", "--checkpoint", ckpt]
    main(joint + ["--steps", "4"])
    m = main(joint + ["--steps", "6"])
    assert m["steps"] == 6 and m["tokens"] == 6 * 4 * 32
    heads = str(tmp_path / "heads")
    main(["frozen", "--model", joint_run[0], "--out", heads, "--data", *setup["files"], "--num-heads", "2",
          "--real-windows", "4", "--prompt-len", "8", "--seq-len", "32", "--batch", "4", "--steps", "4",
          "--log-every", "2", "--val-windows", "2", "--eval-generated", "1", "--eval-new-tokens", "8", "--top-k", "2",
          "--threads", "1", "--progress-interval", "100"])
    assert [(c["desc"], c["recorder"].name, c["start"]) for c in loop_runs] == [
        ("joint", "train_joint", 0), ("joint", "train_joint", 4), ("frozen", "train_frozen", 0)]
    for call, folder in zip(loop_runs[1:], (out, heads)):       # the curve CSV holds exactly the Loop's rows
        rows = read_curve(os.path.join(folder, f"{call['recorder'].name}_curve.csv"))
        assert rows == as_csv(call["recorder"].rows)
        assert list(rows[0])[:6] == ["recipe", "step", "tokens", "elapsed_s", "lr", "loss"]
    joint_rows = loop_runs[1]["recorder"].rows
    assert [r["step"] for r in joint_rows] == [1, 2, 4, 6, 6]   # rows 1-4 come back from the checkpoint; 6 + final
    assert [r.get("val_ntp") is not None for r in joint_rows] == [False, True, True, True, True]   # on_log: eval
    assert [r["step"] for r in loop_runs[2]["recorder"].rows] == [1, 2, 4]


class Interrupted(Exception):
    pass


def test_frozen_run_resumes_from_its_checkpoint(setup, joint_run, tmp_path, monkeypatch, loop_runs):
    # a run killed during step 6 (checkpoints after every step), rerun with the same checkpoint, continues at
    # step 5 and ends exactly where an uninterrupted run ends: same heads, same curve
    def frozen(out, *extra):
        return main(["frozen", "--model", joint_run[0], "--out", str(tmp_path / out), "--data", *setup["files"],
                     "--num-heads", "2", "--real-windows", "4", "--self-generated", "2", "--prompt-len", "8",
                     "--seq-len", "32", "--batch", "4", "--steps", "12", "--lr", "1e-2", "--warmup", "3",
                     "--log-every", "2", "--val-windows", "2", "--eval-generated", "1", "--eval-new-tokens", "8",
                     "--top-k", "2", "--threads", "1", "--progress-interval", "100", *extra])
    losses, steps = frozen_recipe.frozen_head_losses, []

    def counted(*a, crash_at=None, backward=True, **kw):
        if backward:                                 # a training step (the held-out KL has backward=False)
            steps.append(1)
            if len(steps) == crash_at:
                raise Interrupted
        return losses(*a, backward=backward, **kw)
    ckpt = ["--checkpoint", str(tmp_path / "frozen.ckpt"), "--save-every-minutes", "1e-9"]
    monkeypatch.setattr(frozen_recipe, "frozen_head_losses", lambda *a, **kw: counted(*a, crash_at=6, **kw))
    with pytest.raises(Interrupted):
        frozen("resumed", *ckpt)
    monkeypatch.setattr(frozen_recipe, "frozen_head_losses", counted)
    steps.clear()
    m = frozen("resumed", *ckpt)
    assert loop_runs[-1]["start"] == 5 and len(steps) == 12 - 5 and m["steps"] == 12
    steps.clear()
    frozen("straight")
    assert loop_runs[-1]["start"] == 0 and len(steps) == 12
    a, b = load_heads(str(tmp_path / "resumed")), load_heads(str(tmp_path / "straight"))
    assert torch.equal(a.res_weight, b.res_weight) and torch.equal(a.res_bias, b.res_bias)
    ra, rb = (read_curve(str(tmp_path / d / "train_frozen_curve.csv")) for d in ("resumed", "straight"))
    drop = lambda rows: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rows]    # noqa: E731
    assert [r["step"] for r in ra] == ["1", "2", "4", "6", "8", "10", "12"] and drop(ra) == drop(rb)


def test_greedy_continue_matches_hf_generate(joint_run):
    # the self-generated training data and the tau simulation assume these are the model's greedy tokens
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(joint_run[0]).eval()
    prompts = torch.randint(1, 300, (3, 7), generator=torch.Generator().manual_seed(0))
    ours = greedy_continue(model, prompts, 12, batch=2)
    eos = model.generation_config.eos_token_id
    for b in range(3):
        ref = model.generate(prompts[b:b + 1], attention_mask=torch.ones(1, 7, dtype=torch.long),
                             do_sample=False, max_new_tokens=12)[0]
        n = ref.shape[0]
        assert torch.equal(ours[b, :n], ref), f"sequence {b}"
        if n < 19:
            assert ref[-1] == eos   # HF stopped at EOS; ours keeps going


def test_simulate_tau_exact_cases():
    # seqs: 1 sequence of 30 distinct tokens; prompt length 5
    S, H, K = 30, 3, 2
    seqs = torch.arange(100, 100 + S).unsqueeze(0)
    right = torch.full((1, S, H, K), -1, dtype=torch.long)   # rank 0 of head h at a holds token a + h + 2
    wrong = right.clone()
    for a in range(S):
        for h in range(H):
            if a + h + 2 < S:
                right[0, a, h, 0] = seqs[0, a + h + 2]
                wrong[0, a, h, 1] = seqs[0, a + h + 2]   # only rank 1 is right
    chain2, chain3 = Tree.chain(2), Tree.chain(3)
    tau, steps, hist = simulate_tau(right, seqs, 5, chain2)
    assert tau == 3.0 and hist == [0, 0, steps]              # every draft accepted: 2 + bonus per step
    assert simulate_tau(right, seqs, 5, chain3)[0] == 4.0
    assert simulate_tau(wrong, seqs, 5, chain2)[0] == 1.0    # top-1 chain never accepts
    side = Tree.from_choices([(0,), (1,), (1, 1)])           # the rank-1 branch catches them
    assert simulate_tau(wrong, seqs, 5, side)[0] == 3.0
    # steps advance by accepted + 1: from position 4 with 2 accepted per step the drafts come from 4, 7, 10, ...
    assert steps == len(range(4, S - 1 - 2, 3))


def test_build_llama_shapes():
    m = build_llama(vocab_size=77, layers=2, hidden=48, q_heads=4, kv_heads=2, intermediate=40, eos_id=3)
    c = m.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.eos_token_id, c.tie_word_embeddings) == (4, 2, 3, False)
    assert m(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 77)


def test_eval_with_generate(setup, joint_run, tmp_path):
    # tau from the real decoder; every tree must reproduce the serial greedy output exactly
    model_dir, _ = joint_run
    heads_dir = str(setup["root"] / "heads_soft")
    if not os.path.exists(os.path.join(heads_dir, "accuracy.json")):   # -k selected this test alone
        test_frozen_recipe(setup, joint_run, "soft")
    out = str(tmp_path / "tau.json")
    r = main(["eval", "--model", model_dir, "--heads", heads_dir, "--prompts", setup["prompts"], "--out", out,
              "--new-tokens", "10", "--trees", "chain-2", "chain-4", "tuned-6", "--kernels", "torch",
              "--threads", "1"])
    assert set(r["trees"]) == {"chain-2", "tuned-6"}               # chain-4 is deeper than the 3 heads
    for name, t in r["trees"].items():
        assert t["identical_to_serial"], name
        assert 1.0 <= t["tau"] <= t["depth"] + 1
    assert json.load(open(out))["num_prompts"] == 2


def test_corpus_split_and_hash():
    docs = corpus.collect_stdlib()
    ids = [d.id for d in docs]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert not any(part in ("test", "tests", "site-packages", "idle_test") for i in ids for part in i.split("/"))
    assert "pydoc_data/topics.py" not in ids and any(i.startswith("pydoc_data/topics.py::") for i in ids)
    val = [d for d in docs if d.split == "val"]
    assert 0.01 < len(val) / len(docs) < 0.12                           # ~5 % held out, by document
    assert all(d.split == corpus.split_of(d.id) for d in docs)
    assert corpus.corpus_hash(docs) == corpus.corpus_hash(list(reversed(docs)))   # order-independent
    assert corpus.corpus_hash(docs) != corpus.corpus_hash(docs[1:])


def test_thirdparty_prompts_never_stdlib():
    import sys
    rows = corpus.thirdparty_prompts(sysconfig.get_paths()["purelib"], total=6)
    assert len(rows) == 6 and rows == corpus.thirdparty_prompts(sysconfig.get_paths()["purelib"], total=6)
    for r in rows:
        assert r["source"].split()[0] in corpus.THIRDPARTY_PACKAGES
        assert r["source"].split()[0] not in sys.stdlib_module_names
        assert len(r["text"]) >= 400 and r["text"].lstrip().startswith(("def ", "class ", "@"))


def test_tokenizer_has_eos(setup):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(setup["tok"])
    assert tok.eos_token == corpus.EOS and tok.convert_tokens_to_ids(corpus.EOS) == tok.eos_token_id
    ids = corpus.encode_docs(tok, ["x = 1\n", "y = 2\n"])
    assert (ids == tok.eos_token_id).sum() == 2 and ids[-1] == tok.eos_token_id
