"""The MTP module for a frozen chat model, self-distilled from its own answers (`train_heads mtp`).

    python -m mtp_lab train_heads mtp --model smollm2-135m-instruct --answers runs/mtp/answers.jsonl \
        --work runs/mtp --out data/smollm2-135m-instruct-mtp --minutes 40

1. answers  the model's own greedy answers to the training prompts (`answers.py`, resumable; as for the heads)
2. cache    one pass of the frozen target over every prompt + answer stores its final-norm hidden states h at every
            position (bf16), the sequences, and where each answer starts
3. train    the unrolled module (mtp_module.MTPModule.unroll, `--unroll` steps of its own recurrence): step k at
            index m predicts token m + 2 and is scored where that token is an answer token:
                L = sum_k 0.8^k [ CE(p_target(. | h_{m+1}), softmax(L_V' f^(k)_m)) + w * SmoothL1(f^(k)_m, h_{m+1}) ]
            p_target: the target's own next-token distribution over the draft vocabulary V' (self-distillation);
            the feature term (EAGLE-1) keeps f close to the hidden state it stands in for; 0.8^k is EAGLE-3's weight
4. measure  teacher-forced top-1 accuracy of every unroll step on answers held back from training (the last
            `--val-share` of the rows), i.e. the acceptance of depth k + 1 given the depths before it were right
"""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from ..cli import add_common, float_in, int_at_least
from mtp_triton.generate import causal_chains
from mtp_triton.heads import load_heads
from mtp_triton.loading import load_model
from mtp_triton.mtp_module import MTPModule
from mtp_triton.ops import get_ops
from ..records import ensure_writable_dir, env_info, read_jsonl, load_torch, save_torch, write_json

ANSWER_FIELDS = ("mode", "prompt_ids", "answer_ids")      # what an --answers line needs here
from .loop import Loop, LoopConfig, Recorder


@torch.no_grad()
def sequence_hidden(model, seqs, batch=16):
    """Per token list: the target's final-norm hidden states at every position [S, D] (model dtype, CPU)."""
    ops = get_ops("torch", model.device)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    res = [None] * len(seqs)
    for i in range(0, len(order), batch):
        part = [seqs[j] for j in order[i:i + batch]]
        tokens, positions, mask, _ = causal_chains(part, model.device)
        B, S = tokens.shape
        h, _, _ = model.forward_tree(tokens, positions, mask, model.new_cache([S] * B),
                                     torch.arange(B, device=model.device), ops, check_values=False, exact=False)
        for b, j in enumerate(order[i:i + batch]):
            res[j] = h[b, :len(seqs[j])].cpu()
    return res


def build_cache(model, rows, batch=16, max_len=512):
    """{ids: [S] per row, h: [S, D] per row, start: index of each row's first answer token}; rows longer than
    max_len keep their last max_len tokens (the answer's end)."""
    seqs, starts = [], []
    for r in rows:
        s = (r["prompt_ids"] + r["answer_ids"])[-max_len:]
        seqs.append(s)
        starts.append(max(len(s) - len(r["answer_ids"]), 1))
    return dict(ids=[torch.tensor(s) for s in seqs], h=sequence_hidden(model, seqs, batch), start=starts)


def batch_of(cache, idx, device="cpu"):
    """Rows idx as padded tensors: h [B, S, D] fp32, nxt [B, S] (the token after m), tgt_ok [B, S] (m + 2 is an answer
    token of the row), and the padded ids [B, S]."""
    S = max(cache["ids"][i].numel() for i in idx)
    D = cache["h"][idx[0]].shape[-1]
    B = len(idx)
    h, ids = torch.zeros(B, S, D), torch.zeros(B, S, dtype=torch.int64)
    ok = torch.zeros(B, S, dtype=torch.bool)
    for b, i in enumerate(idx):
        n = cache["ids"][i].numel()
        h[b, :n], ids[b, :n] = cache["h"][i].float(), cache["ids"][i]
        m = torch.arange(S)
        ok[b] = (m + 2 >= cache["start"][i]) & (m + 2 < n)
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)
    return h.to(device), nxt.to(device), ok.to(device), ids.to(device)


