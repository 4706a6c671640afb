"""A clearly labelled SYNTHETIC drafter, for measuring the runtime apart from head quality.

`OracleDrafter` knows each sequence's true continuation (from a serial run of the same model) and
proposes it at a chosen per-depth acceptance profile: head h's rank-0 candidate is the true token
with probability profile[h] (independently per step), otherwise a wrong one; lower ranks are random
wrong tokens, except that when rank 0 is wrong the true token sits at rank 1 with probability
profile[h] too (so bushy trees have something to find). Verification is still real: the output is the
model's own, whatever is proposed — only the speed depends on the profile.
"""
import torch


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

    def propose(self, seq_ids, emitted, top_k):
        """seq_ids: batch rows; emitted: tokens emitted so far per row (last = root). -> ids [A, H, top_k]."""
        A, H, V = len(seq_ids), self.num_heads, self.vocab_size
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
        return ids
