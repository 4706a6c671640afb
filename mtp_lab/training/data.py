"""What the heads learn from: text files -> token streams (train / held-out) -> random windows; prompt files.

    streams = token_streams(tok, load_text_files(["my_text.jsonl"]))   # {'train': ids [N], 'val': ids [M]}
    batch = random_windows(streams["train"], 8, 513, gen)          # [8, 513] int64, one randint draw from gen

The recipes draw every batch from one seeded torch.Generator, in a fixed order, so a seeded run sees the same
windows each time (and a resumed run, whose checkpoint holds the generator's state, the same as an
uninterrupted one).
"""
import json
import os

import torch
from mtp_lab import corpus


def read_text(path, what="--data"):
    """The whole file as text, refused (ValueError naming `what`, the file and the line) unless it is UTF-8."""
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path}: no such file" if not os.path.exists(path) else f"{what} {path}: not a file")
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"{what} {path}, line {line}: not valid UTF-8 (byte {data[e.start]:#04x} at offset "
                         f"{e.start}); save the file as UTF-8") from None


def read_text_rows(path, what="--data", fields=("text",)):
    """The rows of a JSONL file in which every non-blank line is a JSON object with the keys `fields` ("text", if
    named, a string). Anything else is refused with a ValueError naming `what`, the file and the line: a torn last
    line (an interrupted write), a missing field, a file that is not UTF-8 or does not exist."""
    lines = read_text(path, what).split("\n")
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            torn = " (a torn last line? finish it or delete it)" if n >= len(lines) - 1 else ""
            raise ValueError(f"{what} {path}, line {n}: not valid JSON: {e.msg}{torn}") from None
        missing = [k for k in fields if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{what} {path}, line {n}: no {', '.join(repr(k) for k in missing)} field (each line "
                             f"must be a JSON object with {', '.join(repr(k) for k in fields)})")
        if "text" in fields and not isinstance(row["text"], str):
            raise ValueError(f"{what} {path}, line {n}: 'text' is {type(row['text']).__name__}, not a string")
        rows.append(row)
    return rows


def load_text_files(paths, what="--data"):
    """Texts from .txt/.py files (one document each, UTF-8) or .jsonl files (a "text" string per line); a missing
    file, a torn or text-less line, or bytes that are not UTF-8 are refused naming the file (and the line)."""
    texts = []
    for p in paths:
        if p.endswith(".jsonl"):
            texts += [r["text"] for r in read_text_rows(p, what)]
        else:
            texts.append(read_text(p, what))
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
    for r in read_text_rows(path, what, fields=("id", "text")):
        ids = tokenizer(r["text"], add_special_tokens=False)["input_ids"]
        out.append((r["id"], ids[-max_tokens:] if max_tokens else ids))
    return out
