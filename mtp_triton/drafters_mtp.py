"""The MTP module as a drafter: its own one-layer paged KV cache, and a dynamic tree drawn at every step.

The module (mtp_module.py) keeps one cache entry per committed position m: the pair (h_m, x_{m+1}) of the target's
hidden state and the token after it, at RoPE position m. So after the target has committed L tokens (the root x_L is
not yet in its cache) the module's cache holds L entries, and its output at the last one, f_{L-1}, scores the tokens
after the root.

    start    after prefill: the prompt's pairs (h_m, x_{m+1}), m = 0 .. S-1, with x_S the first root   -> cache, f
    draft    (1) commit the pairs the last step produced: the root and the accepted nodes with the tokens after
             them, (h_root, a_1), .., (h_{a_n}, bonus): one causal chain over the module's cache  -> f at the root
             (2) the dynamic tree (EAGLE-2, Li et al. 2024, https://arxiv.org/abs/2406.16858):
                   depth 1: the top_k tokens of p = softmax(L f_root), path probability P = p
                   depth d -> d + 1: the `beam` depth-d nodes of highest P go through the module, each at index
                     L + d - 1 reading (f_parent, its token) and attending to the cache plus its own ancestors; each
                     gets top_k children with P_child = P_node * p_child
                 then every drafted node is reranked by P and the nodes - 1 most probable are kept (P only falls
                 along a path, so they form a subtree); the kept rank paths of all rows, united, are the step's Tree,
                 and a node a row did not keep is switched off for it (parent -1), as the runtime policy does
    observe  after accept: remember (hidden states at the accepted path, the tokens after them) for (1)

A serial step (every row at depth 0: the runtime policy's fallback) drafts nothing and commits
nothing: its pairs wait, and the next step that drafts commits all of them as one chain (one forward of the module
for many positions instead of one per step).

Verification and acceptance do not change: the drafts are only proposals, so greedy output is the serial output
and sampling keeps the target's distribution whatever the module proposes. Its drafts need not be exact, so the
module runs the engine's plain (not batch-invariant) step, in bf16 on a CPU that multiplies bf16 natively.
The scores go through the drafting kernel family with the ResBlock switched off (`fused_draft(x, None, None, ..)`:
logits = L x, top-k, log-softmax); with the PyTorch twins on a CPU it multiplies by the prepacked rows of L and
takes a plain top-k.
"""
import copy

import torch

from .drafters import Drafter
from .eagle3 import default_taps
from .model import PagedKVCache
from .ops import cpu_twins
from .packed import packed_linear
from .tree import DrawnTrees, Tree


