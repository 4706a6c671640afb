"""One MTP decoding step in four phases — draft, verify, accept, append — and `mtp_step`, which composes them.

    draft   the drafter proposes a token for every node of the step's tree; node 0, the root, is the newest
            committed token (`drafters.Drafter.draft`)                                          tokens [A, T]
    verify  ONE forward of the T nodes through the target; node i sits at position cache_len + depth_i and sees
            the whole cache plus itself and its ancestors                                        logits [A, T, V]
    accept  node i is accepted iff its parent is accepted and tokens[i] equals the target's choice after the
            parent; the deepest accepted node n ends the path, and the target's choice after n is the bonus
    append  K/V of the root and the accepted nodes become the next cache positions; the bonus is the next root

A serial step is the same step with the one-node tree (T = 1): nothing to draft, nothing to accept, the bonus is
the next token. The phases are the ones Medusa names generate_candidates, tree_decoding, evaluate_posterior and
update_inference_inputs (https://github.com/FasterDecoding/Medusa), and gpt-fast's speculative_decode.
A = rows of the batch taking part in this step (`rows` indexes the cache), T = tree nodes, V = vocabulary.

What a step starts from is a `StepInputs`; how every step of a run is carried out (value checks, phase timer, a
CUDA-graph replay of verify, a pruner between draft and verify) is a `StepPlan`. The pruner and the graphs come in
through the plan: this module knows them only by the calls it makes (`pruner(...)`, `graphs.run(...)`).
"""
from dataclasses import dataclass

import torch


@dataclass
class StepInputs:
    """What one step starts from, for its A rows."""
    roots: torch.Tensor              # [A] the newest committed token per row
    hidden: torch.Tensor             # [A, D] the target's final-norm hidden state at it (drives the draft)
    tree: object = None              # the candidate tree (`tree.Tree`, T nodes); None: the drafter draws its own
    parents: torch.Tensor = None     # [T] or [A, T] the tree's parents, -1 for nodes a row does not use (None: all)
    depths: list = None              # [A] each row's depth limit (the runtime policy's; 0: a serial step for the row)
    context: tuple = None            # (batch indices, tokens each row has emitted so far): for synthetic drafters
    frozen: torch.Tensor = None      # [A] bool, CUDA-graph mode: finished rows (they rewrite their slots, never grow)


@dataclass
class StepPlan:
    """How every step of a run is carried out."""
    check_values: bool = True        # the kernels' value checks (each a host sync on a GPU)
    timer: object = None             # a `stats.PhaseTimer`: seconds per phase
    graphs: object = None            # replays verify: graphs.run(model, cache, rows, tokens, positions, tree, ops)
    pruner: object = None            # cuts the drafted tree before verify: pruner(tree, tokens, path_prob, parents)
    #                                  -> (sub-tree, tokens, parents); pruner.min_prob: what the drafter reports


@dataclass
class Step:
    """What one step produced for its A rows (tensors stay on the model's device)."""
    draft: torch.Tensor          # [A, T] token of every verified node (node 0 = root)
    accept_len: torch.Tensor     # [A] accepted drafts (root excluded)
    accept_nodes: torch.Tensor   # [A, T] root 0, then the accepted nodes by depth, then -1
    bonus: torch.Tensor          # [A] the target's choice after the deepest accepted node: the next root
    hidden: torch.Tensor         # [A, D] final-norm hidden state at the deepest accepted node (drives the next draft)


def draft(drafter, rows, inputs, pruner=None):
    """The step's tree and its tokens.   -> tree (T nodes), tokens [A, T], parents [T] or [A, T]

    drafter.draft (`drafters.Drafter`) gives the tree (the candidate tree, or one the drafter draws), a token per
    node and, for a pruner, each node's path probability under the drafter; the pruner keeps a sub-tree of it
    (T' <= T nodes), which is what the step verifies."""
    min_prob = None if pruner is None else pruner.min_prob
    if min_prob is not None and not drafter.reports_probabilities:
        raise ValueError(f"pruning needs a drafter that reports probabilities; {type(drafter).__name__} does not")
    tree, tokens, path_prob, parents = drafter.draft(rows, inputs.roots, inputs.hidden, inputs.tree, inputs.parents,
                                                     inputs.depths, inputs.context, min_prob)
    if pruner is not None:
        tree, tokens, parents = pruner(tree, tokens, path_prob, parents)            # [A, T'] with T' <= T
    return tree, tokens, parents


