"""Choose trained heads' tree again, for the machine this runs on, without retraining them.

    python -m mtp_lab train_heads retree --heads data/smollm2-135m-instruct-heads \\
        --tune data/chat/heldout_templated.jsonl,data/chat/dev_chat.jsonl --min-speedup 1.4

Which tree a set of heads should ship depends on two things training does not fix: the rank paths the model's
continuations follow on the prompts people send, and what a verify step of T nodes costs on the machine that
decodes (on a 2-core CPU a 25-node step can cost as little as a 21-node one on one machine and 20 % more on
another). So the tree is chosen apart from training, from held-out answers:

1. answers   this engine answers every prompt of the tuning sets and of the report sets greedily (resumable;
             `answers.write_answers`) — the tokens greedy MTP must reproduce
2. ranks     at every answer position, the rank of each true next token among each head's candidates, scored as
             the CPU decoder drafts (`replay.head_ranks`)
3. choose    for each budget, the tree that accepts the most on the tuning sets' ranks together
             (`measure.tree_from_ranks`); its step and drafting costs timed here in interleaved rounds (median);
             predicted speedup = simulated tau x serial step / (tree step + drafting); the shipped tree is the
             one that accepts the most among those predicted at least `--min-speedup` as fast as serial decoding
             (`measure.choose_tree_from_ranks`; without it, the fastest predicted)
4. report    the exact greedy tau of preset trees and of the chosen one on every report set, per category —
             including sets never used to choose (the hand-written held-out chat prompts); each set's ranks are
             computed once and serve both the choice and the report
5. store     the tree and the tuning table go into heads.json (`tree`, `tuning`; the weights file is not
             rewritten, heads.json is replaced whole or not at all); the record, with the machine and commit it was
             measured on, into <records>/retree.json

The tree must never be chosen on the prompts it is reported on as held out: a tuning set that shares a prompt
with a `--never-tune` file (the hand-written held-out chat prompts by default) is refused before anything loads,
whatever the files are called. Prompts are compared by their normalised text (case-folded, whitespace collapsed:
`self_prompts.normalise`).
"""
import json
import os
import time

import torch

from ..cli import add_common, float_in, int_at_least
from mtp_triton.heads import load_heads
from mtp_triton.loading import load_model, load_tokenizer
from ..records import env_info, write_json
from mtp_triton.tree import Tree, get_tree
from . import distill, measure, replay
from .answers import read_prompts, write_answers
from .measure import budget_list
from .self_prompts import normalise


def _sets(spec):
    """'a.jsonl,b.jsonl' -> {name: path}, name = the file's stem."""
    paths = [p for p in spec.split(",") if p.strip()]
    return {os.path.splitext(os.path.basename(p))[0]: p for p in paths}


def tau_by_category(ranks, rows, trees):
    """{category: {tree name: tau}} plus "all", from one set's ranks [N, H] (`replay.head_ranks` over `rows`'
    answers, concatenated in row order), so every subset is replayed from the same ranks instead of new ones."""
    lengths = replay.lengths_of(rows)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    out = {}
    for cat in sorted({r.get("category") or "all" for r in rows}) + ["all"]:
        idx = [j for j, r in enumerate(rows) if cat == "all" or (r.get("category") or "all") == cat]
        part = torch.cat([ranks[starts[j]:starts[j + 1]] for j in idx])
        out[cat] = {name: replay.simulate_tau(part, [lengths[j] for j in idx], t) for name, t in trees.items()}
    return out


def store_tree(heads_dir, tree, table):
    """Put `tree` and its tuning `table` into <heads_dir>/heads.json (the weights file is not touched), replacing
    the file whole (records.write_json): a full disk leaves the old heads.json as it was. Returns the tree it
    replaces (None if there was none)."""
    meta_file = os.path.join(heads_dir, "heads.json")
    with open(meta_file, encoding="utf-8") as f:
        meta = json.load(f)
    previous = meta.get("tree")
    meta["tree"] = [list(p) for p in tree.paths[1:]]
    meta["tuning"] = table
    meta["tuning_by"] = "retree"
    write_json(meta_file, meta)
    return previous


def refuse_protected_prompts(tune, protected):
    """Raise ValueError if any tuning set {path: rows} shares a prompt with a protected set {path: rows}, naming
    both files, how many prompts they share and the first few (tuning id = protected id)."""
    for ppath, prows in protected.items():
        ids = {}
        for r in prows:
            ids.setdefault(normalise(r["text"]), r["id"])
        for tpath, trows in tune.items():
            shared = [(r["id"], ids[normalise(r["text"])]) for r in trows if normalise(r["text"]) in ids]
            if shared:
                shown = ", ".join(f"{a!r} = {b!r}" for a, b in shared[:3]) + (", ..." if len(shared) > 3 else "")
                raise ValueError(
                    f"retree: --tune {tpath} shares {len(shared)} prompt(s) with the held-out set {ppath} "
                    f"(--never-tune): {shown}; held-out prompts must not be used to choose the tree: remove them "
                    "from the tuning set")


