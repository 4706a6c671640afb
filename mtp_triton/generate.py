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

from . import compiled, sizing
from .drafters import Drafter, HeadsDrafter, SerialDrafter
from .drafters_mtp import ModuleDrafter
from .graphs import GraphedVerify
from .heads import MTPHeads
from .draft_block import DraftBlock
from .ops import get_ops
from .policy import RuntimeConfig, RuntimePolicy
from .sampling import Sampler
from .stats import GenerateStats, StatsRecorder
from .step import StepInputs, StepPlan, mtp_step

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
def prefill(model, prompts, cache, ops, all_hidden=False, taps=()):
    """Run every prompt through the model as a causal chain with an empty cache and store all its K/V.

    prompts: list of B token lists (lengths may differ). Returns the final-norm hidden state at each prompt's last
    token [B, D]; with all_hidden=True also those at every position [B, S, D] (what the MTP module reads), or with
    taps (layer ids, `LlamaEngine.forward_tree`) the residual streams entering them, [B, S, len(taps) D] (EAGLE-3's).
    """
    dev = model.device
    tokens, positions, mask, lens = causal_chains(prompts, dev)
    B, S = tokens.shape
    idx = torch.arange(S, device=dev)
    rows = torch.arange(B, device=dev)
    hidden, k_tree, v_tree, *feats = model.forward_tree(tokens, positions, mask, cache, rows, ops, exact=False,
                                                        taps=taps)
    nodes = torch.where(idx[None, :] < lens[:, None], idx[None, :], -1)
    ops.kv_append(cache.k, cache.v, cache.block_table, cache.cache_lens, k_tree, v_tree, nodes, lens - 1)
    cache.cache_lens += lens.to(torch.int32)
    return (hidden[rows, lens - 1], feats[0] if feats else hidden) if all_hidden else hidden[rows, lens - 1]


