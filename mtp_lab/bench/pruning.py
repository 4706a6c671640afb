"""Confidence pruning, measured: serial vs MTP with the heads' tree, unpruned and pruned at several thresholds.

    python -m mtp_lab prune                         # SmolLM2 + shipped heads, held-out chat prompts, CPU
    python -m mtp_lab prune --prompts templated     # the templated held-out set (the one the tree was tuned on)

With `RuntimeConfig(prune_below=p)` a step verifies only the drafted nodes whose path probability under the heads,
prod_{d <= depth} q_d(y_d | path), is at least p (sizing.Pruner; EAGLE-2, Li et al. 2024, shapes its draft tree by
the same confidence, https://arxiv.org/abs/2406.16858). Where drafts look unlikely the verify forward is smaller;
tau falls a little, a step costs less. Every configuration runs on every prompt, one after another (batch 1), and
must emit the serial tokens. Writes <out>/prune.csv (one row per prompt and configuration, the rows of a prompt
appended as soon as it finishes, so Ctrl-C or a full disk loses only the prompt in flight) and <out>/prune.png.

    python -m mtp_lab prune --out out/prune --resume   # after a Ctrl-C: only the prompts not yet in prune.csv

--resume reuses a prompt's rows when prune.csv holds every configuration's row for it with the same setup (the
weights' fingerprints, the tree, --max-new-tokens, --kernels) on the same device; torn rows are left out (said so).
Bad flags and prompt files are refused with one `error:` line before the model loads; one run at a time per --out.
"""
import contextlib
import hashlib
import os
import sys

import torch

from ..cli import add_common, command_parser, error, Resumable, run
from mtp_triton.generate import RuntimeConfig
from ..bundle import (CHAT_PROMPTS, ROOT, SMOLLM2, cli_drafter, describe_drafter, encode, heads_dir_for, load_bundle,
                      pick_prompts, pick_tree, read_prompts, tree_size)
from ..records import md_table, row_key
from .ab import Config, run_prompt, summarise, warm_up
from .common import (KeptRows, append_rows, ensure_writable_dir, env_info, output_lock, resume_rows,
                     save_figure)
from .eval_harness import fingerprint

PROMPT_SETS = {"chat": CHAT_PROMPTS, "templated": os.path.join(ROOT, "data", "chat", "heldout_templated.jsonl")}
THRESHOLDS = (0.01, 0.02, 0.05, 0.1, 0.2)


def configs(thresholds, heads, tree, kernels):
    """The configurations (bench.ab) in the order each prompt runs them: serial, unpruned MTP, then MTP pruned at each
    threshold (`RuntimeConfig(prune_below=t)`)."""
    def mtp(name, p):
        return Config(name, dict(heads=heads, tree=tree, kernels=kernels,
                                 runtime=RuntimeConfig(prune_below=p) if p else None), fields=dict(prune_below=p))
    return ([Config("serial", dict(mtp=False, kernels=kernels), fields=dict(prune_below=None)), mtp("mtp", 0.0)]
            + [mtp(f"mtp p>={t:g}", float(t)) for t in thresholds])


def prune_summary(rows):
    """prune.csv rows (strings or typed, one per prompt and configuration) -> {configuration: dict(tok_s, tau, nodes,
    identical, prompts, speedup)} in the rows' order of configurations: `bench.ab.summarise` (decode tok/s = total
    decode tokens / total decode time, speedup against serial, tau, verified nodes per step, identical prompts)."""
    return {name: dict(tok_s=s["tok_s"], tau=s["tau"], nodes=s["nodes"], identical=s["identical"],
                       prompts=s["prompts"], speedup=s["vs_serial"]) for name, s in summarise(rows).items()}


def prompt_hash(text):
    """12 hex digits of a prompt's text: which prompt a row belongs to (prompt files need not have ids)."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]


# a row's identity for --resume (records.row_key): a prompt's rows are reused only when every configuration's is there
ROW_KEY = ("setup", "device", "prompt_hash", "config")


def build_parser():
    ap = command_parser("python -m mtp_lab prune", __doc__, "model", "drafter", "heads", model=SMOLLM2,
                        drafter=dict(help="medusa: MTP heads; mtp: the MTP module (a dynamic tree each step, pruned by "
                                     "its own path probabilities); default as the demo's"))
    ap.add_argument("--prompts", default="chat", help="'chat', 'templated' or a JSONL file with 'text' (and "
                    "'category')")
    add_common(ap, "per-category", "max-new-tokens", "tree", max_new_tokens=128)
    ap.add_argument("--thresholds", default=",".join(f"{t:g}" for t in THRESHOLDS),
                    help="comma-separated prune_below values in (0, 1]")
    add_common(ap, "kernels", "out", "resume", out=os.path.join("out", "prune"), resume=dict(
        help="skip the prompts whose rows <out>/prune.csv already holds (same model, heads, tree, token count, "
             "kernels and device)"))
    return ap


def parse_thresholds(text):
    """'0.05,0.1' -> [0.05, 0.1]; anything else, a value outside (0, 1] or one given twice, is a ValueError naming
    --thresholds."""
    try:
        thresholds = [float(t) for t in text.split(",") if t.strip()]
        for t in thresholds:
            RuntimeConfig(prune_below=t)                                        # refuses values outside (0, 1]
    except ValueError as e:
        raise ValueError(f"--thresholds {text!r}: {e}") from None
    twice = sorted({f"{t:g}" for t in thresholds if thresholds.count(t) > 1})
    if twice:                                   # each threshold is one configuration (and one row per prompt)
        raise ValueError(f"--thresholds {text!r}: {', '.join(twice)} given more than once; list each threshold once")
    return thresholds


def main(argv=None):
    """`python -m mtp_lab prune`: the exit status (0 every output equals serial, 1 one differs, 2 bad input, 130
    Ctrl-C). The rows of each prompt are appended to <out>/prune.csv as soon as it finishes; one run per --out."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    with contextlib.ExitStack() as held:
        try:                                             # everything that can be checked before the model loads
            thresholds = parse_thresholds(a.thresholds)
            prompts = read_prompts(PROMPT_SETS.get(a.prompts, a.prompts))
            ensure_writable_dir(a.out)
            held.enter_context(output_lock(a.out, "a prune run"))
        except (OSError, ValueError, RuntimeError) as e:
            return error(e)
        return _run(a, argv, thresholds, prompts)


