"""Decoding: prefill, then steps of draft → verify → accept → append (serial = the same step with T = 1).

    step:  hidden [B, D] at the deepest accepted node ──fused_draft──▶ top-k per head [B, H, K]
           tree (root = last emitted token, node i = rank r_i of head depth_i − 1) ──forward_tree──▶
           target choice after every node [B, T] ──tree_accept──▶ accepted path + bonus token
           ──kv_append──▶ K/V of the root and the accepted nodes into the paged cache
Greedy output equals plain greedy decoding token for token (tested against transformers); sampling
uses the lossless sibling-wise rejection rule, so each emitted token is distributed as the target.
"""
import math
import time
from collections import Counter, deque
from dataclasses import dataclass

import torch

from .ops import get_ops
from .reference import sample_from_probs
from .sampling import logits_to_probs
from .stats import GenerateStats, PhaseTimer, gpu_energy_j, peak_memory_bytes, percentile
from .tree import Tree, get_tree


@dataclass
class RuntimeConfig:
    """The seed's runtime features (all off by default)."""
    cold_start_tokens: int = 0            # the first N new tokens of a sequence are decoded serially (seed: 5)
    dynamic_depth: str = None             # None | "throughput" (the seed's rule) | "acceptance" (deterministic)
    depth_window: int = 8                 # steps per adjustment window
    start_depth: int = None               # initial per-sequence depth (default: the tree's depth)
    min_depth: int = 1
    rise: float = 0.05                    # throughput rule: depth + 1 when throughput rose by more than 5 %
    fall: float = 0.03                    # ... and − 1 when it fell by more than 3 %
    accept_up: float = 0.5                # acceptance rule: + 1 when >= 50 % of steps accept the full depth
    accept_down: float = 0.15             # ... − 1 when < 15 % do
    fallback_threshold: float = None      # rolling acceptance rate below which a sequence decodes serially
    fallback_window: int = 8              # MTP steps in the rolling window
    fallback_steps: int = 16              # serial steps before MTP is tried again

    def __post_init__(self):
        if self.dynamic_depth not in (None, "throughput", "acceptance"):
            raise ValueError(f"dynamic_depth must be None, 'throughput' or 'acceptance', got {self.dynamic_depth!r}")
        if self.cold_start_tokens < 0 or self.depth_window < 1 or self.min_depth < 1 or self.fallback_window < 1:
            raise ValueError("RuntimeConfig: counts and windows must be positive")


@dataclass
class GenerateResult:
    tokens: list            # new tokens per sequence
    stats: GenerateStats


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


def _choose(logits, temperature, top_p, gen):
    """Target choice per row: greedy argmax (over fp32 logits, as transformers) or a sample."""
    if temperature == 0:
        return logits.float().argmax(-1)
    probs = logits_to_probs(logits, temperature, top_p)
    u = torch.rand(probs.shape[:-1], generator=gen, device=probs.device).reshape(-1)
    return sample_from_probs(probs.reshape(-1, probs.shape[-1]), u).view(probs.shape[:-1])


@torch.no_grad()
def prefill(model, prompts, cache, ops):
    """Run every prompt through the model as a causal chain with an empty cache and store all its K/V.

    prompts: list of B token lists (lengths may differ; shorter ones are padded with nodes that see only
    themselves and are never stored). Returns the final-norm hidden state at each prompt's last token [B, D].
    """
    B, S = len(prompts), max(len(p) for p in prompts)
    dev = model.device
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    tokens = torch.zeros(B, S, dtype=torch.int64, device=dev)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p, device=dev)
    idx = torch.arange(S, device=dev)
    real = idx[None, :] < lens[:, None]                                       # [B, S]
    causal = torch.tril(torch.ones(S, S, dtype=torch.bool, device=dev))
    mask = (causal[None] & real[:, None, :] & real[:, :, None]) | torch.eye(S, dtype=torch.bool, device=dev)
    positions = idx[None, :].expand(B, S)
    rows = torch.arange(B, device=dev)
    hidden, k_tree, v_tree = model.forward_tree(tokens, positions, mask, cache, rows, ops)
    nodes = torch.where(real, idx[None, :], -1)
    ops.kv_append(cache.k, cache.v, cache.block_table, cache.cache_lens, k_tree, v_tree, nodes, lens - 1)
    cache.cache_lens += lens.to(torch.int32)
    return hidden[rows, lens - 1]


