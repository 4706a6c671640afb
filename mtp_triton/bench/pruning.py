"""Confidence pruning, measured: serial vs MTP with the heads' tree, unpruned and pruned at several thresholds.

    python -m mtp_triton prune                         # SmolLM2 + shipped heads, held-out chat prompts, CPU
    python -m mtp_triton prune --prompts templated     # the templated held-out set (the one the tree was tuned on)

With `RuntimeConfig(prune_below=p)` a step verifies only the drafted nodes whose path probability under the heads,
prod_{d <= depth} q_d(y_d | path), is at least p (step.Pruner; EAGLE-2, Li et al. 2024, shapes its draft tree by
the same confidence, https://arxiv.org/abs/2406.16858). Where drafts look unlikely the verify forward is smaller;
tau falls a little, a step costs less. Every configuration runs on every prompt, one after another (batch 1), and
must emit the serial tokens. Writes <out>/prune.csv (one row per prompt and configuration), <out>/prune.png.
"""
import argparse
import os
import sys

import torch

from ..generate import RuntimeConfig, generate
from .common import ROOT, append_rows, ensure_writable_dir, env_info

PROMPT_SETS = {"chat": os.path.join(ROOT, "data", "chat", "heldout_chat.jsonl"),
               "templated": os.path.join(ROOT, "data", "chat", "heldout_templated.jsonl")}
THRESHOLDS = (0.01, 0.02, 0.05, 0.1, 0.2)


def configs(thresholds):
    """[(name, prune_below)]: serial first (None marks it), then unpruned MTP (0.0), then each threshold."""
    return [("serial", None), ("mtp", 0.0)] + [(f"mtp p>={t:g}", float(t)) for t in thresholds]


def run_prompt(model, heads, tree, ids, max_new, eos, kernels, cfgs):
    """Every configuration on one prompt. -> {name: GenerateResult}"""
    out = {}
    for name, p in cfgs:
        rt = RuntimeConfig(prune_below=p) if p else None
        out[name] = generate(model, [ids], max_new, mtp=p is not None, heads=heads, tree=tree, eos_token_id=eos,
                             kernels=kernels, runtime=rt)
    return out


def summarise(results, cfgs):
    """Per configuration over all prompts: decode tok/s (total tokens / total time), speedup vs serial, tau, mean
    verified nodes per step, identical prompts."""
    table = {}
    for name, _ in cfgs:
        rs = [r[name] for r in results]
        tok = sum(x.stats.new_tokens - 1 for x in rs)
        sec = sum(x.stats.total_s - x.stats.ttft_s for x in rs)
        steps = sum(x.stats.steps for x in rs)
        nodes = sum(x.stats.verified_nodes_per_step * x.stats.steps for x in rs if x.stats.steps)
        table[name] = dict(tok_s=tok / max(sec, 1e-12), tau=tok / max(steps, 1), nodes=nodes / max(steps, 1),
                           identical=sum(x.tokens == r["serial"].tokens for x, r in zip(rs, results)),
                           prompts=len(rs))
    for s in table.values():
        s["speedup"] = s["tok_s"] / table["serial"]["tok_s"]
    return table


def summarise_rows(rows):
    """The same summary as `summarise`, from prune.csv rows (strings, one per prompt and configuration, one run) ->
    {configuration: dict(tok_s, tau, nodes, identical, prompts, speedup)}, in the rows' order of configurations."""
    by = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)
    table = {}
    for name, rs in by.items():
        tok = sum(int(r["new_tokens"]) - 1 for r in rs)
        steps = sum(int(r["steps"]) for r in rs)
        nodes = sum(float(r["verified_nodes_per_step"]) * int(r["steps"]) for r in rs)
        table[name] = dict(tok_s=tok / max(sum(float(r["decode_s"]) for r in rs), 1e-12), tau=tok / max(steps, 1),
                           nodes=nodes / max(steps, 1), identical=sum(r["identical"] == "True" for r in rs),
                           prompts=len(rs))
    for s in table.values():
        s["speedup"] = s["tok_s"] / table["serial"]["tok_s"]
    return table


