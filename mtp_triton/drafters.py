"""Drafters: what proposes a step's candidate tokens, behind one protocol, `Drafter`.

    trees(tree, device)      the trees its steps draft on, from generate's tree= (checked): `tree.SubTrees`, a fixed
                             candidate tree cut to each step's depth limits, or `tree.DrawnTrees`: it draws its own
    draft(rows, roots, hidden, tree, parents, depths, context, min_prob)
                             -> (tree [T nodes], tokens [A, T], path_prob [A, T] or None, parents [T] or [A, T])
    start(prompts, hidden, roots, capacities, block_size)    after prefill (a drafter with its own cache fills it)
    observe(rows, h_tree, tokens, accept_nodes, accept_len, bonus)    after every step (what was committed)
    cache_bytes()            bytes of its own cache
    reports_probabilities    whether draft(min_prob=p) returns path probabilities (pruning and cost sizing need them)

The base class drafts a fixed tree from `propose(hidden, top_k, context, num_heads, roots, probs) -> ids [A, H, K]`
(one call for the first H = tree depth heads): node i takes rank tree.rank[i] of head tree.depth[i] - 1, and its
path probability is the product of the heads' probabilities on its path. `HeadsDrafter` runs MTP heads through
`fused_draft` (all heads and their top-k in one call); heads with token inputs (heads.py) draft per tree node
instead, one `fused_draft` call per depth (`draft_tree`). `drafters_mtp.ModuleDrafter` (the MTP module) draws a
dynamic tree with its own cache. `SerialDrafter` drafts nothing: serial decoding. `OracleDrafter` is a clearly
labelled SYNTHETIC drafter for measuring the runtime apart from head quality: it knows each sequence's true
continuation (from a serial run of the same model) and proposes it at a chosen per-depth acceptance profile: head h's
rank-0 candidate is the true token with probability profile[h] (independently per step), otherwise a wrong one;
lower ranks are random wrong tokens, except that when rank 0 is wrong the true token sits at rank 1 with
probability profile[h] too (so bushy trees have something to find). Verification is still real: the output is the
model's own, whatever is proposed — only the speed depends on the profile.
"""
import torch
import torch.nn.functional as F

from .ops import cpu_twins
from .packed import packed_linear
from .reference import topk_lower_id_first
from .tree import SubTrees, Tree, get_tree


def bf16_draft(hidden, res_weight, res_bias, lm_head, top_k, *, token_map=None, logprobs=False):
    """`fused_draft`'s math in the inputs' own dtype: the bf16 drafting path of a bf16 engine on a CPU.

    z_h = x + silu(W_h x + b_h) and logits_h = L_h z_h as bf16 matmuls (fp32 accumulation inside, bf16 results),
    then the top-k rows by descending logit, ties to the lower row — exactly what the training's `replay.head_ranks`
    computes, so the training's simulated tau is what this path decodes with. res_weight may also be H row-wise
    functions x -> W_h x and lm_head one z -> L z (`packed.packed_linear`: the same weights prepacked, the same
    bits). The PyTorch twin (`reference.fused_draft`, the Triton kernel's specification) computes in fp32 instead,
    which on a CPU reads twice the bytes of a large draft vocabulary per call, and a drafter that drafts node by node
    calls it once per depth. Drafts only steer speed: verification decides every token.
    -> token_ids [B, H, top_k], and with logprobs=True log_softmax(logits_h) at those rows [B, H, top_k] float32
    (else None)."""
    if isinstance(res_weight, torch.Tensor):
        pre = torch.einsum("bd,hed->bhe", hidden, res_weight) + res_bias                 # [B, H, D]
    else:                                                   # H row-wise functions: the same weights, prepacked
        pre = torch.stack([f(hidden) for f in res_weight], 1) + res_bias
    z = hidden[:, None, :] + F.silu(pre)
    if callable(lm_head):
        logits = lm_head(z)                                                              # [B, H, V]
    else:
        logits = z @ lm_head.T if lm_head.dim() == 2 else torch.einsum("bhd,hvd->bhv", z, lm_head)
    logits = logits.float()
    rows = topk_lower_id_first(logits, top_k)
    logp = torch.log_softmax(logits, -1).gather(-1, rows) if logprobs else None
    return (rows if token_map is None else token_map[rows]), logp


