"""How good are the heads? Per-head top-k accuracy, greedy tokens-per-step (tau) simulated exactly from the
heads' ranked drafts, and tau measured with the real decoder (the `eval` subcommand):

    python -m mtp_lab.train_heads eval --model MODEL_DIR --heads HEADS_DIR --prompts P.jsonl --out tau.json

acc[h][r] (head_topk_accuracy) is the held-out probability that rank r of head h equals the target token
t + h + 2; it is the input of `Tree.from_accuracies` (the tuned-N trees).
"""
import json
import os
import time

import torch

from mtp_lab.cli import add_common, int_at_least
from mtp_triton.generate import generate
from mtp_lab.records import env_info, write_json
from mtp_triton.heads import load_heads
from mtp_triton.loading import load_model
from mtp_triton.tree import PRESETS, Tree, get_tree
from mtp_lab.training.data import prompt_ids
from mtp_lab.training.hidden import base_argmax, cache_hidden, greedy_continue, head_z


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


def distinct_ratio(seqs):
    """Mean over sequences of (distinct tokens / tokens) — 1.0 is no repetition, ~0 is a one-token loop.
    seqs: [N, S] tensor or a list of token lists."""
    seqs = seqs.tolist() if torch.is_tensor(seqs) else seqs
    return float(sum(len(set(s)) / max(len(s), 1) for s in seqs) / max(len(seqs), 1))


def standard_trees(acc, budgets=(16, 32, 64)):
    """{name: Tree}: every preset, plus the tuned-N trees built from the accuracies acc [H][K]."""
    trees = {name: Tree.from_choices(ch) for name, ch in PRESETS.items()}
    for b in budgets:
        trees[f"tuned-{b}"] = Tree.from_accuracies(acc, b)
    return trees


def tau_report(heads, model, seqs, start, trees, k):
    """Head accuracy acc [H, k] and simulated greedy tau per tree on greedy continuations seqs [N, S]
    (prompt length `start`). trees: {name: Tree}, or a function acc -> {name: Tree} (trees tuned on acc).
    Trees deeper than the heads, or wider than the k ranks measured, are skipped."""
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


def prompts_tau(heads, model, tok, path, max_tokens, new_tokens, trees, k, device):
    """Simulated greedy tau per tree on a prompts JSONL, prompt by prompt (each continued greedily for
    new_tokens), pooled over the prompts: tau = all tokens emitted / all steps."""
    taus, gens = {}, []
    for _, ids in prompt_ids(tok, path, max_tokens):
        seq = greedy_continue(model, torch.tensor([ids], device=device), new_tokens).cpu()     # [1, P + new]
        _, t = tau_report(heads, model, seq, len(ids), trees, k)
        gens.append(seq[0, len(ids):])
        for name, r in t.items():
            agg = taus.setdefault(name, {"emitted": 0.0, "steps": 0, "nodes": r["nodes"]})
            agg["emitted"] += r["tau"] * r["steps"]
            agg["steps"] += r["steps"]
    return {"prompts": len(gens), "new_tokens": new_tokens, "file": path,
            "tau_simulated": {n: {"tau": a["emitted"] / max(a["steps"], 1), "steps": a["steps"], "nodes": a["nodes"]}
                              for n, a in taus.items()},
            "distinct_ratio": distinct_ratio(torch.stack(gens)),
            "sample": tok.decode(gens[0][:120].tolist())}


# ------------------------------------------------------------------------- measuring tau with generate


def measure_tau(args):
    """Tokens per verify step of the real decoder (mtp_triton.generate), greedy, per tree, on a prompt file.

    Also checks that every tree's output equals the serial output token for token (greedy is lossless),
    and records the distinct-token ratio of the continuations and a sample. Trees deeper than the heads are
    skipped.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(args.threads)
    model = load_model(args.model, device=args.device)
    heads = load_heads(args.heads, device=args.device)
    tok = AutoTokenizer.from_pretrained(args.model)
    acc_file = os.path.join(args.heads, "accuracy.json")
    acc_info = json.load(open(acc_file)) if os.path.exists(acc_file) else None
    acc = acc_info["acc"] if acc_info else None
    prompts = prompt_ids(tok, args.prompts, args.prompt_max)
    ids = [p for _, p in prompts]
    eos = tok.eos_token_id
    t0 = time.time()
    serial = generate(model, ids, args.new_tokens, mtp=False, eos_token_id=eos, kernels=args.kernels)
    out = {"model": args.model, "heads": args.heads, "prompts": args.prompts, "num_prompts": len(ids),
           "new_tokens": args.new_tokens, "eos_token_id": eos, "kernels": args.kernels,
           "kernels_used": serial.stats.kernels,
           "serial": {"tokens_per_step": serial.stats.tokens_per_step, "seconds": round(time.time() - t0, 2)},
           "distinct_ratio": distinct_ratio(serial.tokens),
           "sample": {"prompt_id": prompts[0][0], "prompt_tail": tok.decode(ids[0][-40:]),
                      "continuation": tok.decode(serial.tokens[0])},
           "trees": {}, "env": env_info(args.device)}
    hf = AutoModelForCausalLM.from_pretrained(args.model).to(args.device).eval()
    with torch.no_grad():   # how well the base models this held-out code: mean next-token loss over the prompts
        losses = [hf(torch.tensor([p], device=args.device), labels=torch.tensor([p], device=args.device)).loss.item()
                  for p in ids]
    out["prompt_loss_nats"] = sum(losses) / len(losses)
    del hf
    for name in args.trees:
        tree = get_tree(name, accuracy=acc)
        if tree.max_depth > heads.num_heads:
            continue
        t1 = time.time()
        res = generate(model, ids, args.new_tokens, heads=heads, tree=tree, eos_token_id=eos,
                                  kernels=args.kernels)
        st = res.stats.as_dict()
        out["trees"][name] = {"tau": st["tokens_per_step"], "nodes": tree.size, "depth": tree.max_depth,
                              "accept_rate_per_depth": st["accept_rate_per_depth"],
                              "accept_len_histogram": st["accept_len_histogram"],
                              "identical_to_serial": res.tokens == serial.tokens,
                              "seconds": round(time.time() - t1, 2)}
        print(f"{name:>10}: tau {st['tokens_per_step']:.3f}  ({tree.size} nodes, "
              f"identical to serial: {res.tokens == serial.tokens})")
    if args.tree_budget is not None and acc_info is not None:
        write_json(acc_file, {**acc_info, "tree_budget": args.tree_budget})
        out["tree_budget"] = args.tree_budget
    write_json(args.out, out)
    return out


def add_arguments(e):
    """The `eval` subcommand's options."""
    add_common(e, "model", "heads", model=dict(required=True),
               heads=dict(required=True, help="heads folder (with accuracy.json for the tuned-N trees)"))
    e.add_argument("--prompts", required=True, help="JSONL with id, source, text")
    add_common(e, "out", out=dict(required=True, help="JSON file to write"))
    e.add_argument("--new-tokens", type=int_at_least(1), default=128)
    e.add_argument("--prompt-max", type=int_at_least(1), default=512, help="keep the last N tokens of each prompt")
    e.add_argument("--trees", nargs="+", default=["chain-2", "chain-4", "chain-8", "medusa-8", "medusa-16",
                                                   "medusa-32", "medusa-64", "tuned-16", "tuned-32", "tuned-64"])
    add_common(e, "kernels", "device", "threads", device="cuda" if torch.cuda.is_available() else "cpu")
    e.add_argument("--tree-budget", type=int_at_least(1), default=None,
                   help="also record this as the default tuned tree size (tree_budget) in the heads' accuracy.json")
