"""The main job: serial vs MTP decoding of a real model on the same engine and prompts — and a text interface.

    python -m mtp_triton demo                                  # SmolLM2-135M-Instruct + its shipped heads, CPU
    python -m mtp_triton demo --model data/tiny-stdlib-llama   # the tiny model trained here (code prompts)
    python -m mtp_triton generate --prompt "What is a Python decorator?"

The demo answers held-out chat prompts of six categories one at a time (batch 1), serially, with MTP and with
`transformers`' own greedy `generate` on the same weights, dtype and prompts (the peer a user already has), each
prompt in turn. It checks that MTP gives the serial tokens, counts how often transformers does, and reports tau
(tokens per verify step), acceptance per depth, decode tokens/s and the speedup over both baselines, per category
and overall, next to the speedup predicted when the heads' tree was chosen, and the fraction of the machine's
weight-streaming floor each mode reaches (`bench.roofline`). It writes <out>/demo.csv (one row per prompt and mode)
and <out>/demo.png.
"""
import argparse
import os
import sys
import time

import torch

from .bench.common import save_figure
from .bench.hf_baseline import hf_twin, time_hf
from .bench.roofline import roofline_fields
from .cli import error, float_in, int_at_least
from .generate import RuntimeConfig, generate
from .mtp_module import MTPModule
from .ops import KINDS
from .records import append_rows, ensure_writable_dir, env_info
from .bundle import (CHAT_PROMPTS, DEFAULT_DRAFTER, DRAFTERS, PROMPTS, SMOLLM2, check_tree_name, cli_drafter,
                     describe_drafter, encode, generate_tree, heads_dir_for, load_bundle, pick_prompts, pick_tree,
                     read_prompts, tree_size)
from .sampling import check_seed, check_temperature
from .stats import format_tau

PROBABILITY = float_in(0.0, 1.0, low_open=True)            # argparse type of --prune-below


def run_pair(model, heads, tree, ids, max_new, eos, kernels, runtime=None):
    """Serial then MTP on one prompt (batch 1). -> (serial result, mtp result). tree None: the heads' stored tree,
    each step sized by the measured step costs (generate's default); a Tree is verified whole."""
    ser = generate(model, [ids], max_new, mtp=False, eos_token_id=eos, kernels=kernels)
    mtp = generate(model, [ids], max_new, heads=heads, tree=tree, eos_token_id=eos, kernels=kernels, runtime=runtime)
    return ser, mtp


def summarise(runs):
    """Decode tokens/s over all runs (total tokens / total time) of serial, MTP and transformers, tau and acceptance
    per depth of the MTP runs. runs: (serial result, MTP result, transformers timing dict) per prompt."""
    def rate(rs):
        tok = sum(r.stats.new_tokens - 1 for r in rs)
        sec = sum(r.stats.total_s - r.stats.ttft_s for r in rs)
        return tok / sec if sec > 0 else float("nan")
    ser, mtp, hf = [p[0] for p in runs], [p[1] for p in runs], [p[2] for p in runs]
    steps = sum(sum(r.stats.accept_len_histogram) for r in mtp)
    depth = max(len(r.stats.accept_rate_per_depth) for r in mtp)
    acc = []
    for d in range(depth):
        w = [(sum(r.stats.accept_len_histogram), r.stats.accept_rate_per_depth[d]) for r in mtp
             if d < len(r.stats.accept_rate_per_depth)]
        acc.append(sum(n * a for n, a in w) / max(sum(n for n, _ in w), 1))
    hf_rate = sum(h["decode_tokens"] for h in hf) / sum(h["decode_s"] for h in hf)
    return dict(prompts=len(runs), serial_tok_s=rate(ser), mtp_tok_s=rate(mtp), hf_tok_s=hf_rate,
                speedup=rate(mtp) / rate(ser), speedup_vs_hf=rate(mtp) / hf_rate,
                tau=sum(r.stats.new_tokens - 1 for r in mtp) / max(steps, 1), accept_rate_per_depth=acc,
                identical=sum(p[0].tokens == p[1].tokens for p in runs),
                hf_identical=sum(p[0].tokens[0] == p[2]["tokens"][0] for p in runs),
                verified_nodes_per_step=sum(r.stats.verified_nodes_per_step * r.stats.steps for r in mtp)
                / max(sum(r.stats.steps for r in mtp), 1))