def _rows_fn(w):
    """x [..., K] -> x @ w.T for w [N, K]: prepacked where packing applies (`packed.packed_linear`), else the matmul."""
    return packed_linear(w) or (lambda x: x @ w.T)


class Drafter:
    """The drafter protocol (see the module docstring); the defaults are a stateless drafter of a fixed tree.

    A subclass of a fixed tree implements `propose`; one that draws its own trees overrides `trees` and `draft`; one
    with a cache of its own overrides `start`, `observe` and `cache_bytes`."""
    num_heads = 0                   # the deepest node it drafts: the runtime policy's depth limit
    reports_probabilities = False   # draft(min_prob=p) returns path probabilities (for sizing.Pruner / CostPruner)
    synthetic = False               # proposes a known continuation (a measuring aid), not a model's guesses
    taps = ()                       # target layers whose residual streams `start`/`observe` take (EAGLE-3's fused
    #                                 features); () : the final-norm hidden states

    def trees(self, tree, device):
        """generate's tree= (a Tree, a preset name, Medusa-style choices, or None: the package default), checked
        against the heads -> `SubTrees`, cut to each step's depth limits."""
        return SubTrees(get_tree(tree, self.num_heads).to(device))

    def draft(self, rows, roots, hidden, tree, parents=None, depths=None, context=None, min_prob=None):
        """The step's tree and its tokens: node 0 is the root, node i > 0 rank tree.rank[i] of head tree.depth[i] - 1.

        rows [A] the cache rows, roots [A] the newest committed tokens, hidden [A, D] the target's final-norm hidden
        state at them; tree: the candidate tree (T nodes) with parents [T] or [A, T] (-1: a node row a does not use;
        None: tree.parents); depths [A]: each row's depth limit; context: (batch indices, tokens each row emitted so
        far). min_prob (pruning): also return path_prob [A, T], the product of the heads' probabilities of the
        tokens on the path to each node (root 1); a drafter may stop drafting at the first depth no path reaches it.
        -> (tree, tokens [A, T], path_prob [A, T] or None, parents). A one-node tree is a serial step: no drafting."""
        parents = tree.parents if parents is None else parents
        if tree.size == 1:
            tokens = roots[:, None].clone()                                             # [A, 1]
            return tree, tokens, None if min_prob is None else torch.ones(tokens.shape, device=tokens.device), parents
        tokens, path_prob = self.draft_tokens(hidden, roots, tree, context, min_prob)
        return tree, tokens, path_prob, parents

    def draft_tokens(self, hidden, roots, tree, context=None, min_prob=None):
        """One `propose` for the heads the tree reaches (a depth-2 tree drafts with 2 heads, however many exist), then
        node i takes its rank of its depth's candidates.   -> tokens [A, T], path_prob [A, T] or None

            path_prob[i] = prod over the nodes j on the path root -> i of q_{depth_j - 1}(token_j)
        (a sum of logs over each node's ancestors: one matmul with the tree's mask)."""
        want = min_prob is not None
        out = self.propose(hidden, tree.top_k, context, num_heads=tree.max_depth, roots=roots, probs=want)
        ids, probs = out if want else (out, None)                                       # [A, depth, K]
        tokens = roots[:, None].repeat(1, tree.size)                                    # [A, T]; node 0 = root
        tokens[:, 1:] = ids[:, tree.depth[1:] - 1, tree.rank[1:]]
        if not want:
            return tokens, None
        logp = torch.zeros(tokens.shape, device=tokens.device)                          # [A, T]; log 1 at the root
        logp[:, 1:] = probs[:, tree.depth[1:] - 1, tree.rank[1:]].float().clamp_min(1e-30).log()
        return tokens, torch.exp(logp @ tree.mask.T.float())                            # sum over each node's path

    def propose(self, hidden, top_k, context=None, num_heads=None, roots=None, probs=False):
        """Candidates of the first num_heads heads: ids [A, num_heads, top_k]; with probs=True also their
        probabilities [A, num_heads, top_k]."""
        raise NotImplementedError(f"{type(self).__name__} drafts no fixed tree (it has no propose)")

    def start(self, prompts, hidden, roots, capacities, block_size):
        """After prefill: prompts (B token lists), hidden [B, S, D] the target's final-norm hidden states at every
        prompt position, roots [B] the first new tokens, capacities [B] and block_size of the target's cache."""

    def observe(self, rows, h_tree, tokens, accept_nodes, accept_len, bonus):
        """After a step: h_tree [A, T, D], tokens [A, T], accept_nodes [A, T] (root 0, accepted nodes, -1),
        accept_len [A], bonus [A]."""

    def cache_bytes(self):
        """Bytes of the drafter's own cache (0: none)."""
        return 0


