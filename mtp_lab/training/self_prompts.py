"""Prompts the model writes for itself: Magpie-style self-instruction (Xu et al. 2024, https://arxiv.org/abs/2406.08464).

An instruction-tuned model, handed its chat template up to the start of a user turn, writes a user's message: it
has seen millions of them. Sampling that turn gives free-form chat prompts with no dataset at all, which is the
point here. The templated prompts of `data/chat/make_prompts.py` teach the heads the templates; prompts in the
model's own idea of a user's voice are closer to what people type.

    <|im_start|>system ... <|im_end|> <|im_start|>user \\n [opener]  ->  the model samples the rest of the turn

An optional opener (the first words of the user's message, e.g. "Summarize this paragraph:") steers a batch
towards a category; `open` batches have none. Each kept prompt is the opener plus what the model wrote, up to its
end-of-turn token. Filters drop what a user would not send: turns cut off at the token limit, runs of a repeated
n-gram, near-empty or duplicate text, and any text of a held-out prompt (`avoid`), so a held-out set stays held out.

    rows = write_self_prompts(tok, "runs/smollm2/self-prompts.jsonl", 1000, hf=hf_model)

The file is JSONL (id, category, source, opener, batch, text), appended as batches finish, so an interrupted run
resumes (batch seeds continue after the last batch written).
"""
import collections
import json
import os
import re

import torch

from mtp_triton.generate import generate
from ..records import open_log, read_jsonl
from .answers import hf_answers, normalise  # noqa: F401  (normalise: `retree` takes it from here)

# openers per category: the first words of a user's turn, the model writes the rest ("" = nothing: free Magpie)
OPENERS = {
    "open": [""],
    "coding": ["Can you write a Python function that", "How do I", "Why does my code", "Explain what this code does:"],
    "writing": ["Write a short story about", "Write an email to", "Write a poem about", "Can you help me write"],
    "qa": ["What is", "Why do", "How does", "What are the differences between"],
    "math": ["Solve this problem:", "If a train", "Calculate", "A store sells"],
    "summarization": ["Summarize the following text:\n\n", "Can you give me a short summary of",
                      "TL;DR this for me:\n\n", "Summarize in one sentence:"],
    "extraction": ["Extract all the names from this text:\n\n", "List the dates mentioned in the following:\n\n",
                   "From this paragraph, pull out", "Find the email addresses in this message:\n\n"],
}
SOURCE = "written by the model itself (Magpie-style: its chat template up to the user turn, sampled)"


def repeats(text, n=3, times=3):
    """True when some word n-gram occurs `times` or more (a sampling loop, not a user's message)."""
    w = re.findall(r"\w+", text.lower())
    grams = collections.Counter(tuple(w[i:i + n]) for i in range(len(w) - n + 1))
    return any(c >= times for c in grams.values())


def keep(text, ended, seen, min_words=4, max_words=160):
    """Is this sampled user turn a prompt to keep? ended: the model closed its turn (not cut at the limit)."""
    words = text.split()
    return (ended and min_words <= len(words) <= max_words and not repeats(text)
            and "<|" not in text and normalise(text) not in seen)


def turn_prefix(tok, system=None):
    """The chat template's text up to where a user's message starts (a tokenizer without one: empty)."""
    if not getattr(tok, "chat_template", None):
        return ""
    mark = "\u2063MTP_USER_TURN\u2063"
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": mark}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return text[:text.index(mark)]


def end_of_turn(tok):
    """The token that closes a turn (<|im_end|> for ChatML models; else EOS)."""
    t = tok.convert_tokens_to_ids("<|im_end|>") if hasattr(tok, "convert_tokens_to_ids") else None
    return t if isinstance(t, int) and t != getattr(tok, "unk_token_id", None) else tok.eos_token_id


def plan(b, seed=0):
    """(category, opener) of batch b: round-robin over the categories and, within each, over its openers."""
    cats = list(OPENERS)
    c = cats[b % len(cats)]
    ops = OPENERS[c]
    return c, ops[(b // len(cats) + seed) % len(ops)]


@torch.no_grad()
def sample_turns(tok, prefix, n, max_new_tokens, seed, hf=None, model=None, temperature=1.0, top_p=0.95):
    """n sampled continuations of `prefix` (text) -> [(text, ended)], by transformers (`hf`) or this engine."""
    ids = list(tok(prefix, add_special_tokens=False)["input_ids"]) if prefix else [tok.bos_token_id or 0]
    stop = end_of_turn(tok)
    if hf is not None:
        out = hf_answers(hf, [ids] * n, max_new_tokens, stop, sample=True, temperature=temperature, top_p=top_p,
                         seed=seed)
    else:
        out = generate(model, [ids] * n, max_new_tokens, mtp=False, temperature=temperature, top_p=top_p, seed=seed,
                       eos_token_id=stop).tokens
    res = []
    for o in out:
        ended = stop in o
        o = o[:o.index(stop)] if ended else o
        res.append((tok.decode(o, skip_special_tokens=False), ended))
    return res


def write_self_prompts(tok, path, n, hf=None, model=None, batch=32, max_new_tokens=96, seed=0, avoid=(),
                       system=None, progress=True, max_batches=None):
    """Append model-written prompts to `path` until it holds `n`; returns all its rows (at most n).

    avoid: texts that must not appear (held-out prompts); system: a system message for the template (None: the
    template's default). Stops after `max_batches` batches (default 4 n / batch + 8) whatever it kept."""
    if (hf is None) == (model is None):
        raise ValueError("pass exactly one of hf= (a transformers model) or model= (this engine's)")
    if n < 0 or batch < 1:
        raise ValueError(f"n must be >= 0 and batch >= 1, got n={n}, batch={batch}")
    rows = read_jsonl(path, "self-prompts file", torn_last="skip") if os.path.exists(path) else []
    seen = {normalise(t) for t in avoid} | {normalise(r["text"]) for r in rows}
    start = max((r["batch"] for r in rows), default=-1) + 1
    max_batches = max_batches if max_batches is not None else 4 * n // batch + 8
    prefix = turn_prefix(tok, system)
    count = collections.Counter(r["category"] for r in rows)
    bar = None
    if progress and len(rows) < n:
        from tqdm import tqdm
        bar = tqdm(total=n, initial=len(rows), desc="self-prompts", unit="prompt")
    with open_log(path) as f:
        b = start
        while len(rows) < n and b < start + max_batches:
            cat, opener = plan(b, seed)
            for text, ended in sample_turns(tok, prefix + opener, batch, max_new_tokens, seed * 100003 + b, hf, model):
                full = (opener + text).strip()
                if len(rows) >= n or not keep(full, ended, seen):
                    continue
                seen.add(normalise(full))
                row = dict(id=f"self-{cat}-{count[cat]:05d}", category=cat, source=SOURCE, opener=opener, batch=b,
                           text=full)
                count[cat] += 1
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                if bar:
                    bar.update(1)
            f.flush()
            b += 1
    if bar:
        bar.close()
    return rows[:n]