def unroll_losses(module, embed, lm_v, h, nxt, ok, ids, steps, feature_weight, token_map):
    """The loss of the module docstring and, per unroll step k, (loss_k, teacher-forced top-1 hits, positions)."""
    outs = module.unroll(embed, h, nxt, steps)
    total, parts = 0.0, []
    idx_of = None if token_map is None else torch.full((embed.shape[0],), -1, dtype=torch.int64).scatter_(
        0, token_map, torch.arange(token_map.numel()))
    for k, f in enumerate(outs):
        m = torch.arange(h.shape[1])
        sel = ok & (m >= k)[None, :]                                                 # [B, S]
        sel[:, -1] = False
        b, j = sel.nonzero(as_tuple=True)
        if b.numel() == 0:
            continue
        target_h = h[b, j + 1]                                                       # h_{m+1}  [N, D]
        with torch.no_grad():
            p = torch.softmax((target_h.to(lm_v.dtype) @ lm_v.T).float(), -1)        # [N, V']
        logq = torch.log_softmax((f[b, j].to(lm_v.dtype) @ lm_v.T).float(), -1)
        ce = -(p * logq).sum(-1).mean()
        reg = F.smooth_l1_loss(f[b, j].float(), target_h.float())
        total = total + 0.8 ** k * (ce + feature_weight * reg)
        tok = ids[b, j + 2]
        want = tok if idx_of is None else idx_of[tok]
        hits = int((logq.argmax(-1) == want).sum())
        parts.append((k, ce.item(), reg.item(), hits, int(b.numel())))
    return total, parts


