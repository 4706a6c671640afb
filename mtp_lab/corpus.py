"""The training corpus of the embedded model: the running interpreter's own standard library.

Everything here is available offline on any machine that has Python, so the embedded model
(`data/tiny-stdlib-llama/`) can be rebuilt anywhere with `scripts/build_embedded_model.sh`.

Documents
    * every `*.py` file under `sysconfig.get_paths()["stdlib"]`, except site-packages, test suites
      (any path component named `test`, `tests`, `idle_test`) and `pydoc_data/topics.py` itself;
    * the bundled documentation text: one document per entry of `pydoc_data.topics.topics`
      (the "Python Language Reference" pages `help()` shows).
Split
    held-out by document, deterministically: a document is in the validation split when the first
    8 hex digits of sha256(document id) mod 100 < `val_percent` (default 5). So a file never has
    lines in both splits, and the split does not depend on the order files are listed in.
Hash
    sha256 over the sorted (id, text) pairs; it changes with the Python version, and the model card
    records it with the version.

Token stream: documents are tokenized and joined with the tokenizer's EOS token (`<|endoftext|>`).

Example:
    >>> docs = collect_stdlib()                         # [Doc(id, text, split), ...]
    >>> tok = train_tokenizer([d.text for d in docs if d.split == "train"], vocab_size=4096)
    >>> ids = encode_split(tok, docs, "val")           # 1-D int tensor of token ids
"""
import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass

import torch

from .cli import command_parser, int_at_least, run
from .records import save_torch, write_json, write_text

EOS = "<|endoftext|>"
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class Doc:
    id: str      # path relative to the stdlib root, or "pydoc_data/topics.py::<topic>"
    text: str
    split: str   # "train" | "val"


def split_of(doc_id, val_percent=5):
    """'val' for about val_percent % of ids, chosen by sha256 of the id (deterministic)."""
    h = int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16)
    return "val" if h % 100 < val_percent else "train"


def collect_stdlib(root=None, val_percent=5, include_topics=True):
    """Documents of the standard library at `root` (default: the running interpreter's), sorted by id."""
    root = root or sysconfig.get_paths()["stdlib"]
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if rel == "pydoc_data/topics.py":
                continue  # added below as readable text, one document per topic
            with open(full, "rb") as f:
                text = f.read().decode("utf-8", errors="replace")
            if text.strip():
                docs.append(Doc(rel, text, split_of(rel, val_percent)))
    if include_topics:
        topics_file = os.path.join(root, "pydoc_data", "topics.py")
        if os.path.exists(topics_file):
            ns = {}
            with open(topics_file, encoding="utf-8") as f:
                exec(compile(f.read(), topics_file, "exec"), ns)  # a plain dict literal, from the stdlib itself
            for key in sorted(ns.get("topics", {})):
                did = f"pydoc_data/topics.py::{key}"
                docs.append(Doc(did, ns["topics"][key], split_of(did, val_percent)))
    docs.sort(key=lambda d: d.id)
    return docs


def corpus_hash(docs):
    """sha256 over the sorted (id, text) pairs: identifies the exact corpus a model was trained on."""
    h = hashlib.sha256()
    for d in sorted(docs, key=lambda d: d.id):
        h.update(d.id.encode())
        h.update(b"\0")
        h.update(d.text.encode("utf-8", errors="replace"))
        h.update(b"\0")
    return h.hexdigest()


def corpus_stats(docs):
    out = {"python": sys.version.split()[0], "stdlib": sysconfig.get_paths()["stdlib"],
           "sha256": corpus_hash(docs), "documents": len(docs)}
    for s in ("train", "val"):
        sel = [d for d in docs if d.split == s]
        out[f"{s}_documents"] = len(sel)
        out[f"{s}_chars"] = sum(len(d.text) for d in sel)
    out["py_files"] = sum(1 for d in docs if "::" not in d.id)
    out["doc_topics"] = sum(1 for d in docs if "::" in d.id)
    return out


