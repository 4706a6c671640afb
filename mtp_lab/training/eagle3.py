"""EAGLE-3's drafter for a frozen chat model, self-distilled from its own answers (`train_heads eagle3`).

    python -m mtp_lab train_heads eagle3 --answers data/smollm2-135m-instruct-answers \
        --work runs/eagle3 --out data/smollm2-135m-instruct-eagle3 --minutes 60

Resumable: the checkpoint in --work holds the weights, the optimizer, the batch generator and the curve, and the
draft vocabulary is fixed by the first run (`--work`/vocab.pt); a rerun continues, on whatever answers the shards
hold by then, until --minutes of training in total. --out gets the drafter (EAGLE-3's files, eagle3.py) at every
periodic checkpoint and at the end, with the records.

1. split    answers are held back by prompt id (sha256, `--val-percent`): a prompt's greedy and sampled answers sit
            on one side; held-back greedy answers give the learning curve and the accuracy by depth
2. vocab    the draft vocabulary: the `--vocab` answer tokens most frequent in the training answers (EAGLE-3's
            d2t/t2d), the drafter's own LM head started from the target's rows
3. target   per batch, one no-grad pass of the frozen target (`forward_tree(taps=)`): the residual streams at the
            taps (2, L // 2, L - 3) at every position, its final hidden state (whose LM-head columns token_map are
            its next-token logits over the draft vocabulary) and its choice over the whole vocabulary. Kept on disk
            per sequence (`TargetCache`, in --work), so every later epoch, resumed run and held-back measurement
            reads them instead of running the target again
4. train    the unrolled drafter (`DraftBlock.unroll`, `--unroll` steps: training-time test): step k at index m
            predicts token m + 2 and is scored where that token is an answer token and the target's choice there is
            in the draft vocabulary:
                L = sum_k 0.8^k CE(softmax_V'(target logits at m + 1), softmax(W_lm RMSNorm(y^(k)_m)))
            soft cross-entropy against the target's own distribution, no feature-regression term (EAGLE-3)
5. measure  teacher-forced top-1 accuracy of every unroll step on held-back greedy answers: the chance that depth
            k + 1 of a chain is accepted once the depths above it were
"""
import hashlib
import json
import os
import sys
import time

import torch

from ..bundle import command_dtype
from ..cli import add_common, float_in, int_at_least
from ..corpus import split_of
from ..records import ensure_writable_dir, env_info, load_torch, save_torch, write_json
from .answers import read_answer_shards
from .loop import Loop, LoopConfig, Recorder
from mtp_triton.eagle3 import Eagle3Module, default_taps
from mtp_triton.generate import causal_chains
from mtp_triton.loading import load_model
from mtp_triton.ops import get_ops
from mtp_triton.version import package_hash

WEIGHTS = 0.8                                     # EAGLE-3's weight of unroll step k: 0.8^k


def split(rows, val_percent):
    """(train rows, held-back rows): by prompt id, so both answers to one prompt fall on one side."""
    train, val = [], []
    for r in rows:
        (val if split_of(str(r["id"]), val_percent) == "val" else train).append(r)
    return train, val


