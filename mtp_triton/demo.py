"""The main job: serial vs MTP on the embedded model, same engine, same prompts — and a text interface.

    python -m mtp_triton demo                       # CPU by default; Triton kernels on a GPU
    python -m mtp_triton generate --prompt "def quicksort(" --max-new-tokens 64
"""
import argparse
import json
import os
import sys

import torch

from .bench.common import append_rows, env_info
from .generate import generate
from .heads import load_heads
from .model import load_model
from .tree import Tree, get_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED = os.path.join(ROOT, "data", "tiny-stdlib-llama")
PROMPTS = os.path.join(ROOT, "data", "prompts", "thirdparty_code.jsonl")


def load_embedded(path=EMBEDDED, device=None, dtype=None):
    """(model, heads, tokenizer) of a model folder that has a heads/ subfolder (the embedded model's layout)."""
    from transformers import AutoTokenizer
    model = load_model(path, device=device, dtype=dtype)
    heads = load_heads(os.path.join(path, "heads"), device=model.device, dtype=model.dtype)
    tok = AutoTokenizer.from_pretrained(path)
    return model, heads, tok


def default_tree(heads_dir, num_heads, budget=None):
    """The tree tuned to the heads' measured accuracies (heads/accuracy.json) if present, else the preset.

    accuracy.json: {"acc": [[...K...] x H], "tree_budget": N} — acc[h][r] = P(rank r of head h is right).
    """
    if os.path.exists(os.path.join(heads_dir, "accuracy.json")):
        acc, stored_budget = read_accuracy(heads_dir, num_heads)
        return Tree.from_accuracies(acc, budget or stored_budget)
    return get_tree(None, num_heads)


def read_prompts(path=PROMPTS, n=None):
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:n] if n else rows


def read_accuracy(heads_dir, num_heads):
    """(acc [H, K] float64, tree budget) from heads/accuracy.json."""
    with open(os.path.join(heads_dir, "accuracy.json")) as fh:
        info = json.load(fh)
    return torch.tensor(info["acc"], dtype=torch.float64)[:num_heads], int(info.get("tree_budget", 16))


def _tree_arg(arg, heads_dir, num_heads, model=None, batch=1, kernels="auto"):
    """'auto': tuned to the heads' accuracies AND this hardware's step cost (mtp_triton.tuning.best_tree);
    'tuned': tuned to the accuracies with the budget stored beside them; else a preset name."""
    if arg == "auto" and model is not None and os.path.exists(os.path.join(heads_dir, "accuracy.json")):
        from .tuning import best_tree
        tree, table = best_tree(model, read_accuracy(heads_dir, num_heads)[0], batch=batch, kernels=kernels)
        print("tree size for this hardware (expected tokens/step ÷ measured step-cost ratio):")
        for r in table:
            print(f"  budget {r['budget']:3d}: {r['nodes']:3d} nodes, E[tokens/step] {r['expected_tokens_per_step']:.2f}, "
                  f"cost x{r['cost_ratio']:.2f} -> expected speedup {r['expected_speedup']:.2f}")
        return tree
    return default_tree(heads_dir, num_heads) if arg in (None, "auto", "tuned") else get_tree(arg, num_heads)


