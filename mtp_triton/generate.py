"""Decoding: prefill, then `mtp_step` (draft -> verify -> accept -> append) until every sequence stops.

    prefill   every prompt through the model as one causal chain; its K/V fill the paged cache; the target's
              choice after the last prompt token is the first new token (the first root)
    loop      the runtime policy picks each sequence's draft depth, `step.mtp_step` runs one step for all
              live sequences, and the accepted drafts + bonus are emitted (one host sync per step)
    stop      a sequence stops after an EOS token (included) or max_new_tokens

Greedy output equals plain greedy decoding token for token (tested against transformers); sampling uses the
lossless sibling-wise rejection rule, so each emitted token is distributed as the target. A serial run is the same
loop with the one-node tree.
"""
import time
from dataclasses import dataclass

import numpy as np
import torch

from . import compiled
from .drafters import HeadsDrafter
from .drafters_mtp import ModuleDrafter
from .mtp_module import MTPModule
from .ops import cpu_twins, get_ops
from .policy import RuntimeConfig, RuntimePolicy
from .sampling import Sampler
from .stats import GenerateStats, StatsRecorder
from .costs import step_costs
from .step import CostPruner, GraphedVerify, Pruner, mtp_step
from .tree import Tree, get_tree

__all__ = ["generate", "prefill", "GenerateResult", "RuntimeConfig"]


@dataclass
class GenerateResult:
    tokens: list            # new tokens per sequence (list of lists of ints)
    stats: GenerateStats


def causal_chains(seqs, device):
    """B token lists as one "tree" step with an empty cache: each sequence is a causal chain (prefill).

    -> tokens [B, S], positions [B, S], mask [B, S, S] bool, lens [B]; shorter sequences are padded with nodes
    that see only themselves (and are never stored)."""
    B, S = len(seqs), max(len(p) for p in seqs)
    lens = torch.tensor([len(p) for p in seqs], device=device)
    tokens = torch.zeros(B, S, dtype=torch.int64, device=device)
    for b, p in enumerate(seqs):
        tokens[b, : len(p)] = torch.tensor(p, device=device)
    idx = torch.arange(S, device=device)
    real = idx[None, :] < lens[:, None]                                       # [B, S]
    causal = torch.tril(torch.ones(S, S, dtype=torch.bool, device=device))
    mask = (causal[None] & real[:, None, :] & real[:, :, None]) | torch.eye(S, dtype=torch.bool, device=device)
    return tokens, idx[None, :].expand(B, S), mask, lens


@torch.no_grad()
def prefill(model, prompts, cache, ops, all_hidden=False):
    """Run every prompt through the model as a causal chain with an empty cache and store all its K/V.

    prompts: list of B token lists (lengths may differ). Returns the final-norm hidden state at each prompt's last
    token [B, D]; with all_hidden=True also those at every position [B, S, D] (what the MTP module reads).
    """
    dev = model.device
    tokens, positions, mask, lens = causal_chains(prompts, dev)
    B, S = tokens.shape
    idx = torch.arange(S, device=dev)
    rows = torch.arange(B, device=dev)
    hidden, k_tree, v_tree = model.forward_tree(tokens, positions, mask, cache, rows, ops, exact=False)
    nodes = torch.where(idx[None, :] < lens[:, None], idx[None, :], -1)
    ops.kv_append(cache.k, cache.v, cache.block_table, cache.cache_lens, k_tree, v_tree, nodes, lens - 1)
    cache.cache_lens += lens.to(torch.int32)
    return (hidden[rows, lens - 1], hidden) if all_hidden else hidden[rows, lens - 1]


