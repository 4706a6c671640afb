"""Render README.md (the answers data set's card) from the shards alone — no number typed by hand.

    python data/smollm2-135m-instruct-answers/make_card.py
"""
import collections
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from mtp_lab.records import md_table, write_text  # noqa: E402
from mtp_lab.training.answers import HELD_OUT, read_answer_shards, shard_paths  # noqa: E402

TARGET = 1_500_000                      # answer tokens the drafter's training asks for


def tally(rows):
    """{(category, mode): [answers, answer tokens, answers that hit the token limit]} of the rows."""
    out = collections.defaultdict(lambda: [0, 0, 0])
    for r in rows:
        t = out[(r["category"] or "none", r["mode"])]
        t[0] += 1
        t[1] += len(r["answer_ids"])
        t[2] += bool(r.get("hit_limit"))
    return out


def category_table(rows):
    """Markdown: answers, tokens, mean length and limit hits per category and mode, then the totals."""
    t = tally(rows)
    body = []
    for (cat, mode), (n, tok, hit) in sorted(t.items()):
        body.append((cat, mode, n, f"{tok:,}", f"{tok / n:.0f}", f"{hit} ({100 * hit / n:.0f} %)"))
    n, tok, hit = (sum(v[i] for v in t.values()) for i in range(3))
    body.append(("**all**", "", n, f"{tok:,}", f"{tok / max(n, 1):.0f}", f"{hit} ({100 * hit / max(n, 1):.0f} %)"))
    return md_table(["category", "mode", "answers", "answer tokens", "mean tokens", "hit the token limit"], body)


def runs_table(rows):
    """Markdown: one line per generation setup (command, commit, machine, torch, threads, dtype) with its dates."""
    runs = {}
    for r in rows:
        g = r.get("gen") or {}
        key = tuple(g.get(k) for k in ("command", "commit", "device", "torch", "threads", "dtype"))
        first, last, n = runs.get(key, (g.get("date"), g.get("date"), 0))
        runs[key] = (min(first, g.get("date")), max(last, g.get("date")), n + 1)
    body = [(f"`{c}`", commit, dev, tv, th, dt, n, f"{a} – {b}") for (c, commit, dev, tv, th, dt), (a, b, n)
            in runs.items()]
    return md_table(["command", "commit", "machine", "torch", "threads", "dtype", "answers", "shards begun (UTC)"],
                    body)


def main():
    paths = shard_paths(HERE)
    rows = list(read_answer_shards(HERE))
    tokens = sum(len(r["answer_ids"]) for r in rows)
    files = collections.Counter(r.get("prompt_file") for r in rows)
    held = {os.path.basename(h) for h in HELD_OUT}
    used_held = sorted(f for f in files if f and os.path.basename(f) in held)
    limits = sorted({r["gen"]["max_new_tokens"] for r in rows if r.get("gen")})
    samp = sorted({(r["gen"]["temperature"], r["gen"]["top_p"]) for r in rows if r.get("gen") and r["mode"] == "sample"})
    by = collections.Counter(r.get("by") for r in rows)
    lines = [
        "# SmolLM2-135M-Instruct's own answers (drafter training data)", "",
        "The target model's own answers to chat prompts, for training a drafter (an EAGLE-3-style MTP module) that "
        "predicts what *this* model says. Every prompt is answered greedily (temperature 0: what greedy MTP "
        "verifies against); a share is also answered by sampling. Answers come from this repository's engine "
        "(`mtp_triton.generate`, serial decoding, in batches), written by `mtp_lab/training/answers.py` into "
        "gzip'ed JSONL shards under `shards/`, read back with `mtp_lab.training.answers.read_answer_shards` (its "
        "docstring lists the fields of a row). Every number below is counted from the shards by `make_card.py`.", "",
        "## Size", "",
        f"- **{len(rows):,} answers, {tokens:,} answer tokens** in {len(paths)} shards "
        f"({100 * tokens / TARGET:.0f} % of the {TARGET:,} answer tokens training asks for).",
        f"- Token limit per answer: {', '.join(map(str, limits)) or '–'}; an answer that hit it (no EOS) is kept "
        "and flagged `hit_limit`.",
        "- Sampled answers: temperature / top-p " + (", ".join(f"{t} / {p}" for t, p in samp) or "–") +
        "; one seed per batch (a sampled answer also depends on its batch-mates).",
        "- Written by: " + ", ".join(f"{k} ({v})" for k, v in by.items()) + ".",
        "- Order: greedy answers first, every category in proportion at every point of the run "
        "(`answers.proportional`), so a run stopped early leaves the same mix, smaller.", "",
        category_table(rows), "",
        "## Prompts", "",
        "Prompt files of the answers (answers per file):", "",
        *[f"- `{f}`: {n:,}" for f, n in sorted(files.items(), key=lambda kv: str(kv[0]))], "",
        ("None of them is a tuning or held-out split (" + ", ".join(f"`{h}`" for h in sorted(held)) + "): the "
         "command refuses such a file by name, and any prompt file holding one of their texts."
         if not used_held else f"**Warning: answers from held-out files {used_held}.**"), "",
        "## How it was made", "",
        runs_table(rows), "",
        "Resume or extend: run the same command again; every (id, mode) already in a shard is skipped, and a shard "
        "is written whole (temporary file + rename) when its last batch is done. `--minutes` stops the run before a "
        "shard that would not fit the budget.", ""]
    write_text(os.path.join(HERE, "README.md"), "\n".join(lines))
    print(f"wrote {os.path.join(HERE, 'README.md')}: {len(rows)} answers, {tokens} answer tokens, {len(paths)} shards")


if __name__ == "__main__":
    main()
