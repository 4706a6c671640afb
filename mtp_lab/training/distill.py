"""Heads for a frozen chat model, distilled from its own answers (the recipe behind the shipped SmolLM2 heads).

    python -m mtp_lab train_heads distill --model smollm2-135m-instruct --prompts data/chat/train.jsonl \
        --work runs/smollm2 --out data/smollm2-135m-instruct-heads --minutes 30

0. prompts  optional (`--self-prompts N`): N more prompts the model writes itself, Magpie-style (`self_prompts.py`)
1. answers  the model answers every training prompt greedily, a share also by sampling (`answers.py`; resumable)
2. vocab    the draft vocabulary: the N most frequent tokens of those answers (FR-Spec, Zhao et al. 2025, ranks
            the drafter's vocabulary by frequency the same way); drafting scores only those rows of the LM head
3. cache    one teacher-forced pass stores, at every answer position t, the final-norm hidden state x_t and the
            base's own next-token distribution over the draft vocabulary (its top-K, renormalised); a later run with
            more answers extends the cache (`replay.extend_cache`), keeping its draft vocabulary
4. train    head h at position t learns the base's distribution at t + h + 1 (which predicts token t + h + 2):
                L_h = - sum_k p_base(k | x_{t+h+1}) log softmax(lm_head_V'(z_h(x'_t)))_k,   z_h = x' + silu(W_h x' + b_h)
            with x' = x + P e_root (the root, token t + 1, is the answer's own next token; `--no-root-input`: x' = x);
            with `--token-inputs Q` head h reads s_h = x' + sum_{q < min(h, Q)} Q_q e(answer token t + 1 + h - q)
            instead of x' (teacher forcing: at decode time those are the drafted tokens of the node's path, and on
            the path that gets accepted they are the answer's own tokens); the base never changes, so training
            touches only the cache; W_h, P and Q_q start at 0 (each head starts as the LM head, as in Medusa, Cai
            et al. 2024)
5. measure  on held-out answers: per-head top-k accuracy against the base's greedy token and the exact greedy tau of
            any tree (`replay.simulate_tau`: greedy MTP emits the serial tokens, so replaying the serial answer with the
            heads' top-k at each accepted position gives the tokens per step a real run would have)

Everything is bf16 on the CPU (the engine's exact mode, so MTP stays token-identical to serial decoding).
"""
import argparse
import collections
import json
import os
import time

import torch
import torch.nn.functional as F

from ..bundle import transformers_model
from ..cli import add_common, float_in, int_at_least
from mtp_triton.heads import MTPHeads
from mtp_triton.loading import load_model, load_tokenizer
from ..records import ensure_writable_dir, read_jsonl, load_torch, save_torch, write_json
from mtp_triton.tree import get_tree
from .answers import read_prompts, write_answers
from . import measure, replay
from .measure import budget_list
from .self_prompts import write_self_prompts
from .loop import Loop, LoopConfig, Recorder


def read_answers(path, ids=None):
    """The answer rows of `path` (those of prompts in `ids`, if given), in file order."""
    rows = [r for r in read_jsonl(path, "answers file", ("id", "mode", "prompt_ids", "answer_ids"), torn_last="skip") if ids is None or r["id"] in ids]
    return rows


def draft_vocab(rows, size, always=()):
    """token_map: the `size` most frequent answer tokens (plus `always`, e.g. EOS), as increasing ids."""
    counts = collections.Counter(t for r in rows for t in r["answer_ids"])
    keep = set(always) | {t for t, _ in counts.most_common(max(size - len(set(always)), 0))}
    return torch.tensor(sorted(keep), dtype=torch.int64)


def coverage(rows, token_map):
    """Share of answer tokens that are in the draft vocabulary (an upper bound on any head's accuracy)."""
    inside = set(token_map.tolist())
    toks = [t for r in rows for t in r["answer_ids"]]
    return sum(t in inside for t in toks) / max(len(toks), 1)


