"""Drafters: what proposes the candidate tokens of a step.
`propose(hidden, top_k, context, num_heads=None, roots=None) -> ids [A, num_heads, K]` (the first num_heads heads; all
if None; roots [A]: the step's root tokens, read by heads with root input).

`HeadsDrafter` runs MTP heads through `fused_draft` (all heads and their top-k in one call). `OracleDrafter` is a
clearly labelled SYNTHETIC drafter for measuring the runtime apart from head quality: it knows each sequence's true
continuation (from a serial run of the same model) and proposes it at a chosen per-depth acceptance profile: head h's
rank-0 candidate is the true token with probability profile[h] (independently per step), otherwise a wrong one;
lower ranks are random wrong tokens, except that when rank 0 is wrong the true token sits at rank 1 with
probability profile[h] too (so bushy trees have something to find). Verification is still real: the output is the
model's own, whatever is proposed — only the speed depends on the profile.
"""
import torch


class HeadsDrafter:
    """MTP heads on the target's hidden state: head h's top-k candidates for the token h + 2 positions ahead."""
    synthetic = False

    def __init__(self, heads, model, ops):
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
        # heads with root input read x' = x + P e_root (heads.py); the kernel is handed x'
        self.root_proj = None if heads.root_proj is None else heads.root_proj.detach().to(dev, dt).contiguous()
        self.embed = model.embed_tokens.weight

    def propose(self, hidden, top_k, context=None, num_heads=None, roots=None):
        """Candidates of the first `num_heads` heads (all by default): ids [A, num_heads, top_k]."""
        H = num_heads or self.num_heads
        lm = self.lm_head[:H] if self.lm_head.dim() == 3 else self.lm_head          # per-head LM heads: theirs
        if self.root_proj is not None:
            if roots is None:
                raise ValueError("HeadsDrafter: these heads read the root token; pass roots [A]")
            hidden = hidden + self.embed[roots] @ self.root_proj.T                  # x' = x + P e_root   [A, D]
        ids, _ = self.fused_draft(hidden.contiguous(), self.res_weight[:H], self.res_bias[:H], lm, top_k,
                                  token_map=self.token_map)
        return ids


class OracleDrafter:
    synthetic = True

    def __init__(self, true_tokens, profile, vocab_size, seed=0):
        self.true = [list(t) for t in true_tokens]
        self.profile = [float(p) for p in profile]
        if not all(0.0 <= p <= 1.0 for p in self.profile):
            raise ValueError("OracleDrafter: profile entries must be probabilities")
        self.num_heads = len(self.profile)
        self.vocab_size = vocab_size
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, hidden, top_k, context, num_heads=None, roots=None):
        """context = (batch indices of the rows, tokens each has emitted so far; the last is the root)."""
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
