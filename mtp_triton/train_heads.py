"""Training MTP heads: two recipes, one command.

    python -m mtp_triton.train_heads joint  --tokenizer TOK --out MODEL_DIR ...   # base + heads from scratch
    python -m mtp_triton.train_heads frozen --model MODEL_DIR --out HEADS_DIR ...  # heads for a frozen base
    python -m mtp_triton.train_heads eval   --model MODEL_DIR --heads HEADS_DIR --prompts P.jsonl --out tau.json

For your own Llama checkpoint on a GPU (bf16 base, fp32 heads, hidden states cached once):
    python -m mtp_triton.train_heads frozen --model /ckpt/llama-7b --out /ckpt/llama-7b/heads --device cuda \
        --dtype bf16 --num-heads 4 --real-windows 512 --self-generated 512 --seq-len 1024 --prompt-len 128 \
        --data my_text.jsonl --steps 2000 --batch 8 --max-minutes 60

Heads (see `mtp_triton.heads`): head h reads the final-norm hidden state x_t and predicts the token at
t + h + 2 through the model's own LM head, z_h = x + silu(W_h x + b_h), logits_h = lm_head(z_h).

1. `joint` — multi-token-prediction pre-training (Gloeckle et al. 2024; DeepSeek-V3 §2.2): a fresh
   `LlamaForCausalLM` and its heads are trained together on
        L = CE(next token) + lambda * mean_h CE_h(token t + h + 2)
   (DeepSeek-V3 uses lambda = 0.3 then 0.1). The head losses also shape the trunk: its hidden state has to
   carry information about later tokens. To keep the extra cost small, each step evaluates the heads on a
   random fraction `--head-frac` of the positions (the LM head projection per head costs as much as the
   model's own output layer).
2. `frozen` — Medusa-1 self-distillation for an existing checkpoint: the base is frozen and only the heads
   learn, towards the base's own predictions, so the heads learn what the *base* would say:
        soft: L_h = KL(p_base(. | x_{t+h+1}) || softmax(lm_head(z_h(x_t))))      hard: CE to argmax p_base
   Since the base never changes, its hidden states are computed once and cached; training then touches
   only the cache (one D x D matmul and the LM head per head). `--self-generated N` adds N free-running
   greedy continuations of the base: those are the sequences the heads see at decode time (small models
   loop; heads trained on real text alone do not predict the loops).

Outputs (in --out): the model / heads folder, `train_<recipe>.json` (config, held-out loss, per-head
top-1 / top-5 accuracy, timing), `train_<recipe>_curve.csv` and `.png` (loss curve from the logged rows).
The frozen recipe also writes `accuracy.json` next to the heads: {"acc": acc[H][K], ...}, where acc[h][r] is
the held-out probability that rank r of head h equals the base's greedy token (input of
`Tree.from_accuracies`), measured on greedy continuations of held-out prompts.
"""
import argparse
import csv
import json
import math
import os
import time

import torch
import torch.nn.functional as F

from mtp_triton.heads import MTPHeads, load_heads

# ----------------------------------------------------------------------------------------------- data


def load_text_files(paths):
    """Texts from .txt/.py files (one document each) or .jsonl files (a "text" field per line)."""
    texts = []
    for p in paths:
        if p.endswith(".jsonl"):
            with open(p) as f:
                texts += [json.loads(line)["text"] for line in f if line.strip()]
        else:
            with open(p, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
    return texts


def token_streams(tokenizer, data_files=None, cache_dir=None, val_percent=5):
    """{'train': ids [N], 'val': ids [M]}: the stdlib corpus by default, else the given files split by index."""
    from mtp_triton import corpus
    if not data_files:
        docs = corpus.collect_stdlib(val_percent=val_percent)
        if cache_dir:
            return corpus.cached_token_streams(tokenizer, docs, cache_dir)
        return {s: corpus.encode_split(tokenizer, docs, s) for s in ("train", "val")}
    texts = load_text_files(data_files)
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


def lr_at(progress, step, base_lr, warmup, min_frac=0.1):
    """Linear warm-up for `warmup` steps, then cosine from base_lr to min_frac * base_lr at progress 1."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    return base_lr * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


# --------------------------------------------------------------------------------------------- models


def build_llama(vocab_size, layers=4, hidden=256, q_heads=4, kv_heads=2, intermediate=688, max_pos=2048,
                tie=False, eos_id=0, seed=0):
    """A small LlamaForCausalLM (GQA), built offline from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_pos, tie_word_embeddings=tie, bos_token_id=eos_id,
                      eos_token_id=eos_id, pad_token_id=eos_id, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def final_hidden(model, ids):
    """x [B, S, D]: the final-norm hidden state the LM head (and the MTP heads) read."""
    return model.model(input_ids=ids).last_hidden_state


def head_z(heads, x, h):
    """z_h = x + silu(W_h x + b_h) for one head (x [..., D] -> [..., D]); `heads(x)[..., h, :]` without the rest."""
    return x + F.silu(x @ heads.res_weight[h].T + heads.res_bias[h])


def autocast(dtype, device):
    if dtype == "bf16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return torch.autocast(device_type=torch.device(device).type, enabled=False)


# ------------------------------------------------------------------------------------------ recording


class Recorder:
    """Keeps the logged rows; writes the curve CSV and a PNG plotted from them."""

    def __init__(self, out_dir, name):
        self.rows, self.out_dir, self.name = [], out_dir, name

    def log(self, **row):
        self.rows.append(row)

    def write(self):
        os.makedirs(self.out_dir, exist_ok=True)
        keys = []
        for r in self.rows:
            keys += [k for k in r if k not in keys]
        path = os.path.join(self.out_dir, f"{self.name}_curve.csv")
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.rows)
        plot_curve(self.rows, os.path.join(self.out_dir, f"{self.name}_curve.png"), self.name)
        return path


