"""`train_heads eagle3` on the tiny model: it trains from answer shards, resumes, writes a drafter in EAGLE-3's files
that decodes losslessly, and its pieces (split, vocabulary, position mask) do what the recipe says."""
import argparse
import gzip
import json
import os
import random

import pytest
import torch

import mtp_triton as mt
from mtp_lab.training import eagle3 as recipe
from mtp_triton.eagle3 import Eagle3Module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "data", "tiny-stdlib-llama")


def _shards(folder, n=40, seed=0):
    """Answer shards in the `train_heads answers` format, from the tiny model's own greedy continuations."""
    model = mt.load_model(TINY, dtype=torch.float32)
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, 4096) for _ in range(rng.randrange(3, 9))] for _ in range(n)]
    answers = mt.generate(model, prompts, 24, mtp=False).tokens
    os.makedirs(os.path.join(folder, "shards"), exist_ok=True)
    rows = [dict(id=f"p-{i}", category="test", mode="greedy", seed=0, by="engine", prompt_ids=p, answer_ids=a)
            for i, (p, a) in enumerate(zip(prompts, answers))]
    with gzip.open(os.path.join(folder, "shards", "00000.jsonl.gz"), "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return model, prompts


def _args(tmp_path, *extra):
    ap = argparse.ArgumentParser()
    recipe.add_arguments(ap)
    return ap.parse_args(["--model", TINY, "--answers", str(tmp_path / "answers"), "--work", str(tmp_path / "work"),
                          "--out", str(tmp_path / "out"), "--vocab", "300", "--unroll", "3", "--batch", "4",
                          "--max-len", "64", "--val-percent", "20", "--val-limit", "4", "--final-val-limit", "4",
                          "--log-every", "2", "--eval-every", "2", "--lr", "3e-3", *extra])


def test_trains_resumes_and_decodes_losslessly(tmp_path):
    model, prompts = _shards(tmp_path / "answers")
    first = recipe.run(_args(tmp_path, "--steps", "4"))
    assert first["steps"] == 4 and len(first["val_accuracy_by_depth"]) == 3
    second = recipe.run(_args(tmp_path, "--steps", "8"))                  # continues from the checkpoint
    assert second["steps"] == 8 and second["resumed_at"] == 4
    rows = open(tmp_path / "out" / "records" / "train_eagle3_curve.csv").read().splitlines()
    assert rows[0].split(",")[0] == "step" and "val_acc0" in rows[0] and len(rows) == 1 + 5   # steps 1, 2, 4, 6, 8
    drafter = mt.load_drafter(str(tmp_path / "out"))
    assert isinstance(drafter, Eagle3Module) and drafter.taps == (2, 2, 1) and len(drafter.token_map) == 300
    res = mt.generate(model, prompts[:3], 16, drafter=drafter.with_draft(depth=3, top_k=4, beam=2, nodes=9))
    assert res.tokens == mt.generate(model, prompts[:3], 16, mtp=False).tokens


def test_split_is_by_prompt_and_stable():
    rows = [dict(id=f"x-{i}", mode=m) for i in range(200) for m in ("greedy", "sample")]
    train, val = recipe.split(rows, 10)
    assert {r["id"] for r in train}.isdisjoint({r["id"] for r in val}) and 5 < len(val) // 2 < 40
    assert recipe.split(rows + [dict(id="new", mode="greedy")], 10)[1][:len(val)] == val


def test_draft_vocabulary_is_the_most_frequent_answer_tokens():
    rows = [dict(answer_ids=[5, 5, 5, 9, 9, 2]), dict(answer_ids=[7, 9, 1])]
    assert recipe.draft_vocab(rows, 3, 12).tolist() == [1, 5, 9]          # 9 x3, 5 x3, then the lowest id of the 1s


def test_positions_whose_target_choice_is_outside_the_vocabulary_are_not_scored():
    """EAGLE-3's mask: a position counts only where the target's own choice (over the whole vocabulary) is a draft
    token, and only where the predicted token is an answer token."""
    torch.manual_seed(0)
    model = mt.load_model(TINY, dtype=torch.float32)
    module = Eagle3Module.from_target(model, torch.arange(0, 4096, 2), (2, 2, 1))
    t = recipe.Trainer(model, module, [], [], 64, 2, lambda: torch.autocast("cpu", enabled=False))
    seqs = [[3, 9, 27, 81, 40, 120, 7, 77, 5, 11]]
    feats, h, choice, ids = recipe.target_pass(model, seqs, (2, 2, 1))
    logits_v = h @ t.lm_rows.T
    _, parts = recipe.batch_losses(module, t.embed, feats, logits_v, choice, ids, [10], [4], 2, t.index_of)
    nxt_choice = choice[0, 1:]                                            # the target's choice for token m + 2
    m = torch.arange(9)
    want = int(((m + 2 >= 4) & (m + 2 < 10) & (nxt_choice % 2 == 0)).sum())
    assert parts[0][3] == want


def test_the_target_cache_gives_the_target_pass_and_runs_the_target_once_per_sequence(tmp_path, monkeypatch):
    """What the cache returns is the target pass (its streams stored in bf16), whatever batch a sequence comes in;
    a sequence seen before is read, not computed; a folder made for other taps is refused."""
    model = mt.load_model(TINY, dtype=torch.float32)
    seqs = [[3, 9, 27, 81, 40], [120, 7, 77, 5, 11, 13, 17]]
    feats, h, choice, ids = recipe.target_pass(model, seqs, (2, 2, 1))
    cache = recipe.TargetCache(str(tmp_path / "t"), model, "tiny", (2, 2, 1))
    got = cache(seqs)
    for b, n in enumerate(map(len, seqs)):                              # a sequence's own positions; padding is 0
        assert torch.equal(got[0][b, :n], feats[b, :n].bfloat16().float())
        assert torch.equal(got[1][b, :n], h[b, :n].bfloat16().float()) and torch.equal(got[2][b, :n], choice[b, :n])
        assert not got[0][b, n:].any() and not got[2][b, n:].any()
    assert torch.equal(got[3], ids) and cache.computed == 2
    monkeypatch.setattr(recipe, "target_pass", lambda *a, **k: pytest.fail("the target ran again"))
    again = cache([seqs[1], seqs[0]])                                   # another batch: read from disk
    assert torch.equal(again[0][0], got[0][1]) and torch.equal(again[0][1, :5], got[0][0, :5])
    assert not again[0][1, 5:].any() and torch.equal(again[2][0], got[2][1]) and cache.read == 2
    with pytest.raises(ValueError, match="made for"):
        recipe.TargetCache(str(tmp_path / "t"), model, "tiny", (1, 2, 1))