def summarise_rows(rows):
    """The same summary as `summarise`, from demo.csv rows (strings, one per prompt and mode) -> dict(prompts,
    serial_tok_s, mtp_tok_s, speedup, tau, identical, and where the rows hold transformers runs: hf_tok_s,
    speedup_vs_hf, hf_identical). Decode tok/s = decode tokens (new tokens minus the prefill's) summed over the
    prompts / decode seconds summed; tau = the MTP rows' decode tokens / their steps."""
    def tokens(rs):
        return sum(int(r["new_tokens"]) - 1 for r in rs)
    by = {m: [r for r in rows if r["mode"] == m] for m in ("serial", "mtp", "transformers")}
    rate = {m: tokens(rs) / sum(float(r["decode_s"]) for r in rs) for m, rs in by.items() if rs}
    mtp = by["mtp"]
    out = dict(prompts=len(mtp), serial_tok_s=rate["serial"], mtp_tok_s=rate["mtp"],
               speedup=rate["mtp"] / rate["serial"], tau=tokens(mtp) / max(sum(int(r["steps"]) for r in mtp), 1),
               identical=sum(r["identical"] == "True" for r in mtp))
    if by["transformers"]:
        out.update(hf_tok_s=rate["transformers"], speedup_vs_hf=rate["mtp"] / rate["transformers"],
                   serial_vs_hf=rate["serial"] / rate["transformers"],
                   hf_identical=sum(r["identical"] == "True" for r in by["transformers"]))
    return out


