"""One MTP decoding step in four phases — draft, verify, accept, append — and `mtp_step`, which composes them.

    draft   the heads read the hidden state at the deepest accepted node; node i of the tree gets rank r_i of head
            depth_i - 1 (node 0, the root, is the newest committed token)                       draft [A, T]
    verify  ONE forward of the T nodes through the target; node i sits at position cache_len + depth_i and sees
            the whole cache plus itself and its ancestors                                        logits [A, T, V]
    accept  node i is accepted iff its parent is accepted and draft[i] equals the target's choice after the
            parent; the deepest accepted node n ends the path, and the target's choice after n is the bonus
    append  K/V of the root and the accepted nodes become the next cache positions; the bonus is the next root

A serial step is the same step with the one-node tree (T = 1): nothing to draft, nothing to accept, the bonus is
the next token. The phases are the ones Medusa names generate_candidates, tree_decoding, evaluate_posterior and
update_inference_inputs (https://github.com/FasterDecoding/Medusa), and gpt-fast's speculative_decode.
A = rows of the batch taking part in this step (`rows` indexes the cache), T = tree nodes, K = top-k, H = heads.

Optionally the drafted tree is pruned by the heads' confidence before it is verified (`Pruner`, EAGLE-2's idea
of a draft tree shaped by the draft's own probabilities): a step whose drafts look unlikely verifies fewer nodes.
"""
from dataclasses import dataclass

import torch

from .tree import Tree


@dataclass
class Step:
    """What one step produced for its A rows (tensors stay on the model's device)."""
    draft: torch.Tensor          # [A, T] token of every node (node 0 = root)
    accept_len: torch.Tensor     # [A] accepted drafts (root excluded)
    accept_nodes: torch.Tensor   # [A, T] root 0, then the accepted nodes by depth, then -1
    bonus: torch.Tensor          # [A] the target's choice after the deepest accepted node: the next root
    hidden: torch.Tensor         # [A, D] final-norm hidden state at the deepest accepted node (drives the next draft)


def draft(drafter, hidden, roots, tree, context=None, min_prob=None):
    """Tokens for every node: the root, then rank tree.rank[i] of head tree.depth[i] - 1.   -> [A, T]

    drafter.propose(hidden [A, D], top_k, context, num_heads, roots) -> ids [A, num_heads, K] (`drafters.HeadsDrafter`,
    or the synthetic `drafters.OracleDrafter`, which reads `context` = (batch indices, tokens emitted so far)
    instead of hidden). Only the heads the tree reaches run: a depth-2 tree drafts with 2 heads, however many exist.
    A drafter with `sequential = True` (heads that read the drafted tokens of their path) drafts node by node
    instead: drafter.draft_tree(hidden, roots, tree) -> [A, T].

    min_prob (for `Pruner`): also return path_prob [A, T], the product of the heads' probabilities of the tokens
    on the path from the root to each node (root 1); the drafter must report probabilities
    (`reports_probabilities`). A sequential drafter stops drafting at the first depth no path reaches min_prob."""
    want = min_prob is not None
    if want and not getattr(drafter, "reports_probabilities", False):
        raise ValueError(f"confidence pruning needs a drafter that reports probabilities; "
                         f"{type(drafter).__name__} does not")
    if tree.size == 1:
        tokens = roots[:, None].clone()
        return (tokens, torch.ones(tokens.shape, device=tokens.device)) if want else tokens
    if getattr(drafter, "sequential", False):
        return drafter.draft_tree(hidden, roots, tree, min_prob=min_prob)
    tokens = roots[:, None].repeat(1, tree.size)                                    # [A, T]; node 0 = root
    out = drafter.propose(hidden, tree.top_k, context, num_heads=tree.max_depth, roots=roots, **(
        {"probs": True} if want else {}))                                           # [A, depth, K]
    ids, probs = out if want else (out, None)
    tokens[:, 1:] = ids[:, tree.depth[1:] - 1, tree.rank[1:]]
    if not want:
        return tokens
    logp = torch.zeros(tokens.shape, device=tokens.device)                          # [A, T]; log 1 at the root
    logp[:, 1:] = probs[:, tree.depth[1:] - 1, tree.rank[1:]].float().clamp_min(1e-30).log()
    return tokens, torch.exp(logp @ tree.mask.T.float())                            # sum over each node's path