def draft_vocab(rows, size, vocab_size):
    """The `size` most frequent answer tokens of `rows` (ties: the lower id), sorted: [V'] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for r in rows:
        counts += torch.bincount(torch.tensor(r["answer_ids"], dtype=torch.int64), minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))[:size]
    return torch.tensor(sorted(order), dtype=torch.int64)


def sequences(rows, max_len):
    """(token lists, index of each one's first answer token): prompt + answer, the last max_len tokens."""
    seqs, starts = [], []
    for r in rows:
        s = (r["prompt_ids"] + r["answer_ids"])[-max_len:]
        seqs.append(s)
        starts.append(max(len(s) - len(r["answer_ids"]), 1))
    return seqs, starts


@torch.no_grad()
def target_pass(model, seqs, taps):
    """The frozen target over a padded batch: feats [B, S, len(taps) D] (fp32) at the taps, the final hidden state
    h [B, S, D] (fp32; the LM head's input), its choice over the whole vocabulary [B, S] and ids [B, S] (padding 0).
    The LM head runs one row at a time ([S, V] each)."""
    tokens, positions, mask, _ = causal_chains(seqs, model.device)
    B, S = tokens.shape
    h, _, _, feats = model.forward_tree(tokens, positions, mask, model.new_cache([S] * B),
                                        torch.arange(B, device=model.device), get_ops("torch", model.device),
                                        check_values=False, exact=False, taps=taps)
    choice = torch.stack([model.logits(row).argmax(-1) for row in h])
    return feats.float(), h.float(), choice, tokens


class TargetCache:
    """`target_pass` per sequence, computed once and kept in a folder: one file per sequence, named by a hash of
    its tokens, holding its taps' streams [S, len(taps) D] and final hidden state [S, D] in bf16 (what EAGLE-3's
    data pipeline stores) and the target's choice [S]. meta.json names the target, its dtype, the taps, its config,
    the engine code and a sample of LM-head rows; a folder made for anything else is refused. Rows of a padded batch
    do not see one another, so a sequence's outputs do not depend on the batch that computed them."""

    def __init__(self, folder, model, name, taps):
        self.folder, self.model, self.taps = folder, model, taps
        w = model.lm_head.weight.detach()
        meta = dict(target=name, dtype=str(model.dtype).replace("torch.", ""), taps=list(taps),
                    config=repr(model.config), code=package_hash(),
                    weights=hashlib.sha256(w[:: max(1, w.shape[0] // 64)].float().numpy().tobytes()).hexdigest()[:16])
        os.makedirs(folder, exist_ok=True)
        file = os.path.join(folder, "meta.json")
        if os.path.exists(file):
            with open(file, encoding="utf-8") as f:
                had = json.load(f)
            if had != meta:
                raise ValueError(f"{folder}: its target outputs were made for {had}, this run needs {meta}; delete "
                                 "the folder or give another --work")
        else:
            write_json(file, meta)
        self.computed = self.read = 0

    def _path(self, seq):
        digest = hashlib.sha256(torch.tensor(seq, dtype=torch.int64).numpy().tobytes()).hexdigest()[:24]
        return os.path.join(self.folder, f"{digest}.pt")

    def __call__(self, seqs):
        """target_pass(model, seqs, taps), its missing sequences computed (as one batch) and stored first."""
        paths = [self._path(s) for s in seqs]
        todo = [i for i, p in enumerate(paths) if not os.path.exists(p)]
        if todo:
            feats, h, choice, _ = target_pass(self.model, [seqs[i] for i in todo], self.taps)
            for j, i in enumerate(todo):
                n = len(seqs[i])
                save_torch(dict(feats=feats[j, :n].bfloat16(), h=h[j, :n].bfloat16(), choice=choice[j, :n].int()),
                           paths[i])
            self.computed += len(todo)
        self.read += len(seqs) - len(todo)
        got = [load_torch(p, "target cache") for p in paths]
        B, S = len(seqs), max(len(s) for s in seqs)
        feats = torch.zeros(B, S, got[0]["feats"].shape[-1])
        h = torch.zeros(B, S, got[0]["h"].shape[-1])
        choice, ids = torch.zeros(B, S, dtype=torch.int64), torch.zeros(B, S, dtype=torch.int64)
        for b, (g, seq) in enumerate(zip(got, seqs)):
            n = len(seq)
            if g["choice"].shape[0] != n:
                raise ValueError(f"target cache {paths[b]}: holds {g['choice'].shape[0]} positions, the sequence "
                                 f"{n}; delete the file")
            feats[b, :n], h[b, :n], choice[b, :n] = g["feats"].float(), g["h"].float(), g["choice"].long()
            ids[b, :n] = torch.tensor(seq)
        dev = self.model.device
        return feats.to(dev), h.to(dev), choice.to(dev), ids.to(dev)


def batch_losses(module, embed, feats, logits_v, choice, ids, lens, starts, steps, index_of):
    """The loss of the module docstring and, per unroll step k, (k, soft CE, teacher-forced top-1 hits, positions).
    logits_v [B, S, V']: the target's logits over the draft vocabulary; choice [B, S]: its argmax over the whole
    vocabulary; index_of [V]: a target id's index in the draft vocabulary, -1 outside it."""
    B, S, _ = feats.shape
    m = torch.arange(S)
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)                                        # [B, S] the token at m + 1
    answer = (m[None, :] + 2 >= torch.tensor(starts)[:, None]) & (m[None, :] + 2 < torch.tensor(lens)[:, None])
    tgt = torch.cat([logits_v[:, 1:], logits_v[:, :1]], 1)                             # [B, S, V'] target at m + 1
    in_vocab = index_of[torch.cat([choice[:, 1:], choice[:, :1]], 1)] >= 0             # EAGLE-3's position mask
    outs = module.unroll(embed, feats, nxt, steps)
    w = module.lm_head.weight
    total, parts = 0.0, []
    for k, y in enumerate(outs):
        b, j = (answer & (m >= k)[None, :] & in_vocab).nonzero(as_tuple=True)
        if b.numel() == 0:
            continue
        p = torch.softmax(tgt[b, j], -1)                                                # [N, V']
        logq = torch.log_softmax((module.head_input(y[b, j]) @ w.T).float(), -1)
        ce = -(p * logq).sum(-1).mean()
        total = total + WEIGHTS ** k * ce
        want = index_of[ids[b, j + 2]]
        parts.append((k, ce.item(), int((logq.argmax(-1) == want).sum()), int(b.numel())))
    return total, parts


def groups_of(seqs, batch):
    """Indices of the rows in groups of `batch` of similar length (padding is little)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    return [order[i:i + batch] for i in range(0, len(order), batch)]


class Trainer:
    """The frozen target, the drafter and the data, with what a step and a measurement need."""

    def __init__(self, model, module, train_rows, val_rows, max_len, unroll, autocast, cache=None):
        self.model, self.module, self.unroll, self.autocast = model, module, unroll, autocast
        self.taps = module.taps
        self.target = cache if cache is not None else (lambda seqs: target_pass(model, seqs, self.taps))
        self.lm_rows = model.lm_head.weight.detach()[module.token_map].float()          # [V', D]
        self.embed = model.embed_tokens.weight.detach()
        V = model.config.vocab_size
        self.index_of = torch.full((V,), -1, dtype=torch.int64).index_copy_(
            0, module.token_map, torch.arange(len(module.token_map)))
        self.train_seqs, self.train_starts = sequences(train_rows, max_len)
        self.val_seqs, self.val_starts = sequences([r for r in val_rows if r["mode"] == "greedy"], max_len)

    def losses(self, seqs, starts):
        feats, h, choice, ids = self.target(seqs)
        logits_v = h @ self.lm_rows.T                                # [B, S, V']: the LM head's columns token_map
        with self.autocast():
            return batch_losses(self.module, self.embed.float(), feats, logits_v, choice, ids,
                                [len(s) for s in seqs], starts, self.unroll, self.index_of)

    @torch.no_grad()
    def accuracy(self, limit, batch=8):
        """(mean soft CE of step 0, [top-1 accuracy of each unroll step]) on the first `limit` held-back greedy
        answers."""
        hits, n, ce0, seen = [0] * self.unroll, [0] * self.unroll, 0.0, 0
        seqs, starts = self.val_seqs[:limit], self.val_starts[:limit]
        for g in groups_of(seqs, batch):
            _, parts = self.losses([seqs[i] for i in g], [starts[i] for i in g])
            for k, ce, hk, nk in parts:
                hits[k] += hk
                n[k] += nk
                if k == 0:
                    ce0, seen = ce0 + ce * nk, seen + nk
        return ce0 / max(seen, 1), [h / max(c, 1) for h, c in zip(hits, n)]


def run(args):
    """The `eagle3` subcommand: shards -> split -> vocabulary -> train (resumable) -> held-back accuracy -> save."""
    torch.set_num_threads(args.threads)
    t0 = time.time()
    rows = list(read_answer_shards(args.answers))
    if not rows:
        raise ValueError(f"--answers {args.answers}: no answers (write them with `train_heads answers`)")
    ensure_writable_dir(args.out)
    os.makedirs(args.work, exist_ok=True)
    dtype, why = command_dtype(args.dtype, args.model)
    model = load_model(args.model, device="cpu", dtype=dtype)
    print(f"eagle3: target in {model.dtype} ({why}); {len(rows)} answers", file=sys.stderr)
    train_rows, val_rows = split(rows, args.val_percent)
    vocab_file = os.path.join(args.work, "vocab.pt")
    if os.path.exists(vocab_file):                      # fixed by the first run: the checkpoint's LM head is over it
        token_map = load_torch(vocab_file, "draft vocabulary")
    else:
        token_map = draft_vocab(train_rows, args.vocab, model.config.vocab_size)
        save_torch(token_map, vocab_file)
    taps = default_taps(model.config.num_hidden_layers)
    module = Eagle3Module.from_target(model, token_map, taps, dict(depth=args.depth))
    module.train()
    bf16 = model.dtype == torch.bfloat16
    cache = None if args.no_target_cache else TargetCache(os.path.join(args.work, "target"), model, args.model, taps)
    trainer = Trainer(model, module, train_rows, val_rows, args.max_len, args.unroll,
                      lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), cache)
    records = args.records or os.path.join(args.out, "records")
    gen = torch.Generator().manual_seed(args.seed)
    loop = Loop(module.parameters(), LoopConfig(steps=args.steps, max_minutes=args.minutes, lr=args.lr,
                                                warmup=args.warmup,
                                                log_every=args.log_every, desc="eagle3", clip=1.0,
                                                checkpoint=os.path.join(args.work, "eagle3-ckpt.pt"),
                                                checkpoint_minutes=args.save_every_minutes),
                state=(gen.get_state, gen.set_state))
    start_step = loop.resume()
    rec = Recorder(records, "train_eagle3")
    groups = groups_of(trainer.train_seqs, args.batch)
    meta = dict(recipe="eagle3", base=args.model, answers=len(rows), train_answers=len(train_rows),
                answer_tokens=sum(len(r["answer_ids"]) for r in train_rows))

    def step_fn(step):
        g = groups[int(torch.randint(0, len(groups), (1,), generator=gen))]
        loss, parts = trainer.losses([trainer.train_seqs[i] for i in g], [trainer.train_starts[i] for i in g])
        loss.backward()
        out = {"loss": loss.item(), "positions": parts[0][3] if parts else 0}
        for k, ce, hits, n in parts:
            out[f"ce{k}"], out[f"acc{k}"] = ce, hits / n
        return out

    def on_log(row):
        if row["step"] % args.eval_every and row["step"] != 1:
            return {}
        module.eval()
        ce0, acc = trainer.accuracy(args.val_limit)
        module.train()
        return {"val_ce0": ce0, **{f"val_acc{k}": a for k, a in enumerate(acc)}}

    def on_save():
        _save(module, args.out, meta, loop)
        rec.write()

    steps = loop.run(step_fn, rec, on_log=on_log, on_save=on_save)
    rec.write()
    module.eval()
    t1 = time.time()
    ce0, acc = trainer.accuracy(args.final_val_limit)
    info = dict(env_info(), command="python -m mtp_lab " + " ".join(sys.argv[1:]), model=args.model,
                answers_dir=args.answers, **meta, val_answers=len(trainer.val_seqs),
                val_measured=min(args.final_val_limit, len(trainer.val_seqs)), draft_vocab=int(token_map.numel()),
                taps=list(taps), steps=steps, resumed_at=start_step, train_minutes=round(loop.elapsed / 60, 1),
                seconds=dict(total_this_run=round(time.time() - t0, 1), measure=round(time.time() - t1, 1)),
                val_ce0=ce0, val_accuracy_by_depth=acc, target_dtype=str(model.dtype), threads=torch.get_num_threads(),
                params=sum(p.numel() for p in module.parameters()),
                config={k: v for k, v in vars(args).items() if k != "func"})
    _save(module, args.out, meta, loop)
    write_json(os.path.join(records, "train_eagle3.json"), info)
    print(json.dumps({k: info[k] for k in ("answers", "answer_tokens", "steps", "train_minutes",
                                           "val_accuracy_by_depth")}))
    return info


def _save(module, out, meta, loop):
    """The drafter in EAGLE-3's files (bf16), with how far training got."""
    module.eval()
    copy = Eagle3Module(module.config, module.token_map, module.taps, module.draft)
    copy.load_state_dict(module.state_dict())
    copy.to(torch.bfloat16).save(out, **meta, steps=loop.step, train_minutes=round(loop.elapsed / 60, 1),
                                 note="self-distilled on a frozen base from its own answers (EAGLE-3's recipe: "
                                      "three feature layers, training-time test, soft cross-entropy)")
    module.train()


def add_arguments(sp):
    add_common(sp, "model", model="smollm2-135m-instruct")
    sp.add_argument("--answers", default=os.path.join("data", "smollm2-135m-instruct-answers"),
                    help="folder of answer shards (written by `train_heads answers`)")
    sp.add_argument("--work", default=os.path.join("runs", "eagle3"),
                    help="checkpoint, draft vocabulary and the target's outputs (target/: about 2 MB per answer)")
    add_common(sp, "out", out=os.path.join("data", "smollm2-135m-instruct-eagle3"))
    sp.add_argument("--records", default=None, help="default: <out>/records")
    sp.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                    help="the target's dtype (default: bf16 where the CPU multiplies it natively, else fp32)")
    sp.add_argument("--max-len", type=int_at_least(8), default=512)
    sp.add_argument("--no-target-cache", action="store_true",
                    help="run the target on every batch instead of keeping its outputs in <work>/target (4.6 kB "
                         "per token, prompt tokens included: about 2 MB per answer)")
    sp.add_argument("--val-percent", type=int_at_least(1), default=3, help="answers held back, by prompt id")
    sp.add_argument("--vocab", type=int_at_least(2), default=8192, help="draft vocabulary size (EAGLE-3: 32 k)")
    sp.add_argument("--unroll", type=int_at_least(1), default=5, help="steps of the training-time test")
    sp.add_argument("--depth", type=int_at_least(1), default=6, help="the dynamic tree's depth stored with it")
    sp.add_argument("--minutes", type=float_in(0, low_open=True), default=60.0,
                    help="training time budget, summed over resumed runs")
    sp.add_argument("--steps", type=int_at_least(1), default=100000)
    sp.add_argument("--batch", type=int_at_least(1), default=8, help="sequences per step")
    sp.add_argument("--lr", type=float_in(0, low_open=True), default=1e-3)
    sp.add_argument("--warmup", type=int_at_least(0), default=20, help="steps of linear warm-up")
    sp.add_argument("--log-every", type=int_at_least(1), default=10)
    sp.add_argument("--eval-every", type=int_at_least(1), default=100, help="steps between held-back measurements")
    sp.add_argument("--val-limit", type=int_at_least(1), default=24, help="held-back answers per curve point")
    sp.add_argument("--final-val-limit", type=int_at_least(1), default=96, help="held-back answers at the end")
    sp.add_argument("--save-every-minutes", type=float_in(0), default=10.0)
    add_common(sp, "seed", "threads")