def run(args):
    torch.set_num_threads(args.threads)
    env = env_info()                              # stamped before anything is written
    t0 = time.time()
    # every input checked before the model loads: prompt files, the held-out guard, the heads' draft vocabulary
    tune, report = _sets(args.tune), _sets(args.report)
    if not tune:
        raise ValueError("retree: --tune names no prompt file")
    prompt_sets = {name: read_prompts(path, "--tune" if name in tune else "--report")
                   for name, path in {**report, **tune}.items()}
    refuse_protected_prompts({tune[n]: prompt_sets[n] for n in tune},
                             {p: read_prompts(p, "--never-tune") for p in args.never_tune.split(",") if p.strip()})
    heads = load_heads(args.heads)
    if heads.token_map is None:
        raise ValueError(f"retree: {args.heads} has no draft vocabulary (token_map); these heads come from `distill`")
    model = load_model(args.model, device="cpu", dtype=torch.bfloat16)
    tok = load_tokenizer(args.model)
    rows = {}
    for name, path in {**tune, **report}.items():
        prompts = prompt_sets[name]
        f = os.path.join(args.work, f"answers-{name}.jsonl")
        write_answers(model, tok, prompts, f, args.max_new_tokens, sample_share=0.0, batch=args.gen_batch)
        rows[name] = [r for r in distill.read_answers(f, {p["id"] for p in prompts}) if r["mode"] == "greedy"]
    t_answers = time.time() - t0

    t1 = time.time()
    ranks = {}                                    # once per set: the choice and the report both replay them
    for name in rows:
        c = replay.build_cache(model, rows[name], heads.token_map, 1, num_heads=heads.num_heads)
        ranks[name] = replay.head_ranks(heads, model, c)
    tree, table = measure.choose_tree_from_ranks(
        model, heads, torch.cat([ranks[n] for n in tune]), [k for n in tune for k in replay.lengths_of(rows[n])],
        budgets=args.budgets, reps=args.reps, min_speedup=args.min_speedup)
    t_choose = time.time() - t1

    t2 = time.time()
    trees = {n: get_tree(n) for n in ("chain-2", "chain-4", "medusa-16", "medusa-32")}
    trees = {n: t for n, t in trees.items() if t.max_depth <= heads.num_heads}
    if heads.tree is not None:
        trees["previous"] = Tree.from_choices([tuple(p) for p in heads.tree])
    trees["chosen"] = tree
    tau = {name: tau_by_category(ranks[name], rows[name], trees) for name in dict.fromkeys(list(tune) + list(report))}
    t_report = time.time() - t2

    previous = store_tree(args.heads, tree, table)
    records = args.records or os.path.join(args.heads, "records")
    cmd = "python -m mtp_lab train_heads retree " + " ".join(
        f"--{k.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, tuple) else v}"
        for k, v in vars(args).items() if k not in ("func", "recipe") and v is not None)
    info = dict(env, command=cmd, config={k: v for k, v in vars(args).items() if k not in ("func", "recipe")},
                threads=torch.get_num_threads(), tune={n: len(rows[n]) for n in tune},
                report={n: len(rows[n]) for n in report},
                positions={n: sum(replay.lengths_of(r)) for n, r in rows.items()},
                tree_nodes=tree.size, tree_depth=tree.max_depth, previous_tree_nodes=len(previous) + 1 if previous
                else None, tau=tau, seconds=dict(answers=round(t_answers, 1), choose=round(t_choose, 1),
                                                 report=round(t_report, 1)))
    write_json(os.path.join(records, "retree.json"), info)
    chat = {n: t["all"]["chosen"] for n, t in tau.items()}
    print(json.dumps(dict(tree_nodes=tree.size, tree_depth=tree.max_depth, tau_chosen=chat,
                          seconds=info["seconds"])))
    return info


def add_arguments(sp):
    add_common(sp, "model", "heads", model="smollm2-135m-instruct", heads=dict(
        default=os.path.join("data", "smollm2-135m-instruct-heads"), help="heads folder; its heads.json gets the "
        "new tree"))
    sp.add_argument("--tune", default=",".join(os.path.join("data", "chat", f) for f in
                                               ("heldout_templated.jsonl", "dev_chat.jsonl")),
                    help="comma-separated prompt files whose answers choose the tree")
    sp.add_argument("--report", default=",".join(os.path.join("data", "chat", f) for f in
                                                 ("heldout_templated.jsonl", "heldout_chat.jsonl")),
                    help="comma-separated prompt files to report tau on")
    sp.add_argument("--never-tune", default=os.path.join("data", "chat", "heldout_chat.jsonl"),
                    help="comma-separated prompt files no --tune file may share a prompt with (compared by normalised "
                         "text, whatever the files are called); '' turns the guard off")
    sp.add_argument("--work", default=os.path.join("runs", "retree"), help="answers (resumable)")
    sp.add_argument("--records", default=None, help="default: <heads>/records")
    add_common(sp, "max-new-tokens", max_new_tokens=192)
    sp.add_argument("--gen-batch", type=int_at_least(1), default=32)
    sp.add_argument("--budgets", type=budget_list, default="1,2,3,4,6,8,12,16,20,24,28,32",
                    help="tree sizes (drafts) to choose from")
    sp.add_argument("--min-speedup", type=float_in(0, low_open=True), default=1.4,
                    help="ship the most accepting tree predicted at least this fast (none: the fastest predicted)")
    sp.add_argument("--reps", type=int_at_least(1), default=21, help="timing rounds per tree (median)")
    add_common(sp, "threads")
