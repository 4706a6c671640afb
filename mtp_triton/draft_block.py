"""What the MTP module (mtp_module.py) and EAGLE-3's drafter (eagle3.py) share: `DraftBlock`, one decoder block of
the target's family that drafts recurrently — its dynamic tree's settings, RoPE, the unrolled forward of training
(EAGLE-3's training-time test) and the one-layer engine that decodes it over a paged cache."""
import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .model import LlamaEngine, apply_rope, rope_inv_freq, rope_tables

# the dynamic tree's defaults (EAGLE-2): depth, candidates per expanded node, nodes expanded per depth, nodes kept
DRAFT_DEFAULTS = dict(depth=6, top_k=8, beam=4, nodes=32)


class DraftBlock(nn.Module):
    """What the MTP module and EAGLE-3's drafter (eagle3.py) share: one block of the target's family (`self.block`),
    the dynamic tree's settings, RoPE, the engine that decodes the block over a paged cache, and the unrolled forward
    of training. A subclass defines its inputs and outputs:
        step_inputs(embed, h, tokens, own) -> (x, a)   the block's residual input [..., D] and what its q, k, v are
                                                        projected from (None: RMSNorm(x)); h is the target's (own
                                                        False) or the block's own recurrent state (own True)
        recurrent             a module, y -> r: the state a deeper node reads, from the block's output y (the
                              engine's final norm)
        head_input(r) -> z    what the LM-head rows (`lm_rows`) score
        taps                  the target layers whose residual streams make h: () the final hidden state; None
                              EAGLE-3's default three (`eagle3.default_taps`)
    """
    taps = ()

    def _setup(self, cfg, draft):
        last = None if cfg.layer_types is None else (cfg.layer_types[-1],)
        self.config = dataclasses.replace(cfg, num_hidden_layers=1, layer_types=last)
        if draft is not None and not isinstance(draft, dict):
            raise ValueError(f"draft must be an object of dynamic-tree settings ({', '.join(DRAFT_DEFAULTS)}), got "
                             f"{draft!r}")
        unknown = sorted(set(draft or {}) - set(DRAFT_DEFAULTS))
        if unknown:
            raise ValueError(f"draft: unknown settings {unknown}; the dynamic tree takes {', '.join(DRAFT_DEFAULTS)}")
        self.draft = dict(DRAFT_DEFAULTS, **(draft or {}))
        self.meta = {}

    @property
    def hidden_size(self):
        return self.config.hidden_size

    def inv_freq(self, device):
        """RoPE's inverse frequencies in fp32 whatever the weights' dtype (not a buffer: .to(bf16) would round them)."""
        return rope_inv_freq(self.config).to(device)

    def with_draft(self, **settings):
        """The same module (weights shared, not copied) with other dynamic-tree settings (depth, top_k, beam, nodes):
        e.g. with_draft(depth=4, top_k=1, beam=1, nodes=5) drafts a chain of 4, MTP-4."""
        if not set(settings) <= set(DRAFT_DEFAULTS):
            raise ValueError(f"with_draft: unknown settings {sorted(set(settings) - set(DRAFT_DEFAULTS))}; "
                             f"use {sorted(DRAFT_DEFAULTS)}")
        other = copy.copy(self)
        other.draft = dict(self.draft, **settings)
        return other

    # ---- training: the unrolled, differentiable forward -------------------------------------------------
    def unroll(self, embed, h, nxt, steps):
        """r^(k) [B, S, D] (`recurrent`) for k = 0 .. steps-1 (module docstring). h [B, S, D_h] what the target gives
        at m (`step_inputs`); nxt [B, S] the token at m + 1. r^(k)_m predicts the token at m + 2 and is scored where
        m >= k: step k at m reads r^(k-1)_{m-1} and x_{m+1} and attends to step 0's keys at m' <= m - k and to step j's
        key at m - (k - j), 1 <= j <= k (a tree node at depth k: the committed cache, then its ancestors)."""
        cfg, blk = self.config, self.block
        B, S, _ = h.shape
        Hq, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        m = torch.arange(S, device=h.device)
        cos, sin = (t[None, :, None, :] for t in rope_tables(m, self.inv_freq(h.device)))   # [1, S, 1, Dh] fp32
        window = cfg.window(0)
        ks, vs, outs, u = [], [], [], h
        for k in range(steps):
            x, a = self.step_inputs(embed, u, nxt, own=k > 0)
            a = blk.input_layernorm(x) if a is None else a
            q = blk.q_proj(a).view(B, S, Hq, Dh)
            kk, v = blk.k_proj(a).view(B, S, Hkv, Dh), blk.v_proj(a).view(B, S, Hkv, Dh)
            if cfg.qk_norm:
                q, kk = blk.q_norm(q), blk.k_norm(kk)
            q, kk = (apply_rope(t, cos.to(t.dtype), sin.to(t.dtype)) for t in (q, kk))
            ks.append(kk)
            vs.append(v)
            seen = m[None, :] <= m[:, None] - k                                     # step 0: the committed context
            if window is not None:
                seen &= m[:, None] - m[None, :] < window
            mask = torch.cat([seen] + [m[None, :] == m[:, None] - (k - j) for j in range(1, k + 1)], 1)  # [S, (k+1)S]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), torch.cat(ks, 1).transpose(1, 2),
                                               torch.cat(vs, 1).transpose(1, 2), attn_mask=mask, enable_gqa=True)
            x = x + blk.o_proj(o.transpose(1, 2).reshape(B, S, Hq * Dh))
            a = blk.post_attention_layernorm(x)
            r = self.recurrent(x + blk.down_proj(F.silu(blk.gate_proj(a)) * blk.up_proj(a)))
            outs.append(r)
            u = torch.cat([r[:, :1], r[:, :-1]], 1)                                 # u^(k+1)_m = r^(k)_{m-1}
        return outs

    # ---- decoding: the block as a one-layer engine over a paged cache ----------------------------------
    def engine(self, model):
        """A one-layer LlamaEngine whose layer, final norm (`recurrent`) and RoPE are this module's (shared, not
        copied): its `forward_tree(embeds=x, attn_in=a)` is the decoding step, over a paged cache of its own."""
        with torch.device("meta"):
            eng = LlamaEngine(self.config)
        w = self.fc.weight                                 # the engine's device and dtype are the module's
        eng.embed_tokens = nn.Embedding(1, 1).to(w)        # unused: embeds are passed (the target's E is shared)
        eng.lm_head = nn.Linear(1, 1, bias=False).to(w)    # unused: drafting scores lm_rows itself
        eng.layers = nn.ModuleList([self.block])
        eng.norm = self.recurrent
        eng.inv_freq = self.inv_freq(w.device)
        eng.pack_weights, eng.script_layers = model.pack_weights, model.script_layers
        return eng.eval()
