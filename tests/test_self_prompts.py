"""Magpie-style prompts the model writes for itself: the filters, the batch plan, resuming, held-out avoidance, and
the chat template cut where a user's turn starts (the sampling itself runs on the real model in test_loading.py)."""
import json

import pytest

from mtp_lab.training import self_prompts as sp


def test_filters_drop_cut_off_looping_short_and_duplicate_turns():
    seen = {sp.normalise("What is a  Closure?")}
    assert sp.keep("How do I reverse a list in Python?", True, set())
    assert not sp.keep("How do I reverse a list in Python?", False, set())         # cut at the token limit
    assert not sp.keep("Too short", True, set())
    assert not sp.keep("what is a closure?", True, seen)                           # a duplicate, case and spaces aside
    assert not sp.keep("Tell me more. " + "ENTIRE ENTIRE ENTIRE " * 3, True, set())  # a sampling loop
    assert not sp.keep("Hello <|im_start|>assistant there you go", True, set())    # template tokens in the text
    assert sp.repeats("a b c a b c a b c") and not sp.repeats("a b c d e f g h i")


def test_plan_visits_every_category_and_then_its_next_opener():
    cats = list(sp.OPENERS)
    first = [sp.plan(b) for b in range(len(cats))]
    assert [c for c, _ in first] == cats and all(o == sp.OPENERS[c][0] for c, o in first)
    c, o = sp.plan(len(cats) + 1)
    assert c == cats[1] and o == sp.OPENERS[c][1 % len(sp.OPENERS[c])]


class FakeTok:
    """Only what write_self_prompts touches without a chat template (no model is run: sample_turns is replaced)."""
    chat_template = None


def test_write_resumes_avoids_held_out_and_numbers_per_category(tmp_path, monkeypatch):
    calls = []

    def turns(tok, prefix, n, max_new_tokens, seed, hf=None, model=None):
        calls.append(seed)
        b = len(calls)
        return [(f" please explain topic number {b} part {i} to me", i != 1) for i in range(n)] + \
               [("what is the capital of France?" if prefix == "" else " la la la la la la la la la", True)]

    monkeypatch.setattr(sp, "sample_turns", turns)
    path = tmp_path / "p.jsonl"
    rows = sp.write_self_prompts(FakeTok(), str(path), 5, model=object(), batch=3, progress=False,
                                 avoid=["What is the capital of France?"])
    assert len(rows) == 5 and len(path.read_text().splitlines()) == 5
    assert all("France" not in r["text"] for r in rows)                              # held out stays held out
    assert rows[2]["text"].startswith(sp.plan(1)[1] + " please")                   # opener + what the model wrote
    assert all("part 1 " not in r["text"] for r in rows)                             # not ended: dropped
    assert [r["batch"] for r in rows] == [0, 0, 1, 1, 2]
    assert rows[0]["id"] == "self-open-00000" and rows[2]["category"] == sp.plan(1)[0]
    again = sp.write_self_prompts(FakeTok(), str(path), 7, model=object(), batch=3, progress=False)
    assert [r["text"] for r in again[:5]] == [r["text"] for r in rows]              # resumed, not redone
    assert len(again) == 7 and again[5]["batch"] == 3 and len(calls) == 4           # batch seeds continue
    assert len({r["id"] for r in again}) == 7
    assert [json.loads(line)["text"] for line in path.read_text().splitlines()] == [r["text"] for r in again]


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        sp.write_self_prompts(FakeTok(), str(tmp_path / "p.jsonl"), 3, progress=False)
    with pytest.raises(ValueError, match="n must be"):
        sp.write_self_prompts(FakeTok(), str(tmp_path / "p.jsonl"), -1, model=object(), progress=False)