class SerialDrafter(Drafter):
    """No drafts: every step verifies the root alone, so the bonus is the next token (generate's mtp=False)."""

    def trees(self, tree, device):
        return SubTrees(Tree.root_only().to(device))


class HeadsDrafter(Drafter):
    """MTP heads on the target's hidden state: head h's top-k candidates for the token h + 2 positions ahead."""
    reports_probabilities = True            # propose(probs=True) / draft_tree(min_prob=...)

    def __init__(self, heads, model, ops, draft_dtype=None):
        """draft_dtype: None (auto: bf16 on a CPU with the PyTorch twins for a bf16 model, and for an fp32 model where
        the CPU multiplies bf16 natively; else the model's dtype), or torch.float32 / torch.bfloat16 to choose."""
        if heads.hidden_size != model.config.hidden_size:
            raise ValueError(f"heads hidden size {heads.hidden_size} != model hidden size {model.config.hidden_size}")
        self.num_heads = heads.num_heads
        self.fused_draft = ops.fused_draft
        dev, dt = model.device, model.dtype
        self.res_weight = heads.res_weight.detach().to(dev, dt).contiguous()        # [H, D, D]
        self.res_bias = heads.res_bias.detach().to(dev, dt).contiguous()            # [H, D]
        # the rows drafting scores: the model's LM head [V, D], the heads' own [H, V, D], or a draft vocabulary's
        # rows [V', D] with token_map [V'] mapping row -> token id (all prepared once, here)
        self.lm_head, self.token_map = heads.draft_weights(model.lm_head.weight)
        cpu = cpu_twins(ops, dev)
        if draft_dtype is None:
            draft_dtype = torch.bfloat16 if ops.numerics(dev, dt).draft_bf16 else dt
        if draft_dtype != dt and not (cpu and dt == torch.float32 and draft_dtype == torch.bfloat16):
            raise ValueError(f"HeadsDrafter: draft_dtype must be the model's dtype ({dt}), or torch.bfloat16 for a "
                             f"float32 model on a CPU with the PyTorch twins; got {draft_dtype}")
        if cpu and draft_dtype == torch.bfloat16:
            # the CPU's bf16 matmuls, as the training measures (see bf16_draft). An fp32 model drafts in bf16 too
            # where the CPU multiplies bf16 natively: half the bytes of the fp32 LM head per draft, the drafts the
            # training simulated; verification in fp32 decides every token, so the output is unchanged.
            self.fused_draft = bf16_draft
            self.res_weight, self.res_bias = (t.to(torch.bfloat16) for t in (self.res_weight, self.res_bias))
            self.lm_head = self.lm_head.to(torch.bfloat16).contiguous()
        # what drafting multiplies by on the bf16 path: the ResBlocks' weights and a shared LM head or draft vocabulary
        # prepacked where packing applies (packed.py; bf16: the same bits, faster for a few rows)
        bf16 = self.fused_draft is bf16_draft
        self.res_rows = [_rows_fn(w) for w in self.res_weight] if bf16 else self.res_weight
        self.lm_rows = (bf16 and self.lm_head.dim() == 2 and packed_linear(self.lm_head)) or self.lm_head
        # heads with root input read x' = x + P e_root (heads.py); the kernel is handed x'
        self.root_proj = None if heads.root_proj is None else heads.root_proj.detach().to(dev, dt).contiguous()
        # heads with token inputs also read the drafted tokens of their path: s_h = x' + sum_q Q_q e(y_{h-q})
        self.token_proj = None if heads.token_proj is None else heads.token_proj.detach().to(dev, dt).contiguous()
        self.root_rows = None if self.root_proj is None else _rows_fn(self.root_proj)          # e -> P e
        self.proj_rows = [] if self.token_proj is None else [_rows_fn(q) for q in self.token_proj]  # e -> Q_q e
        self.sequential = self.token_proj is not None       # candidates depend on the tree node: draft_tree
        self.embed = model.embed_tokens.weight.detach()
        self.stored_tree = heads.tree                       # the tree saved with the heads (None: the default)
        self._plans = {}

    def trees(self, tree, device):
        """tree=None: the tree stored with the heads, else the package default."""
        return super().trees(self.stored_tree if tree is None else tree, device)

    def draft_tokens(self, hidden, roots, tree, context=None, min_prob=None):
        if not self.sequential:
            return super().draft_tokens(hidden, roots, tree, context, min_prob)
        out = self.draft_tree(hidden, roots, tree, min_prob=min_prob)
        return out if min_prob is not None else (out, None)

    def _root_input(self, hidden, roots):
        if self.root_proj is None:
            return hidden
        if roots is None:
            raise ValueError("HeadsDrafter: these heads read the root token; pass roots [A]")
        return hidden + self.root_rows(self.embed[roots])                           # x' = x + P e_root   [A, D]

    def propose(self, hidden, top_k, context=None, num_heads=None, roots=None, probs=False):
        """Candidates of the first `num_heads` heads (all by default): ids [A, num_heads, top_k]; with probs=True
        also each candidate's probability under its head [A, num_heads, top_k] (over the draft vocabulary)."""
        if self.sequential:
            raise ValueError("HeadsDrafter.propose: these heads read the drafted tokens of their path, so their "
                             "candidates depend on the tree node; use draft_tree(hidden, roots, tree)")
        H = num_heads or self.num_heads
        lm = self.lm_head[:H] if self.lm_head.dim() == 3 else self.lm_rows          # per-head LM heads: theirs
        hidden = self._root_input(hidden, roots)
        ids, logp = self._draft(hidden.contiguous(), self.res_rows[:H], self.res_bias[:H], lm, top_k, probs)
        return (ids, logp.exp()) if probs else ids

    def _draft(self, x, w, b, lm, k, probs):
        if self.fused_draft is bf16_draft:
            return bf16_draft(x.to(b.dtype), w, b, lm, k, token_map=self.token_map, logprobs=probs)
        return self.fused_draft(x, w, b, lm, k, token_map=self.token_map, check_values=False)   # checked on load

    def _plan(self, tree, device):
        """Per depth d = 1 .. max_depth: (nodes at d [n], their parents at d - 1 without repeats [p], each node's slot
        in that list [n], each node's rank [n], top-k needed, ancestors [Q', p]: the nodes at depths d-1, d-2, .. of
        each parent's path, nearest first (Q' = min(d - 1, Q))). Computed once per tree."""
        key = (tree.paths, str(device))
        if key not in self._plans:
            parents, depth, rank = tree.parents.tolist(), tree.depth.tolist(), tree.rank.tolist()
            Q, plan = self.token_proj.shape[0], []
            for d in range(1, tree.max_depth + 1):
                nodes = [i for i in range(tree.size) if depth[i] == d]
                par = sorted({parents[i] for i in nodes})
                slot = [par.index(parents[i]) for i in nodes]
                anc = []
                for _ in range(min(d - 1, Q)):                  # walk up from each parent: itself, its parent, ...
                    anc.append(par if not anc else [parents[a] for a in anc[-1]])
                t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)
                plan.append((t(nodes), t(par), t(slot), t([rank[i] for i in nodes]), max(rank[i] for i in nodes) + 1,
                             t(anc).reshape(len(anc), len(par))))
            self._plans[key] = plan
        return self._plans[key]

    def draft_tree(self, hidden, roots, tree, min_prob=None):
        """Tokens for every node of `tree`: [A, T] (node 0 = roots [A]); hidden [A, D] at the root's position.

        Depth by depth: every node p at depth d - 1 with children gets s = x' + sum_q Q_q e(y_{d-1-q}) from the
        tokens on its path (heads.py), head d - 1 scores it in one `fused_draft` call for all such p and all rows,
        and child c of p takes rank rank[c] of p's candidates.

        min_prob (confidence pruning, `sizing.Pruner`): also return path_prob [A, T] = the product of the heads'
        probabilities of the tokens from the root to each node (root 1). Path probabilities only fall with depth,
        so once no parent of a depth's nodes reaches min_prob in any row, nothing deeper can: drafting stops there
        and the deeper nodes get path probability 0 (their tokens stay the root's, and are never verified)."""
        A, T = roots.shape[0], tree.size
        tokens = roots[:, None].repeat(1, T)                                        # [A, T]
        path_prob = torch.ones(A, T, device=roots.device) if min_prob is not None else None
        x = self._root_input(hidden, roots)                                         # [A, D]
        for d, (nodes, par, slot, rank, k, anc) in enumerate(self._plan(tree, roots.device), 1):
            if path_prob is not None and d > 1 and not bool((path_prob[:, par] >= min_prob).any()):  # host sync
                path_prob[:, tree.depth >= d] = 0.0
                break
            h = d - 1
            s = x[:, None, :].expand(A, par.numel(), x.shape[-1])                   # [A, p, D]
            for q in range(anc.shape[0]):                                           # y_{h - q}: the q-th ancestor
                s = s + self.proj_rows[q](self.embed[tokens[:, anc[q]]])
            lm = self.lm_head[h:h + 1] if self.lm_head.dim() == 3 else self.lm_rows
            ids, logp = self._draft(s.reshape(-1, s.shape[-1]).contiguous(), self.res_rows[h:h + 1],
                                    self.res_bias[h:h + 1], lm, k, path_prob is not None)   # [A * p, 1, k]
            tokens[:, nodes] = ids.view(A, par.numel(), k)[:, slot, rank]
            if path_prob is not None:
                p = logp.view(A, par.numel(), k)[:, slot, rank].exp()               # [A, n]
                path_prob[:, nodes] = path_prob[:, par[slot]] * p
        return tokens if path_prob is None else (tokens, path_prob)