@torch.no_grad()
def generate(model, prompts, max_new_tokens, *, heads=None, mtp=True, tree=None, temperature=0.0, top_p=1.0,
             seed=None, eos_token_id=None, kernels="auto", runtime=None, block_size=16, drafter=None,
             cuda_graph=False):
    """Generate up to max_new_tokens per prompt with MTP (or serially: mtp=False, or no heads).

    prompts: list of token-id lists (lengths may differ) or a LongTensor [B, S]. tree: a Tree, a preset name or
    Medusa-style choices, verified as given (None: the heads' stored tree, else the package default, and on a CPU
    each step verifies the part of it that pays on this machine's measured step costs: RuntimeConfig.size_by_cost).
    temperature 0: greedy; > 0: sampling (top_p nucleus), reproducible from `seed` (an int in [0, 2**64); one generator serves the whole batch,
    so a sampled prompt's tokens depend on its batch-mates: run a prompt alone for samples of its own; the random
    numbers also follow the verified trees, so where the CPU default sizes them by measured costs, pass
    RuntimeConfig(size_by_cost=False) for samples that do not depend on the machine's timing). eos_token_id: None, an int, a list of ints or an int tensor.
    kernels: "triton" | "torch" | "compiled" | "auto" (Triton on CUDA, the PyTorch twins elsewhere; "compiled": the
    twins with the decoder layer compiled by torch.compile, CPU: mtp_triton/ops.py, compiled.py). A bf16/fp16 model
    runs the exact path (invariant.py; the Triton kernels' batch-invariant variant on a GPU), so greedy MTP emits the
    serial tokens bit for bit.
    runtime: a `RuntimeConfig` or a dict of its fields (cold start, dynamic depth, fallback, confidence pruning). block_size: the paged cache's block size.
    heads: MTP heads (`load_heads`) or an MTP module (`load_module`, mtp_module.py: a one-layer drafter with its own
    cache that draws a dynamic tree each step, `drafters_mtp.ModuleDrafter`; tree= must then be None).
    drafter: instead of heads, any object with `num_heads` and `propose(hidden, top_k, context, num_heads, roots)`
    (e.g. the synthetic `drafters.OracleDrafter`). cuda_graph: replay the verify forward as a CUDA graph (one per
    tree size); finished sequences then keep running, frozen and never emitted, so shapes stay fixed.
    Returns GenerateResult(tokens, stats).
    """
    cfg, dev = model.config, model.device
    prompts = _check_prompts(prompts, cfg.vocab_size, cfg.max_position_embeddings)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context "
                         f"length {cfg.max_position_embeddings}")
    stop = _stop_ids(eos_token_id, cfg.vocab_size)
    sampler = Sampler(temperature, top_p, seed, dev)
    runtime = RuntimeConfig.of(runtime)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1 (tokens per cache block), got {block_size!r}")
    if cuda_graph and dev.type != "cuda":
        raise ValueError("cuda_graph=True needs the model on a CUDA device")
    ops = get_ops(kernels, dev)
    if cuda_graph and ops.kind != "triton":
        raise ValueError(f"cuda_graph=True needs the Triton kernels (kernels='triton' or 'auto'), got "
                         f"kernels={kernels!r}: the PyTorch twins' steps are planned on the host")
    if ops.kind == "compiled":
        compiled.warm_up(model, ops)            # compiles the step's graphs once per process, before any timing
    if mtp and drafter is None and heads is not None:
        drafter = ModuleDrafter(heads, model, ops) if isinstance(heads, MTPModule) else HeadsDrafter(heads, model, ops)
    if not mtp:
        drafter = None
    dynamic = getattr(drafter, "dynamic", False)
    if dynamic:                                 # the drafter draws each step's tree: at most `nodes` nodes
        if tree is not None:
            raise ValueError(f"{type(drafter).__name__} draws its own tree every step (a dynamic tree); pass its "
                             "size to the drafter (depth, top_k, beam, nodes), not tree=")
        if cuda_graph:
            raise ValueError(f"cuda_graph=True needs a fixed tree per step; {type(drafter).__name__} draws a "
                             "dynamic one")
        full_tree, budget, max_depth = None, drafter.nodes, drafter.num_heads
    else:
        if drafter is None:
            full_tree = Tree.root_only().to(dev)
        else:                                   # tree=None: the tree stored with the heads, else the default
            stored = getattr(heads, "tree", None) if isinstance(drafter, HeadsDrafter) else None
            full_tree = get_tree(tree if tree is not None else stored, drafter.num_heads).to(dev)
        budget, max_depth = full_tree.size, full_tree.max_depth
        trees = _SubTrees(full_tree)
    rec = StatsRecorder(dev, len(prompts))
    graphs = GraphedVerify() if cuda_graph else None
    pruner = None
    if runtime is not None and runtime.prune_below is not None and drafter is not None:
        if cuda_graph:
            raise ValueError("RuntimeConfig.prune_below changes the verified tree every step; it cannot be combined "
                             "with cuda_graph=True (one captured graph per tree size)")
        if not getattr(drafter, "reports_probabilities", False):
            raise ValueError(f"RuntimeConfig.prune_below needs a drafter that reports probabilities; "
                             f"{type(drafter).__name__} does not")
        pruner = Pruner(runtime.prune_below)
    elif drafter is not None and budget > 1 and _size_by_cost(runtime, drafter, dev, ops, cuda_graph,
                                                              pinned=tree is not None):
        pruner = CostPruner(step_costs(model, budget, kernels, batch=len(prompts)))
    by_cost = isinstance(pruner, CostPruner) and (runtime is None or runtime.fallback_by_cost is not False)
    if runtime is not None and runtime.fallback_by_cost and not isinstance(pruner, CostPruner):
        raise ValueError("RuntimeConfig.fallback_by_cost=True compares speculative steps with the measured cost of a "
                         "serial step, which comes with size_by_cost; it is off here (size_by_cost=False, a tree "
                         "passed in, prune_below, a GPU, or a drafter without probabilities): set size_by_cost=True")
    policy = RuntimePolicy(runtime, len(prompts), max_depth, by_cost)
    # The kernels' value checks read tensors (a host sync each on a GPU). The loop builds every input itself
    # (a validated tree, its own block tables and lengths), so on a GPU they are skipped inside the loop.
    check = dev.type != "cuda"

    B = len(prompts)
    # a step appends at most its verified nodes past a row's length: a fixed tree's `budget`; a dynamic tree is the
    # union of the rows' own trees (each row keeps up to budget - 1 drafts), up to B (budget - 1) + 1 nodes
    room = B * (budget - 1) + 1 if dynamic else budget
    capacities = [len(p) + max_new_tokens + room for p in prompts]
    cache = model.new_cache(capacities, block_size)
    hidden, every = prefill(model, prompts, cache, ops, all_hidden=True)            # [B, D], [B, S, D]
    roots = sampler.choose(model.logits(hidden))                                    # [B] the first new tokens
    if getattr(drafter, "stateful", False):                                         # its own cache, from the prompts
        drafter.start(prompts, every, roots, capacities, block_size)
    del every
    out = [[t] for t in roots.tolist()]
    rec.first_token()
    done = [t in stop or max_new_tokens == 1 for t in roots.tolist()]
    live, rows = None, None

    while not all(done):
        t_step = time.perf_counter()
        now = list(range(B)) if graphs is not None else [b for b in range(B) if not done[b]]
        if now != live:                                                             # rebuild only on change
            live, rows = now, torch.tensor(now, device=dev)
        depths = policy.depths(live, out, done if graphs is not None else None)
        tree, parents = (None, None) if dynamic else trees.for_depths(depths)
        frozen = torch.tensor([done[b] for b in live], device=dev) if graphs is not None else None
        if by_cost:
            pruner.weigh(*policy.calibration(live))
            drafted = rec.timer.total["draft"]                  # seconds of drafting so far (CPU: per step)
        step = mtp_step(model, cache, rows, roots[rows], hidden[rows], tree, drafter, sampler, ops, parents=parents,
                        context=(live, [out[b] for b in live]), check_values=check, timer=rec.timer,
                        graphs=graphs, frozen=frozen, pruner=pruner, depths=depths)
        hidden[rows] = step.hidden
        roots[rows] = step.bonus

        # ---- emit (one host sync per step): accepted drafts, then the bonus; stop at EOS / length ----
        T = step.draft.shape[1]                                                     # verified nodes (pruned or not)
        host = torch.cat([step.accept_len[:, None], step.bonus[:, None], step.accept_nodes, step.draft], 1).tolist()
        pred = kept = None                          # drafts expected accepted, the deepest node kept
        if by_cost and pruner.predicted is not None:
            pred, kept, pruner.predicted = pruner.predicted.tolist(), pruner.kept_depth.tolist(), None
        accepted, emitted, stepped, predicted, reach = [], [], [], [], []
        for a, b in enumerate(live):
            if done[b]:                                                             # frozen row (graph mode)
                continue
            n_acc, bonus, nodes, toks = host[a][0], host[a][1], host[a][2:2 + T], host[a][2 + T:]
            new = [toks[n] for n in nodes[1:n_acc + 1]] + [bonus]
            n = _extend(out[b], new, stop, max_new_tokens)
            done[b] = out[b][-1] in stop or len(out[b]) >= max_new_tokens
            accepted.append(n_acc)
            emitted.append(n)
            stepped.append((b, depths[a]))
            predicted.append(pred[a] if pred else 0.0)
            reach.append(kept[a] if kept else max_depth)
        dt = time.perf_counter() - t_step
        rec.step(dt, accepted, [d for _, d in stepped], emitted, nodes=T)
        cost = pruner.costs.serial_steps(T, dt, rec.timer.total["draft"] - drafted) if by_cost else None
        rec.fallbacks += policy.update([b for b, _ in stepped], [d for _, d in stepped], accepted, emitted, dt,
                                       predicted, cost, reach)

    cache_bytes = cache.nbytes() + (drafter.cache.nbytes() if getattr(drafter, "stateful", False) else 0)
    return GenerateResult(out, rec.finish(sum(len(o) for o in out), ops.kind, budget, cache_bytes,
                                          pruner.costs.describe() if isinstance(pruner, CostPruner) else None))