def head_loss(heads, sub, cache, i, x, h):
    """Soft cross-entropy of head h at positions i against the base's distribution at i + h + 1 (same answer);
    x [len(i), D]: the heads' inputs x' at those positions (`head_inputs`)."""
    w, b = heads.res_weight[h], heads.res_bias[h]
    keep = cache["ok"][i, h]
    i, x = i[keep], x[keep]
    if i.numel() == 0:
        return None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = x + F.silu(x @ w.T + b)
        logits = z @ sub.T                                                        # [M, V']
    logq = torch.log_softmax(logits.float(), -1)
    t = i + h + 1
    p = cache["tgt_p"][t].float()
    return -(p * logq.gather(1, cache["tgt_idx"][t].long())).sum(-1).mean()


def train(heads, model, cache, minutes, steps=100000, batch=512, lr=2e-3, seed=0, checkpoint=None, out_dir=None,
          resume=True):
    """Train the heads on the cache with the shared loop (time-budgeted, resumable). Returns the steps done."""
    sub = model.lm_head.weight.detach()[cache["token_map"]].to(torch.bfloat16)  # frozen rows, bf16 matmuls
    embed = model.embed_tokens.weight.detach()
    gen = torch.Generator().manual_seed(seed)
    starts = torch.nonzero(cache["ok"][:, 0])[:, 0]
    loop = Loop(heads.parameters(), LoopConfig(steps=steps, max_minutes=minutes, lr=lr, warmup=100, log_every=25,
                                               desc="distill", checkpoint=checkpoint),
                state=(gen.get_state, gen.set_state))
    if resume:
        loop.resume()

    def step_fn(step):
        i = starts[torch.randint(0, starts.numel(), (batch,), generator=gen)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            xp = replay.head_inputs(heads, embed, cache, i, torch.float32)   # x' once for all heads   [batch, D]
        x = xp.detach().requires_grad_(heads.root_input)            # the heads' gradients w.r.t. x' meet here
        out = {}
        for h in range(heads.num_heads):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                s = replay.path_inputs(heads, embed, cache, i, x, h)            # + Q_q e(y_{h-q}) (token inputs)   [batch, D]
            loss = head_loss(heads, sub, cache, i, s, h)
            if loss is not None:
                (loss / heads.num_heads).backward()              # one head's [M, V'] logits alive at a time
                out[f"loss_head{h}"] = loss.item()
        if x.grad is not None:
            xp.backward(x.grad)                                  # then P's gradient, in one pass
        out["loss"] = sum(out.values()) / max(len(out), 1)
        return out

    rec = Recorder(out_dir, "train_distill") if out_dir else None
    done = loop.run(step_fn, rec)
    if rec:
        rec.write()
    return done, loop.elapsed


def new_heads(model, num_heads, token_map, root_input=True, token_inputs=0):
    heads = MTPHeads(num_heads, model.config.hidden_size, dtype=torch.float32,   # W_h = 0, P = 0, Q = 0: each head
                     root_input=root_input, token_inputs=token_inputs)            # = the LM head
    heads.token_map = token_map
    return heads


def run(args):
    """The `distill` subcommand: answers -> vocab -> cache -> train -> measure -> choose the tree -> save."""
    torch.set_num_threads(args.threads)
    t0 = time.time()
    ensure_writable_dir(args.out)               # a bad --out fails now, not after the answers, cache and training
    model = load_model(args.model, device="cpu", dtype=torch.bfloat16)
    tok = load_tokenizer(args.model)
    hf = None
    if args.answers_by == "transformers":
        hf = transformers_model(args.model, dtype=torch.bfloat16)
    os.makedirs(args.work, exist_ok=True)
    records = args.records or os.path.join(args.out, "records")
    prompts = read_prompts(args.prompts)
    self_rows = []
    if args.self_prompts:                       # Magpie-style prompts the model writes, none equal to a held-out one
        held_texts = [r["text"] for p in (args.heldout, args.heldout_chat) for r in read_prompts(p)]
        self_rows = write_self_prompts(tok, os.path.join(args.work, "self-prompts.jsonl"), args.self_prompts,
                                       hf=hf, model=None if hf is not None else model, batch=args.gen_batch,
                                       seed=args.seed, avoid=held_texts)
    t_prompts = time.time() - t0
    prompts = prompts + self_rows
    answers_file = os.path.join(args.work, "answers.jsonl")
    write_answers(model, tok, prompts, answers_file, args.max_new_tokens, args.sample_share, batch=args.gen_batch,
                  hf=hf)
    del hf
    t_answers = time.time() - t0 - t_prompts
    rows = read_answers(answers_file, {r["id"] for r in prompts})
    cache_file = os.path.join(args.work, f"cache-v{args.vocab}-k{args.top_k}.pt")
    if os.path.exists(cache_file):              # built before: add the answers it lacks (same draft vocabulary)
        cache, added = replay.extend_cache(model, load_torch(cache_file, "cache"), rows, args.num_heads)
        if added:
            save_torch(cache, cache_file)
        token_map = cache["token_map"]
        cache_origin = dict(fresh=False, rows_added=added)      # the card says where the vocabulary came from
    else:
        token_map = draft_vocab(rows, args.vocab, always=[tok.eos_token_id])
        cache = replay.build_cache(model, rows, token_map, args.top_k, num_heads=args.num_heads)
        save_torch(cache, cache_file)
        cache_origin = dict(fresh=True, rows_added=len(rows))
    t_cache = time.time() - t0 - t_prompts - t_answers
    heads = new_heads(model, args.num_heads, token_map, args.root_input, args.token_inputs)
    steps, train_s = train(heads, model, cache, args.minutes, steps=args.steps, batch=args.batch, lr=args.lr,
                           seed=args.seed,
                           checkpoint=os.path.join(args.work, "heads-ckpt.pt"), out_dir=records)
    del cache

    # held-out: this engine's own greedy answers (what MTP must reproduce), on both held-out sets
    t1 = time.time()
    held = {}
    for name, path in (("templated", args.heldout), ("chat", args.heldout_chat)):
        hp = read_prompts(path)
        f = os.path.join(args.work, f"heldout-{name}.jsonl")
        write_answers(model, tok, hp, f, args.eval_new_tokens, sample_share=0.0, batch=args.gen_batch)
        held[name] = read_answers(f, {r["id"] for r in hp})
    trees = {n: get_tree(n) for n in ("chain-2", "chain-3", "chain-4", "chain-8", "medusa-8", "medusa-16",
                                         "medusa-32")}
    trees = {n: t for n, t in trees.items() if t.max_depth <= args.num_heads}
    ev = {name: measure.evaluate_heads(model, heads, r, trees) for name, r in held.items()}
    tree, table = measure.choose_tree(model, heads, held["templated"], budgets=args.budgets,
                                      min_speedup=args.min_speedup)
    for name in ev:                             # the chosen tree's tau on every held-out set and category
        for cat, e in ev[name].items():
            part = held[name] if cat == "all" else [r for r in held[name] if r.get("category") == cat]
            c = replay.build_cache(model, [r for r in part if r["mode"] == "greedy"], token_map, 1, num_heads=args.num_heads)
            e["tau"]["chosen"] = replay.simulate_tau(replay.head_ranks(heads, model, c), replay.lengths_of(part), tree)
    t_measure = time.time() - t1
    heads.tree = [list(p) for p in tree.paths[1:]]
    # seconds per phase, summed over the invocations that did the work (a resumed run adds only what it redid)
    spent = dict(prompts=t_prompts, answers=t_answers, cache=t_cache, train=train_s, measure=t_measure)
    timing_file = os.path.join(args.work, "timings.json")
    past = json.load(open(timing_file)) if os.path.exists(timing_file) else {}
    total = {k: past.get(k, 0.0) + v for k, v in spent.items() if k != "train"}
    total["train"] = train_s                                 # the Loop already sums training time over resumes
    total["invocations"] = past.get("invocations", 0) + 1
    write_json(timing_file, total)
    info = dict(model=args.model, prompts=args.prompts, self_prompts=dict(collections.Counter(r["category"]
                                                                                             for r in self_rows)),
                answers=len(rows), answer_tokens=sum(replay.lengths_of(rows)), cache=cache_origin,
                answers_by=dict(collections.Counter(r.get("by", "unrecorded") for r in rows)), draft_vocab=len(token_map), coverage_train=coverage(rows, token_map),
                coverage_heldout={n: coverage(r, token_map) for n, r in held.items()}, steps=steps,
                seconds={k: round(v, 1) for k, v in total.items() if k != "invocations"},
                invocations=total["invocations"],
                threads=torch.get_num_threads(), heldout=ev, tree_nodes=tree.size,
                config={k: v for k, v in vars(args).items() if k != "func"})
    heads = heads.to(torch.bfloat16)            # 8 heads x 576^2: 5.3 MB in bf16 (the heads run in bf16 anyway)
    heads.save(args.out, recipe="distill", base=args.model, tuning=table,
               note="self-distilled on a frozen base from its own answers; head h predicts token t + h + 2")
    write_json(os.path.join(records, "train_distill.json"), info)
    print(json.dumps({k: info[k] for k in ("answers", "answer_tokens", "draft_vocab", "coverage_train", "steps",
                                           "tree_nodes", "seconds")}))
    return info


def add_arguments(sp):
    """The `distill` options (registered in mtp_lab/train_heads.py); every number is range-checked here."""
    add_common(sp, "model", model="smollm2-135m-instruct")
    sp.add_argument("--prompts", default=os.path.join("data", "chat", "train.jsonl"))
    sp.add_argument("--heldout", default=os.path.join("data", "chat", "heldout_templated.jsonl"))
    sp.add_argument("--heldout-chat", default=os.path.join("data", "chat", "heldout_chat.jsonl"))
    sp.add_argument("--work", default=os.path.join("runs", "smollm2"), help="answers, cache and checkpoints")
    add_common(sp, "out", out=os.path.join("data", "smollm2-135m-instruct-heads"))
    sp.add_argument("--records", default=None, help="default: <out>/records")
    sp.add_argument("--answers-by", default="transformers", choices=["transformers", "engine"],
                    help="who writes the training answers (held-out answers always come from this engine)")
    sp.add_argument("--num-heads", type=int_at_least(1), default=8, help="8: enough for the MTP-8 row of the depth sweep")
    sp.add_argument("--root-input", action=argparse.BooleanOptionalAction, default=True,
                    help="the heads also read the root token (x' = x + P e_root); --no-root-input: Medusa's heads")
    sp.add_argument("--token-inputs", type=int_at_least(0), default=0,
                    help="Q: head h also reads the last min(h, Q) drafted tokens of its path (Hydra-style; 0: none)")
    sp.add_argument("--vocab", type=int_at_least(1), default=8192, help="draft vocabulary size")
    sp.add_argument("--top-k", type=int_at_least(1), default=16, help="soft targets kept per position")
    add_common(sp, "max-new-tokens", max_new_tokens=256)
    sp.add_argument("--eval-new-tokens", type=int_at_least(1), default=192)
    sp.add_argument("--sample-share", type=float_in(0, 1), default=0.4, help="share of prompts also answered by "
                    "sampling (0 to 1)")
    sp.add_argument("--self-prompts", type=int_at_least(0), default=0,
                    help="also answer this many prompts the model writes itself (Magpie-style, self_prompts.py; needs a chat "
                         "template; the shipped SmolLM2 heads used 2400)")
    sp.add_argument("--gen-batch", type=int_at_least(1), default=32)
    sp.add_argument("--minutes", type=float_in(0, low_open=True), default=30.0, help="training time budget")
    sp.add_argument("--steps", type=int_at_least(1), default=6000, help="training step budget (whichever ends first)")
    sp.add_argument("--batch", type=int_at_least(1), default=1024)
    sp.add_argument("--lr", type=float_in(0, low_open=True), default=2e-3)
    add_common(sp, "seed", "threads")
    sp.add_argument("--budgets", type=budget_list, default="1,2,3,4,6,8,12,16,24,32",
                    help="tree sizes (drafts) to choose from")
    sp.add_argument("--min-speedup", type=float_in(0, low_open=True), default=None,
                    help="ship the most accepting tree predicted at least this fast (default: the fastest predicted)")