@torch.no_grad()
def generate(model, prompts, max_new_tokens, *, heads=None, mtp=True, tree=None, temperature=0.0, top_p=1.0,
             seed=None, eos_token_id=None, kernels="auto", runtime=None, block_size=16, drafter=None,
             cuda_graph=False):
    """Generate up to max_new_tokens per prompt; see API.md. mtp=False or heads=None: serial decoding.

    runtime: RuntimeConfig (cold start, dynamic depth, fallback). block_size: paged-cache block size.
    drafter: instead of heads, an object with `num_heads` and `propose(rows, emitted, top_k) -> [A, H, K]`
    (e.g. the synthetic `drafters.OracleDrafter` used to measure the runtime apart from head quality).
    cuda_graph: replay the verify forward as a CUDA graph (one per tree size) to remove Python launch
    overhead; finished sequences then keep running (frozen, never emitted) so shapes stay fixed.
    """
    cfg = model.config
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    prompts = _check_prompts(prompts, cfg.vocab_size, cfg.max_position_embeddings)
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context "
                         f"length {cfg.max_position_embeddings}")
    rt = runtime or RuntimeConfig()
    dev = model.device
    if cuda_graph and dev.type != "cuda":
        raise ValueError("cuda_graph=True needs the model on a CUDA device")
    ops = get_ops(kernels, dev)
    use_mtp = bool(mtp) and (heads is not None or drafter is not None)
    if use_mtp and drafter is not None:
        full_tree = get_tree(tree, drafter.num_heads).to(dev)
    elif use_mtp:
        if heads.hidden_size != cfg.hidden_size:
            raise ValueError(f"heads hidden size {heads.hidden_size} != model hidden size {cfg.hidden_size}")
        full_tree = get_tree(tree, heads.num_heads).to(dev)
        res_w = heads.res_weight.detach().to(dev, model.dtype).contiguous()
        res_b = heads.res_bias.detach().to(dev, model.dtype).contiguous()
    else:
        full_tree = Tree.root_only().to(dev)
    lm_w = model.lm_head.weight.detach()
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed if seed is not None else torch.seed())
    stop = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
    B = len(prompts)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        energy0 = gpu_energy_j(dev)
    timer = PhaseTimer(dev)
    # The kernels' value checks read tensors (a host sync each on a GPU). The loop builds every input itself
    # (validated tree, its own block tables and lengths), so on a GPU they are skipped inside the loop.
    check = dev.type != "cuda"
    t_start = time.perf_counter()

    cache = model.new_cache([len(p) + max_new_tokens + full_tree.size for p in prompts], block_size)
    hidden = prefill(model, prompts, cache, ops)                            # [B, D]
    first = _choose(model.logits(hidden), temperature, top_p, gen)          # [B]
    out = [[t] for t in first.tolist()]
    ttft = time.perf_counter() - t_start
    roots = first
    done = [t in stop or max_new_tokens == 1 for t in first.tolist()]
    depth_b = [rt.start_depth or full_tree.max_depth] * B                   # per-sequence depth control
    serial_until = [0] * B                                                  # fallback: serial until step n
    windows = [deque(maxlen=rt.fallback_window) for _ in range(B)]          # (accepted, tried) per MTP step
    depth_hist = [deque(maxlen=rt.depth_window) for _ in range(B)]
    tput_win, tput_prev = [0, 0.0], None
    steps = seq_steps = fallback_count = 0
    accept_hist, reached, accepted_at = Counter(), Counter(), Counter()
    itl = []
    pruned = {full_tree.max_depth: full_tree}                               # sub-trees by depth limit
    graphs = {} if cuda_graph else None                                     # tree size -> _GraphedVerify

    while not all(done):
        t_step = time.perf_counter()
        was_done = list(done)
        active = list(range(B)) if graphs is not None else [b for b in range(B) if not done[b]]
        rows = torch.tensor(active, device=dev)
        A = len(active)
        # ---- per-sequence depth this step (cold start, fallback, dynamic depth) ----
        allowed = []
        for b in active:
            d = depth_b[b] if use_mtp else 0
            if len(out[b]) < rt.cold_start_tokens or steps < serial_until[b] or done[b]:
                d = 0
            allowed.append(min(d, full_tree.max_depth))
        max_d = max(allowed)
        if max_d not in pruned:
            pruned[max_d] = _prune(full_tree, max_d)
        step_tree = pruned[max_d]
        T = step_tree.size
        allowed_t = torch.tensor(allowed, device=dev)                      # switch off deeper nodes per sequence
        parents = torch.where(step_tree.depth[None, :] > allowed_t[:, None], -1, step_tree.parents[None, :])  # [A, T]

        # ---- draft: all heads in one launch from the hidden state at the deepest accepted node ----
        t0 = timer.start()
        draft = roots[rows][:, None].repeat(1, T)                           # [A, T]; node 0 = root
        if T > 1 and drafter is not None:
            ids = drafter.propose(active, [out[b] for b in active], step_tree.top_k).to(dev)
            draft[:, 1:] = ids[:, step_tree.depth[1:] - 1, step_tree.rank[1:]]
        elif T > 1:
            ids, _ = ops.fused_draft(hidden[rows].contiguous(), res_w, res_b, lm_w, step_tree.top_k)  # [A, H, K]
            draft[:, 1:] = ids[:, step_tree.depth[1:] - 1, step_tree.rank[1:]]
        timer.stop("draft", t0)

        # ---- verify: one forward over the root + drafts; each node sees the cache and its ancestors ----
        t0 = timer.start()
        positions = cache.cache_lens[rows].long()[:, None] + step_tree.depth[None, :]
        if graphs is not None:
            if T not in graphs:
                graphs[T] = _GraphedVerify(model, cache, rows, step_tree, ops)
            h_tree, k_tree, v_tree, logits = graphs[T](draft, positions)
        else:
            h_tree, k_tree, v_tree = model.forward_tree(draft, positions, step_tree.mask, cache, rows, ops, check)
            logits = model.logits(h_tree)                                    # [A, T, V]
        timer.stop("verify", t0)

        # ---- accept: node i is accepted iff its parent is and draft[i] == target choice after the parent ----
        t0 = timer.start()
        if temperature == 0:
            target = logits.float().argmax(-1)                               # [A, T]
            accept_len, accept_nodes, bonus = ops.tree_accept(draft, parents, target, check_values=check)
        else:
            probs = logits_to_probs(logits, temperature, top_p).contiguous()
            u_acc = torch.rand(A, T, generator=gen, device=dev, dtype=probs.dtype)
            u_smp = torch.rand(A, generator=gen, device=dev, dtype=probs.dtype)
            accept_len, accept_nodes, bonus = ops.tree_accept_sample(draft, parents, probs, u_acc, u_smp,
                                                                     check_values=check)
        timer.stop("accept", t0)

        # ---- append: K/V of the root and accepted nodes go to the next cache positions ----
        t0 = timer.start()
        block_table = cache.block_table[rows]
        ops.kv_append(cache.k, cache.v, block_table, cache.cache_lens[rows], k_tree, v_tree, accept_nodes,
                      accept_len, check_values=check)
        grow = accept_len + 1
        if graphs is not None:                   # finished rows re-write their own slots but never grow
            grow = grow * torch.tensor([not d for d in was_done], device=dev)
        cache.cache_lens[rows] += grow.to(torch.int32)
        last = accept_nodes.gather(1, accept_len[:, None])[:, 0]             # deepest accepted node
        hidden[rows] = h_tree[torch.arange(A, device=dev), last]
        roots[rows] = bonus
        timer.stop("append", t0)

        # ---- emit (one host sync per step): accepted drafts, then the bonus; stop at EOS / length ----
        host = torch.cat([accept_len[:, None], bonus[:, None], accept_nodes, draft], dim=1).tolist()  # one copy
        acc_l, bonus_l = [h[0] for h in host], [h[1] for h in host]
        acc_n, draft_l = [h[2 : 2 + T] for h in host], [h[2 + T :] for h in host]
        steps += 1
        n_emitted = 0
        for a, b in enumerate(active):
            if was_done[b]:
                continue
            new = [draft_l[a][n] for n in acc_n[a][1 : acc_l[a] + 1]] + [bonus_l[a]]
            for t in new:
                if len(out[b]) >= max_new_tokens:
                    break
                out[b].append(t)
                n_emitted += 1
                if t in stop:
                    break
            if out[b][-1] in stop or len(out[b]) >= max_new_tokens:
                done[b] = True
            seq_steps += 1
            accept_hist[acc_l[a]] += 1
            for d in range(1, allowed[a] + 1):
                reached[d] += 1
                accepted_at[d] += acc_l[a] >= d
            if allowed[a] > 0:
                windows[b].append((acc_l[a], allowed[a]))
                depth_hist[b].append(acc_l[a] >= allowed[a])
                fallback_count += _runtime_update(rt, b, depth_b, serial_until, windows, depth_hist, steps,
                                                  full_tree.max_depth)
        dt = time.perf_counter() - t_step
        itl += [dt / max(n_emitted, 1)] * n_emitted
        tput_win[0] += n_emitted
        tput_win[1] += dt
        if use_mtp and rt.dynamic_depth == "throughput" and steps % rt.depth_window == 0:
            tput = tput_win[0] / max(tput_win[1], 1e-12)
            if tput_prev is not None:
                change = +1 if tput > tput_prev * (1 + rt.rise) else -1 if tput < tput_prev * (1 - rt.fall) else 0
                depth_b = [min(max(d + change, rt.min_depth), full_tree.max_depth) for d in depth_b]
            tput_prev, tput_win = tput, [0, 0.0]

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    total = time.perf_counter() - t_start
    phases = timer.result()
    new_tokens = sum(len(o) for o in out)
    decode_tokens = new_tokens - B
    max_depth = max(reached) if reached else 0
    energy = None
    if dev.type == "cuda" and energy0 is not None:
        e1 = gpu_energy_j(dev)
        energy = None if e1 is None else e1 - energy0
    stats = GenerateStats(
        steps=steps, new_tokens=new_tokens,
        tokens_per_step=(decode_tokens / seq_steps) if seq_steps else float("nan"),
        accept_rate_per_depth=[accepted_at[d] / reached[d] for d in range(1, max_depth + 1)],
        accept_len_histogram=[accept_hist[i] for i in range(max(accept_hist, default=0) + 1)],
        fallback_count=fallback_count,
        time_draft_s=phases["draft"], time_verify_s=phases["verify"], time_accept_s=phases["accept"],
        time_append_s=phases["append"], ttft_s=ttft, total_s=total,
        itl_p50_s=percentile(itl, 50), itl_p95_s=percentile(itl, 95), itl_p99_s=percentile(itl, 99),
        tokens_per_s=new_tokens / total, decode_tokens_per_s=decode_tokens / max(total - ttft, 1e-12),
        peak_memory_bytes=peak_memory_bytes(dev), energy_j=energy, kernels=ops.kind, tree_size=full_tree.size,
        cache_bytes=cache.nbytes(),
    )
    return GenerateResult(tokens=out, stats=stats)


