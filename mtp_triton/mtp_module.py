"""The MTP module: one decoder block that drafts from the target's hidden state and the next token.

DeepSeek-V3's multi-token-prediction module (DeepSeek-AI 2024, https://arxiv.org/abs/2412.19437, section 2.2) and
EAGLE's draft model (Li et al. 2024, https://arxiv.org/abs/2401.15077) are one machine. At index m it reads the
target's final-norm hidden state h_m and the input embedding of the token after it, x_{m+1}:

    u_m = W_fc [RMSNorm_e(E x_{m+1}); RMSNorm_h(h_m)]            W_fc [D, 2D] (vLLM's deepseek_mtp.py order)
    f_m = RMSNorm_o(Block(u)_m)                                  one decoder block of the target's own family
    p(x_{m+2} | ...) = softmax(L f_m)                            L: the target's LM head (a draft vocabulary's rows)

The block attends causally over the indices m (RoPE position m). f_m is trained towards h_{m+1}, the target's own
hidden state one position on, so the module can stand in for the target: to draft further it reads its own f and
its own drafted token (EAGLE's feature-level recurrence). E and L are the target's, frozen and shared; the module
owns W_fc, the three norms and the block (about 3 % of SmolLM2-135M).

Training unrolls that recurrence ("training-time test", EAGLE-3, https://arxiv.org/abs/2503.01840): step k of the
unroll reads, at index m, u^(k)_m from f^(k-1)_{m-1} and x_{m+1}, and attends to step 0's keys at m' <= m - k and to
step j's key at m - (k - j) for 1 <= j <= k: exactly what a tree node at depth k sees when drafting (the committed
cache, then its own ancestors). `unroll` is that differentiable forward; decoding runs the same block through the
engine's paged-cache step (`engine`, `drafters_mtp.ModuleDrafter`).

Files: a folder with module.safetensors (fc, the norms, the block's projections, token_map) and module.json
(format "mtp_triton.module/1", the block's config fields, the dynamic tree's defaults, free metadata).
"""
import copy
import dataclasses
import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save
from torch import nn

from .heads import _check_token_map
from .loading import check_finite as check_finite_tensors
from .model import Block, LlamaEngine, ModelConfig, RMSNorm, apply_rope, rope_inv_freq, rope_tables
from .files import write_bytes, write_json
from .heads import load_heads

MODULE_FILE, MODULE_META, FORMAT = "module.safetensors", "module.json", "mtp_triton.module/1"
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
    """

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
        eng.pack_weights = model.pack_weights
        return eng.eval()


class MTPModule(DraftBlock):
    """One block of the target's family over fc([enorm(E x); hnorm(h)]), an output norm, and a draft vocabulary.

    cfg: the target's ModelConfig (the block takes its widths, heads, RoPE and norms; one layer).
    token_map: the draft vocabulary [V'] (strictly increasing ids) whose LM-head rows drafting scores; None: all."""

    def __init__(self, cfg, token_map=None, draft=None):
        super().__init__()
        self._setup(cfg, draft)
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm, self.norm = RMSNorm(D, eps), RMSNorm(D, eps), RMSNorm(D, eps)
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.block = Block(self.config)
        self.token_map = None if token_map is None else _check_token_map(token_map, cfg.vocab_size)

    @classmethod
    def from_target(cls, model, token_map=None, draft=None):
        """A fresh module for `model`, in fp32 on the model's device: the block starts as the target's last layer
        with its two output projections (o, down) at zero, fc as [0 | I] and the output norm as the target's final
        norm, so the module starts as f = RMSNorm_o(hnorm(h)), close to h itself; training then moves it on."""
        m = cls(model.config, token_map, draft).to(model.device)
        D = model.config.hidden_size
        with torch.no_grad():
            m.block.load_state_dict(model.layers[-1].state_dict())
            m.block.o_proj.weight.zero_()
            m.block.down_proj.weight.zero_()
            m.fc.weight.zero_()
            m.fc.weight[:, D:] = torch.eye(D)
            m.norm.weight.copy_(model.norm.weight)
        return m.float()

    def inputs(self, embed, h, tokens):
        """u = W_fc [enorm(E x); hnorm(h)]: embed [V, D] the target's embedding, h [..., D], tokens [...] -> [..., D]."""
        e = embed[tokens].to(h.dtype)
        return self.fc(torch.cat([self.enorm(e), self.hnorm(h)], -1))

    def step_inputs(self, embed, h, tokens, own=False):
        """(u, None): the target's final-norm h and the module's own f are read alike."""
        return self.inputs(embed, h, tokens), None

    @property
    def recurrent(self):
        """f = RMSNorm_o(y): trained towards the target's final-norm hidden state, read by a deeper node as h."""
        return self.norm

    def head_input(self, f):
        return f

    def lm_rows(self, lm_weight):
        """The LM-head rows drafting scores: lm_weight[token_map] [V', D] (or all of it)."""
        return lm_weight if self.token_map is None else lm_weight[self.token_map.to(lm_weight.device)]

    # ---- files -------------------------------------------------------------------------------------------
    def save(self, path, **meta):
        """Write module.safetensors + module.json into the folder `path` (bf16 or fp32 as the weights are)."""
        os.makedirs(path, exist_ok=True)
        sd = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.token_map is not None:
            sd["token_map"] = self.token_map.cpu()
        write_bytes(os.path.join(path, MODULE_FILE), save(sd))
        fields = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(ModelConfig)}
        write_json(os.path.join(path, MODULE_META), dict(format=FORMAT, config=fields, draft=self.draft,
                                                         **{**self.meta, **meta}))


