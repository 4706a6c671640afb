"""The answers data set (`train_heads answers`): the job order keeps every category in proportion at every prefix,
shards are written whole and a second run writes nothing new, and the tuning/held-out prompt files are refused.
Generation runs on the tiny model (a few tokens per answer)."""
import collections
import gzip
import json
import os

import pytest

import mtp_triton as mt
from mtp_lab.training import answers as A

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "data", "tiny-stdlib-llama")
CATS = {"coding": 12, "math": 6, "writing": 3}


def prompt_rows():
    return [dict(id=f"{c}-{i}", category=c, text=f"def {c}_{i}(x):\n    return x +")
            for c, n in CATS.items() for i in range(n)]


def test_every_prefix_of_the_order_is_proportional_and_greedy_comes_first():
    rows = prompt_rows()
    order = A.proportional(A.jobs(rows, sample_share=0.5, seed=3), seed=3)
    modes = [m for _, m, _ in order]
    assert modes == sorted(modes) and modes.count("greedy") == len(rows)            # greedy first, then sampled
    greedy, total = order[:len(rows)], len(rows)
    for k in range(1, total + 1):
        have = collections.Counter(A.category_of(r) for r, _, _ in greedy[:k])
        for c, n in CATS.items():
            assert abs(have[c] - k * n / total) <= 1, (k, c, have)
    sampled = {r["id"] for r, m, _ in A.jobs(rows, 0.5, 3) if m == "sample"}
    assert sampled <= {r["id"] for r, m, _ in A.jobs(rows, 0.8, 3) if m == "sample"}  # a larger share: a superset


def test_batches_keep_one_mode_and_sort_by_length_inside_a_window():
    rows = prompt_rows()
    window = A.proportional(A.jobs(rows, 0.5, 0))[:16]
    lengths = {r["id"]: (hash(r["id"]) % 50) for r in rows}
    parts = A.batches_of(window, lengths, 4)
    assert sorted(j[0]["id"] + j[1] for p in parts for j in p) == sorted(j[0]["id"] + j[1] for j in window)
    for p in parts:
        assert len(p) <= 4 and len({j[1] for j in p}) == 1
        assert [lengths[j[0]["id"]] for j in p] == sorted(lengths[j[0]["id"]] for j in p)


@pytest.mark.parametrize("name", ["dev_chat.jsonl", "heldout_chat.jsonl", "heldout_templated.jsonl"])
def test_tuning_and_held_out_files_are_refused(name):
    with pytest.raises(ValueError, match=name):
        A.check_prompt_files([os.path.join(ROOT, "data", "chat", "train.jsonl"), os.path.join(ROOT, "data", "chat",
                                                                                              name)])


def test_a_copy_of_a_held_out_prompt_is_refused(tmp_path):
    held = json.loads(open(os.path.join(ROOT, "data", "chat", "heldout_chat.jsonl")).readline())
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(dict(id="new", text="  " + held["text"].upper() + " ")) + "\n")
    with pytest.raises(ValueError, match="mine.jsonl.*held-out"):
        A.check_prompt_files([str(path)])


def test_the_command_refuses_a_held_out_file_before_the_model_loads(tmp_path):
    from mtp_lab.train_heads import main
    with pytest.raises(ValueError, match="dev_chat.jsonl"):
        main(["answers", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "out"),
              "--prompts", os.path.join(ROOT, "data", "chat", "dev_chat.jsonl")])
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def tiny():
    return mt.load_model(TINY, device="cpu"), mt.load_tokenizer(TINY)


def shard_bytes(folder):
    return {p: open(p, "rb").read() for p in A.shard_paths(folder)}


def test_shards_are_whole_resumable_and_stop_at_the_time_budget(tmp_path, tiny, monkeypatch):
    model, tok = tiny
    rows = [dict(r, prompt_file="mine.jsonl") for r in prompt_rows()]
    folder = str(tmp_path / "answers")
    kw = dict(max_new_tokens=6, sample_share=0.5, batch=4, shard_size=8, log=lambda line: None)
    assert A.write_answer_shards(model, tok, rows, folder, minutes=1e-9, **kw) == (0, 0)     # budget: stop at once

    calls, real = [], A.answer_batch

    def failing(*a, **k):                                  # the 3rd batch fails: the 2nd shard must not appear
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("killed")
        return real(*a, **k)

    monkeypatch.setattr(A, "answer_batch", failing)
    with pytest.raises(RuntimeError):
        A.write_answer_shards(model, tok, rows, folder, **kw)
    assert [os.path.basename(p) for p in A.shard_paths(folder)] == ["00000.jsonl.gz"]
    assert sorted(os.listdir(os.path.join(folder, "shards"))) == ["00000.jsonl.gz"]   # no temporary file left
    monkeypatch.setattr(A, "answer_batch", real)

    n_jobs = len(A.jobs(rows, 0.5))
    shards, written = A.write_answer_shards(model, tok, rows, folder, **kw)
    assert written == n_jobs - 8 and shards == -(-written // 8)
    got = list(A.read_answer_shards(folder))
    assert len(got) == n_jobs and len({(r["id"], r["mode"]) for r in got}) == n_jobs
    first = [r for r in got if r["mode"] == "greedy"][:len(rows) // 3]               # the first third: every category
    assert {r["category"] for r in first} == set(CATS)
    for r in got:
        assert set(r) >= {"id", "category", "mode", "seed", "by", "prompt_ids", "answer_ids", "hit_limit", "gen"}
        assert r["hit_limit"] == (len(r["answer_ids"]) == 6 and r["answer_ids"][-1] != tok.eos_token_id)
        assert r["prompt_file"] == "mine.jsonl" and r["gen"]["max_new_tokens"] == 6
    json.loads(gzip.decompress(open(A.shard_paths(folder)[0], "rb").read()).splitlines()[0])
    before = shard_bytes(folder)
    assert A.write_answer_shards(model, tok, rows, folder, **kw) == (0, 0)            # resumed: nothing new
    assert shard_bytes(folder) == before


def test_write_answers_jsonl_makes_every_answer_once_in_the_proportional_order(tmp_path, tiny):
    model, tok = tiny
    rows, path = prompt_rows(), str(tmp_path / "answers.jsonl")
    assert A.write_answers(model, tok, rows, path, max_new_tokens=4, sample_share=0.3, batch=4, progress=False) \
        == len(A.jobs(rows, 0.3))
    assert A.write_answers(model, tok, rows, path, max_new_tokens=4, sample_share=0.3, batch=4, progress=False) == 0
    got = [json.loads(line) for line in open(path)]
    assert {(r["id"], r["mode"]) for r in got} == {(r["id"], m) for r, m, _ in A.jobs(rows, 0.3)}
    assert {r["category"] for r in got[:12]} == set(CATS)            # the first window holds every category
