"""The main job: serial vs MTP decoding of a real model on the same engine and prompts — and a text interface.

    python -m mtp_lab demo                                  # SmolLM2-135M-Instruct + its shipped heads, CPU
    python -m mtp_lab demo --model data/tiny-stdlib-llama   # the tiny model trained here (code prompts)
    python -m mtp_lab generate --prompt "What is a Python decorator?"

The demo answers held-out chat prompts of six categories one at a time (batch 1), serially, with MTP and with
`transformers`' own greedy `generate` on the same weights, dtype and prompts (the peer a user already has), each
prompt in turn. It checks that MTP gives the serial tokens, counts how often transformers does, and reports tau
(tokens per verify step), acceptance per depth, decode tokens/s and the speedup over both baselines, per category
and overall, next to the speedup predicted when the heads' tree was chosen, and the fraction of the machine's
weight-streaming floor each configuration reaches (`bench.roofline`). It writes <out>/demo.csv (one row per prompt
and configuration: the rows of `bench.ab`) and <out>/demo.png.
"""
import os
import sys
import time

import torch

from .bench.ab import PEER, Config, run_prompt, summarise, warm_up
from .bench.common import save_figure
from .bench.hf_baseline import hf_twin
from .cli import add_common, command_parser, error
from mtp_triton.generate import RuntimeConfig, generate
from mtp_triton.mtp_module import MTPModule
from .records import append_rows, ensure_writable_dir, env_info
from .bundle import (CHAT_PROMPTS, command_dtype, PROMPTS, SMOLLM2, check_tree_name, cli_drafter, reproducible_runtime,
                     describe_drafter, encode, generate_tree, heads_dir_for, load_bundle, pick_prompts, pick_tree,
                     read_prompts, tree_size)
from mtp_triton.sampling import check_seed, check_temperature


def format_tau(tau):
    """tau for a person: two decimals, or 'n/a (no verify step)' when the run had none (a 1-token output)."""
    return "n/a (no verify step)" if tau != tau else f"{tau:.2f}"


def configs(heads, tree, kernels, runtime=None):
    """The demo's configurations (bench.ab), in the order each prompt runs them: our serial loop, MTP (tree None: the
    heads' stored tree, each step sized by the measured step costs, generate's default; a Tree is verified whole),
    and transformers' greedy generate on the same weights."""
    return [Config("serial", dict(mtp=False, kernels=kernels)),
            Config("mtp", dict(heads=heads, tree=tree, kernels=kernels, runtime=runtime)),
            Config(PEER, peer=True)]


def demo_summary(rows):
    """The demo's summary of its rows (demo.csv rows, strings or typed, one per prompt and configuration) through
    `bench.ab.summarise` -> dict(prompts, serial_tok_s, mtp_tok_s, speedup, tau, identical, accept_rate_per_depth,
    verified_nodes_per_step, and where the rows hold transformers runs: hf_tok_s, speedup_vs_hf, serial_vs_hf,
    hf_identical). Decode tok/s = decode tokens (new tokens minus the prefill's) summed over the prompts / decode
    seconds summed; tau = the MTP rows' decode tokens / their steps."""
    t = summarise(rows)
    ser, mtp, hf = t["serial"], t["mtp"], t.get(PEER)
    out = dict(prompts=mtp["prompts"], serial_tok_s=ser["tok_s"], mtp_tok_s=mtp["tok_s"], speedup=mtp["vs_serial"],
               tau=mtp["tau"], identical=mtp["identical"], accept_rate_per_depth=mtp["accept"],
               verified_nodes_per_step=mtp["nodes"])
    if hf:
        out.update(hf_tok_s=hf["tok_s"], speedup_vs_hf=mtp["vs_peer"], serial_vs_hf=ser["vs_peer"],
                   hf_identical=hf["identical"])
    return out