def is_module_folder(path):
    return os.path.isdir(path) and os.path.exists(os.path.join(path, MODULE_META))


def load_module(path, device=None, dtype=None, *, check_finite=True):
    """An MTPModule from a folder written by `MTPModule.save`. Bad files: a ValueError naming the file and field."""
    meta_file, file = os.path.join(path, MODULE_META), os.path.join(path, MODULE_FILE)
    for f in (meta_file, file):
        if not os.path.exists(f):
            raise ValueError(f"load_module: {f} does not exist (an MTP module folder holds {MODULE_FILE} and "
                             f"{MODULE_META})")
    try:
        meta = json.load(open(meta_file))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"load_module: {meta_file} is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("config"), dict):
        raise ValueError(f"load_module: {meta_file} must have format {FORMAT!r} and a config object")
    try:
        cfg = ModelConfig(**meta["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"load_module: {meta_file}: config: {e}") from None
    try:
        sd = load_file(file)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for torn files
        raise ValueError(f"load_module: {file} is not a readable safetensors file: {e}") from None
    odd = sorted(k for k, v in sd.items() if (k == "token_map") == v.is_floating_point())
    if odd:
        raise ValueError(f"load_module: {file}: tensors {odd[:5]} have the wrong dtype (weights are floating point, "
                         "token_map holds integer ids)")
    if check_finite:
        check_finite_tensors(sd, file)
    token_map = sd.pop("token_map", None)
    try:
        m = MTPModule(cfg, token_map, meta.get("draft"))
    except ValueError as e:
        where = file if str(e).startswith("token_map") else meta_file
        raise ValueError(f"load_module: {where}: {e}") from None
    expected = m.state_dict()
    bad = sorted(k for k in set(sd) | set(expected) if k not in sd or k not in expected
                 or sd[k].shape != expected[k].shape)
    if bad:
        raise ValueError(f"load_module: {file} does not match {meta_file}'s config: missing, unexpected or "
                         f"mis-shaped tensors {bad[:5]}")
    m = m.to(sd["fc.weight"].dtype)                  # the file's dtype first: loading into fp32 would round fp64
    m.load_state_dict(sd)
    m.meta = {k: v for k, v in meta.items() if k not in ("format", "config", "draft")}
    return m.to(device=device, dtype=dtype or sd["fc.weight"].dtype).eval()


def load_drafter(path, device=None, dtype=None):
    """The drafter saved at `path`: an MTP module folder (module.json) -> `load_module`, an EAGLE-3 drafter folder
    (config.json naming LlamaForCausalLMEagle3) -> `eagle3.load_eagle3`, anything else -> MTP heads
    (`heads.load_heads`: our heads folder or a Medusa checkpoint). Any of them goes to generate(drafter=...)."""
    from .eagle3 import is_eagle3_folder, load_eagle3      # eagle3 builds on this module's DraftBlock
    if is_module_folder(path):
        return load_module(path, device, dtype)
    if is_eagle3_folder(path):
        return load_eagle3(path, device, dtype)
    if os.path.exists(os.path.join(path, MODULE_FILE)):
        raise ValueError(f"load_drafter: {path} holds {MODULE_FILE} but no {MODULE_META}: an MTP module folder "
                         f"needs both (MTPModule.save writes them)")
    return load_heads(path, device, dtype)