def demo(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mtp_triton demo", description=__doc__)
    ap.add_argument("--model", default=EMBEDDED)
    ap.add_argument("--prompts", default=PROMPTS, help="JSONL with a 'text' field")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--tree", default="auto", help="'auto' (tuned to the heads' accuracies and this hardware's "
                    "step cost), 'tuned' (accuracies only, budget from heads/accuracy.json) or a preset name")
    ap.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=os.path.join("out", "demo"))
    a = ap.parse_args(argv)
    model, heads, tok = load_embedded(a.model, device=a.device)
    texts = [r["text"] for r in read_prompts(a.prompts, a.num_prompts)]
    prompts = [tok(t)["input_ids"] for t in texts]
    tree = _tree_arg(a.tree, os.path.join(a.model, "heads"), heads.num_heads, model, len(prompts), a.kernels)
    eos = tok.eos_token_id
    dev = model.device
    print(f"model {a.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params, {model.config.num_hidden_layers}"
          f" layers, {heads.num_heads} heads; device {dev}, dtype {model.dtype}, kernels {a.kernels}; tree of "
          f"{tree.size} nodes (depth {tree.max_depth})")
    generate(model, prompts[:1], 8, heads=heads, tree=tree, kernels=a.kernels)          # warm-up, not timed
    generate(model, prompts[:1], 8, mtp=False, kernels=a.kernels)
    ser = generate(model, prompts, a.max_new_tokens, mtp=False, eos_token_id=eos, kernels=a.kernels)
    mtp = generate(model, prompts, a.max_new_tokens, heads=heads, tree=tree, eos_token_id=eos, kernels=a.kernels)
    same = ser.tokens == mtp.tokens
    for i, (t, s, m) in enumerate(zip(texts, ser.tokens, mtp.tokens)):
        print(f"\n--- prompt {i} (last line): {t.rstrip().splitlines()[-1][:70]!r}")
        print(f"serial: {tok.decode(s)[:300]!r}")
        print(f"mtp   : {'(identical)' if s == m else tok.decode(m)[:300]!r}")
    s, m = ser.stats.as_dict(), mtp.stats.as_dict()
    speedup = m["decode_tokens_per_s"] / s["decode_tokens_per_s"]
    print(f"\noutputs identical: {same}")
    print(f"tau (tokens per verify step, bonus included): {m['tokens_per_step']:.2f}")
    print("acceptance per depth: " + ", ".join(f"d{d + 1} {r:.0%}" for d, r in enumerate(m["accept_rate_per_depth"])))
    print(f"decode tokens/s: serial {s['decode_tokens_per_s']:.1f}, MTP {m['decode_tokens_per_s']:.1f} -> "
          f"speedup {speedup:.2f}x ({env_info(dev)['device']}, batch {len(prompts)})")
    print(f"time per phase (MTP): draft {m['time_draft_s']:.2f}s, verify {m['time_verify_s']:.2f}s, accept "
          f"{m['time_accept_s']:.2f}s, append {m['time_append_s']:.2f}s")
    env = env_info(dev)
    rows = [dict(env, run="demo", mode=mode, tree=a.tree, tree_size=r.stats.tree_size, batch=len(prompts),
                 max_new_tokens=a.max_new_tokens, kernels=r.stats.kernels, tokens_per_step=r.stats.tokens_per_step,
                 decode_tokens_per_s=r.stats.decode_tokens_per_s, ttft_s=r.stats.ttft_s,
                 identical=same, command="python -m mtp_triton demo " + " ".join(argv or sys.argv[2:]))
            for mode, r in (("serial", ser), ("mtp", mtp))]
    os.makedirs(a.out, exist_ok=True)
    append_rows(os.path.join(a.out, "demo.csv"), rows)
    _plot(s, m, env, os.path.join(a.out, "demo.png"))
    print(f"wrote {a.out}/demo.csv and {a.out}/demo.png")
    if not same:
        print("ERROR: MTP output differs from serial output", file=sys.stderr)
        return 1
    return 0


def _plot(s, m, env, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2), dpi=80)
    ax[0].bar(["serial", "MTP"], [s["decode_tokens_per_s"], m["decode_tokens_per_s"]], color=["grey", "tab:blue"])
    ax[0].set_ylabel("decode tokens/s")
    ax[0].set_title(f"{env['device'][:40]}", fontsize=9)
    rates = m["accept_rate_per_depth"]
    ax[1].bar(range(1, len(rates) + 1), rates, color="tab:green")
    ax[1].set_xlabel("depth")
    ax[1].set_ylabel("acceptance rate")
    ax[1].set_ylim(0, 1)
    ax[1].set_title(f"tau = {m['tokens_per_step']:.2f} tokens / step", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def text_generate(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mtp_triton generate")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--model", default=EMBEDDED)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tree", default="auto", help="'auto', 'tuned' or a preset name (see demo --help)")
    ap.add_argument("--no-mtp", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--device", default=None)
    a = ap.parse_args(argv)
    model, heads, tok = load_embedded(a.model, device=a.device)
    tree = _tree_arg(a.tree, os.path.join(a.model, "heads"), heads.num_heads, model, 1, a.kernels)
    ids = tok(a.prompt)["input_ids"]
    res = generate(model, [ids], a.max_new_tokens, heads=heads, mtp=not a.no_mtp, tree=tree,
                   temperature=a.temperature, top_p=a.top_p, seed=a.seed, eos_token_id=tok.eos_token_id,
                   kernels=a.kernels)
    print(a.prompt + tok.decode(res.tokens[0]))
    s = res.stats.as_dict()
    print(f"\n[{s['new_tokens']} tokens, {s['steps']} steps, tau {s['tokens_per_step']:.2f}, "
          f"{s['decode_tokens_per_s']:.1f} tok/s decode, TTFT {s['ttft_s'] * 1e3:.0f} ms]", file=sys.stderr)
    return 0