@torch.no_grad()
def generate(model, prompts, max_new_tokens, *, drafter=None, heads=None, mtp=True, tree=None, temperature=0.0,
             top_p=1.0, seed=None, eos_token_id=None, kernels="auto", runtime=None, block_size=16, cuda_graph=False):
    """Generate up to max_new_tokens per prompt with MTP (or serially: mtp=False, or no drafter).

    prompts: list of token-id lists (lengths may differ) or a LongTensor [B, S].
    drafter: what drafts: MTP heads (`load_heads`), an MTP module (`load_module`, mtp_module.py: a one-layer drafter
    with its own cache that draws a dynamic tree each step, `drafters_mtp.ModuleDrafter`; tree= must then be None),
    or any `drafters.Drafter` (e.g. the synthetic `drafters.OracleDrafter`). heads: the older name of drafter=
    (the same meaning; pass one of them). tree: a Tree, a preset name or Medusa-style choices, verified as given
    (None: the heads' stored tree, else the package default, and on a CPU each step verifies the part of it that
    pays on this machine's measured step costs: RuntimeConfig.size_by_cost).
    temperature 0: greedy; > 0: sampling (top_p nucleus), reproducible from `seed` (an int in [0, 2**64); one
    generator serves the whole batch, so a sampled prompt's tokens depend on its batch-mates: run a prompt alone for
    samples of its own; the random numbers also follow the verified trees, so where the CPU default sizes them by
    measured costs, pass RuntimeConfig(size_by_cost=False) for samples that do not depend on the machine's timing).
    eos_token_id: None, an int, a list of ints or an int tensor.
    kernels: "triton" | "torch" | "compiled" | "auto" (Triton on CUDA, the PyTorch twins elsewhere; "compiled": the
    twins with the decoder layer compiled by torch.compile, CPU: mtp_triton/ops.py, compiled.py). A bf16/fp16 model
    runs the exact path (invariant.py; the Triton kernels' batch-invariant variant on a GPU), so greedy MTP emits the
    serial tokens bit for bit.
    runtime: a `RuntimeConfig` or a dict of its fields (fallbacks, confidence pruning, sizing by cost).
    block_size: the paged cache's block size. cuda_graph: replay the verify forward as a CUDA graph (one per tree
    size); finished sequences then keep running, frozen and never emitted, so shapes stay fixed.
    Returns GenerateResult(tokens, stats).
    """
    dev = model.device
    prompts = _check_prompts(prompts, model.config.vocab_size, model.config.max_position_embeddings)
    _check_lengths(prompts, max_new_tokens, block_size, model.config.max_position_embeddings)
    B = len(prompts)
    stop = _stop_ids(eos_token_id, model.config.vocab_size)
    sampler = Sampler(temperature, top_p, seed, dev)
    runtime = RuntimeConfig.of(runtime)
    ops = _kernels(model, kernels, cuda_graph)
    drafter = _drafter(drafter, heads, mtp, model, ops)
    trees = drafter.trees(tree, dev)                # the candidate tree cut per step, or the drafter draws its own
    if trees.budget > model.config.max_position_embeddings:
        raise ValueError(f"a step of up to {trees.budget} nodes (the {type(drafter).__name__}'s tree) is more than the "
                         f"model's context length {model.config.max_position_embeddings}: choose a smaller tree")
    if cuda_graph and not trees.fixed:
        raise ValueError(f"cuda_graph=True needs a fixed tree per step; {type(drafter).__name__} draws a dynamic one")
    rec = StatsRecorder(dev, B)
    pruner, by_cost = sizing.choose(runtime, drafter, trees, model, kernels, ops, cuda_graph=cuda_graph,
                                    pinned=tree is not None, batch=B)
    policy = RuntimePolicy(runtime, B, trees.max_depth, by_cost)
    # The kernels' value checks read tensors (a host sync each on a GPU, dozens of ops on any device). The loop
    # builds every input itself (a validated tree, its own block tables and lengths): they are skipped inside it.
    plan = StepPlan(check_values=False, timer=rec.timer, graphs=GraphedVerify() if cuda_graph else None,
                    pruner=pruner)

    # a step's nodes sit past a row's length: room for the most a step verifies (a dynamic tree: the rows' union)
    capacities = [len(p) + max_new_tokens + trees.room(B) for p in prompts]
    cache = model.new_cache(capacities, block_size)
    hidden, every = prefill(model, prompts, cache, ops, all_hidden=True, taps=drafter.taps)  # [B, D], [B, S, D']
    roots = sampler.choose(model.logits(hidden))                                    # [B] the first new tokens
    drafter.start(prompts, every, roots, capacities, block_size)                    # its own cache, if it has one
    del every
    out = [[t] for t in roots.tolist()]
    rec.first_token()
    done = [t in stop or max_new_tokens == 1 for t in roots.tolist()]
    live, rows = None, None

    while not all(done):
        t_step = time.perf_counter()
        now = list(range(B)) if cuda_graph else [b for b in range(B) if not done[b]]
        if now != live:                                                             # rebuild only on change
            live, rows = now, torch.tensor(now, device=dev)
        depths = policy.depths(live, done if cuda_graph else None)
        tree, parents = trees.for_depths(depths)
        frozen = torch.tensor([done[b] for b in live], device=dev) if cuda_graph else None
        if by_cost:
            pruner.weigh(*policy.calibration(live))
            drafted = rec.timer.total["draft"]                  # seconds of drafting so far (CPU: per step)
        inputs = StepInputs(roots[rows], hidden[rows], tree, parents, depths, (live, [out[b] for b in live]), frozen)
        step = mtp_step(model, cache, rows, inputs, drafter, sampler, ops, plan)
        hidden[rows] = step.hidden
        roots[rows] = step.bonus

        # ---- emit (one host sync per step): accepted drafts, then the bonus; stop at EOS / length ----
        T = step.draft.shape[1]                                                     # verified nodes (pruned or not)
        at, seqs, accepted, emitted = map(list, zip(*_emit(step, live, done, out, stop, max_new_tokens)))
        depth = [depths[a] for a in at]
        predicted, reach = [0.0] * len(at), [trees.max_depth] * len(at)
        if by_cost and pruner.predicted is not None:    # drafts the pruner expected accepted, the deepest node kept
            pred, kept, pruner.predicted = pruner.predicted.tolist(), pruner.kept_depth.tolist(), None
            predicted, reach = [pred[a] for a in at], [kept[a] for a in at]
        dt = time.perf_counter() - t_step
        rec.step(dt, accepted, depth, emitted, nodes=T)
        cost = None
        if by_cost:
            draft_dt = rec.timer.total["draft"] - drafted
            pruner.costs.observe(T, dt - draft_dt)              # the cost model learns from the step it ran
            cost = pruner.costs.serial_steps(T, dt, draft_dt)
        rec.fallbacks += policy.update(seqs, depth, accepted, emitted, predicted, cost, reach)

    cache_bytes = cache.nbytes() + drafter.cache_bytes()
    return GenerateResult(out, rec.finish(sum(len(o) for o in out), ops.kind, trees.budget, cache_bytes,
                                          pruner.describe() if pruner is not None else None))