def plot_curve(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    keys = []
    for r in rows:
        keys += [k for k in r if (k.startswith("loss") or k.startswith("val")) and k not in keys]
    for key in keys:
        pts = [(float(r["tokens"]), float(r[key])) for r in rows if r.get(key) not in (None, "")]
        if pts:
            ax.plot(*zip(*pts), label=key, marker="o" if key.startswith("val") else None, ms=3)
    ax.set_xlabel("training tokens (positions)")
    ax.set_ylabel("nats / position (CE, or KL for soft targets)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_curve_csv(csv_path):
    """Re-draw <name>_curve.png from the logged rows in <name>_curve.csv."""
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    png = csv_path[:-4] + ".png"
    plot_curve(rows, png, os.path.basename(csv_path)[:-len("_curve.csv")])
    return png


def write_json(path, obj):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


# ---------------------------------------------------------------------------------- evaluation helpers


@torch.no_grad()
def head_topk_accuracy(heads, lm_head, x, targets, valid, k=10):
    """acc [H, k]: P(rank r of head h == targets[t + h + 1]) over valid positions.

    x [N, S, D] hidden states; targets [N, S] the token each position's *next* slot should hold
    (real tokens shifted, or the base's argmax at each position); valid [N, S] bool.
    Head h at t is scored against targets[t + h + 1] (= the token at t + h + 2).
    """
    H, S = heads.num_heads, x.shape[1]
    hits = torch.zeros(H, k, dtype=torch.float64)
    for h in range(H):
        n = S - h - 1
        if n <= 0:
            continue
        ok = valid[:, :n] & valid[:, h + 1:]
        count = 0
        for i in range(0, x.shape[0], 8):
            z = head_z(heads, x[i:i + 8, :n].float(), h)
            top = lm_head(z).topk(k, dim=-1).indices                 # [b, n, k]
            tgt = targets[i:i + 8, h + 1:h + 1 + n]
            m = ok[i:i + 8]
            hits[h] += ((top == tgt.unsqueeze(-1)) & m.unsqueeze(-1)).sum(dim=(0, 1)).double()
            count += int(m.sum())
        hits[h] /= max(count, 1)
    return hits


def simulate_tau(topk, seqs, start, tree):
    """Exact greedy tokens-per-step of an MTP decoder on a greedy sequence, without running one.

    seqs [N, S]: prompt of length `start` then the base's greedy continuation; topk [N, S, H, K]: the
    heads' ranked drafts at every position. In greedy decoding the accepted tokens are exactly the
    greedy ones, so the hidden state at the deepest accepted node is the one at that position of the
    greedy sequence. A step whose drafts come from position a (root = token a + 1) accepts the deepest
    tree path whose node at depth d holds seqs[a + 1 + d]; it emits (accepted + 1) tokens, and the next
    drafts come from a + 1 + accepted. Steps are only counted while the whole tree fits in the sequence.
    Returns (tau, steps, accept_len_histogram).
    """
    paths = tree.paths[1:]
    D = tree.max_depth
    emitted = steps = 0
    hist = [0] * (D + 1)
    seqs, topk = seqs.tolist(), topk.tolist()
    for n in range(len(seqs)):
        s, tk = seqs[n], topk[n]
        a = start - 1
        while a + 1 + D < len(s):
            ok = {(): True}
            m = 0
            for p in paths:  # parents before children
                d = len(p)
                good = ok.get(p[:-1], False) and p[-1] < len(tk[a][d - 1]) and tk[a][d - 1][p[-1]] == s[a + 1 + d]
                ok[p] = good
                if good and d > m:
                    m = d
            hist[m] += 1
            emitted += m + 1
            steps += 1
            a += 1 + m
    return emitted / max(steps, 1), steps, hist


@torch.no_grad()
def greedy_continue(model, prompts, new_tokens, batch=64):
    """[N, P + new_tokens]: greedy continuations (no early stop), with a KV cache, batch by batch."""
    import inspect
    from transformers import DynamicCache
    # transformers >= 5.2x calls the cache argument `cache` (the old `past_key_values` still works, with a warning)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    outs = []
    for i in range(0, prompts.shape[0], batch):
        ids = prompts[i:i + batch]
        cache = DynamicCache()                                  # updated in place by every forward
        out = model(input_ids=ids, use_cache=True, **{kw: cache})
        toks = [ids]
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new_tokens - 1):
            toks.append(nxt)
            out = model(input_ids=nxt, use_cache=True, **{kw: cache})
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        toks.append(nxt)
        outs.append(torch.cat(toks, dim=1))
    return torch.cat(outs)


def distinct_ratio(seqs):
    """Mean over sequences of (distinct tokens / tokens) — 1.0 is no repetition, ~0 is a one-token loop."""
    return float(sum(len(set(s)) / max(len(s), 1) for s in seqs.tolist()) / max(len(seqs), 1))


# ------------------------------------------------------------------------------------ recipe 1: joint


def train_joint(args):
    from transformers import AutoTokenizer, GenerationConfig
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    streams = token_streams(tok, args.data, args.cache_dir)
    H, S, B = args.num_heads, args.seq_len, args.batch
    if args.init_model:     # continue training a saved model (and its joint heads, when there are enough)
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(args.init_model, dtype=torch.float32).to(args.device)
        args.hidden = model.config.hidden_size
    else:
        model = build_llama(len(tok), args.layers, args.hidden, args.q_heads, args.kv_heads, args.intermediate,
                            args.max_pos, args.tie, tok.eos_token_id, args.seed).to(args.device)
    heads = MTPHeads(H, args.hidden, device=args.device)          # W_h = 0: every head starts as the LM head
    init_dir = os.path.join(args.init_model or "", args.heads_subdir)
    if args.init_model and os.path.exists(os.path.join(init_dir, "heads.safetensors")):
        init_from(heads, init_dir)
    params = list(model.parameters()) + list(heads.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    val = random_windows(streams["val"], args.val_windows, S + H + 1, torch.Generator().manual_seed(1234))
    rec = Recorder(args.records or args.out, args.run_name)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"joint: {n_params / 1e6:.2f} M params, {H} heads, lambda={args.mtp_weight}, "
          f"train {streams['train'].numel()} / val {streams['val'].numel()} tokens")

    def losses(ids):
        x = final_hidden(model, ids[:, :S])                                   # [B, S, D]
        ntp = F.cross_entropy(model.lm_head(x).flatten(0, 1).float(), ids[:, 1:S + 1].flatten())
        if H == 0 or args.mtp_weight == 0:
            return ntp, []
        n = max(1, int(S * args.head_frac))
        pos = torch.randperm(S, generator=gen)[:n].to(ids.device)             # positions scored by the heads
        xs = x[:, pos]                                                         # [B, n, D]
        head = []
        for h in range(H):
            logits = model.lm_head(head_z(heads, xs, h)).float()               # [B, n, V]
            head.append(F.cross_entropy(logits.flatten(0, 1), ids[:, pos + h + 2].flatten()))
        return ntp, head

    @torch.no_grad()
    def evaluate():
        model.eval()
        tot, th = 0.0, [0.0] * H
        for i in range(0, val.shape[0], B):
            ids = val[i:i + B].to(args.device)
            with autocast(args.dtype, args.device):
                x = final_hidden(model, ids[:, :S])
                tot += F.cross_entropy(model.lm_head(x).flatten(0, 1).float(), ids[:, 1:S + 1].flatten(),
                                       reduction="sum").item()
                for h in range(H):
                    lg = model.lm_head(head_z(heads, x, h)).float()
                    th[h] += F.cross_entropy(lg.flatten(0, 1), ids[:, h + 2:S + h + 2].flatten(),
                                             reduction="sum").item()
        model.train()
        n = val.shape[0] * S
        return tot / n, [t / n for t in th]

    from tqdm import tqdm
    t0, step, tokens = time.time(), 0, 0
    last_save = t0
    acc_loss, acc_parts, acc_n = 0.0, None, 0
    bar = tqdm(total=args.steps, desc="joint", mininterval=args.progress_interval)
    model.train()
    while True:
        progress = max(step / args.steps, (time.time() - t0) / (60 * args.max_minutes))
        if progress >= 1.0:
            break
        lr = lr_at(progress, step, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        ids = random_windows(streams["train"], B, S + H + 1, gen).to(args.device)
        with autocast(args.dtype, args.device):
            ntp, head = losses(ids)
            loss = ntp + (args.mtp_weight * sum(head) / H if head else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        tokens += B * S
        parts = [ntp.item()] + [h.item() for h in head]
        acc_parts = parts if acc_parts is None else [a + b for a, b in zip(acc_parts, parts)]
        acc_loss += loss.item()
        acc_n += 1
        bar.update(1)
        if step % args.log_every == 0 or step == 1:
            row = {"recipe": "joint", "step": step, "tokens": tokens, "elapsed_s": round(time.time() - t0, 1),
                   "lr": lr, "loss": acc_loss / acc_n, "loss_ntp": acc_parts[0] / acc_n}
            for h in range(len(acc_parts) - 1):
                row[f"loss_head{h}"] = acc_parts[h + 1] / acc_n
            if step % args.eval_every == 0:
                v, vh = evaluate()
                row["val_ntp"] = v
                row["val_head0"] = vh[0] if vh else None
                bar.write(f"step {step} tokens {tokens} train {row['loss_ntp']:.3f} val {v:.3f} "
                          f"({tokens / (time.time() - t0):.0f} tok/s)")
            rec.log(**row)
            acc_loss, acc_parts, acc_n = 0.0, None, 0
        if args.save_every_minutes and time.time() - last_save > 60 * args.save_every_minutes:
            model.save_pretrained(args.out)                                    # a checkpoint, in case of a crash
            last_save = time.time()
    bar.close()
    train_s = time.time() - t0
    val_loss, vh = evaluate()
    rec.log(recipe="joint", step=step, tokens=tokens, elapsed_s=round(train_s, 1), lr=lr, val_ntp=val_loss,
            val_head0=vh[0] if vh else None)
    # save: model (safetensors), tokenizer, generation config with the EOS id, joint heads
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                                               bos_token_id=tok.eos_token_id, do_sample=False)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    with torch.no_grad():
        xv = torch.cat([final_hidden(model.eval(), val[i:i + B, :S].to(args.device)) for i in range(0, len(val), B)])
        acc = head_topk_accuracy(heads, model.lm_head, xv, val[:, 1:S + 1].to(args.device),
                                 torch.ones(xv.shape[:2], dtype=torch.bool), k=5) if H else torch.zeros(0, 5)
    heads_dir = os.path.join(args.out, args.heads_subdir)
    if H:
        heads.save(heads_dir, recipe="joint", mtp_weight=args.mtp_weight,
                   note="trained jointly with the base; head h predicts token t + h + 2")
    metrics = {"recipe": "joint", "init_model": args.init_model, "params": n_params, "num_heads": H,
               "mtp_weight": args.mtp_weight, "steps": step, "tokens": tokens, "train_seconds": round(train_s, 1),
               "tokens_per_s": round(tokens / train_s, 1), "val_ntp_loss": val_loss, "val_head_loss": vh,
               "head_top1_real": acc[:, 0].tolist(), "head_top5_real": acc.sum(1).tolist(),
               "config": {k: v for k, v in vars(args).items() if k != "func"}, "threads": torch.get_num_threads()}
    write_json(os.path.join(args.records or args.out, f"{args.run_name}.json"), metrics)
    rec.write()
    print(json.dumps({k: metrics[k] for k in ("steps", "tokens", "val_ntp_loss", "head_top1_real")}, indent=1))
    return metrics


# ----------------------------------------------------------------------------------- recipe 2: frozen


@torch.no_grad()
def cache_hidden(model, seqs, batch, store_dtype=torch.float32):
    """x [N, S, D] on the CPU: the frozen base's final-norm hidden states, computed once."""
    dev = next(model.parameters()).device
    return torch.cat([final_hidden(model, seqs[i:i + batch].to(dev)).to("cpu", store_dtype)
                      for i in range(0, seqs.shape[0], batch)])


@torch.no_grad()
def base_argmax(model, x, batch=8):
    """[N, S]: the base's own greedy token after each position (argmax of its LM head)."""
    dev, w = next(model.parameters()).device, model.lm_head.weight
    return torch.cat([model.lm_head(x[i:i + batch].to(dev, w.dtype)).argmax(-1).cpu()
                      for i in range(0, x.shape[0], batch)])


def frozen_head_losses(heads, lm_head, x, targets="soft", backward=True):
    """Per-head self-distillation losses on hidden states x [B, S, D] of the frozen base.

    Head h at position t learns the base's distribution at t + h + 1 (which predicts token t + h + 2):
    soft: KL(p_base || q_h), hard: CE(q_h, argmax p_base). With backward=True each head's loss is
    back-propagated right away, so only one head's [B, S, V] logits are alive at a time.
    """
    S, w = x.shape[1], lm_head.weight
    with torch.no_grad():
        base_logp = torch.log_softmax(lm_head(x.to(w.dtype)).float(), -1)      # [B, S, V]
        base_p = base_logp.exp() if targets == "soft" else None
        ent = -(base_p * base_logp).sum(-1) if targets == "soft" else None     # [B, S]
        arg = base_logp.argmax(-1)
    out = []
    for h in range(heads.num_heads):
        n = S - h - 1
        if n <= 0:
            break
        logq = torch.log_softmax(lm_head(head_z(heads, x[:, :n].float(), h).to(w.dtype)).float(), -1)
        if targets == "soft":   # KL = cross-entropy - entropy of the target
            loss = (-(base_p[:, h + 1:] * logq).sum(-1) - ent[:, h + 1:]).mean()
        else:
            loss = F.nll_loss(logq.flatten(0, 1), arg[:, h + 1:].flatten())
        if backward:
            (loss / heads.num_heads).backward()
        out.append(loss.detach())
    return out


def init_from(heads, path):
    """Copy the first heads from a saved set; extra heads start as copies of the deepest saved one."""
    src = load_heads(path)
    if src.hidden_size != heads.hidden_size:
        raise ValueError(f"--init heads have hidden size {src.hidden_size}, the model {heads.hidden_size}")
    with torch.no_grad():
        for h in range(heads.num_heads):
            j = min(h, src.num_heads - 1)
            heads.res_weight[h].copy_(src.res_weight[j])
            heads.res_bias[h].copy_(src.res_bias[j])
    return src.num_heads


def prompt_ids(tokenizer, path, max_tokens=None):
    """[(id, ids list)] from a prompts JSONL (fields id, source, text)."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                ids = tokenizer(r["text"], add_special_tokens=False)["input_ids"]
                out.append((r["id"], ids[-max_tokens:] if max_tokens else ids))
    return out


def tau_report(heads, model, seqs, start, trees, k):
    """Head accuracy acc [H, k] and simulated greedy tau per tree on greedy continuations seqs [N, S]
    (prompt length `start`). trees: {name: Tree}, or a function acc -> {name: Tree} (trees tuned on acc)."""
    x = cache_hidden(model, seqs, 8)
    arg = base_argmax(model, x)
    valid = torch.zeros(seqs.shape, dtype=torch.bool)
    valid[:, start - 1:] = True                                  # score drafts made on the generated part
    acc = head_topk_accuracy(heads, model.lm_head, x, arg, valid, k=k)
    dev, w = next(model.parameters()).device, model.lm_head.weight
    with torch.no_grad():
        topk = torch.stack([torch.cat([model.lm_head(head_z(heads, x[i:i + 8].to(dev).float(), h).to(w.dtype))
                                       .topk(k, dim=-1).indices.cpu() for i in range(0, x.shape[0], 8)])
                            for h in range(heads.num_heads)], dim=2)                    # [N, S, H, k]
    taus = {}
    if callable(trees):
        trees = trees(acc.tolist())
    for name, tree in trees.items():
        if tree.max_depth <= heads.num_heads and tree.top_k <= k:
            tau, steps, hist = simulate_tau(topk, seqs, start, tree)
            taus[name] = {"tau": tau, "steps": steps, "nodes": tree.size, "accept_len_histogram": hist}
    return acc, taus


def standard_trees(acc, budgets=(16, 32, 64)):
    from mtp_triton.tree import PRESETS, Tree
    trees = {name: Tree.from_choices(ch) for name, ch in PRESETS.items()}
    for b in budgets:
        trees[f"tuned-{b}"] = Tree.from_accuracies(acc, b)
    return trees


def train_frozen(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    streams = token_streams(tok, args.data, args.cache_dir)
    D, S, H, P = model.config.hidden_size, args.seq_len, args.num_heads, args.prompt_len
    rec = Recorder(args.records or args.out, "train_frozen")
    t0 = time.time()

    # 1. the sequences the heads learn on: real text windows + the base's own greedy continuations
    parts, kinds = [], []
    if args.real_windows:
        parts.append(random_windows(streams["train"], args.real_windows, S, gen))
        kinds.append(f"{args.real_windows} real windows")
    if args.self_generated:
        prompts = random_windows(streams["train"], args.self_generated, P, gen)
        parts.append(greedy_continue(model, prompts.to(args.device), S - P, args.gen_batch).cpu())
        kinds.append(f"{args.self_generated} greedy continuations ({P} prompt + {S - P} generated tokens)")
    if not parts:
        raise ValueError("frozen: nothing to train on (--real-windows 0 and --self-generated 0)")
    seqs = torch.cat(parts)
    t_gen = time.time() - t0
    # 2. frozen base: hidden states once (the heads' only input), then the base is only used for its LM head
    x_cache = cache_hidden(model, seqs, args.batch, dtype)
    t_cache = time.time() - t0 - t_gen
    print(f"frozen: cached {tuple(x_cache.shape)} hidden states ({'; '.join(kinds)}) in {t_gen + t_cache:.0f} s")

    heads = MTPHeads(H, D, device=args.device)                   # W_h = 0 (Medusa): each head starts as the LM head
    init_n = init_from(heads, args.init) if args.init else 0
    opt = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0)
    from tqdm import tqdm
    bar = tqdm(total=args.steps, desc="frozen", mininterval=args.progress_interval)
    t1, step, acc_l, acc_n = time.time(), 0, None, 0
    while True:
        progress = max(step / args.steps, (time.time() - t1) / (60 * args.max_minutes))
        if progress >= 1.0:
            break
        lr = lr_at(progress, step, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, x_cache.shape[0], (args.batch,), generator=gen)
        opt.zero_grad(set_to_none=True)
        losses = frozen_head_losses(heads, model.lm_head, x_cache[idx].to(args.device), args.targets)
        opt.step()
        step += 1
        vals = [l.item() for l in losses]
        acc_l = vals if acc_l is None else [a + b for a, b in zip(acc_l, vals)]
        acc_n += 1
        bar.update(1)
        if step % args.log_every == 0 or step == 1:
            row = {"recipe": f"frozen-{args.targets}", "step": step, "tokens": step * args.batch * S,
                   "elapsed_s": round(time.time() - t1, 1), "lr": lr, "loss": sum(acc_l) / len(acc_l) / acc_n}
            row.update({f"loss_head{h}": v / acc_n for h, v in enumerate(acc_l)})
            rec.log(**row)
            acc_l, acc_n = None, 0
    bar.close()
    train_s = time.time() - t1
    del x_cache

    # 3. held-out evaluation: real text (vs real tokens and vs the base's argmax), greedy continuations
    #    of held-out prompts (-> accuracy.json, the input of Tree.from_accuracies), third-party prompts (tau)
    K = args.top_k
    egen = torch.Generator().manual_seed(args.seed + 777)
    val = random_windows(streams["val"], args.val_windows, S, egen)
    xv = cache_hidden(model, val, 8)
    real = val[:, 1:]
    vmask = torch.ones(real.shape, dtype=torch.bool)
    acc_real = head_topk_accuracy(heads, model.lm_head, xv[:, :-1], real, vmask, k=K)
    acc_base = head_topk_accuracy(heads, model.lm_head, xv, base_argmax(model, xv),
                                  torch.ones(val.shape, dtype=torch.bool), k=K)
    with torch.no_grad():
        val_kl = [l.item() for l in frozen_head_losses(heads, model.lm_head, xv[:8].to(args.device),
                                                       "soft", backward=False)]
    del xv
    vprompts = random_windows(streams["val"], args.eval_generated, P, egen)
    vseqs = greedy_continue(model, vprompts.to(args.device), args.eval_new_tokens, args.gen_batch).cpu()
    acc_greedy, taus_val = tau_report(heads, model, vseqs, P, standard_trees, K)
    trees = standard_trees(acc_greedy.tolist())
    metrics = {
        "recipe": "frozen", "targets": args.targets, "model": args.model, "num_heads": H,
        "init": args.init, "init_heads": init_n, "sequences": kinds, "cache_shape": [seqs.shape[0], S, D],
        "generate_seconds": round(t_gen, 1), "cache_seconds": round(t_cache, 1),
        "train_seconds": round(train_s, 1), "steps": step,
        "val_kl_per_head": val_kl,
        "heldout_real": {"top1_vs_text": acc_real[:, 0].tolist(), "top5_vs_text": acc_real[:, :5].sum(1).tolist(),
                         "top1_vs_base": acc_base[:, 0].tolist(), "top5_vs_base": acc_base[:, :5].sum(1).tolist()},
        "heldout_greedy": {"prompts": args.eval_generated, "prompt_len": P, "new_tokens": args.eval_new_tokens,
                           "top1": acc_greedy[:, 0].tolist(), "top5": acc_greedy[:, :5].sum(1).tolist(),
                           "tau_simulated": taus_val, "distinct_ratio": distinct_ratio(vseqs[:, P:])},
        "config": {k: v for k, v in vars(args).items() if k != "func"}, "threads": torch.get_num_threads(),
    }
    if args.eval_prompts:   # held-out third-party code: greedy continuations prompt by prompt
        taus, gens = {}, []
        for pid, ids in prompt_ids(tok, args.eval_prompts, args.eval_prompt_max):
            s1 = greedy_continue(model, torch.tensor([ids], device=args.device), args.eval_new_tokens).cpu()
            _, t = tau_report(heads, model, s1, len(ids), trees, K)
            gens.append(s1[0, len(ids):])
            for name, r in t.items():
                agg = taus.setdefault(name, {"emitted": 0.0, "steps": 0, "nodes": r["nodes"]})
                agg["emitted"] += r["tau"] * r["steps"]
                agg["steps"] += r["steps"]
        metrics["thirdparty_greedy"] = {
            "prompts": len(gens), "new_tokens": args.eval_new_tokens, "file": args.eval_prompts,
            "tau_simulated": {n: {"tau": a["emitted"] / max(a["steps"], 1), "steps": a["steps"], "nodes": a["nodes"]}
                              for n, a in taus.items()},
            "distinct_ratio": distinct_ratio(torch.stack(gens)),
            "sample": tok.decode(gens[0][:120].tolist())}
    heads.save(args.out, recipe="frozen", targets=args.targets, base=os.path.abspath(args.model)
               if args.store_base_path else os.path.basename(os.path.normpath(args.model)),
               note="self-distilled on a frozen base; head h predicts token t + h + 2")
    write_json(os.path.join(args.out, "accuracy.json"), {
        "format": "mtp_triton.accuracy/1",
        "description": "acc[h][r] = held-out P(rank r of head h == the base's greedy token t + h + 2), "
                       "measured teacher-forced on greedy continuations; input of Tree.from_accuracies(acc, budget)",
        "num_heads": H, "top_k": K, "acc": acc_greedy.tolist(), "tree_budget": args.tree_budget,
        "measured_on": f"{args.eval_generated} greedy continuations ({args.eval_new_tokens} tokens) of held-out "
                       f"prompts ({P} tokens)"})
    write_json(os.path.join(args.records or args.out, "train_frozen.json"), metrics)
    rec.write()
    print(json.dumps({"top1_greedy": metrics["heldout_greedy"]["top1"],
                      "tau": {k: round(v["tau"], 3) for k, v in taus_val.items()}}, indent=1))
    return metrics


# ------------------------------------------------------------------------- measuring tau with generate


def tree_by_name(name, acc=None):
    """A preset name, or 'tuned-N': the N-node tree built from measured accuracies (accuracy.json)."""
    from mtp_triton.tree import Tree, get_tree
    if name.startswith("tuned-"):
        if acc is None:
            raise ValueError(f"tree {name!r} needs an accuracy.json next to the heads")
        return Tree.from_accuracies(acc, int(name.split("-", 1)[1]))
    return get_tree(name)


def measure_tau(args):
    """Tokens per verify step of the real decoder (mtp_triton.generate), greedy, per tree, on a prompt file.

    Also checks that every tree's output equals the serial output token for token (greedy is lossless),
    and records the distinct-token ratio of the continuations and a sample.
    """
    import mtp_triton
    from transformers import AutoTokenizer
    torch.set_num_threads(args.threads)
    model = mtp_triton.load_model(args.model, device=args.device)
    heads = mtp_triton.load_heads(args.heads, device=args.device)
    tok = AutoTokenizer.from_pretrained(args.model)
    acc_file = os.path.join(args.heads, "accuracy.json")
    acc = json.load(open(acc_file))["acc"] if os.path.exists(acc_file) else None
    prompts = prompt_ids(tok, args.prompts, args.prompt_max)
    ids = [p for _, p in prompts]
    eos = tok.eos_token_id
    t0 = time.time()
    serial = mtp_triton.generate(model, ids, args.new_tokens, mtp=False, eos_token_id=eos, kernels=args.kernels)
    out = {"model": args.model, "heads": args.heads, "prompts": args.prompts, "num_prompts": len(ids),
           "new_tokens": args.new_tokens, "eos_token_id": eos, "kernels": args.kernels,
           "kernels_used": serial.stats.kernels,
           "serial": {"tokens_per_step": serial.stats.tokens_per_step, "seconds": round(time.time() - t0, 2)},
           "distinct_ratio": float(sum(len(set(t)) / len(t) for t in serial.tokens) / len(serial.tokens)),
           "sample": {"prompt_id": prompts[0][0], "prompt_tail": tok.decode(ids[0][-40:]),
                      "continuation": tok.decode(serial.tokens[0])},
           "trees": {}}
    from mtp_triton.bench.common import env_info
    from transformers import AutoModelForCausalLM
    out["env"] = env_info(args.device)
    hf = AutoModelForCausalLM.from_pretrained(args.model).to(args.device).eval()
    with torch.no_grad():   # how well the base models this held-out code: mean next-token loss over the prompts
        losses = [hf(torch.tensor([p], device=args.device), labels=torch.tensor([p], device=args.device)).loss.item()
                  for p in ids]
    out["prompt_loss_nats"] = sum(losses) / len(losses)
    del hf
    for name in args.trees:
        tree = tree_by_name(name, acc)
        if tree.max_depth > heads.num_heads:
            continue
        t1 = time.time()
        res = mtp_triton.generate(model, ids, args.new_tokens, heads=heads, tree=tree, eos_token_id=eos,
                                  kernels=args.kernels)
        st = res.stats.as_dict()
        out["trees"][name] = {"tau": st["tokens_per_step"], "nodes": tree.size, "depth": tree.max_depth,
                              "accept_rate_per_depth": st["accept_rate_per_depth"],
                              "accept_len_histogram": st["accept_len_histogram"],
                              "identical_to_serial": res.tokens == serial.tokens,
                              "seconds": round(time.time() - t1, 2)}
        print(f"{name:>10}: tau {st['tokens_per_step']:.3f}  ({tree.size} nodes, "
              f"identical to serial: {res.tokens == serial.tokens})")
    if args.tree_budget is not None and acc is not None:
        info = json.load(open(acc_file))
        info["tree_budget"] = args.tree_budget
        write_json(acc_file, info)
        out["tree_budget"] = args.tree_budget
    write_json(args.out, out)
    return out


# ------------------------------------------------------------------------------------------------ CLI


def build_parser():
    p = argparse.ArgumentParser(prog="python -m mtp_triton.train_heads", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="recipe", required=True)

    def common(sp):
        sp.add_argument("--out", required=True, help="output folder")
        sp.add_argument("--data", nargs="*", help="training text (.py/.txt files, .jsonl with 'text'); "
                                                 "default: the Python stdlib corpus (mtp_triton.corpus)")
        sp.add_argument("--cache-dir", default=None, help="where to cache the tokenized corpus")
        sp.add_argument("--num-heads", type=int, default=4)
        sp.add_argument("--steps", type=int, default=1000)
        sp.add_argument("--max-minutes", type=float, default=60.0, help="stop (and finish the LR schedule) here")
        sp.add_argument("--lr", type=float, default=3e-3)
        sp.add_argument("--warmup", type=int, default=50)
        sp.add_argument("--batch", type=int, default=8)
        sp.add_argument("--seq-len", type=int, default=512)
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        sp.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="autocast / storage dtype")
        sp.add_argument("--threads", type=int, default=2, help="torch CPU threads")
        sp.add_argument("--log-every", type=int, default=10)
        sp.add_argument("--eval-every", type=int, default=100)
        sp.add_argument("--records", default=None, help="folder for metrics JSON / curve CSV+PNG (default --out)")
        sp.add_argument("--progress-interval", type=float, default=5.0, help="seconds between tqdm refreshes")

    j = sub.add_parser("joint", help="train a small Llama and its heads together (MTP loss)")
    common(j)
    j.add_argument("--tokenizer", required=True, help="tokenizer folder (transformers AutoTokenizer)")
    j.add_argument("--layers", type=int, default=4)
    j.add_argument("--hidden", type=int, default=256)
    j.add_argument("--q-heads", type=int, default=4)
    j.add_argument("--kv-heads", type=int, default=2)
    j.add_argument("--intermediate", type=int, default=688)
    j.add_argument("--max-pos", type=int, default=2048)
    j.add_argument("--tie", action="store_true", help="tie input embeddings and LM head")
    j.add_argument("--init-model", default=None, help="continue from a saved model folder (new LR schedule)")
    j.add_argument("--run-name", default="train_joint", help="name of the records (<name>.json, <name>_curve.csv)")
    j.add_argument("--mtp-weight", type=float, default=0.3, help="lambda: weight of the mean head loss (0: plain LM)")
    j.add_argument("--head-frac", type=float, default=0.25, help="fraction of positions the heads are trained on")
    j.add_argument("--weight-decay", type=float, default=0.1)
    j.add_argument("--val-windows", type=int, default=48)
    j.add_argument("--heads-subdir", default="heads_joint")
    j.add_argument("--save-every-minutes", type=float, default=10.0)
    j.set_defaults(func=train_joint)

    f = sub.add_parser("frozen", help="self-distil heads for a frozen base (Medusa-1)")
    common(f)
    f.add_argument("--model", required=True, help="a Hugging Face causal-LM folder (Llama family)")
    f.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model)")
    f.add_argument("--targets", choices=["soft", "hard"], default="soft",
                   help="soft: KL to the base's distribution; hard: CE to its argmax")
    f.add_argument("--init", default=None, help="heads folder to start from (extra heads copy the deepest one)")
    f.add_argument("--real-windows", type=int, default=256, help="real-text windows of --seq-len to cache")
    f.add_argument("--self-generated", type=int, default=0,
                   help="N greedy continuations of the base (prompt --prompt-len, up to --seq-len) to cache")
    f.add_argument("--prompt-len", type=int, default=64)
    f.add_argument("--gen-batch", type=int, default=64)
    f.add_argument("--val-windows", type=int, default=32)
    f.add_argument("--eval-generated", type=int, default=32, help="held-out prompts continued greedily for eval")
    f.add_argument("--eval-new-tokens", type=int, default=256)
    f.add_argument("--eval-prompts", default=None, help="prompts JSONL (id, source, text) for a tau estimate")
    f.add_argument("--eval-prompt-max", type=int, default=512, help="keep the last N tokens of each prompt")
    f.add_argument("--top-k", type=int, default=10, help="ranks measured per head (accuracy.json)")
    f.add_argument("--store-base-path", action="store_true", help="record the absolute base path in heads.json")
    f.add_argument("--tree-budget", type=int, default=16,
                   help="nodes of the default tuned tree, recorded in accuracy.json for the decoder")
    f.set_defaults(func=train_frozen, lr=1e-3, steps=600, warmup=20)

    e = sub.add_parser("eval", help="measure tau with mtp_triton.generate (greedy) per tree on a prompt file")
    e.add_argument("--model", required=True)
    e.add_argument("--heads", required=True, help="heads folder (with accuracy.json for the tuned-N trees)")
    e.add_argument("--prompts", required=True, help="JSONL with id, source, text")
    e.add_argument("--out", required=True, help="JSON file to write")
    e.add_argument("--new-tokens", type=int, default=128)
    e.add_argument("--prompt-max", type=int, default=512, help="keep the last N tokens of each prompt")
    e.add_argument("--trees", nargs="+", default=["chain-2", "chain-4", "chain-8", "medusa-8", "medusa-16",
                                                   "medusa-32", "medusa-64", "tuned-16", "tuned-32", "tuned-64"])
    e.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"])
    e.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--tree-budget", type=int, default=None,
                   help="also record this as the default tuned tree size (tree_budget) in the heads' accuracy.json")
    e.set_defaults(func=measure_tau)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    main()
