"""Sizing each step's verified tree before it is verified: which drafted nodes are worth their cost.

    Pruner       confidence pruning (RuntimeConfig.prune_below): keep the nodes whose path probability under the
                 drafter is at least a threshold (EAGLE-2's idea of a draft tree shaped by the draft's own
                 probabilities: a step whose drafts look unlikely verifies fewer nodes)
    CostPruner   sizing by cost (RuntimeConfig.size_by_cost): keep each row's n nodes with the most expected tokens
                 for the cost of verifying them (`costs.LiveCosts`, this machine's c(T), learned as it runs)
    choose       which of the two (or none) a `generate` call runs, from its settings

A pruner is called by the step between draft and verify: (tree, tokens, path_prob, parents) -> the kept sub-tree.
Lossless whatever it keeps: which nodes are verified depends only on the drafter and past steps, never on the
target, and acceptance is unchanged.
"""
import torch

from .costs import live_costs
from .ops import cpu_twins
from .tree import Tree


class Pruner:
    """Confidence pruning: verify only the nodes whose path probability under the drafter is >= min_prob.

        keep[a, i] = path_prob[a, i] >= min_prob  (and the node is not switched off for row a: parents[a, i] >= 0)

    The verified tree is the union of the rows' kept nodes, with the nodes a row did not keep switched off for it
    (parent -1, as the runtime policy's depth limit does); at batch 1 it is exactly the kept nodes. A child's
    path probability never exceeds its parent's, so the kept set is a subtree. Lossless whatever min_prob is:
    which nodes are verified depends only on the drafter, never on the target, and acceptance is unchanged.
    Sub-trees are built once per set of kept nodes and cached. After a call, `kept_depth` [A] is each row's deepest
    kept node."""
    by_cost = False                         # not sized by measured costs (no fallback by cost beside it)

    def __init__(self, min_prob):
        if not 0.0 < float(min_prob) <= 1.0:
            raise ValueError(f"Pruner: min_prob must be in (0, 1], got {min_prob!r}")
        self.min_prob = float(min_prob)
        self.trees = {}                     # (tree.paths, kept nodes) -> the sub-tree
        self.kept_depth = None
        self.ancestors = {}                 # (tree.paths, device) -> mask.T as float [T, T] (the ancestor check)

    def keep(self, path_prob, on):
        """path_prob [A, T], on [A, T] (nodes the row uses, root included) -> keep [A, T] bool."""
        return on & (path_prob >= self.min_prob)

    def __call__(self, tree, tokens, path_prob, parents):
        """tree with T nodes, tokens [A, T], path_prob [A, T], parents [T] or [A, T]
        -> (sub-tree with T' nodes, tokens [A, T'], parents [T'] or [A, T'])"""
        A, T = tokens.shape
        on = (parents >= 0).expand(A, T).clone()
        on[:, 0] = True
        keep = self.keep(path_prob, on)
        keep[:, 0] = True
        key = (tree.paths, tree.mask.device)
        anc = self.ancestors.get(key)
        if anc is None:
            anc = self.ancestors[key] = tree.mask.T.float()
        keep &= (~keep).float() @ anc == 0                                          # every ancestor kept too
        self.kept_depth = (keep.long() * tree.depth).amax(1)                        # [A] deepest kept node
        idx = keep.any(0).nonzero()[:, 0]                                           # [T'] (a host sync)
        key = (tree.paths, tuple(idx.tolist()))
        if key not in self.trees:
            self.trees[key] = Tree.from_choices([tree.paths[i] for i in key[1][1:]]).to(tokens.device)
        sub = self.trees[key]
        # at batch 1 the union is the row's own kept set; with more rows a node some row did not keep is off for it
        sub_parents = sub.parents if A == 1 else torch.where(keep[:, idx], sub.parents[None, :], -1)
        return sub, tokens[:, idx], sub_parents

    def describe(self):
        """The cost model it sizes by, one line for stats (None: none)."""
        return None