class _GraphedVerify:
    """The verify forward (+ logits) captured as one CUDA graph for a fixed batch and tree.

    Possible because, with value checks off, every kernel's launch grid depends only on tensor shapes and
    the block table's width; the cache, block table and lengths are read from their (static) storage at
    replay. Inputs are copied into static buffers; outputs are overwritten by the next replay.
    """

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
        return h, k, v, self.model.logits(h)

    def __call__(self, tokens, positions):
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.out


def _runtime_update(rt, b, depth_b, serial_until, windows, depth_hist, steps, max_depth):
    """Per-sequence fallback and acceptance-driven depth (deterministic: depends only on acceptances).

    Returns 1 when the sequence falls back to serial decoding (for `fallback_count`), else 0."""
    if rt.fallback_threshold is not None and len(windows[b]) == rt.fallback_window:
        acc = sum(a for a, _ in windows[b]) / max(sum(t for _, t in windows[b]), 1)
        if acc < rt.fallback_threshold:
            serial_until[b] = steps + rt.fallback_steps
            windows[b].clear()
            depth_hist[b].clear()
            return 1
    if rt.dynamic_depth == "acceptance" and len(depth_hist[b]) == rt.depth_window:
        full = sum(depth_hist[b]) / rt.depth_window
        if full >= rt.accept_up:
            depth_b[b] = min(depth_b[b] + 1, max_depth)
        elif full < rt.accept_down:
            depth_b[b] = max(depth_b[b] - 1, rt.min_depth)
        depth_hist[b].clear()
    return 0


def _prune(tree, max_depth):
    """The sub-tree of nodes with depth <= max_depth (node order is preserved)."""
    if max_depth == 0:
        return Tree.root_only().to(tree.parents.device)
    return Tree.from_choices([p for p in tree.paths[1:] if len(p) <= max_depth]).to(tree.parents.device)
