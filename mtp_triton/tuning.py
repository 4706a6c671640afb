"""Pick the tree size for *this* hardware: expected tokens per step ÷ measured cost of a step.

A tree of T nodes yields E[tokens/step] = 1 + Σ_nodes P(path accepted) (from measured head accuracies,
`Tree.expected_accept_len`), but a T-node verify step costs c(T) × a 1-node step. On a memory-bound GPU
c(T) ≈ 1 up to large T (weights are read once either way), so big trees win; on a CPU with a small
model c(T) grows quickly, so small trees win. `best_tree` times c(T) on the real model and batch and
returns the budget that maximises (1 + E[accept]) / c(T) — the analytic speedup of notebook 06.
"""
import statistics
import time

import torch

from .drafters import HeadsDrafter
from .ops import get_ops
from .tree import Tree


@torch.no_grad()
def step_cost(model, trees, batch=1, context=256, kernels="auto", reps=5):
    """Median seconds of one verify step (forward over T nodes + logits) for each tree, on random tokens.

    The trees are timed in interleaved rounds (each round runs every tree once), so a slow spell of a shared
    machine slows every tree's samples alike instead of one tree's; each tree's median is over its `reps` rounds."""
    dev = model.device
    ops = get_ops(kernels, dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    context = min(context, model.config.max_position_embeddings - max(t.size for t in trees) - 1)
    cache = model.new_cache([context + max(t.size for t in trees)] * batch)
    cache.cache_lens.fill_(context)
    rows = torch.arange(batch, device=dev)
    runs = []
    for tree in trees:
        tree = tree.to(dev)
        tokens = torch.randint(0, model.config.vocab_size, (batch, tree.size), generator=g).to(dev)
        positions = context + tree.depth[None, :].expand(batch, -1)

        def run(tokens=tokens, positions=positions, mask=tree.mask):
            h, _, _ = model.forward_tree(tokens, positions, mask, cache, rows, ops, check_values=False)
            model.logits(h, model.exact_mode(ops))                    # as step.verify
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        runs.append(run)
    return interleaved_medians(runs, reps)


@torch.no_grad()
def drafting_costs(model, heads, trees, reps=7):
    """Median seconds of drafting each tree at batch 1 with the heads (the heads it reaches, the draft vocabulary),
    torch path, timed in interleaved rounds like `step_cost`: a step's cost is its verify step plus its drafting."""
    d = HeadsDrafter(heads, model, get_ops("torch", model.device))
    h = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(model.dtype)
    root = torch.zeros(1, dtype=torch.int64, device=model.device)
    return interleaved_medians([lambda t=t.to(model.device): d.draft(None, root, h, t) for t in trees], reps)


def interleaved_medians(runs, reps):
    """Median seconds of each function of `runs` after one warm-up call (kernel compiles), timed in interleaved
    rounds: each round calls every function once, so a slow spell of a shared machine slows every one's samples
    alike instead of one's; each median is over its `reps` rounds."""
    for run in runs:
        run()
    times = [[] for _ in runs]
    for _ in range(reps):
        for run, ts in zip(runs, times):
            t0 = time.perf_counter()
            run()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


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