def _size_by_cost(runtime, drafter, device, ops, cuda_graph, pinned):
    """Size each step's tree by the measured step costs? RuntimeConfig.size_by_cost: True / False, or None (auto):
    when no tree was passed (tree=None: the heads' stored tree, or the default, is the candidate set; a tree passed
    in is verified as given), on a CPU with the PyTorch twins, where c(T) grows with T, for a drafter that reports
    probabilities; off on a GPU, where c(T) is nearly flat at batch 1 and CUDA graphs want fixed tree sizes, and
    for the Triton kernels in the interpreter (a teaching path, whose timings mean nothing)."""
    flag = runtime.size_by_cost if runtime is not None else None
    probs = getattr(drafter, "reports_probabilities", False)
    if flag:
        if not probs:
            raise ValueError(f"RuntimeConfig.size_by_cost needs a drafter that reports probabilities; "
                             f"{type(drafter).__name__} does not")
        if cuda_graph:
            raise ValueError("RuntimeConfig.size_by_cost changes the verified tree every step; it cannot be "
                             "combined with cuda_graph=True (one captured graph per tree size)")
        return True
    return flag is None and not pinned and probs and cpu_twins(ops, device) and not cuda_graph


def _extend(out, new, stop, max_new_tokens):
    """Append new tokens to one sequence's output up to max_new_tokens or an EOS (kept). Returns how many."""
    n = 0
    for t in new:
        if len(out) >= max_new_tokens:
            break
        out.append(t)
        n += 1
        if t in stop:
            break
    return n