def main(argv=None):
    from ..demo import SMOLLM2, encode, heads_dir_for, load_bundle, pick_prompts, pick_tree, read_prompts
    ap = argparse.ArgumentParser(prog="python -m mtp_triton prune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SMOLLM2)
    ap.add_argument("--heads", default=None, help="heads folder (default: the model's shipped heads)")
    ap.add_argument("--prompts", default="chat", help="'chat', 'templated' or a JSONL file with 'text' (and "
                    "'category')")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tree", default="stored", help="as the demo's --tree")
    ap.add_argument("--thresholds", default=",".join(f"{t:g}" for t in THRESHOLDS),
                    help="comma-separated prune_below values in (0, 1]")
    ap.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--out", default=os.path.join("out", "prune"))
    a = ap.parse_args(argv)
    try:
        thresholds = [float(t) for t in a.thresholds.split(",") if t.strip()]
        for t in thresholds:
            RuntimeConfig(prune_below=t)                                        # refuses values outside (0, 1]
        ensure_writable_dir(a.out)
        model, heads, tok = load_bundle(a.model, a.heads)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfgs = configs(thresholds)
    rows = pick_prompts(read_prompts(PROMPT_SETS.get(a.prompts, a.prompts)), a.per_category)
    tree = pick_tree(a.tree, heads, a.heads or heads_dir_for(a.model), model, a.kernels)
    eos = tok.eos_token_id
    print(f"model {a.model}, {model.dtype}, {torch.get_num_threads()} threads; tree of {tree.size} nodes (depth "
          f"{tree.max_depth}); {len(rows)} prompts ({a.prompts}), {a.max_new_tokens} new tokens; "
          f"configurations: {', '.join(n for n, _ in cfgs)}")
    run_prompt(model, heads, tree, encode(tok, rows[0]["text"]), 8, eos, a.kernels, cfgs)   # warm-up, not timed
    results = []
    for r in rows:
        results.append(run_prompt(model, heads, tree, encode(tok, r["text"]), a.max_new_tokens, eos, a.kernels, cfgs))
        got = results[-1]
        print(f"[{r.get('category', 'all')}] " + "  ".join(
            f"{n}: {got[n].stats.decode_tokens_per_s:.1f} tok/s" + ("" if n == "serial" else
                                                                   f" tau {got[n].stats.tokens_per_step:.2f}")
            for n, _ in cfgs), flush=True)
    table = summarise(results, cfgs)
    print(f"\n| configuration | decode tok/s | speedup | tau | verified nodes / step | identical |")
    print("|---|---|---|---|---|---|")
    for n, s in table.items():
        print(f"| {n} | {s['tok_s']:.1f} | {s['speedup']:.2f}x | {s['tau']:.2f} | {s['nodes']:.1f} | "
              f"{s['identical']}/{s['prompts']} |")
    env = env_info(model.device)
    cmd = "python -m mtp_triton prune " + " ".join(argv if argv is not None else sys.argv[2:])
    out_rows = [dict(env, run="prune", model=a.model, dtype=str(model.dtype).replace("torch.", ""),
                     threads=torch.get_num_threads(), prompts=a.prompts, prompt_id=r.get("id"),
                     category=r.get("category"), config=n, prune_below=p, tree_size=tree.size,
                     max_new_tokens=a.max_new_tokens, kernels=res[n].stats.kernels, new_tokens=res[n].stats.new_tokens,
                     steps=res[n].stats.steps, tokens_per_step=res[n].stats.tokens_per_step,
                     verified_nodes_per_step=res[n].stats.verified_nodes_per_step,
                     decode_tokens_per_s=res[n].stats.decode_tokens_per_s,
                     decode_s=res[n].stats.total_s - res[n].stats.ttft_s,
                     identical=res[n].tokens == res["serial"].tokens, command=cmd)
                for r, res in zip(rows, results) for n, p in cfgs]
    append_rows(os.path.join(a.out, "prune.csv"), out_rows)
    plot(table, thresholds, env, os.path.join(a.out, "prune.png"))
    print(f"wrote {a.out}/prune.csv and {a.out}/prune.png")
    if any(s["identical"] != s["prompts"] for s in table.values()):
        print("ERROR: MTP output differs from serial output", file=sys.stderr)
        return 1
    return 0


def plot(table, thresholds, env, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n in table if n != "serial"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.4), dpi=80)
    x = range(len(names))
    labels = ["none"] + [f"{t:g}" for t in thresholds]
    ax[0].bar(x, [table[n]["speedup"] for n in names], color="tab:blue")
    ax[0].axhline(1.0, color="grey", lw=0.8)
    ax[0].set_xticks(list(x), labels)
    ax[0].set_xlabel("prune_below")
    ax[0].set_ylabel("decode speedup vs serial")
    ax[0].set_title(env["device"][:90], fontsize=7)
    ax[1].plot(x, [table[n]["tau"] for n in names], "o-", color="tab:green", label="tau (tokens / step)")
    ax[1].plot(x, [table[n]["nodes"] / 10 for n in names], "s--", color="tab:orange", label="verified nodes / 10")
    ax[1].set_xticks(list(x), labels)
    ax[1].set_xlabel("prune_below")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