class Pruner:
    """Confidence pruning: verify only the nodes whose path probability under the heads is >= min_prob.

        keep[a, i] = path_prob[a, i] >= min_prob  (and the node is not switched off for row a: parents[a, i] >= 0)

    The verified tree is the union of the rows' kept nodes, with the nodes a row did not keep switched off for it
    (parent -1, as the runtime policy's depth limit does); at batch 1 it is exactly the kept nodes. A child's
    path probability never exceeds its parent's, so the kept set is a subtree. Lossless whatever min_prob is:
    which nodes are verified depends only on the drafter, never on the target, and acceptance is unchanged.
    Sub-trees are built once per set of kept nodes and cached. After a call, `kept_depth` [A] is each row's deepest
    kept node."""

    def __init__(self, min_prob):
        if not 0.0 < float(min_prob) <= 1.0:
            raise ValueError(f"Pruner: min_prob must be in (0, 1], got {min_prob!r}")
        self.min_prob = float(min_prob)
        self.trees = {}                     # (tree.paths, kept nodes) -> the sub-tree
        self.kept_depth = None
        self.ancestors = {}                 # (tree.paths, device) -> mask.T as float [T, T] (for the ancestor check's matmul)

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


class CostPruner(Pruner):
    """Size each step's verified tree by cost: keep the n nodes with the most expected tokens for their cost.

        S_a(n)    = sum of the n - 1 largest path probabilities of row a's drafted nodes
        gain_a(n) = 1 + alpha_a S_a(n) - rho_a c(n) / c(1)       expected tokens of the step, less what its cost buys
        n_a       = argmax_n gain_a(n),   c(n) = the measured cost of verifying n nodes (`costs.StepCosts`)
        keep[a, i] = node i is among the n_a most probable nodes of row a (ties: the lower node first)

    rho_a is the tokens per serial step's time that row a's recent speculative steps emitted, drafting included
    (at least 1: serial decoding is always available). Maximising the long-run rate tokens / seconds means
    maximising each step's tokens less rate x seconds (Dinkelbach's ratio method): a node is worth verifying when its
    path probability exceeds the tokens its marginal cost would buy at the rate the sequence already reaches.
    alpha_a calibrates the drafter: drafts accepted over drafts its probabilities predicted, on the same recent steps
    (SmolLM2's heads are about right on code and maths and twice too confident on questions, summaries and
    extraction). Both come from `policy.RuntimePolicy.calibration` (`weigh`); 1 and 1 without history.
    A child's path probability never exceeds its parent's, so the kept set is a subtree, as for `Pruner`, which
    this generalises: a fixed threshold becomes the threshold that pays on this machine. n_a = 1 (the root alone)
    makes the step a serial one. Lossless whatever the costs: the choice reads only the drafter and past steps.
    After `keep`, `predicted` [A] holds each row's sum of kept path probabilities (drafts expected accepted)."""

    def __init__(self, costs):
        super().__init__(1.0)
        self.min_prob = 0.0                 # draft() then reports path probabilities without cutting any
        self.costs, self.ratio = costs, {}  # ratio: T -> c(1 .. T) / c(1) [T] on the device
        self.alpha = self.rho = 1.0         # scalars or [A] float64 tensors (weigh)
        self.predicted = None

    def weigh(self, alpha, rho):
        """Per-row calibration alpha [A] and rate rho [A] (lists or tensors) for the next `keep`."""
        self.alpha, self.rho = (torch.as_tensor(x, dtype=torch.float64)[:, None] for x in (alpha, rho))

    def keep(self, path_prob, on):
        A, T = path_prob.shape
        if T not in self.ratio:
            self.ratio[T] = self.costs.ratios(T).to(path_prob.device)                    # [T] c(n) / c(1)
        alpha, rho = (x.to(path_prob.device) if torch.is_tensor(x) else x for x in (self.alpha, self.rho))
        p = torch.where(on, path_prob.double(), 0.0)
        p[:, 0] = 2.0                                                                   # the root always first
        order = torch.sort(p, dim=1, descending=True, stable=True).indices              # [A, T]
        S = torch.cumsum(p.gather(1, order), dim=1) - 2.0                               # [A, T] S(n), n = 1 .. T
        n = torch.argmax(alpha * S - rho * self.ratio[T], dim=1)                        # [A] n_a - 1
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(T, device=p.device).expand(A, T))
        kept = on & (rank <= n[:, None])
        self.predicted = S.gather(1, n[:, None])[:, 0]                                  # [A]
        return kept