def train_tokenizer(texts, vocab_size=4096, min_frequency=2):
    """A byte-level BPE (GPT-2 style) trained on `texts`, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                   pad_token=EOS, model_max_length=2048, clean_up_tokenization_spaces=False)


def encode_docs(tokenizer, texts, eos=True):
    """Token ids of `texts` joined by EOS (one EOS after each document), as a 1-D int32 tensor."""
    eos_id = tokenizer.eos_token_id
    parts = []
    batch = 256
    for i in range(0, len(texts), batch):  # the Rust tokenizer directly: no "longer than model_max_length" noise
        for enc in tokenizer.backend_tokenizer.encode_batch(list(texts[i:i + batch]), add_special_tokens=False):
            parts.append(torch.tensor(enc.ids + ([eos_id] if eos else []), dtype=torch.int32))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)


def encode_split(tokenizer, docs, split):
    return encode_docs(tokenizer, [d.text for d in docs if d.split == split])


def cached_token_streams(tokenizer, docs, cache_dir):
    """{'train': ids, 'val': ids} for the corpus, cached on disk keyed by corpus + tokenizer hash."""
    tok_hash = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, f"stdlib-{corpus_hash(docs)[:16]}-{tok_hash}.pt")
    if os.path.exists(path):
        return torch.load(path)
    streams = {s: encode_split(tokenizer, docs, s) for s in ("train", "val")}
    save_torch(streams, path)                       # whole or not at all: a torn cache would be loaded next time
    return streams


THIRDPARTY_PACKAGES = ("tqdm", "psutil", "safetensors", "nbformat", "jinja2", "click", "attr", "idna", "fsspec",
                       "filelock", "dateutil", "packaging")


def thirdparty_prompts(site_packages, packages=THIRDPARTY_PACKAGES, total=30, min_chars=1200, max_chars=1800):
    """Held-out evaluation prompts: chunks of code from third-party packages (never the stdlib).

    Deterministic: files of each package (no tests, at least 80 lines) are ranked by sha256 of their
    path; prompts are taken round-robin over the packages. A chunk starts at a top-level or method
    `def`/`class` line picked by hash and runs, whole lines, to at least `min_chars` characters
    (a few hundred tokens). Files with fewer than 3 def/class lines (data tables) are skipped.
    Returns dicts {id, source, text}.
    """
    from importlib import metadata
    per_pkg = {}
    for pkg in packages:
        root = os.path.join(site_packages, pkg)
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and "test" not in d)
            for name in sorted(filenames):
                if name.endswith(".py") and "test" not in name:
                    full = os.path.join(dirpath, name)
                    with open(full, encoding="utf-8", errors="replace") as f:
                        lines = f.read().splitlines(keepends=True)
                    n_defs = sum(1 for l in lines if l.lstrip().startswith(("def ", "class ")))
                    if len(lines) >= 80 and n_defs >= 3:  # code, not a data table
                        files.append((hashlib.sha256(os.path.relpath(full, site_packages).encode()).hexdigest(),
                                      os.path.relpath(full, site_packages).replace(os.sep, "/"), lines))
        files.sort()
        if files:
            per_pkg[pkg] = files
    try:
        versions = {p: metadata.version({"attr": "attrs", "dateutil": "python-dateutil"}.get(p, p)) for p in per_pkg}
    except metadata.PackageNotFoundError:
        versions = {}
    out, round_ = [], 0
    while len(out) < total and any(round_ < len(f) for f in per_pkg.values()):
        for pkg, files in per_pkg.items():
            if len(out) >= total or round_ >= len(files):
                continue
            h, rel, lines = files[round_]
            starts = [i for i, l in enumerate(lines[:-20]) if l.lstrip().startswith(("def ", "class "))] or [0]
            i0 = starts[int(h[:8], 16) % len(starts)]
            text, i = "", i0
            while i < len(lines) and len(text) < min_chars:
                if len(text) + len(lines[i]) > max_chars and text:
                    break
                text += lines[i]
                i += 1
            out.append({"id": f"{pkg}-{len(out):02d}", "source": f"{pkg} {versions.get(pkg, '?')}: {rel}:{i0 + 1}-{i}",
                        "text": text})
        round_ += 1
    return out


def main(argv=None):
    p = command_parser("python -m mtp_lab.corpus", "Describe the stdlib corpus; optionally train and save the "
                       "tokenizer.")
    p.add_argument("--tokenizer-out", help="folder to save a freshly trained tokenizer to")
    p.add_argument("--vocab-size", type=int_at_least(256), default=4096)
    p.add_argument("--val-percent", type=int_at_least(1), default=5)
    p.add_argument("--stats-out", help="write the corpus statistics JSON here")
    p.add_argument("--prompts-out", help="write held-out third-party code prompts (JSONL) here and exit")
    p.add_argument("--site-packages", default=sysconfig.get_paths()["purelib"],
                   help="where the third-party packages for --prompts-out live")
    args = p.parse_args(argv)
    if args.prompts_out:
        rows = thirdparty_prompts(args.site_packages)
        write_text(args.prompts_out, "".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} prompts to {args.prompts_out}")
        return
    docs = collect_stdlib(val_percent=args.val_percent)
    stats = corpus_stats(docs)
    if args.tokenizer_out:
        tok = train_tokenizer([d.text for d in docs if d.split == "train"], vocab_size=args.vocab_size)
        tok.save_pretrained(args.tokenizer_out)
        for s in ("train", "val"):
            stats[f"{s}_tokens"] = int(encode_split(tok, docs, s).numel())
        stats["vocab_size"] = len(tok)
    if args.stats_out:
        write_json(args.stats_out, stats)
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    sys.exit(run(main))