def _run(a, argv, thresholds, prompts):
    a.drafter = cli_drafter(a.model, a.drafter, a.heads)
    try:
        model, heads, tok = load_bundle(a.model, a.heads, drafter=a.drafter)
        tree = pick_tree(a.tree, heads, a.heads or heads_dir_for(a.model, a.drafter), model, a.kernels)
    except (OSError, ValueError, RuntimeError) as e:
        return error(e)
    cfgs = configs(thresholds, heads, tree, a.kernels)
    rows = pick_prompts(prompts, a.per_category)
    eos = tok.eos_token_id
    csv_path = os.path.join(a.out, "prune.csv")
    env = env_info(model.device)
    paths = "dynamic " + repr(heads.draft) if tree is None else repr(tree.paths)
    setup = (f"model {fingerprint(model)} heads {fingerprint(heads)} tree {prompt_hash(paths)} "
             f"max_new_tokens {a.max_new_tokens} kernels {a.kernels}")
    kept = KeptRows(resume_rows(csv_path, log=lambda line: print(line, file=sys.stderr)) if a.resume else [],
                    ROW_KEY)
    cmd = "python -m mtp_lab prune " + " ".join(argv)
    print(f"model {a.model}, {model.dtype}, {torch.get_num_threads()} threads; {describe_drafter(heads, tree)}; "
          f"{len(rows)} prompts ({a.prompts}), {a.max_new_tokens} new tokens; "
          f"configurations: {', '.join(c.name for c in cfgs)}" + ("; --resume" if a.resume else ""))
    mine, warm = [], False
    with Resumable(csv_path, "prompt") as stop:
        for r in rows:
            base = dict(env, run="prune", setup=setup, model=a.model, dtype=str(model.dtype).replace("torch.", ""),
                        threads=torch.get_num_threads(), prompts=a.prompts, prompt_id=r.get("id"),
                        prompt_hash=prompt_hash(r["text"]), category=r.get("category"),
                        tree_size=tree_size(heads, tree), drafter=a.drafter, max_new_tokens=a.max_new_tokens,
                        command=cmd)
            again = kept.take(*[row_key(dict(base, config=c.name), ROW_KEY) for c in cfgs])
            if again:
                mine += again
                print(f"[{r.get('category', 'all')}] kept from an earlier run", flush=True)
                continue
            ids = encode(tok, r["text"])
            if not warm:                                                          # warm-up, not timed
                warm_up(model, ids, cfgs, eos=eos)
                warm = True
            new, _ = run_prompt(model, ids, a.max_new_tokens, cfgs, eos=eos, base=base)
            append_rows(csv_path, new)                                 # now: a Ctrl-C later keeps this prompt
            mine += new
            print(f"[{r.get('category', 'all')}] " + "  ".join(
                f"{x['config']}: {x['decode_tokens_per_s']:.1f} tok/s" + ("" if x["config"] == "serial" else
                                                                          f" tau {x['tokens_per_step']:.2f}")
                for x in new), flush=True)
    if stop.rc is not None:
        return stop.rc
    table = prune_summary(mine)
    print("\n" + md_table(["configuration", "decode tok/s", "speedup", "tau", "verified nodes / step", "identical"],
                          [[n, f"{s['tok_s']:.1f}", f"{s['speedup']:.2f}x", f"{s['tau']:.2f}", f"{s['nodes']:.1f}",
                            f"{s['identical']}/{s['prompts']}"] for n, s in table.items()]))
    plot(table, thresholds, env, os.path.join(a.out, "prune.png"))
    print(f"wrote {csv_path} and {a.out}/prune.png" + (f" ({kept.used} rows kept from earlier runs)"
                                                        if kept.used else ""))
    if any(s["identical"] != s["prompts"] for s in table.values()):
        print("ERROR: MTP output differs from serial output", file=sys.stderr)
        return 1
    return 0


def plot(table, thresholds, env, path):
    """Speedup, tau and verified nodes per threshold (a `prune_summary` table), built without pyplot."""
    from matplotlib.figure import Figure
    names = [n for n in table if n != "serial"]
    fig = Figure(figsize=(10, 3.4), dpi=80)
    ax = fig.subplots(1, 2)
    x = range(len(names))
    ax[0].bar(x, [table[n]["speedup"] for n in names], color="tab:blue")
    ax[0].axhline(1.0, color="grey", lw=0.8)
    ax[0].set_ylabel("decode speedup vs serial")
    ax[0].set_title(env["device"][:90], fontsize=7)
    ax[1].plot(x, [table[n]["tau"] for n in names], "o-", color="tab:green", label="tau (tokens / step)")
    ax[1].plot(x, [table[n]["nodes"] / 10 for n in names], "s--", color="tab:orange", label="verified nodes / 10")
    for a in ax:
        a.set_xticks(list(x), ["none"] + [f"{t:g}" for t in thresholds])
        a.set_xlabel("prune_below")
    ax[1].legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(run(main))