def demo(argv=None):
    ap = command_parser("python -m mtp_lab demo", __doc__, "model", "drafter", "heads", model=SMOLLM2)
    ap.add_argument("--prompts", default=None, help="JSONL with 'text' (and 'category'); default: held-out chat "
                    "prompts for chat models, held-out code for the tiny model")
    add_common(ap, "per-category", "max-new-tokens", "tree", "prune-below", "kernels", "dtype", "device", "out",
               max_new_tokens=128, out=os.path.join("out", "demo"))
    a = ap.parse_args(argv)
    try:                                                  # everything that can be checked before the model loads
        runtime = RuntimeConfig(prune_below=a.prune_below) if a.prune_below is not None else None
        check_tree_name(a.tree)
        given = read_prompts(a.prompts) if a.prompts else None
        ensure_writable_dir(a.out)
        dtype, why = command_dtype(a.dtype, a.model, a.device)
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
    print(f"model {a.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params, {str(model.dtype)[6:]} ({why}), "
          f"{torch.get_num_threads()} threads, kernels {a.kernels}; {describe_drafter(heads, tree)}"
          + (f", pruned below path probability {a.prune_below:g}" if runtime else ""))
    hf = hf_twin(model)                                   # transformers' LlamaForCausalLM on the same weights
    cfgs = configs(heads, generate_tree(a.tree, heads, tree), a.kernels, runtime)
    warm_up(model, encode(tok, rows[0]["text"]), cfgs, hf=hf, eos=eos)            # warm-up (and c(T)), not timed
    predicted = _predicted(heads, tree)
    env = env_info(model.device)
    cmd = "python -m mtp_lab demo " + " ".join(argv if argv is not None else sys.argv[2:])
    base = dict(env, run="demo", model=a.model, dtype=str(model.dtype).replace("torch.", ""),
                threads=torch.get_num_threads(), tree_size=tree_size(heads, tree), prune_below=a.prune_below,
                drafter="mtp" if isinstance(heads, MTPModule) else "medusa",
                max_new_tokens=a.max_new_tokens, predicted_speedup=predicted, command=cmd)
    out_rows = []
    for i, r in enumerate(rows):
        got, tokens = run_prompt(model, encode(tok, r["text"]), a.max_new_tokens, cfgs, hf=hf, eos=eos,
                                 base=dict(base, prompt_id=r.get("id", i), category=r.get("category", "all")))
        out_rows += got
        ser, mtp, peer = got
        print(f"\n--- [{ser['category']}] {r['text'][:90]!r}")
        print(f"    {tok.decode(tokens['serial'], skip_special_tokens=True)[:240]!r}")
        same = mtp["identical_to_serial"]
        print(f"    MTP: {'identical' if same else 'DIFFERENT: ' + tok.decode(tokens['mtp'])[:200]!r}, tau "
              f"{format_tau(mtp['tokens_per_step'])}, {mtp['verified_nodes_per_step']:.1f} nodes verified per "
              f"step; decode tok/s: transformers {peer['decode_tokens_per_s']:.1f}"
              f"{'' if peer['identical_to_serial'] else ' (other tokens)'}, serial "
              f"{ser['decode_tokens_per_s']:.1f}, MTP {mtp['decode_tokens_per_s']:.1f}")
    cats = list(dict.fromkeys(r["category"] for r in out_rows))
    table = {c: demo_summary([r for r in out_rows if r["category"] == c]) for c in cats}
    table["all"] = demo_summary(out_rows)
    print("\n| category | prompts | transformers tok/s | serial tok/s | MTP tok/s | MTP vs serial | MTP vs "
          "transformers | tau | identical to serial | transformers identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c, s in table.items():
        print(f"| {c} | {s['prompts']} | {s['hf_tok_s']:.1f} | {s['serial_tok_s']:.1f} | {s['mtp_tok_s']:.1f} | "
              f"{s['speedup']:.2f}x | {s['speedup_vs_hf']:.2f}x | {s['tau']:.2f} | {s['identical']}/{s['prompts']} | "
              f"{s['hf_identical']}/{s['prompts']} |")
    s = table["all"]
    print("acceptance per depth: " + ", ".join(f"d{d + 1} {r:.0%}" for d, r in enumerate(s["accept_rate_per_depth"])))
    cost = next(r["cost_model"] for r in out_rows if r["config"] == "mtp")
    print(f"verified nodes per step: {s['verified_nodes_per_step']:.1f} of at most {tree_size(heads, tree)}"
          + (f", sized by this machine's measured step costs: {cost}" if cost else ""))
    if predicted is not None:
        print(f"predicted speedup when the tree was chosen: {predicted:.2f}x; measured now: {s['speedup']:.2f}x")
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
    ap = command_parser("python -m mtp_lab generate", "generate text from a prompt")
    ap.add_argument("--prompt", required=True)
    add_common(ap, "model", "drafter", "heads", model=SMOLLM2)
    ap.add_argument("--raw", action="store_true", help="don't wrap the prompt in the chat template")
    add_common(ap, "max-new-tokens", "tree", max_new_tokens=128)
    ap.add_argument("--no-mtp", action="store_true")
    add_common(ap, "prune-below", "temperature", "top-p", "seed", "kernels", "dtype", "device",
               seed=dict(default=None, help="random seed of the sampling (default: none)"))
    a = ap.parse_args(argv)
    try:
        a.prompt.encode("utf-8")
    except UnicodeEncodeError:
        return error("--prompt is not valid UTF-8 text")
    try:
        dtype = command_dtype(a.dtype, a.model, a.device)[0]
        runtime = reproducible_runtime(a.temperature, a.seed, prune_below=a.prune_below)
        check_temperature(a.temperature, a.top_p)
        check_seed(a.seed)
        check_tree_name(a.tree)
        a.drafter = None if a.no_mtp else cli_drafter(a.model, a.drafter, a.heads)     # --no-mtp: no drafter at all
        model, heads, tok = load_bundle(a.model, a.heads, a.device, dtype, a.drafter)
        tree = None if a.no_mtp else pick_tree(a.tree, heads, a.heads or heads_dir_for(a.model, a.drafter), model,
                                               a.kernels)
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