def verify(model, cache, rows, tokens, tree, ops, check_values=True, graphs=None, taps=()):
    """One forward of all nodes. -> hidden [A, T, D], k_tree, v_tree [L, A, T, Hkv, Dh], logits [A, T, V], and with
    taps (layer ids, `LlamaEngine.forward_tree`) the residual streams entering them, feats [A, T, len(taps) D]"""
    positions = cache.cache_lens[rows].long()[:, None] + tree.depth                # [A, T]
    if graphs is not None:                                  # replay a captured CUDA graph of this tree size
        return graphs.run(model, cache, rows, tokens, positions, tree, ops)
    hidden, k_tree, v_tree, *feats = model.forward_tree(tokens, positions, tree.mask, cache, rows, ops, check_values,
                                                        taps=taps)
    return (hidden, k_tree, v_tree, model.logits(hidden, model.exact_mode(ops)), *feats)


def accept(logits, tokens, parents, sampler, ops, check_values=True):
    """The acceptance rule, lossless for greedy and for sampling.   -> accept_len [A], accept_nodes [A, T], bonus [A]

    greedy:   node i is accepted iff its parent p is and tokens[i] == argmax(logits[p])   (exact match)
    sampling: at the current node, try its children in order; child c (token x) is accepted with probability
              p(x) / sum(p) under the current p; on rejection p(x) <- 0 and the next child is tried; when all are
              rejected the bonus is drawn from what is left of p (so each emitted token is distributed as p)
    """
    if sampler.greedy:
        target = logits.float().argmax(-1)                                          # [A, T]
        if tokens.shape[1] == 1:                         # a serial step: the root alone, the bonus is its argmax
            return target.new_zeros(target.shape[0]), target.new_zeros(target.shape), target[:, 0]
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
    cache.cache_lens.index_add_(0, rows, grow.to(torch.int32))                     # rows are distinct


def mtp_step(model, cache, rows, inputs, drafter, sampler, ops, plan=None):
    """draft -> verify -> accept -> append for the rows `rows` [A] of the cache.   -> Step

    inputs: a `StepInputs`; drafter: a `drafters.Drafter` (`drafters.SerialDrafter` for a serial step); sampler: a
    `sampling.Sampler`; plan: a `StepPlan` (default: value checks on, no timer, graphs or pruner). With a pruner,
    Step.draft and Step.accept_nodes index the pruned tree (Step.draft.shape[1] nodes). After append the drafter
    is shown what was committed (`observe`: a drafter with its own cache takes the accepted pairs from it; one with
    taps, EAGLE-3's, is shown the residual streams at its taps instead of the final-norm hidden states)."""
    plan = plan or StepPlan()
    clock = plan.timer.start if plan.timer else (lambda: None)
    stop = plan.timer.stop if plan.timer else (lambda name, t0: None)

    t0 = clock()
    tree, tokens, parents = draft(drafter, rows, inputs, plan.pruner)              # [A, T]
    stop("draft", t0)

    t0 = clock()
    h_tree, k_tree, v_tree, logits, *feats = verify(model, cache, rows, tokens, tree, ops, plan.check_values,
                                                    plan.graphs, drafter.taps)
    stop("verify", t0)

    t0 = clock()
    accept_len, accept_nodes, bonus = accept(logits, tokens, parents, sampler, ops, plan.check_values)
    stop("accept", t0)

    t0 = clock()
    append(cache, rows, k_tree, v_tree, accept_nodes, accept_len, ops, plan.check_values, inputs.frozen)
    drafter.observe(rows, feats[0] if feats else h_tree, tokens, accept_nodes, accept_len, bonus)
    if tokens.shape[1] == 1:                                                       # a serial step
        h_last = h_tree[:, 0].clone()           # [A, D], a copy (graphs: h_tree is the graph's output buffer)
    else:
        last = accept_nodes.gather(1, accept_len[:, None])[:, 0]                    # deepest accepted node [A]
        h_last = h_tree[torch.arange(len(last), device=last.device), last]          # [A, D]
    stop("append", t0)
    return Step(tokens, accept_len, accept_nodes, bonus, h_last)
