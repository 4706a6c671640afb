"""A compact Llama-family decoder with a paged KV cache and a tree step.

Architecture (Llama 1/2/3, Mistral, Qwen2/2.5, Qwen3): token embedding → L × [RMSNorm → attention with RoPE
(GQA: Hq query heads share Hkv key/value heads) → residual → RMSNorm → SwiGLU MLP → residual] →
final RMSNorm → LM head (tied or untied). The families differ in three switches of `ModelConfig`:
    qkv_bias        bias on the q, k and v projections, not on o                          (Qwen2 / Qwen2.5)
    qk_norm         RMSNorm over head_dim on every q and k head, before RoPE                (Qwen3)
    sliding_window  a node at position p sees key position j only if p - j < window        (Mistral; Qwen with
                    use_sliding_window, on the layers `layer_types` marks "sliding_attention")
Numerics mirror `transformers` (RMSNorm in fp32, RoPE cos/sin from fp32 inverse frequencies) so that an
fp64 run is token-identical to its `generate`. Reading checkpoints (config.json, safetensors, GGUF) is in
`mtp_triton.loading`.

KV cache: paged, k/v [L, NB, BS, Hkv, Dh]; sequence b's token at position p lives in block
block_table[b, p // BS], slot p % BS. A step runs T tree nodes (the root + drafts) through every
layer: each node attends to the whole cache plus its ancestors (`tree_attention`), and its K/V go to
per-step tree buffers k_tree/v_tree [L, B, T, Hkv, Dh]; `kv_append` later copies the accepted ones.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import invariant
from .config import ROPE_TYPES, ModelConfig  # noqa: F401  (ModelConfig: public here too)
from .kernels.tree_attention_ref import Keys, Plan, attention, check_tree_values, plain_attention, plain_plan, plan
from .packed import packed_layers

def rope_inv_freq(cfg):
    """Inverse frequencies [Dh / 2] (fp32, as transformers computes them) incl. Llama-3 / linear scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = cfg.rope_scaling.get("rope_type", "default") if cfg.rope_scaling else "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / cfg.rope_scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
        s = cfg.rope_scaling
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / hi) & ~(wavelen > old_ctx / lo)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {kind!r} (supported: {', '.join(ROPE_TYPES)})")


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x, w, eps: float):
    """x [..., D] -> w * (x / sqrt(mean(x^2) + eps)), as transformers computes it: normalised in fp32, cast back to
    x's dtype, then scaled (typed for TorchScript: mtp_triton/scripted.py calls it too)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


def rope_tables(positions, inv_freq):
    """positions [...] -> cos, sin [..., Dh] in fp32 (as transformers computes them), with rotate_half's sign in sin:
    for angles a = positions * inv_freq [..., Dh/2], cos = [cos a; cos a] and sin = [-sin a; sin a]."""
    freqs = positions.float()[..., None] * inv_freq.float()                 # [..., Dh/2]
    emb = torch.cat((freqs, freqs), -1)                                     # as HF: cos and sin of the [..., Dh] row
    sin = emb.sin()
    sin[..., :freqs.shape[-1]].neg_()
    return emb.cos(), sin


def apply_rope(x, cos, sin):
    """x [..., Dh] -> x cos + rotate_half(x) sin_hf, transformers' RoPE to the bit, with rotate_half(x) = [-x2; x1]
    and sin_hf = [sin a; sin a]: here roll(x, Dh/2) = [x2; x1] times `rope_tables`' signed sin, and (-u) v rounds
    as u (-v). Four element-wise calls, for a layer's q, k and v heads together (`LlamaEngine.rope`)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, Dh, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(D, Hq * Dh, bias=qkv_bias)
        self.k_proj = nn.Linear(D, Hkv * Dh, bias=qkv_bias)
        self.v_proj = nn.Linear(D, Hkv * Dh, bias=qkv_bias)
        self.o_proj = nn.Linear(Hq * Dh, D, bias=cfg.attention_bias)
        if cfg.qk_norm:                                  # Qwen3: one RMSNorm over head_dim, shared by the heads
            self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(D, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(D, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, D, bias=cfg.mlp_bias)


def _plain(layer, x):
    """layer(x): the plain path's linear layers and norms (the exact path's are `invariant.linear`, `rowwise`)."""
    return layer(x)


@dataclass
class Paged:
    """Attention through the ops' `tree_attention` over the paged cache (the Triton kinds: the kernels plan their own
    launch). exact: its batch-invariant variant (exact=True), and linear layers through `invariant.linear`."""
    ops: object
    block_table: torch.Tensor       # [B, max_blocks] int32
    cache_lens: torch.Tensor        # [B] int32
    tree_mask: torch.Tensor         # [T, T] or [B, T, T] bool
    window: int | None              # this layer's sliding window
    exact: bool = False


def layer(x, cos, sin, blk, packed, k_cache, v_cache, attend, a=None):
    """One decoder layer over T nodes per sequence: x [B, T, D] -> (x [B, T, D], k, v [B, T, Hkv, Dh]: the nodes' K/V,
    which `forward_tree` stacks into the step's tree buffers). The body of `forward_tree`; the "compiled" kind of ops
    runs this same function through `torch.compile` (mtp_triton/compiled.py), and the twins run a plain step on packed
    weights from TorchScript (`scripted.layer`: the same calls, bar fp32's fused residual adds; bit for bit the same).

    cos, sin [B, T, Hq + 2 Hkv, Dh] (`LlamaEngine.rope`); blk: the layer's Block (norms; its nn.Linear layers when
    packed is None); packed: its (qkv, o, gate_up, down) packed linears, or None; k_cache, v_cache [NB, BS, Hkv, Dh]:
    this layer's cache.
    attend: how the layer attends, laid out once per step by `forward_tree` for all layers: a `Keys` (the plain twin,
    `plain_attention`), a `Plan` (the exact twin, `attention`, with linear layers and norms through `invariant`, whose
    rows round alike in every call) or a `Paged` (the ops' `tree_attention`: the Triton kernels).
    a [B, T, D_a]: what q, k and v are projected from instead of RMSNorm(x) (EAGLE-3's block, eagle3.py, attends
    from [RMSNorm(E x); RMSNorm(u)], D_a = 2D, with x = u as its residual).
        h = RMSNorm(x);  q, k, v = h Wq, h Wk, h Wv;  q, k = RoPE(q), RoPE(k);  x = x + Attn(q, K, V) Wo
        h = RMSNorm(x);  x = x + (silu(h Wg) * h Wu) Wd
    """
    B, T, _ = x.shape
    Hkv, Dh = k_cache.shape[-2:]
    Hq = blk.q_proj.out_features // Dh
    exact = isinstance(attend, Plan) or (isinstance(attend, Paged) and attend.exact)
    lin = invariant.linear if exact else _plain
    norm = invariant.rowwise if exact else _plain                         # a GPU's reductions: see invariant.py
    h = norm(blk.input_layernorm, x) if a is None else a
    if packed:
        qkv = lin(packed[0], h)
    else:
        qkv = torch.cat([lin(blk.q_proj, h), lin(blk.k_proj, h), lin(blk.v_proj, h)], -1)
    qkv = qkv.reshape(B, T, Hq + 2 * Hkv, Dh)
    if hasattr(blk, "q_norm"):                                             # Qwen3: per head, over Dh
        qkv = torch.cat([norm(blk.q_norm, qkv[:, :, :Hq]), norm(blk.k_norm, qkv[:, :, Hq:Hq + Hkv]),
                         qkv[:, :, Hq + Hkv:]], 2)
    q, k, v = apply_rope(qkv, cos, sin).split([Hq, Hkv, Hkv], 2)          # v's heads turn by angle 0 (`rope`)
    if isinstance(attend, Keys):                                           # the engine's caches: finite
        o = plain_attention(q, k_cache, v_cache, k, v, attend, finite=True)
    elif isinstance(attend, Plan):
        o = attention(q.contiguous(), k_cache, v_cache, k, v, attend, finite=True)
    else:                                                                  # the kernels read contiguous tensors
        k, v = k.contiguous(), v.contiguous()
        o = attend.ops.tree_attention(q.contiguous(), k_cache, v_cache, attend.block_table, attend.cache_lens, k, v,
                                      attend.tree_mask, window=attend.window, check_values=False,
                                      exact=attend.exact)                  # [B, T, Hq, Dh]
    x = x + lin(packed[1] if packed else blk.o_proj, o.reshape(B, T, Hq * Dh))
    h = norm(blk.post_attention_layernorm, x)
    if packed:
        g, u = lin(packed[2], h).chunk(2, -1)
    else:
        g, u = lin(blk.gate_proj, h), lin(blk.up_proj, h)
    return x + lin(packed[3] if packed else blk.down_proj, F.silu(g) * u), k, v


class PagedKVCache:
    """k, v [L, NB, BS, Hkv, Dh]; block_table [B, max_blocks] int32; cache_lens [B] int32.

    Each sequence gets ceil(capacity_b / BS) blocks of its own from one pool (a real allocator would hand
    them out on demand; allocating up front keeps the decode loop free of host work). Row b lists them,
    then -1 (no block) up to the longest row: block 0 belongs to sequence 0, so padding with 0 would let a
    write past a shorter sequence's end land in it; a -1 in use is refused by the kernels' value checks.
    """

    def __init__(self, cfg, capacities, block_size=16, dtype=torch.float32, device="cpu"):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        nblocks = [math.ceil(c / block_size) for c in capacities]
        NB, max_blocks = sum(nblocks), max(nblocks)
        shape = (cfg.num_hidden_layers, NB, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_table = torch.full((len(capacities), max_blocks), -1, dtype=torch.int32, device=device)
        start = 0
        for b, n in enumerate(nblocks):
            self.block_table[b, :n] = torch.arange(start, start + n, dtype=torch.int32, device=device)
            start += n
        self.cache_lens = torch.zeros(len(capacities), dtype=torch.int32, device=device)
        self.block_size = block_size

    def nbytes(self):
        return self.k.numel() * self.k.element_size() * 2


class LlamaEngine(nn.Module):
    """The decoder. `forward_tree` is the only forward: prefill is a causal chain with an empty cache."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.pack_weights = True     # bf16/fp32 on a CPU: matmuls on prepacked weights (mtp_triton/packed.py)
        self.script_layers = True    # a plain step on packed weights runs its layers from TorchScript (scripted.py)

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def new_cache(self, capacities, block_size=16):
        return PagedKVCache(self.config, capacities, block_size, self.dtype, self.device)

    def rope(self, positions):
        """positions [B, T] -> cos, sin [B, T, Hq + 2 Hkv, Dh] in the model dtype, a layer's whole q, k, v row: for
        the q and k heads `rope_tables` (fp32 like HF, signed sin), for the v heads cos 1 and sin 0, so that one
        `apply_rope` over the row (then one split) leaves v as it is: v 1 + roll(v) 0 = v for finite v (a zero's
        sign aside), and q, k turn as they would alone. The tables are that wide, not broadcast over the heads: a
        long prefill holds two of them, each the size of its q, k, v rows."""
        cfg = self.config
        B, T = positions.shape
        Hqk, Hkv = cfg.num_attention_heads + cfg.num_key_value_heads, cfg.num_key_value_heads
        cos, sin = rope_tables(positions[:, :, None], self.inv_freq)                  # [B, T, 1, Dh] fp32
        v_heads = (B, T, Hkv, cos.shape[-1])                                           # angle 0
        return [torch.cat([t.expand(B, T, Hqk, -1), fill(v_heads)], 2).to(self.dtype)
                for t, fill in ((cos, cos.new_ones), (sin, sin.new_zeros))]

    def exact_mode(self, ops):
        """Does this model decode batch-invariantly with `ops` (mtp_triton/invariant.py)? `ops.numerics` decides."""
        return ops.numerics(self.device, self.dtype).exact

    @torch.no_grad()
    def forward_tree(self, tokens, positions, tree_mask, cache, rows, ops, check_values=True, exact=None, embeds=None,
                     attn_in=None, taps=None):
        """Run T nodes per sequence through all layers.

        tokens, positions [B, T] int64; tree_mask [T, T] or [B, T, T] bool; rows [B] int64: which cache
        sequences these are. Returns the final-norm hidden states [B, T, D] and the new K/V as tree buffers
        k_tree, v_tree [L, B, T, Hkv, Dh] (not yet in the cache: `kv_append` copies the accepted ones).
        The value checks of the mask and block table (`check_tree_values`, host syncs on a GPU) run once per call, not
        at all with check_values=False; the attention's layout is planned once per call too (`_attend`).
        Layers with a sliding window pass it to the attention (window=): it derives each node's
        position from cache_lens and its depth in tree_mask, which is how `positions` are built.
        exact: `tree_attention(..., exact=True)` and `invariant.linear` (None: `exact_mode(ops)`; prefill
        passes False: it is the same call for serial and MTP decoding, so it needs no invariance).
        embeds [B, T, D]: the first layer's input instead of embed_tokens(tokens) (tokens may then be None): the MTP
        module (mtp_module.py) runs its block this way, on fc([enorm(E x); hnorm(h)]). attn_in [B, T, D_a]: what the
        first layer's q, k, v are projected from (`layer`'s a; EAGLE-3's block, eagle3.py).
        taps: layer ids j (0 <= j <= L): also return the residual stream entering layer j (j = L: after the last
        layer, before the final norm), concatenated: (h, k_tree, v_tree, feats [B, T, len(taps) D]). EAGLE-3's
        drafter reads layers (2, L // 2, L - 3) this way (vLLM's eagle_aux_hidden_state_layer_ids).
        """
        cfg = self.config
        B, T = positions.shape
        exact = self.exact_mode(ops) if exact is None else exact
        run = getattr(ops, "layer", layer) if exact else layer       # the compiled kind's `layer` (compiled.py)
        if run is not layer and B > 1:
            # compiled: one sequence at a time, so that a batch rounds exactly as each of its sequences alone
            # (a graph for B > 1 may vectorise and split its loops otherwise than the B = 1 graph)
            one = [self.forward_tree(None if tokens is None else tokens[b:b + 1], positions[b:b + 1],
                                     tree_mask[b] if tree_mask.dim() == 3 else tree_mask, cache, rows[b:b + 1], ops,
                                     check_values, exact,
                                     *(None if t is None else t[b:b + 1] for t in (embeds, attn_in)), taps)
                   for b in range(B)]
            return tuple(torch.cat(parts, 1 if i in (1, 2) else 0) for i, parts in enumerate(zip(*one)))
        block_table, cache_lens = cache.block_table[rows], cache.cache_lens[rows]
        if check_values:                                 # once per step: every layer reads the same layout
            check_tree_values(block_table, cache_lens, tree_mask.expand(B, T, T), cache.k.shape[1], cache.block_size)
        cos, sin = self.rope(positions)
        x = self.embed_tokens(tokens) if embeds is None else embeds            # [B, T, D]
        packed = packed_layers(self)                # None: the nn.Linear layers (bf16: the same bits, slower)
        if not exact and packed and self.script_layers and hasattr(ops, "plain_layer"):
            run = ops.plain_layer                   # the twins' `layer` from TorchScript (scripted.py): Keys plans
        attends, ks, vs = {}, [], []                # the step's layout, once per sliding window; the nodes' K/V
        tapped = {}                                 # layer id -> the residual stream entering it
        for l, (blk, kc, vc) in enumerate(zip(self.layers, cache.k.unbind(0), cache.v.unbind(0))):
            if taps and l in taps:
                tapped[l] = x
            w = cfg.window(l)
            if w not in attends:
                attends[w] = self._attend(ops, exact, block_table, cache_lens, tree_mask, cache, w)
            x, k, v = run(x, cos, sin, blk, packed.layer(l) if packed else None, kc, vc, attends[w],
                          *(() if l or attn_in is None else (attn_in,)))
            ks.append(k)
            vs.append(v)
        k_tree, v_tree = torch.stack(ks), torch.stack(vs)                    # [L, B, T, Hkv, Dh]
        h = (invariant.rowwise if exact else _plain)(self.norm, x)
        if not taps:
            return h, k_tree, v_tree
        tapped[len(self.layers)] = x
        return h, k_tree, v_tree, torch.cat([tapped[j] for j in taps], -1)

    def _attend(self, ops, exact, block_table, cache_lens, tree_mask, cache, window):
        """How every layer of a step with this window attends (`layer`'s attend): the twins' layout planned here, once
        (`plain_plan` / the exact `plan`, min_chunks 2 for the compiled kind: see plan()), or the Triton kernels'
        `Paged` call, which plans its own launch."""
        if ops.kind not in ("torch", "compiled"):
            return Paged(ops, block_table, cache_lens, tree_mask, window, exact)
        if exact:
            return plan(block_table, cache_lens, tree_mask, cache.block_size, window,
                        min_chunks=2 if ops.kind == "compiled" else 1)
        return plain_plan(block_table, cache_lens, tree_mask, cache.k.shape[1], cache.block_size, window,
                          torch.promote_types(self.dtype, torch.float32))

    def logits(self, hidden, exact=False):
        """hidden [..., D] -> logits [..., V]. On a CPU, and with exact=True (`exact_mode`) on a GPU, the rows go
        through `invariant.linear` (CPU: a row alone only where it rounds as among others, never more than
        invariant.MATMUL_ROWS at once; GPU: always MATMUL_ROWS rows), so a serial step rounds like a tree step."""
        packed = packed_layers(self)
        head = packed.lm_head if packed else self.lm_head
        return invariant.linear(head, hidden) if exact or self.device.type == "cpu" else head(hidden)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, cfg, sd, device=None, dtype=None, source="checkpoint"):
        """From a Hugging Face-style state dict (`model.layers.0.self_attn.q_proj.weight`, ...)."""
        sd = {k[len("model."):] if k.startswith("model.") else k: v for k, v in sd.items()}
        sd = {k.replace("self_attn.", "").replace("mlp.", ""): v for k, v in sd.items()}
        for k in [k for k in sd if k.endswith("rotary_emb.inv_freq")]:
            sd.pop(k)
        if cfg.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        elif "lm_head.weight" not in sd:
            raise ValueError(f"{source}: no lm_head.weight and tie_word_embeddings is false")
        if "embed_tokens.weight" not in sd:
            raise ValueError(f"{source}: no model.embed_tokens.weight (is this a {cfg.model_type} checkpoint?)")
        if dtype is None:
            dtype = sd["embed_tokens.weight"].dtype
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device=device or "cpu")
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        expected = model.state_dict()
        bad_keys = {k for k, v in sd.items() if k in expected and v.shape != expected[k].shape}
        bad = [f"{k} {tuple(sd[k].shape)} (config: {tuple(expected[k].shape)})" for k in sorted(bad_keys)]
        missing, unexpected = model.load_state_dict({k: v for k, v in sd.items() if k not in bad_keys}, strict=False)
        missing = [m for m in missing if m not in bad_keys]
        missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected or bad:
            raise ValueError(f"{source} does not match its {cfg.model_type} config: " + "; ".join(
                f"{what} {names[:5]}" + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
                for what, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", bad))
                if names))
        model.inv_freq = rope_inv_freq(cfg).to(model.device)
        return model.to(dtype).eval()

    @classmethod
    def from_hf(cls, hf_model, device=None, dtype=None):
        """From a `transformers` *ForCausalLM object of a supported family (same weights, same numerics)."""
        cfg = ModelConfig.from_hf(hf_model.config.to_dict(), source=type(hf_model).__name__)
        p = next(hf_model.parameters())
        return cls.from_state_dict(cfg, hf_model.state_dict(), device=device or p.device, dtype=dtype or p.dtype,
                                   source=type(hf_model).__name__)