class OracleDrafter(Drafter):
    """SYNTHETIC drafts of a known continuation at a per-depth acceptance profile (see the module docstring)."""
    synthetic = True

    def __init__(self, true_tokens, profile, vocab_size, seed=0):
        self.true = [list(t) for t in true_tokens]
        self.profile = [float(p) for p in profile]
        if not all(0.0 <= p <= 1.0 for p in self.profile):
            raise ValueError("OracleDrafter: profile entries must be probabilities")
        self.num_heads = len(self.profile)
        self.vocab_size = vocab_size
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, hidden, top_k, context=None, num_heads=None, roots=None, probs=False):
        """context = (batch indices of the rows, tokens each has emitted so far; the last is the root)."""
        if probs:
            raise ValueError("OracleDrafter: synthetic drafts have no probabilities")
        seq_ids, emitted = context
        A, H, V = len(seq_ids), num_heads or self.num_heads, self.vocab_size
        ids = torch.randint(0, V, (A, H, top_k), generator=self.gen)
        for a, (b, out) in enumerate(zip(seq_ids, emitted)):
            for h in range(H):
                pos = len(out) + h                                   # head h proposes out[len + h]
                truth = self.true[b][pos] if pos < len(self.true[b]) else None
                row = ids[a, h]
                if truth is not None:
                    row[row == truth] = (truth + 1) % V             # no accidental hits
                    if torch.rand((), generator=self.gen) < self.profile[h]:
                        row[0] = truth
                    elif top_k > 1 and torch.rand((), generator=self.gen) < self.profile[h]:
                        row[1] = truth
        return ids.to(hidden.device)
