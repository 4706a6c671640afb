"""How good are distilled heads, and which tree pays on this machine? (Held-out answers; CPU timings, median of
repeats; every number recorded with what it was measured on.)

- `evaluate_heads`: per-head top-k accuracy against the base's greedy token and the exact simulated greedy tau of a
  set of trees, per category, on held-out greedy answers (see `distill.simulate_tau`).
- `choose_tree`: predicted speedup of each candidate tree = tau x (serial step) / (tree step + drafting), with the
  step costs measured on this machine (median of `reps`), so the choice never promises more than the measured costs
  allow; the demo later prints this prediction beside the measured speedup.
"""
import statistics
import time

import torch

from ..drafters import HeadsDrafter
from ..ops import get_ops
from ..tree import Tree
from ..tuning import step_cost
from . import distill


def evaluate_heads(model, heads, rows, trees, K=8):
    """{category: {"positions", "acc" [H][K], "tau" {tree: tau}}} plus "all", on greedy held-out answers `rows`."""
    rows = [r for r in rows if r["mode"] == "greedy"]
    out = {}
    cats = sorted({r.get("category") or "all" for r in rows})
    for cat in cats + ["all"]:
        part = rows if cat == "all" else [r for r in rows if (r.get("category") or "all") == cat]
        if not part:
            continue
        cache = distill.build_cache(model, part, heads.token_map, top_k=1, num_heads=heads.num_heads)
        ranks = distill.head_ranks(heads, model, cache, K)
        lengths = distill.lengths_of(part)
        out[cat] = dict(answers=len(part), positions=int(cache["x"].shape[0]),
                        acc=distill.accuracy(ranks, K).tolist(),
                        tau={name: distill.simulate_tau(ranks, lengths, t) for name, t in trees.items()})
    return out


def drafting_cost(model, heads, top_k, reps=7, num_heads=None):
    """Median seconds of one drafting call (the first num_heads heads, the draft vocabulary) at batch 1, torch path."""
    d = HeadsDrafter(heads, model, get_ops("torch", model.device))
    h = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(model.dtype)
    root = torch.zeros(1, dtype=torch.int64, device=model.device)
    d.propose(h, top_k, num_heads=num_heads, roots=root)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        d.propose(h, top_k, num_heads=num_heads, roots=root)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def choose_tree(model, heads, rows, budgets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32), acc=None, reps=7, context=300):
    """(best tree, table): candidate trees from the held-out accuracies, each with its simulated tau, measured step
    cost ratio and predicted speedup on this machine (batch 1)."""
    rows = [r for r in rows if r["mode"] == "greedy"]
    cache = distill.build_cache(model, rows, heads.token_map, top_k=1, num_heads=heads.num_heads)
    ranks = distill.head_ranks(heads, model, cache)
    lengths = distill.lengths_of(rows)
    acc = distill.accuracy(ranks) if acc is None else torch.as_tensor(acc)
    trees = [Tree.root_only()] + [Tree.from_accuracies(acc, b) for b in budgets]
    costs = step_cost(model, trees, batch=1, context=context, kernels="torch", reps=reps)
    table = []
    for b, tree, c in zip(budgets, trees[1:], costs[1:]):
        draft = drafting_cost(model, heads, tree.top_k, reps, num_heads=tree.max_depth)
        tau = distill.simulate_tau(ranks, lengths, tree)
        ratio = (c + draft) / costs[0]
        table.append(dict(budget=b, nodes=tree.size, depth=tree.max_depth, tau_simulated=tau,
                          step_ms=1e3 * c, draft_ms=1e3 * draft, serial_step_ms=1e3 * costs[0], cost_ratio=ratio,
                          predicted_speedup=tau / ratio, choices=[list(p) for p in tree.paths[1:]]))
    best = max(table, key=lambda r: r["predicted_speedup"])
    return Tree.from_choices(best["choices"]), table
