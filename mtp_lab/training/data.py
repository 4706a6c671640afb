"""What the heads learn from: text files -> token streams (train / held-out) -> random windows; prompt files.

    streams = token_streams(tok, load_text_files(["my_text.jsonl"]))   # {'train': ids [N], 'val': ids [M]}
    batch = random_windows(streams["train"], 8, 513, gen)          # [8, 513] int64, one randint draw from gen

The recipes draw every batch from one seeded torch.Generator, in a fixed order, so a seeded run sees the same
windows each time (and a resumed run, whose checkpoint holds the generator's state, the same as an
uninterrupted one).
"""
import torch

from mtp_lab import corpus
from mtp_lab.records import read_jsonl, read_utf8


def load_text_files(paths, what="--data"):
    """Texts from .txt/.py files (one document each, UTF-8) or .jsonl files (a "text" string per line); a missing
    file, a torn or text-less line, or bytes that are not UTF-8 are refused naming the file (and the line)."""
    texts = []
    for p in paths:
        if p.endswith(".jsonl"):
            texts += [r["text"] for r in read_jsonl(p, what, ("text",))]
        else:
            texts.append(read_utf8(p, what))
    return texts


def token_streams(tokenizer, texts=None, cache_dir=None, val_percent=5):
    """{'train': ids [N], 'val': ids [M]}: the stdlib corpus by default, else the documents `texts` (from
    `load_text_files`, which a recipe calls first so that a bad --data file fails before anything loads) split by
    index."""
    if not texts:
        docs = corpus.collect_stdlib(val_percent=val_percent)
        if cache_dir:
            return corpus.cached_token_streams(tokenizer, docs, cache_dir)
        return {s: corpus.encode_split(tokenizer, docs, s) for s in ("train", "val")}
    if len(texts) < 2:
        raise ValueError("--data: need at least two documents (one is held out)")
    split = [corpus.split_of(f"{i}", val_percent) for i in range(len(texts))]
    if "val" not in split:      # few documents: hold out the last one
        split[-1] = "val"
    if "train" not in split:
        split[0] = "train"
    return {s: corpus.encode_docs(tokenizer, [t for t, sp in zip(texts, split) if sp == s])
            for s in ("train", "val")}


def random_windows(stream, n, length, gen):
    """n windows [n, length] (int64) starting at random offsets of a 1-D token stream."""
    if stream.numel() < length + 1:
        raise ValueError(f"token stream of {stream.numel()} tokens is shorter than a window of {length}")
    starts = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    return torch.stack([stream[s:s + length] for s in starts.tolist()]).long()


def prompt_ids(tokenizer, path, max_tokens=None, what="--prompts"):
    """[(id, ids list)] from a prompts JSONL (fields id, source, text); max_tokens keeps the last N tokens."""
    out = []
    for r in read_jsonl(path, what, ("id", "text")):
        ids = tokenizer(r["text"], add_special_tokens=False)["input_ids"]
        out.append((r["id"], ids[-max_tokens:] if max_tokens else ids))
    return out