def demo(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mtp_triton demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SMOLLM2, help="a short name, a checkpoint folder or a .gguf file")
    ap.add_argument("--drafter", default=None, choices=DRAFTERS, help="medusa: MTP heads; mtp: the MTP module (one "
                    f"block, dynamic tree); default {DEFAULT_DRAFTER} where the model has one, else medusa")
    ap.add_argument("--heads", default=None, help="the drafter's folder (default: the model's shipped heads or module)")
    ap.add_argument("--prompts", default=None, help="JSONL with 'text' (and 'category'); default: held-out chat "
                    "prompts for chat models, held-out code for the tiny model")
    ap.add_argument("--per-category", type=int_at_least(1), default=2)
    ap.add_argument("--max-new-tokens", type=int_at_least(1), default=128)
    ap.add_argument("--tree", default="stored", help="'stored' (saved with the heads), 'auto' (tuned now to this "
                    "machine), 'tuned' (to the heads' accuracies) or a preset name")
    ap.add_argument("--prune-below", type=PROBABILITY, default=None, metavar="P", help="confidence pruning: verify only "
                    "drafted nodes whose path probability under the heads is >= P (RuntimeConfig.prune_below; off)")
    ap.add_argument("--kernels", default="auto", choices=KINDS)
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp32"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=os.path.join("out", "demo"))
    a = ap.parse_args(argv)
    try:                                                  # everything that can be checked before the model loads
        runtime = RuntimeConfig(prune_below=a.prune_below) if a.prune_below is not None else None
        check_tree_name(a.tree)
        given = read_prompts(a.prompts) if a.prompts else None
        ensure_writable_dir(a.out)
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[a.dtype]
        a.drafter = cli_drafter(a.model, a.drafter, a.heads)
        model, heads, tok = load_bundle(a.model, a.heads, a.device, dtype, a.drafter)
        heads_dir = a.heads or heads_dir_for(a.model, a.drafter)
        chat = bool(getattr(tok, "chat_template", None))
        rows = given or read_prompts(CHAT_PROMPTS if chat else PROMPTS)
        rows = pick_prompts(rows, a.per_category) if chat else rows[:3]
        tree = pick_tree(a.tree, heads, heads_dir, model, a.kernels)
    except (OSError, ValueError, RuntimeError) as e:
        return error(e)
    eos = tok.eos_token_id
    print(f"model {a.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params, {model.dtype}, "
          f"{torch.get_num_threads()} threads, kernels {a.kernels}; {describe_drafter(heads, tree)}"
          + (f", pruned below path probability {a.prune_below:g}" if runtime else ""))
    ids0 = encode(tok, rows[0]["text"])
    hf = hf_twin(model)                                   # transformers' LlamaForCausalLM on the same weights
    gen_tree = generate_tree(a.tree, heads, tree)
    run_pair(model, heads, gen_tree, ids0, 8, eos, a.kernels, runtime)             # warm-up (and c(T)), not timed
    time_hf(hf, [ids0], 8, eos)
    runs, cats = [], []
    for r in rows:
        ids = encode(tok, r["text"])
        ser, mtp = run_pair(model, heads, gen_tree, ids, a.max_new_tokens, eos, a.kernels, runtime)
        peer = time_hf(hf, [ids], a.max_new_tokens, eos, warmup="none")
        runs.append((ser, mtp, peer))
        cats.append(r.get("category", "all"))
        same = ser.tokens == mtp.tokens
        print(f"\n--- [{cats[-1]}] {r['text'][:90]!r}")
        print(f"    {tok.decode(ser.tokens[0], skip_special_tokens=True)[:240]!r}")
        print(f"    MTP: {'identical' if same else 'DIFFERENT: ' + tok.decode(mtp.tokens[0])[:200]!r}, tau "
              f"{format_tau(mtp.stats.tokens_per_step)}, {mtp.stats.verified_nodes_per_step:.1f} nodes verified per "
              f"step; decode tok/s: transformers {peer['decode_tokens_per_s']:.1f}"
              f"{'' if peer['tokens'][0] == ser.tokens[0] else ' (other tokens)'}, serial "
              f"{ser.stats.decode_tokens_per_s:.1f}, MTP {mtp.stats.decode_tokens_per_s:.1f}")
    groups = {c: [p for p, pc in zip(runs, cats) if pc == c] for c in dict.fromkeys(cats)}
    table = {c: summarise(ps) for c, ps in groups.items()}
    table["all"] = summarise(runs)
    print(f"\n| category | prompts | transformers tok/s | serial tok/s | MTP tok/s | MTP vs serial | MTP vs "
          f"transformers | tau | identical to serial | transformers identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c, s in table.items():
        print(f"| {c} | {s['prompts']} | {s['hf_tok_s']:.1f} | {s['serial_tok_s']:.1f} | {s['mtp_tok_s']:.1f} | "
              f"{s['speedup']:.2f}x | {s['speedup_vs_hf']:.2f}x | {s['tau']:.2f} | {s['identical']}/{s['prompts']} | "
              f"{s['hf_identical']}/{s['prompts']} |")
    s = table["all"]
    print("acceptance per depth: " + ", ".join(f"d{d + 1} {r:.0%}" for d, r in enumerate(s["accept_rate_per_depth"])))
    cost = runs[0][1].stats.cost_model
    print(f"verified nodes per step: {s['verified_nodes_per_step']:.1f} of at most {tree_size(heads, tree)}"
          + (f", sized by this machine's measured step costs: {cost}" if cost else ""))
    predicted = _predicted(heads, tree)
    if predicted is not None:
        print(f"predicted speedup when the tree was chosen: {predicted:.2f}x; measured now: {s['speedup']:.2f}x")
    env = env_info(model.device)
    cmd = "python -m mtp_triton demo " + " ".join(argv if argv is not None else sys.argv[2:])
    base = dict(env, run="demo", model=a.model, dtype=str(model.dtype).replace("torch.", ""),
                threads=torch.get_num_threads(), tree_size=tree_size(heads, tree), prune_below=a.prune_below,
                drafter="mtp" if isinstance(heads, MTPModule) else "medusa",
                max_new_tokens=a.max_new_tokens, predicted_speedup=predicted, command=cmd)
    out_rows = []
    for r, c, (ser, mtp, peer) in zip(rows, cats, runs):
        for mode, res in (("serial", ser), ("mtp", mtp)):
            st = res.stats
            out_rows.append(dict(base, prompt_id=r.get("id"), category=c, mode=mode,
                                 verified_nodes_per_step=st.verified_nodes_per_step, cost_model=st.cost_model,
                                 kernels=st.kernels, new_tokens=st.new_tokens, steps=st.steps,
                                 tokens_per_step=st.tokens_per_step, decode_tokens_per_s=st.decode_tokens_per_s,
                                 ttft_s=st.ttft_s, decode_s=st.total_s - st.ttft_s, identical=ser.tokens == mtp.tokens,
                                 **roofline_fields(model, st.decode_tokens_per_s, st.tokens_per_step)))
        one = peer["per_prompt"][0]
        out_rows.append(dict(base, prompt_id=r.get("id"), category=c, mode="transformers", verified_nodes_per_step=1,
                             kernels="transformers generate (sdpa)", new_tokens=one["new_tokens"],
                             steps=one["new_tokens"] - 1, tokens_per_step=1.0,
                             decode_tokens_per_s=peer["decode_tokens_per_s"], ttft_s=one["ttft_s"],
                             decode_s=one["decode_s"], identical=peer["tokens"][0] == ser.tokens[0],
                             **roofline_fields(model, peer["decode_tokens_per_s"])))
    append_rows(os.path.join(a.out, "demo.csv"), out_rows)
    _plot(table, env, os.path.join(a.out, "demo.png"))
    print(f"wrote {a.out}/demo.csv and {a.out}/demo.png")
    if s["identical"] != s["prompts"]:
        print("ERROR: MTP output differs from serial output", file=sys.stderr)
        return 1
    return 0


def _predicted(heads, tree):
    """The predicted speedup stored with the heads for this tree size (from the tuning table), if any."""
    for r in heads.meta.get("tuning", []):
        if tree is not None and r.get("nodes") == tree.size:
            return r.get("predicted_speedup")
    return None


def _plot(table, env, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cats = [c for c in table if c != "all"] + ["all"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.4), dpi=80)
    x = range(len(cats))
    for off, key, label, color in ((-0.27, "hf_tok_s", "transformers generate", "tab:orange"),
                                   (0.0, "serial_tok_s", "our serial", "grey"), (0.27, "mtp_tok_s", "our MTP", "tab:blue")):
        ax[0].bar([i + off for i in x], [table[c][key] for c in cats], 0.27, label=label, color=color)
    ax[0].set_xticks(list(x), cats, rotation=30, fontsize=8)
    ax[0].set_ylabel("decode tokens/s (batch 1)")
    ax[0].legend(fontsize=8)
    ax[0].set_title(env["device"][:48], fontsize=9)
    rates = table["all"]["accept_rate_per_depth"]
    ax[1].bar(range(1, len(rates) + 1), rates, color="tab:green")
    ax[1].set_xlabel("depth")
    ax[1].set_ylabel("acceptance rate")
    ax[1].set_ylim(0, 1)
    ax[1].set_title(f"tau = {table['all']['tau']:.2f} tokens / step; MTP {table['all']['speedup']:.2f}x serial, "
                    f"{table['all']['speedup_vs_hf']:.2f}x transformers", fontsize=9)
    save_figure(fig, path, close=True)


def text_generate(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mtp_triton generate")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--model", default=SMOLLM2)
    ap.add_argument("--drafter", default=None, choices=DRAFTERS, help="medusa (heads) or mtp (the module); default "
                    f"{DEFAULT_DRAFTER} where the model has one, else medusa")
    ap.add_argument("--heads", default=None, help="the drafter's folder (default: the model's shipped one)")
    ap.add_argument("--raw", action="store_true", help="don't wrap the prompt in the chat template")
    ap.add_argument("--max-new-tokens", type=int_at_least(1), default=128)
    ap.add_argument("--tree", default="stored", help="'stored', 'auto', 'tuned' or a preset name (see demo --help)")
    ap.add_argument("--no-mtp", action="store_true")
    ap.add_argument("--prune-below", type=PROBABILITY, default=None, metavar="P",
                    help="confidence pruning of the tree (RuntimeConfig.prune_below; off)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--kernels", default="auto", choices=KINDS)
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp32"])
    ap.add_argument("--device", default=None)
    a = ap.parse_args(argv)
    try:
        a.prompt.encode("utf-8")
    except UnicodeEncodeError:
        return error("--prompt is not valid UTF-8 text")
    try:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[a.dtype]
        runtime = RuntimeConfig(prune_below=a.prune_below) if a.prune_below is not None else None
        check_temperature(a.temperature, a.top_p)
        check_seed(a.seed)
        check_tree_name(a.tree)
        a.drafter = cli_drafter(a.model, a.drafter, a.heads)
        model, heads, tok = load_bundle(a.model, a.heads, a.device, dtype, a.drafter)
        tree = pick_tree(a.tree, heads, a.heads or heads_dir_for(a.model, a.drafter), model, a.kernels)
        ids = tok(a.prompt)["input_ids"] if a.raw else encode(tok, a.prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        t0 = time.perf_counter()
        res = generate(model, [ids], a.max_new_tokens, heads=heads, mtp=not a.no_mtp,
                       tree=generate_tree(a.tree, heads, tree),
                       temperature=a.temperature, top_p=a.top_p, seed=a.seed, eos_token_id=tok.eos_token_id,
                       kernels=a.kernels, runtime=runtime)
    except (OSError, ValueError, RuntimeError, TypeError) as e:
        return error(e)
    print((a.prompt if a.raw else "") + tok.decode(res.tokens[0], skip_special_tokens=not a.raw))
    s = res.stats
    print(f"\n[{s.new_tokens} tokens, {s.steps} steps, tau {format_tau(s.tokens_per_step)}, {s.decode_tokens_per_s:.1f} tok/s "
          f"decode, TTFT {s.ttft_s * 1e3:.0f} ms, {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    return 0