def train(module, model, cache, train_idx, minutes, steps, batch, lr, unroll, feature_weight, seed, checkpoint,
          records):
    """The shared loop over random batches of training rows. Returns (steps done, training seconds)."""
    embed = model.embed_tokens.weight.detach().float()
    lm_v = module.lm_rows(model.lm_head.weight.detach()).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    loop = Loop(module.parameters(), LoopConfig(steps=steps, max_minutes=minutes, lr=lr, warmup=50, log_every=10,
                                                desc="mtp module", checkpoint=checkpoint, clip=1.0),
                state=(gen.get_state, gen.set_state))
    loop.resume()
    order = sorted(train_idx, key=lambda i: cache["ids"][i].numel())                 # similar lengths together
    groups = [order[i:i + batch] for i in range(0, len(order), batch)]

    def step_fn(step):
        idx = groups[int(torch.randint(0, len(groups), (1,), generator=gen))]
        h, nxt, ok, ids = batch_of(cache, idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, parts = unroll_losses(module, embed, lm_v, h, nxt, ok, ids, unroll, feature_weight,
                                        module.token_map)
        loss.backward()
        out = {"loss": loss.item()}
        for k, ce, reg, hits, n in parts:
            out[f"ce{k}"], out[f"acc{k}"] = ce, hits / n
        return out

    rec = Recorder(records, "train_mtp")
    done = loop.run(step_fn, rec)
    rec.write()
    return done, loop.elapsed


@torch.no_grad()
def accuracy(module, model, cache, idx, unroll, batch=8):
    """Teacher-forced top-1 accuracy of each unroll step (the module's drafted token = the answer's token) on rows
    idx: [acc of depth 1, acc of depth 2 given depth 1 right, ...]."""
    embed = model.embed_tokens.weight.detach().float()
    lm_v = module.lm_rows(model.lm_head.weight.detach()).to(torch.bfloat16)
    hits, n = [0] * unroll, [0] * unroll
    for i in range(0, len(idx), batch):
        h, nxt, ok, ids = batch_of(cache, idx[i:i + batch])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, parts = unroll_losses(module, embed, lm_v, h, nxt, ok, ids, unroll, 0.0, module.token_map)
        for k, _, _, hk, nk in parts:
            hits[k] += hk
            n[k] += nk
    return [h / max(c, 1) for h, c in zip(hits, n)]


def run(args):
    """The `mtp` subcommand: answers -> cache -> train -> held-back accuracy -> save."""
    torch.set_num_threads(args.threads)
    t0 = time.time()
    # everything that can be checked before the model loads: the answers (each line with its fields) and --out
    rows = [r for r in read_jsonl(args.answers, "--answers", ANSWER_FIELDS, torn_last="skip")
            if r["mode"] == "greedy"]
    if not rows:
        raise ValueError(f"--answers {args.answers}: no greedy answers (write them with `train_heads distill` or "
                         f"mtp_lab.training.answers.write_answers)")
    ensure_writable_dir(args.out)
    model = load_model(args.model, device="cpu", dtype=torch.bfloat16)
    os.makedirs(args.work, exist_ok=True)
    token_map = load_heads(args.vocab_from).token_map if args.vocab_from else None
    cache_file = os.path.join(args.work, f"module-cache-{len(rows)}.pt")
    if os.path.exists(cache_file):
        cache = load_torch(cache_file, "cache")
    else:
        cache = build_cache(model, rows, max_len=args.max_len)
        save_torch(cache, cache_file)
    t_cache = time.time() - t0
    n_val = max(1, int(len(rows) * args.val_share))
    val_idx, train_idx = list(range(len(rows) - n_val, len(rows))), list(range(len(rows) - n_val))
    module = MTPModule.from_target(model, token_map)
    module.train()
    records = args.records or os.path.join(args.out, "records")
    steps, train_s = train(module, model, cache, train_idx, args.minutes, args.steps, args.batch, args.lr,
                           args.unroll, args.feature_weight, args.seed, os.path.join(args.work, "module-ckpt.pt"),
                           records)
    module.eval()
    t1 = time.time()
    acc = accuracy(module, model, cache, val_idx, max(args.unroll, 4))
    t_measure = time.time() - t1
    info = dict(env_info(), command="python -m mtp_lab " + " ".join(sys.argv[1:]), model=args.model,
                answers=args.answers, rows=len(rows), train_rows=len(train_idx),
                val_rows=n_val, answer_tokens=sum(len(r["answer_ids"]) for r in rows),
                answers_by=_count(r.get("by", "unrecorded") for r in rows),
                draft_vocab=None if token_map is None else int(token_map.numel()), steps=steps,
                seconds=dict(cache=round(t_cache, 1), train=round(train_s, 1), measure=round(t_measure, 1)),
                val_accuracy_by_depth=acc, threads=torch.get_num_threads(),
                params=sum(p.numel() for p in module.parameters()),
                config={k: v for k, v in vars(args).items() if k != "func"})
    module.to(torch.bfloat16).save(args.out, recipe="mtp", base=args.model,
                                   note="self-distilled on a frozen base from its own answers; predicts token m + 2 "
                                        "from (h_m, x_{m+1}), recurrently")
    write_json(os.path.join(records, "train_mtp.json"), info)
    print(json.dumps({k: info[k] for k in ("rows", "answer_tokens", "steps", "seconds", "val_accuracy_by_depth")}))
    return info


def _count(items):
    out = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def add_arguments(sp):
    add_common(sp, "model", model="smollm2-135m-instruct")
    sp.add_argument("--answers", default=os.path.join("runs", "mtp", "answers.jsonl"),
                    help="the model's own answers (JSONL written by mtp_lab.training.answers.write_answers)")
    sp.add_argument("--vocab-from", default=os.path.join("data", "smollm2-135m-instruct-heads"),
                    help="heads folder whose draft vocabulary (token_map) the module scores ('' for the whole vocabulary)")
    sp.add_argument("--work", default=os.path.join("runs", "mtp"), help="hidden-state cache and checkpoint")
    add_common(sp, "out", out=os.path.join("data", "smollm2-135m-instruct-mtp"))
    sp.add_argument("--records", default=None, help="default: <out>/records")
    sp.add_argument("--max-len", type=int_at_least(8), default=512)
    sp.add_argument("--val-share", type=float_in(0, 0.5, low_open=True), default=0.03,
                    help="the last share of the answers, held back from training, for the accuracy by depth")
    sp.add_argument("--unroll", type=int_at_least(1), default=3, help="steps of the training-time recurrence")
    sp.add_argument("--feature-weight", type=float_in(0), default=0.1, help="weight of the SmoothL1 feature term")
    sp.add_argument("--minutes", type=float_in(0, low_open=True), default=40.0, help="training time budget")
    sp.add_argument("--steps", type=int_at_least(1), default=100000)
    sp.add_argument("--batch", type=int_at_least(1), default=8, help="sequences per step")
    sp.add_argument("--lr", type=float_in(0, low_open=True), default=5e-4)
    add_common(sp, "seed", "threads")