def verify(model, cache, rows, tokens, tree, ops, check_values=True, graphs=None):
    """One forward of all nodes. -> hidden [A, T, D], k_tree, v_tree [L, A, T, Hkv, Dh], logits [A, T, V]"""
    positions = cache.cache_lens[rows].long()[:, None] + tree.depth[None, :]       # [A, T]
    if graphs is not None:                                  # replay a captured CUDA graph of this tree size
        return graphs.run(model, cache, rows, tokens, positions, tree, ops)
    hidden, k_tree, v_tree = model.forward_tree(tokens, positions, tree.mask, cache, rows, ops, check_values)
    return hidden, k_tree, v_tree, model.logits(hidden, model.exact_mode(ops))


def accept(logits, tokens, parents, sampler, ops, check_values=True):
    """The acceptance rule, lossless for greedy and for sampling.   -> accept_len [A], accept_nodes [A, T], bonus [A]

    greedy:   node i is accepted iff its parent p is and tokens[i] == argmax(logits[p])   (exact match)
    sampling: at the current node, try its children in order; child c (token x) is accepted with probability
              p(x) / sum(p) under the current p; on rejection p(x) <- 0 and the next child is tried; when all are
              rejected the bonus is drawn from what is left of p (so each emitted token is distributed as p)
    """
    if sampler.greedy:
        target = logits.float().argmax(-1)                                          # [A, T]
        return ops.tree_accept(tokens, parents, target, check_values=check_values)
    probs = sampler.probs(logits).contiguous()                                      # [A, T, V]
    A, T = tokens.shape
    u_accept, u_sample = sampler.uniform((A, T), probs), sampler.uniform((A,), probs)
    return ops.tree_accept_sample(tokens, parents, probs, u_accept, u_sample, check_values=check_values)


def append(cache, rows, k_tree, v_tree, accept_nodes, accept_len, ops, check_values=True, frozen=None):
    """K/V of the root and the accepted nodes go to positions cache_len .. cache_len + accept_len; lengths grow.

    frozen [A] bool (CUDA-graph mode): finished rows rewrite their own next slots but never grow."""
    ops.kv_append(cache.k, cache.v, cache.block_table[rows], cache.cache_lens[rows], k_tree, v_tree, accept_nodes,
                  accept_len, check_values=check_values)
    grow = accept_len + 1
    if frozen is not None:
        grow = grow.masked_fill(frozen, 0)
    cache.cache_lens[rows] += grow.to(torch.int32)