class _SubTrees:
    """The candidate tree cut to each depth limit (cached), and the parents that switch nodes off per row."""

    def __init__(self, tree):
        self.full = tree
        self.by_depth = {tree.max_depth: tree}

    def for_depths(self, depths):
        """-> (tree for the deepest row, parents [T] if all rows use it whole, else [A, T] with -1 past a row's depth)"""
        d = max(depths)
        if d not in self.by_depth:
            keep = [p for p in self.full.paths[1:] if len(p) <= d]
            self.by_depth[d] = Tree.from_choices(keep).to(self.full.parents.device)
        tree = self.by_depth[d]
        if min(depths) == d:
            return tree, tree.parents
        limit = torch.tensor(depths, device=tree.parents.device)
        return tree, torch.where(tree.depth[None, :] > limit[:, None], -1, tree.parents[None, :])


def _stop_ids(eos_token_id, vocab_size):
    """None | int | list of ints | int tensor -> a set of token ids (Llama-3 instruct models stop on two)."""
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, np.ndarray):                                   # numpy ids: as a tensor
        if eos_token_id.dtype.kind not in "iu":
            raise ValueError(f"eos_token_id array must hold integer ids, got {eos_token_id.dtype}")
        eos_token_id = torch.from_numpy(eos_token_id.astype(np.int64))
    if isinstance(eos_token_id, torch.Tensor):
        if eos_token_id.is_floating_point() or eos_token_id.is_complex() or eos_token_id.dtype == torch.bool:
            raise ValueError(f"eos_token_id tensor must hold integer ids, got {eos_token_id.dtype}")
        ids = eos_token_id.reshape(-1).tolist()
    elif isinstance(eos_token_id, (list, tuple, set)):
        ids = list(eos_token_id)
    else:
        ids = [eos_token_id]
    out = set()
    for t in ids:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise ValueError(f"eos_token_id must be None, an int, a list of ints or an int tensor; got {eos_token_id!r}")
        t = int(t.__index__())
        if not 0 <= t < vocab_size:
            raise ValueError(f"eos_token_id {t} is out of the vocabulary range [0, {vocab_size})")
        out.add(t)
    return out


def _check_prompts(prompts, vocab_size, max_len):
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"prompts tensor must be int64 [B, S], got {prompts.dtype} {tuple(prompts.shape)}")
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists (or a LongTensor [B, S])")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if not isinstance(p, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int) for t in p):
            raise ValueError(f"prompt {i} must be a list of int token ids")
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: need at least one token")
        if len(p) > max_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens, over the context length {max_len}")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids out of range [0, {vocab_size}): {bad[:5]}")
        out.append(list(p))
    return out