class CostPruner(Pruner):
    """Size each step's verified tree by cost: keep the n nodes with the most expected tokens for their cost.

        S_a(n)    = sum of the n - 1 largest path probabilities of row a's drafted nodes
        gain_a(n) = 1 + alpha_a S_a(n) - rho_a c(n) / c(1)       expected tokens of the step, less what its cost buys
        n_a       = argmax_n gain_a(n),   c(n) = the cost of verifying n nodes now (`costs.LiveCosts`)
        keep[a, i] = node i is among the n_a most probable nodes of row a (ties: the lower node first)

    rho_a is the tokens per serial step's time that row a's recent speculative steps emitted, drafting included
    (at least 1: serial decoding is always available). Maximising the long-run rate tokens / seconds means
    maximising each step's tokens less rate x seconds (Dinkelbach's ratio method): a node is worth verifying when its
    path probability exceeds the tokens its marginal cost would buy at the rate the sequence already reaches.
    alpha_a calibrates the drafter: drafts accepted over drafts its probabilities predicted, on the same recent steps
    (heads can be about right on one kind of prompt and over-confident on another). Both come from
    `policy.RuntimePolicy.calibration` (`weigh`); 1 and 1 without history.
    A child's path probability never exceeds its parent's, so the kept set is a subtree, as for `Pruner`, which
    this generalises: a fixed threshold becomes the threshold that pays on this machine. n_a = 1 (the root alone)
    makes the step a serial one. Lossless whatever the costs: the choice reads only the drafter and past steps.
    After `keep`, `predicted` [A] holds each row's sum of kept path probabilities (drafts expected accepted)."""
    by_cost = True

    def __init__(self, costs):
        super().__init__(1.0)
        self.min_prob = 0.0                 # the drafter then reports path probabilities without cutting any
        self.costs = costs                  # c(T): `costs.LiveCosts` (learns from the steps) or any StepCosts
        self.alpha = self.rho = 1.0         # scalars or [A] float64 tensors (weigh)
        self.predicted = None

    def weigh(self, alpha, rho):
        """Per-row calibration alpha [A] and rate rho [A] (lists or tensors) for the next `keep`."""
        self.alpha, self.rho = (torch.as_tensor(x, dtype=torch.float64)[:, None] for x in (alpha, rho))

    def keep(self, path_prob, on):
        A, T = path_prob.shape
        ratio = self.costs.ratios(T).to(path_prob.device)                               # [T] c(n) / c(1) now
        alpha, rho = (x.to(path_prob.device) if torch.is_tensor(x) else x for x in (self.alpha, self.rho))
        p = torch.where(on, path_prob.double(), 0.0)
        p[:, 0] = 2.0                                                                   # the root always first
        order = torch.sort(p, dim=1, descending=True, stable=True).indices              # [A, T]
        S = torch.cumsum(p.gather(1, order), dim=1) - 2.0                               # [A, T] S(n), n = 1 .. T
        n = torch.argmax(alpha * S - rho * ratio, dim=1)                        # [A] n_a - 1
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(T, device=p.device).expand(A, T))
        kept = on & (rank <= n[:, None])
        self.predicted = S.gather(1, n[:, None])[:, 0]                                  # [A]
        return kept

    def describe(self):
        return self.costs.describe()


def choose(runtime, drafter, trees, model, kernels, ops, *, cuda_graph, pinned, batch):
    """The pruner a `generate` call runs, and whether the fallback by cost is on.   -> (pruner or None, by_cost)

    runtime: the RuntimeConfig (or None); trees: the drafter's `trees(...)` (budget: the most nodes a step verifies);
    pinned: a tree was passed to generate (verified as given unless size_by_cost=True). prune_below -> `Pruner`;
    else size_by_cost (`sizes_by_cost`) -> `CostPruner` on this machine's measured step costs; a one-node budget
    (serial decoding) has nothing to prune. The fallback by cost needs the cost pruner's measured costs: on with it
    unless fallback_by_cost=False; fallback_by_cost=True without it is refused."""
    prune_below = None if runtime is None else runtime.prune_below
    pruner = None
    if prune_below is not None and trees.budget > 1:
        if cuda_graph:
            raise ValueError("RuntimeConfig.prune_below changes the verified tree every step; it cannot be combined "
                             "with cuda_graph=True (one captured graph per tree size)")
        _needs_probabilities("prune_below", drafter)
        pruner = Pruner(prune_below)
    elif trees.budget > 1 and sizes_by_cost(runtime, drafter, model.device, ops, cuda_graph, pinned):
        pruner = CostPruner(live_costs(model, trees.budget, kernels, batch=batch))
    by_cost = pruner is not None and pruner.by_cost and (runtime is None or runtime.fallback_by_cost is not False)
    if runtime is not None and runtime.fallback_by_cost and not by_cost:
        raise ValueError("RuntimeConfig.fallback_by_cost=True compares speculative steps with the measured cost of a "
                         "serial step, which comes with size_by_cost; it is off here (size_by_cost=False, a tree "
                         "passed in, prune_below, a GPU, or a drafter without probabilities): set size_by_cost=True")
    return pruner, by_cost


def sizes_by_cost(runtime, drafter, device, ops, cuda_graph, pinned):
    """Size each step's tree by the measured step costs? RuntimeConfig.size_by_cost: True / False, or None (auto):
    when no tree was passed (tree=None: the heads' stored tree, or the default, is the candidate set; a tree passed
    in is verified as given), on a CPU with the PyTorch twins, where c(T) grows with T, for a drafter that reports
    probabilities; off on a GPU, where c(T) is nearly flat at batch 1 and CUDA graphs want fixed tree sizes, and
    for the Triton kernels in the interpreter (a teaching path, whose timings mean nothing)."""
    flag = None if runtime is None else runtime.size_by_cost
    if flag:
        _needs_probabilities("size_by_cost", drafter)
        if cuda_graph:
            raise ValueError("RuntimeConfig.size_by_cost changes the verified tree every step; it cannot be "
                             "combined with cuda_graph=True (one captured graph per tree size)")
        return True
    return (flag is None and not pinned and drafter.reports_probabilities and cpu_twins(ops, device)
            and not cuda_graph)


def _needs_probabilities(setting, drafter):
    if not drafter.reports_probabilities:
        raise ValueError(f"RuntimeConfig.{setting} needs a drafter that reports probabilities; "
                         f"{type(drafter).__name__} does not")