def mtp_step(model, cache, rows, roots, hidden, tree, drafter, sampler, ops, *, parents=None, context=None,
             check_values=True, timer=None, graphs=None, frozen=None, pruner=None, depths=None):
    """draft -> verify -> accept -> append for the rows `rows` of the cache.   -> Step

    roots [A] the newest committed token per row; hidden [A, D] its hidden state; tree: the candidate tree;
    parents [T] or [A, T]: the tree's parents, with -1 for nodes a row does not use (default tree.parents).
    context: passed to drafter.propose. timer: an optional `stats.PhaseTimer` (seconds per phase).
    graphs: a `GraphedVerify` to replay the verify forward from (CUDA). frozen [A] bool: rows that must not grow.
    pruner: a `Pruner` (confidence pruning): the step then verifies only the nodes it keeps, and Step.draft /
    accept_nodes index that sub-tree (Step.draft.shape[1] nodes).
    A drafter with `dynamic = True` draws the tree itself (`draft_dynamic(rows, roots, depths)`, depths: each row's
    depth limit; `tree` and `parents` are then unused), and one with `stateful = True` is shown what was committed
    (`observe`) after the step.
    """
    clock = timer.start if timer else (lambda: None)
    stop = timer.stop if timer else (lambda name, t0: None)
    parents = tree.parents if parents is None and tree is not None else parents

    t0 = clock()
    if getattr(drafter, "dynamic", False):          # the drafter draws the step's tree (drafters_mtp.ModuleDrafter)
        tree, tokens, path_prob, parents = drafter.draft_dynamic(rows, roots, depths)
        if pruner is not None:
            tree, tokens, parents = pruner(tree, tokens, path_prob, parents)        # [A, T'] with T' <= T
    elif pruner is None:
        tokens = draft(drafter, hidden, roots, tree, context)                       # [A, T]
    else:
        tokens, path_prob = draft(drafter, hidden, roots, tree, context, min_prob=pruner.min_prob)
        tree, tokens, parents = pruner(tree, tokens, path_prob, parents)            # [A, T'] with T' <= T
    stop("draft", t0)

    t0 = clock()
    h_tree, k_tree, v_tree, logits = verify(model, cache, rows, tokens, tree, ops, check_values, graphs)
    stop("verify", t0)

    t0 = clock()
    accept_len, accept_nodes, bonus = accept(logits, tokens, parents, sampler, ops, check_values)
    stop("accept", t0)

    t0 = clock()
    append(cache, rows, k_tree, v_tree, accept_nodes, accept_len, ops, check_values, frozen)
    if getattr(drafter, "stateful", False):         # the drafter's own cache takes the committed pairs next draft
        drafter.observe(rows, h_tree, tokens, accept_nodes, accept_len, bonus)
    last = accept_nodes.gather(1, accept_len[:, None])[:, 0]                        # deepest accepted node [A]
    h_last = h_tree[torch.arange(len(last), device=last.device), last]              # [A, D]
    stop("append", t0)
    return Step(tokens, accept_len, accept_nodes, bonus, h_last)


class GraphedVerify:
    """The verify forward (+ logits) captured as CUDA graphs, one per tree size, replayed with new inputs.

    The rows must be the same at every call (graph mode runs the whole batch every step, finished rows frozen).

    Possible because, with value checks off, every kernel's launch grid depends only on tensor shapes and the
    block table's width; the cache, block table and lengths are read from their (static) storage at replay.
    Inputs are copied into static buffers; outputs are overwritten by the next replay.
    """

    def __init__(self):
        self.graphs = {}

    def run(self, model, cache, rows, tokens, positions, tree, ops):
        if tree.size not in self.graphs:
            self.graphs[tree.size] = _Captured(model, cache, rows, tree, ops)
        return self.graphs[tree.size](tokens, positions)


class _Captured:
    def __init__(self, model, cache, rows, tree, ops):
        self.model, self.cache, self.rows, self.mask, self.ops = model, cache, rows, tree.mask, ops
        self.tokens = torch.zeros(len(rows), tree.size, dtype=torch.int64, device=model.device)
        self.positions = cache.cache_lens[rows].long()[:, None] + tree.depth[None, :]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):            # warm-up: compile/autotune outside the capture
            for _ in range(2):
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._run()

    def _run(self):
        h, k, v = self.model.forward_tree(self.tokens, self.positions, self.mask, self.cache, self.rows, self.ops,
                                          check_values=False)
        return h, k, v, self.model.logits(h, self.model.exact_mode(self.ops))

    def __call__(self, tokens, positions):
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.out