def _drafter(drafter, heads, mtp, model, ops):
    """generate's drafter= / heads= (its older name) -> one `Drafter`: a Drafter as it is, MTP heads -> HeadsDrafter,
    an MTP module or EAGLE-3 drafter -> ModuleDrafter; mtp=False or neither -> SerialDrafter (the one-node tree every
    step)."""
    if drafter is not None and heads is not None:
        raise ValueError("generate: pass the drafter once, as drafter= (heads= is its older name), not both")
    given = heads if drafter is None else drafter
    if not mtp or given is None:
        return SerialDrafter()
    if isinstance(given, Drafter):
        return given
    if isinstance(given, DraftBlock):
        return ModuleDrafter(given, model, ops)
    if isinstance(given, MTPHeads):
        return HeadsDrafter(given, model, ops)
    raise ValueError(f"generate: drafter must be MTP heads (load_heads), an MTP module or EAGLE-3 drafter "
                     f"(load_drafter) or a drafters.Drafter, got {type(given).__name__}")


def _kernels(model, kernels, cuda_graph):
    """The kernel set (`ops.get_ops`), checked against cuda_graph; the compiled step is compiled here, once per
    process, before any timing."""
    dev = model.device
    if cuda_graph and dev.type != "cuda":
        raise ValueError("cuda_graph=True needs the model on a CUDA device")
    ops = get_ops(kernels, dev)
    if cuda_graph and ops.kind != "triton":
        raise ValueError(f"cuda_graph=True needs the Triton kernels (kernels='triton' or 'auto'), got "
                         f"kernels={kernels!r}: the PyTorch twins' steps are planned on the host")
    if ops.kind == "compiled":
        compiled.warm_up(model, ops)
    return ops


def _emit(step, live, done, out, stop, max_new_tokens):
    """Each row's accepted drafts, then the bonus, onto its output (one host sync); done[b] set at an EOS or the
    length. -> [(a, b, drafts accepted, tokens emitted)] for the rows a = 0 .. A-1 (sequence b) that took part."""
    T = step.draft.shape[1]
    host = torch.cat([step.accept_len[:, None], step.bonus[:, None], step.accept_nodes, step.draft], 1).tolist()
    stepped = []
    for a, b in enumerate(live):
        if done[b]:                                                                 # frozen row (graph mode)
            continue
        n_acc, bonus, nodes, toks = host[a][0], host[a][1], host[a][2:2 + T], host[a][2 + T:]
        n = _extend(out[b], [toks[i] for i in nodes[1:n_acc + 1]] + [bonus], stop, max_new_tokens)
        done[b] = out[b][-1] in stop or len(out[b]) >= max_new_tokens
        stepped.append((a, b, n_acc, n))
    return stepped


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
            raise ValueError(f"eos_token_id must be None, an int, a list of ints or an int tensor; got "
                             f"{eos_token_id!r}")
        t = int(t.__index__())
        if not 0 <= t < vocab_size:
            raise ValueError(f"eos_token_id {t} is out of the vocabulary range [0, {vocab_size})")
        out.add(t)
    return out


def _check_lengths(prompts, max_new_tokens, block_size, context):
    """max_new_tokens and block_size: ints >= 1; the longest prompt + max_new_tokens within the context length."""
    for name, value in (("max_new_tokens", max_new_tokens), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            what = " (tokens per cache block)" if name == "block_size" else ""
            raise ValueError(f"{name} must be an int >= 1{what}, got {value!r}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > context:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context "
                         f"length {context}")


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
