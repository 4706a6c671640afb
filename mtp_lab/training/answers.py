"""Self-distillation data: the target model's own answers to a prompt set (as Medusa-2 builds its training data).

MTP heads should predict what *this* model will say, not what some corpus says: so the training text is the model's
own output. Every prompt is answered greedily (what greedy MTP verifies against) and a share of them also by
sampling (temperature, top-p), for variety. Answers are written to a JSONL file as they finish, so an interrupted
run resumes where it stopped (rows already in the file are skipped).

The answers can come from this engine or from transformers' own `generate` on the same checkpoint (`hf=` a
*ForCausalLM object): on a CPU transformers' batched decoding (contiguous cache, fused SDPA attention) is the faster
of the two at batch 32, and for training data a near-tie decided the other way now and then does not matter.

    rows = read_prompts("data/chat/train.jsonl")
    write_answers(model, tok, rows, "runs/smollm2/answers.jsonl", max_new_tokens=256, sample_share=0.4)
"""
import json
import os
import random

import torch

from ..bundle import chat_ids
from mtp_triton.generate import generate
from ..records import open_log, read_jsonl


def read_prompts(path, what="prompt file"):
    """Rows of a prompts JSONL (id, category, text, ...); a line without an id or a text string, a torn line, a file
    that is not UTF-8 or is missing: a ValueError naming `what` (the flag), the file and the line."""
    return read_jsonl(path, what, ("id", "text"))


def jobs(rows, sample_share=0.4, seed=0):
    """(row, mode, seed) per answer to make: every row greedy, a seeded share of them also sampled."""
    rng = random.Random(seed)
    out = [(r, "greedy", 0) for r in rows]
    out += [(r, "sample", rng.randrange(1 << 30)) for r in rows if rng.random() < sample_share]
    return out


def done_keys(path):
    """(id, mode) of the answers in the log `path` (a torn last line left out: that answer is made again)."""
    if not os.path.exists(path):
        return set()
    return {(r["id"], r["mode"]) for r in read_jsonl(path, "answers file", ("id", "mode"), torn_last="skip")}


@torch.no_grad()
def hf_answers(hf, prompts, max_new_tokens, eos, sample=False, temperature=0.7, top_p=0.9, seed=0):
    """transformers' generate on a batch of token-id prompts (left-padded). -> new tokens per prompt, up to EOS."""
    S = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), S), eos, dtype=torch.int64)
    att = torch.zeros(len(prompts), S, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, S - len(p):] = torch.tensor(p)
        att[i, S - len(p):] = 1
    kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if sample else dict(do_sample=False)
    if sample:
        torch.manual_seed(seed)
    out = hf.generate(input_ids=ids.to(hf.device), attention_mask=att.to(hf.device), max_new_tokens=max_new_tokens,
                      eos_token_id=eos, pad_token_id=eos, **kw)[:, S:].tolist()
    return [o[:o.index(eos) + 1] if eos in o else o for o in out]


@torch.no_grad()
def write_answers(model, tok, rows, path, max_new_tokens=256, sample_share=0.4, temperature=0.7, top_p=0.9,
                  batch=32, max_prompt_tokens=512, seed=0, progress=True, hf=None):
    """Answer every row (greedy, plus sampled for a share) and append one JSON line per answer to `path`.

    Greedy answers run in batches of prompts of similar length (short prompts pad less); sampled ones one batch
    per seed group. Returns the number of answers written by this call."""
    have = done_keys(path)
    todo = [j for j in jobs(rows, sample_share, seed) if (j[0]["id"], j[1]) not in have]
    enc = {}
    for r, _, _ in todo:
        if r["id"] not in enc:
            enc[r["id"]] = chat_ids(tok, r["text"])[-max_prompt_tokens:]
    todo.sort(key=lambda j: (j[1], len(enc[j[0]["id"]])))     # similar lengths together; a batch shares a seed
    eos = tok.eos_token_id
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(todo), desc="answers", unit="answer")
    written = 0
    batches = [[j for j in todo if j[1] == m][i:i + batch] for m in ("greedy", "sample")
               for i in range(0, sum(j[1] == m for j in todo), batch)]          # one mode per batch
    with open_log(path) as f:
        for part in batches:
            mode = part[0][1]
            prompts = [enc[r["id"]] for r, _, _ in part]
            kw = dict(mtp=False, eos_token_id=eos)
            if mode == "sample":
                kw.update(temperature=temperature, top_p=top_p, seed=part[0][2])
            if hf is not None:
                answers = hf_answers(hf, prompts, max_new_tokens, eos, mode == "sample", temperature, top_p,
                                     part[0][2])
            else:
                answers = generate(model, prompts, max_new_tokens, **kw).tokens
            for (r, m, s), p, ans in zip(part, prompts, answers):
                f.write(json.dumps(dict(id=r["id"], category=r.get("category"), mode=m, seed=part[0][2],
                                        by="transformers" if hf is not None else "engine", prompt_ids=p,
                                        answer_ids=ans)) + "\n")
            f.flush()
            written += len(part)
            if bar:
                bar.update(len(part))
    if bar:
        bar.close()
    return written
