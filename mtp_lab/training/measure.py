"""How good are distilled heads, and which tree pays on this machine? (Held-out answers; CPU timings, median of
repeats; every number recorded with what it was measured on.)

- `evaluate_heads`: per-head top-k accuracy against the base's greedy token and the exact simulated greedy tau of a
  set of trees, per category, on held-out greedy answers (see `replay.simulate_tau`).
- `tree_from_ranks`: the tree of N nodes that accepts the most on held-out answers (the N rank paths the true
  continuation follows most often; Medusa's sparse trees are built from measured accuracies the same way, without
  assuming the heads independent, which heads that read their path are not).
- `choose_tree`: predicted speedup of each candidate tree = tau x (serial step) / (tree step + drafting), with the
  step costs measured on this machine (median of `reps`), so the choice never promises more than the measured costs
  allow; the demo later prints this prediction beside the measured speedup.
- `best_tree`: the tree built from measured head accuracies (`Tree.from_accuracies`) whose expected speedup
  (1 + E[accepted]) / c(T) is highest on this hardware: a T-node verify step costs c(T) x a 1-node step, nearly flat
  on a memory-bound GPU (big trees win) and growing fast on a CPU with a small model (small trees win).
- `drafting_costs`: the drafting half of a step's cost, per tree, for the heads.
"""
import argparse
import collections

import torch

from mtp_triton.tree import Tree
from mtp_triton.costs import interleaved_medians, step_cost
from mtp_triton.drafters import HeadsDrafter
from mtp_triton.ops import get_ops
from . import replay


def budget_list(text):
    """argparse type of --budgets: comma-separated tree sizes (drafts), each an integer >= 1 -> a tuple."""
    try:
        budgets = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not budgets or min(budgets) < 1:
        raise argparse.ArgumentTypeError(f"every tree size must be >= 1, got {text!r}")
    return budgets


def evaluate_heads(model, heads, rows, trees, K=8):
    """{category: {"positions", "acc" [H][K], "tau" {tree: tau}}} plus "all", on greedy held-out answers `rows`."""
    rows = [r for r in rows if r["mode"] == "greedy"]
    out = {}
    cats = sorted({r.get("category") or "all" for r in rows})
    for cat in cats + ["all"]:
        part = rows if cat == "all" else [r for r in rows if (r.get("category") or "all") == cat]
        if not part:
            continue
        cache = replay.build_cache(model, part, heads.token_map, top_k=1, num_heads=heads.num_heads)
        ranks = replay.head_ranks(heads, model, cache, K)
        lengths = replay.lengths_of(part)
        out[cat] = dict(answers=len(part), positions=int(cache["x"].shape[0]),
                        acc=replay.accuracy(ranks, K).tolist(),
                        tau={name: replay.simulate_tau(ranks, lengths, t) for name, t in trees.items()})
    return out


def tree_from_ranks(ranks, budget, K=8):
    """The `budget`-node tree with the largest simulated greedy acceptance on these ranks [N, H] (`head_ranks`).

    A node (r_1 .. r_d) is accepted at a position iff the true tokens there have ranks r_1 .. r_d, so a tree
    accepts, summed over positions, the count of each of its nodes' paths; a child's count never exceeds its
    parent's, so the `budget` most frequent paths (ties: shorter first) form the best prefix-closed tree."""
    counts = collections.Counter()
    for row in ranks.tolist():
        path = ()
        for r in row:
            if not 0 <= r < K:
                break
            path += (r,)
            counts[path] += 1
    best = sorted(counts, key=lambda p: (-counts[p], len(p), p))[:budget]
    return Tree.from_choices(best)


def choose_tree(model, heads, rows, budgets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32), reps=7, context=300,
                min_speedup=None):
    """(best tree, table): candidate trees from the held-out ranks (`tree_from_ranks`), each with its simulated tau,
    measured step cost ratio and predicted speedup on this machine (batch 1). Best = the fastest predicted; with
    `min_speedup`, the one that accepts the most (highest τ) among those predicted at least that fast (the fastest
    if none is)."""
    rows = [r for r in rows if r["mode"] == "greedy"]
    cache = replay.build_cache(model, rows, heads.token_map, top_k=1, num_heads=heads.num_heads)
    return choose_tree_from_ranks(model, heads, replay.head_ranks(heads, model, cache), replay.lengths_of(rows),
                                  budgets, reps, context, min_speedup)


def choose_tree_from_ranks(model, heads, ranks, lengths, budgets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32), reps=7,
                           context=300, min_speedup=None):
    """`choose_tree` on ranks [N, H] already computed (`replay.head_ranks`; lengths: positions per answer), e.g.
    the ranks of several held-out sets concatenated."""
    trees = [Tree.root_only()] + [tree_from_ranks(ranks, b) for b in budgets]
    costs = step_cost(model, trees, batch=1, context=context, kernels="torch", reps=reps)
    drafting = drafting_costs(model, heads, trees[1:], reps)
    table = []
    for b, tree, c, draft_s in zip(budgets, trees[1:], costs[1:], drafting):
        tau = replay.simulate_tau(ranks, lengths, tree)
        ratio = (c + draft_s) / costs[0]
        table.append(dict(budget=b, nodes=tree.size, depth=tree.max_depth, tau_simulated=tau,
                          step_ms=1e3 * c, draft_ms=1e3 * draft_s, serial_step_ms=1e3 * costs[0], cost_ratio=ratio,
                          predicted_speedup=tau / ratio, choices=[list(p) for p in tree.paths[1:]]))
    best = max(table, key=lambda r: r["predicted_speedup"])
    if min_speedup is not None:                # the most accepting tree still predicted at least this fast
        fast = [r for r in table if r["predicted_speedup"] >= min_speedup]
        if fast:
            best = max(fast, key=lambda r: (r["tau_simulated"], r["predicted_speedup"]))
    return Tree.from_choices(best["choices"]), table


@torch.no_grad()
def drafting_costs(model, heads, trees, reps=7):
    """Median seconds of drafting each tree at batch 1 with the heads (the heads it reaches, the draft vocabulary),
    torch path, timed in interleaved rounds like `step_cost`: a step's cost is its verify step plus its drafting."""
    d = HeadsDrafter(heads, model, get_ops("torch", model.device))
    h = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(model.dtype)
    root = torch.zeros(1, dtype=torch.int64, device=model.device)
    return interleaved_medians([lambda t=t.to(model.device): d.draft(None, root, h, t) for t in trees], reps)


def best_tree(model, acc, budgets=(1, 2, 4, 8, 16, 32, 64), batch=1, context=256, kernels="auto"):
    """(tree, table): the `Tree.from_accuracies(acc, b)` with the best expected speedup on this hardware.

    table rows: budget, nodes, expected tokens per step, cost ratio c(T), expected speedup.
    """
    acc = torch.as_tensor(acc, dtype=torch.float64)
    trees = [Tree.root_only()] + [Tree.from_accuracies(acc, b) for b in budgets]
    costs = step_cost(model, trees, batch=batch, context=context, kernels=kernels)
    table = []
    for b, tree, c in zip(budgets, trees[1:], costs[1:]):
        tokens = 1.0 + tree.expected_accept_len(acc)
        table.append(dict(budget=b, nodes=tree.size, expected_tokens_per_step=tokens, cost_ratio=c / costs[0],
                          expected_speedup=tokens / (c / costs[0])))
    best = max(range(len(table)), key=lambda i: table[i]["expected_speedup"])
    return trees[best + 1], table