class ModuleDrafter(Drafter):
    """The MTP module as a `Drafter`: a dynamic tree every step (`draft_dynamic`) and a cache per sequence (`start`
    after prefill, `observe` after every step)."""
    reports_probabilities = True

    def __init__(self, module, model, ops, *, depth=None, top_k=None, beam=None, nodes=None):
        """depth, top_k, beam, nodes: the dynamic tree (None: the module's stored defaults, module.draft).
        nodes counts the root: a step verifies at most `nodes` nodes."""
        cfg = model.config
        if module.hidden_size != cfg.hidden_size or module.config.vocab_size != cfg.vocab_size:
            raise ValueError(f"ModuleDrafter: the module is for hidden size {module.hidden_size} and vocabulary "
                             f"{module.config.vocab_size}, the model has {cfg.hidden_size} and {cfg.vocab_size}")
        d = dict(module.draft)
        d.update({k: v for k, v in dict(depth=depth, top_k=top_k, beam=beam, nodes=nodes).items() if v is not None})
        for k, v in d.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < (2 if k == "nodes" else 1):
                raise ValueError(f"ModuleDrafter: {k} must be an int >= {2 if k == 'nodes' else 1}, got {v!r}")
        self.depth, self.top_k, self.beam, self.nodes = d["depth"], d["top_k"], d["beam"], d["nodes"]
        self.num_heads = self.depth                      # the deepest node: the runtime policy's depth limit
        L = cfg.num_hidden_layers
        self.taps = default_taps(L) if module.taps is None else tuple(module.taps)   # the target layers it reads
        if any(not 0 <= j <= L for j in self.taps):
            raise ValueError(f"ModuleDrafter: the drafter reads target layers {list(self.taps)}, the model has {L}")
        dev, dt = model.device, model.dtype
        self.bf16 = ops.numerics(dev, dt).draft_bf16
        self.dtype = torch.bfloat16 if self.bf16 else dt
        self.module = copy.deepcopy(module).to(dev, self.dtype).eval()   # the caller's module is left as it is
        self.engine = self.module.engine(model)
        self.embed = model.embed_tokens.weight.detach()
        lm = self.module.lm_rows(model.lm_head.weight.detach()).to(self.dtype).contiguous()   # [V', D]
        # the PyTorch twins on a CPU score with L prepacked (packed.py; either dtype): a few rows of a large draft
        # vocabulary in one oneDNN call, a third of the plain fp32 matmul's time; elsewhere the ops' fused_draft
        self.lm = (packed_linear(lm) if cpu_twins(ops, dev) else None) or lm
        self.token_map = None if module.token_map is None else module.token_map.to(dev)
        self.top_k = min(self.top_k, lm.shape[0])           # never more candidates than the draft vocabulary has
        self.ops = ops                                      # its inputs are built here: no value checks per step
        self.cache = self.f = None
        self.pending = []                                   # (rows, h, nxt, n) of each step not yet committed
        self._tree_cache = {}                               # rank paths -> Tree (`_tree`)

    def trees(self, tree, device):
        """No candidate tree: each step's is drawn here, at most `nodes` nodes per row, `depth` deep."""
        if tree is not None:
            raise ValueError(f"{type(self).__name__} draws its own tree every step (a dynamic tree); pass its size "
                             "to the drafter (depth, top_k, beam, nodes), not tree=")
        return DrawnTrees(self.nodes, self.depth, self.top_k)

    def draft(self, rows, roots, hidden, tree=None, parents=None, depths=None, context=None, min_prob=None):
        """The dynamic tree (`draft_dynamic`); tree, parents, hidden (the module reads its own f) and context unused,
        path probabilities always returned."""
        return self.draft_dynamic(rows, roots, depths)

    def cache_bytes(self):
        return 0 if self.cache is None else self.cache.nbytes()

    # ---- the module's own cache ------------------------------------------------------------------------
    def start(self, prompts, hidden, roots, capacities, block_size):
        """After prefill: prompts (B token lists), hidden [B, S, D] the target's final-norm hidden states at every
        prompt position, roots [B] the first new tokens. Builds the cache and commits the prompts' pairs."""
        dev, B = roots.device, len(prompts)
        self.cache = PagedKVCache(self.module.config, capacities, block_size, self.dtype, dev)
        self.f = torch.zeros(B, self.module.hidden_size, dtype=self.dtype, device=dev)
        nxt = torch.zeros(B, hidden.shape[1], dtype=torch.int64, device=dev)          # [B, S] the token after m
        for b, p in enumerate(prompts):
            nxt[b, :len(p) - 1] = torch.tensor(p[1:], dtype=torch.int64, device=dev)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        nxt[torch.arange(B, device=dev), lens - 1] = roots
        self.pending = []
        self._commit(torch.arange(B, device=dev), hidden, nxt, lens)

    def observe(self, rows, h_tree, tokens, accept_nodes, accept_len, bonus):
        """After a step: the pairs (h at the root and each accepted node, the token after it), committed at the next
        draft. h_tree [A, T, D], tokens [A, T], accept_nodes [A, T] (root 0, accepted nodes, -1), accept_len [A]."""
        A = tokens.shape[0]
        n = int(accept_len.max()) + 1                                              # pairs of the longest row
        idx = accept_nodes[:, :n].clamp_min(0)                                     # [A, n]
        h = h_tree.gather(1, idx[..., None].expand(A, n, h_tree.shape[-1]))        # [A, n, D]
        path = tokens.gather(1, idx)                                               # root, a_1 .. a_k, (padding)
        nxt = torch.cat([path[:, 1:], path[:, :1]], 1)
        nxt[torch.arange(A, device=nxt.device), accept_len] = bonus                # (h_{a_k}, bonus) last
        self.pending.append((rows, h, nxt, accept_len + 1))

    def _flush(self):
        """Commit the pending pairs: one step's as they are; several steps' (serial steps in between) joined per
        sequence, in order, into one chain."""
        if len(self.pending) == 1:
            self._commit(*self.pending[0])
        elif self.pending:
            per = {}                                                               # batch index -> [(h, nxt)]
            for rows, h, nxt, n in self.pending:
                for a, (b, k) in enumerate(zip(rows.tolist(), n.tolist())):
                    per.setdefault(b, []).append((h[a, :k], nxt[a, :k]))
            order = sorted(per)
            hs = [torch.cat([x for x, _ in per[b]]) for b in order]                # [n_b, D] per sequence
            ts = [torch.cat([t for _, t in per[b]]) for b in order]
            h = torch.nn.utils.rnn.pad_sequence(hs, batch_first=True)              # [A, N, D]
            nxt = torch.nn.utils.rnn.pad_sequence(ts, batch_first=True)            # [A, N]
            dev = nxt.device
            self._commit(torch.tensor(order, device=dev), h, nxt, torch.tensor([len(t) for t in ts], device=dev))
        self.pending = []

    def _commit(self, rows, h, nxt, n):
        """n [A] pairs per row, (h [A, N, D], nxt [A, N]), as one causal chain after the row's cache; then
        f[rows] = the module's output at each row's last pair."""
        A, N = nxt.shape
        dev = nxt.device
        x, a = self.module.step_inputs(self.embed, h.to(self.dtype), nxt)          # [A, N, D], [A, N, 2D] or None
        idx = torch.arange(N, device=dev)
        real = idx[None, :] < n[:, None]                                           # [A, N]
        causal = torch.tril(torch.ones(N, N, dtype=torch.bool, device=dev))
        mask = (causal[None] & real[:, None, :] & real[:, :, None]) | torch.eye(N, dtype=torch.bool, device=dev)
        g, k_new, v_new = self.engine.forward_tree(None, self.cache.cache_lens[rows].long()[:, None] + idx, mask,
                                                   self.cache, rows, self.ops, check_values=False, exact=False,
                                                   embeds=x, attn_in=a)
        self.ops.kv_append(self.cache.k, self.cache.v, self.cache.block_table[rows], self.cache.cache_lens[rows],
                           k_new, v_new, torch.where(real, idx, -1), n - 1, check_values=False)
        self.cache.cache_lens[rows] += n.to(torch.int32)
        self.f[rows] = g[torch.arange(A, device=dev), n - 1]

    def _score(self, x, k):
        """x [n, D] -> (token ids [n, k], log-probabilities over the draft vocabulary [n, k]): L x, top-k."""
        if self.bf16 or callable(self.lm):  # L x in the draft dtype (prepacked on a CPU); plain top-k: a draft needs
            #                                     no tie rule, only speed
            logits = (self.lm(x.to(self.dtype)) if callable(self.lm) else x.to(self.dtype) @ self.lm.T).float()
            top, rows = logits.topk(k, dim=-1)                                      # [n, k]
            logp = top - torch.logsumexp(logits, -1, keepdim=True)
            return (rows if self.token_map is None else self.token_map[rows]), logp
        else:
            ids, logp = self.ops.fused_draft(x.contiguous(), None, None, self.lm, k, token_map=self.token_map,
                                             check_values=False)
        return ids[:, 0], logp[:, 0].float()

    # ---- the dynamic tree ----------------------------------------------------------------------------
    def draft_dynamic(self, rows, roots, depths):
        """-> (tree [T nodes], tokens [A, T], path_prob [A, T], parents [T] or [A, T]) for the rows `rows`.
        depths: each row's depth limit (the runtime policy's; 0: a serial step for that row)."""
        A, dev, K = len(rows), roots.device, self.top_k
        depth = min(self.depth, max(depths))
        if depth == 0:                                                             # a serial step: commit later
            tree = self._tree(())
            return tree, roots[:, None].clone(), torch.ones(A, 1, device=dev), tree.parents
        self._flush()
        ids, lp = self._score(self.module.head_input(self.f[rows]), K)             # [A, K] depth 1
        tok, logp, parent = [ids], [lp], [torch.full((A, K), -1, device=dev)]      # per candidate
        rank, level = [torch.arange(K, device=dev)], [torch.ones(K, dtype=torch.int64, device=dev)]
        fw_x, fw_a, fw_par, fw_depth = [], [], [], []   # nodes run through the module: inputs, parent slot, depth
        slot = torch.full((A, K), -1, dtype=torch.int64, device=dev)               # candidate -> its fw slot
        start, width, n_fw = 0, K, 0
        L = self.cache.cache_lens[rows].long()
        for d in range(1, depth):
            b = min(self.beam, width)
            cand_lp = torch.cat(logp, 1)
            top = cand_lp[:, start:start + width].topk(b, dim=1).indices + start   # [A, b] the depth-d beam
            par = torch.cat(parent, 1).gather(1, top)                              # [A, b] their parents
            par_slot = torch.where(par >= 0, slot.gather(1, par.clamp_min(0)), -1)
            if d == 1:
                f_par = self.f[rows][:, None, :].expand(A, b, -1)
            else:
                f_par = g.gather(1, par_slot.clamp_min(0)[..., None].expand(A, b, g.shape[-1]))
            x, a = self.module.step_inputs(self.embed, f_par, torch.cat(tok, 1).gather(1, top), own=True)
            fw_x.append(x)
            fw_a.append(a)
            fw_par.append(par_slot)
            fw_depth += [d] * b
            slot = torch.cat([slot, torch.full((A, b * K), -1, dtype=torch.int64, device=dev)], 1)
            slot.scatter_(1, top, torch.arange(n_fw, n_fw + b, device=dev).expand(A, b))
            n_fw += b
            fpar = torch.cat(fw_par, 1)                                            # [A, F]
            mask = torch.eye(n_fw, dtype=torch.bool, device=dev).repeat(A, 1, 1)    # [A, F, F] self + ancestors
            anc = fpar
            for _ in range(d - 1):
                mask.scatter_(2, anc.clamp_min(0)[..., None], (anc >= 0)[..., None] | mask.gather(
                    2, anc.clamp_min(0)[..., None]))
                anc = torch.where(anc >= 0, fpar.gather(1, anc.clamp_min(0)), -1)
            pos = L[:, None] + torch.tensor(fw_depth, device=dev)[None, :] - 1     # index m = L + d - 1
            g, _, _ = self.engine.forward_tree(None, pos, mask, self.cache, rows, self.ops, check_values=False,
                                               exact=False, embeds=torch.cat(fw_x, 1),
                                               attn_in=None if a is None else torch.cat(fw_a, 1))   # [A, F, D]
            ids, lp = self._score(self.module.head_input(g[:, n_fw - b:]).reshape(A * b, -1), K)   # [A * b, K]
            tok.append(ids.view(A, b * K))
            logp.append((cand_lp.gather(1, top)[:, :, None] + lp.view(A, b, K)).view(A, b * K))
            parent.append(top[:, :, None].expand(A, b, K).reshape(A, b * K))
            rank.append(torch.arange(K, device=dev).repeat(b))
            level.append(torch.full((b * K,), d + 1, dtype=torch.int64, device=dev))
            start, width = start + width, b * K
        return self._select(roots, torch.cat(tok, 1), torch.cat(logp, 1), torch.cat(parent, 1), torch.cat(rank),
                            torch.cat(level), depths)

    def _select(self, roots, tok, logp, parent, rank, level, depths):
        """Keep each row's nodes - 1 most probable candidates (ties: the earlier, i.e. shallower, first), within its
        depth limit; build the union Tree of their rank paths."""
        A, C = tok.shape
        limit = torch.tensor(depths, device=tok.device)
        logp = torch.where(level[None, :] <= limit[:, None], logp, float("-inf"))
        n = min(self.nodes - 1, C)
        keep = torch.sort(logp, dim=1, descending=True, stable=True).indices[:, :n]  # [A, n]
        ok = logp.gather(1, keep) > float("-inf")
        host_par, host_rank = parent.tolist(), rank.tolist()
        paths, mine = set(), []
        for a, (row, good) in enumerate(zip(keep.tolist(), ok.tolist())):
            own = {}
            for c, g in zip(row, good):
                if g:
                    p, q = [], c
                    while q >= 0:
                        p.append(host_rank[q])
                        q = host_par[a][q]
                    own[tuple(reversed(p))] = c
            paths |= own.keys()
            mine.append(own)
        tree = self._tree(tuple(sorted(paths, key=lambda p: (len(p), p))))
        T = tree.size
        node = {p: i for i, p in enumerate(tree.paths)}
        cand = [[-1] * T for _ in range(A)]                                        # row a's candidate at each node
        for a, own in enumerate(mine):
            for p, c in own.items():
                cand[a][node[p]] = c
        cand = torch.tensor(cand, dtype=torch.int64, device=tok.device)
        on = cand >= 0
        on[:, 0] = True
        tokens = torch.where(on, tok.gather(1, cand.clamp_min(0)), roots[:, None])
        tokens[:, 0] = roots
        path_prob = torch.where(on, logp.gather(1, cand.clamp_min(0)).exp(), 0.0)
        path_prob[:, 0] = 1.0
        parents = tree.parents if bool(on.all()) else torch.where(on, tree.parents[None, :], -1)
        return tree, tokens, path_prob, parents

    def _tree(self, paths):
        """The Tree of these rank paths (cached; at most 4096 kept)."""
        t = self._tree_cache.get(paths)
        if t is None:
            if len(self._tree_cache) >= 4096:
                self._tree_cache.clear()
            dev = self.f.device if self.f is not None else "cpu"
            t = self._tree_cache[paths] = Tree.from_choices(list(paths)).to(dev)
        return t
