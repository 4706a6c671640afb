"""A compact Llama-family decoder with a paged KV cache and a tree step.

Architecture (Llama 1/2/3, Mistral-style GQA): token embedding → L × [RMSNorm → attention with RoPE
(GQA: Hq query heads share Hkv key/value heads) → residual → RMSNorm → SwiGLU MLP → residual] →
final RMSNorm → LM head (tied or untied). Numerics mirror `transformers` (RMSNorm in fp32, RoPE cos/sin
from fp32 inverse frequencies) so that an fp64 run is token-identical to `LlamaForCausalLM.generate`.

KV cache: paged, k/v [L, NB, BS, Hkv, Dh]; sequence b's token at position p lives in block
block_table[b, p // BS], slot p % BS. A step runs T tree nodes (the root + drafts) through every
layer: each node attends to the whole cache plus its ancestors (`tree_attention`), and its K/V go to
per-step tree buffers k_tree/v_tree [L, B, T, Hkv, Dh]; `kv_append` later copies the accepted ones.
"""
import glob
import json
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)   # {} = default RoPE; rope_type "llama3" | "linear"
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_id: object = None

    @classmethod
    def from_hf(cls, d):
        """From a Hugging Face config dict (transformers 4.x/5.x spellings)."""
        if d.get("model_type") not in (None, "llama", "mistral", "qwen2") and "LlamaForCausalLM" not in d.get(
                "architectures", ["LlamaForCausalLM"]):
            raise ValueError(f"unsupported model_type {d.get('model_type')!r}: this engine runs Llama-family models")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d.get('hidden_act')!r} (Llama uses silu)")
        heads = d["num_attention_heads"]
        rope = dict(d.get("rope_parameters") or {})
        rope.update(d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope = {} if rope_type == "default" else dict(rope, rope_type=rope_type)
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), rope_scaling=rope,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)), mlp_bias=bool(d.get("mlp_bias", False)),
            eos_token_id=d.get("eos_token_id"))


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
    raise ValueError(f"unsupported rope_type {kind!r} (supported: default, linear, llama3)")


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # as transformers: normalise in fp32, cast back, then scale
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, Dh, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(D, Hq * Dh, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(D, Hkv * Dh, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(D, Hkv * Dh, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(Hq * Dh, D, bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(D, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(D, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, D, bias=cfg.mlp_bias)


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

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def new_cache(self, capacities, block_size=16):
        return PagedKVCache(self.config, capacities, block_size, self.dtype, self.device)

    def rope(self, positions):
        """positions [B, T] -> cos, sin [B, T, 1, Dh] in the model dtype (computed in fp32 like HF)."""
        freqs = positions.float()[..., None] * self.inv_freq.float()        # [B, T, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, :, None, :], emb.sin().to(self.dtype)[:, :, None, :]

    @torch.no_grad()
    def forward_tree(self, tokens, positions, tree_mask, cache, rows, ops, check_values=True):
        """Run T nodes per sequence through all layers.

        tokens, positions [B, T] int64; tree_mask [T, T] or [B, T, T] bool; rows [B] int64: which cache
        sequences these are. Returns the final-norm hidden states [B, T, D] and the new K/V as tree buffers
        k_tree, v_tree [L, B, T, Hkv, Dh] (not yet in the cache: `kv_append` copies the accepted ones).
        The kernels' value checks (host syncs on a GPU) run on the first layer only, and not at all with
        check_values=False: the inputs are the same for every layer.
        """
        cfg = self.config
        B, T = tokens.shape
        Hq, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        block_table, cache_lens = cache.block_table[rows], cache.cache_lens[rows]
        k_tree = torch.empty(cfg.num_hidden_layers, B, T, Hkv, Dh, dtype=self.dtype, device=self.device)
        v_tree = torch.empty_like(k_tree)
        cos, sin = self.rope(positions)
        x = self.embed_tokens(tokens)                                          # [B, T, D]
        for l, blk in enumerate(self.layers):
            h = blk.input_layernorm(x)
            q = blk.q_proj(h).view(B, T, Hq, Dh)
            k = blk.k_proj(h).view(B, T, Hkv, Dh)
            v = blk.v_proj(h).view(B, T, Hkv, Dh)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k_tree[l], v_tree[l] = k, v
            o = ops.tree_attention(q.contiguous(), cache.k[l], cache.v[l], block_table, cache_lens,
                                   k_tree[l], v_tree[l], tree_mask,
                                   check_values=check_values and l == 0)       # [B, T, Hq, Dh]
            x = x + blk.o_proj(o.reshape(B, T, Hq * Dh))
            h = blk.post_attention_layernorm(x)
            x = x + blk.down_proj(F.silu(blk.gate_proj(h)) * blk.up_proj(h))
        return self.norm(x), k_tree, v_tree

    def logits(self, hidden):
        return self.lm_head(hidden)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, cfg, sd, device=None, dtype=None):
        sd = {k[len("model."):] if k.startswith("model.") else k: v for k, v in sd.items()}
        sd = {k.replace("self_attn.", "").replace("mlp.", ""): v for k, v in sd.items()}
        sd.pop("rotary_emb.inv_freq", None)
        for k in [k for k in sd if k.endswith("rotary_emb.inv_freq")]:
            sd.pop(k)
        if cfg.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        elif "lm_head.weight" not in sd:
            raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        if dtype is None:
            dtype = sd["embed_tokens.weight"].dtype
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device=device or "cpu")
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        missing, unexpected = model.load_state_dict(sd, strict=False)
        missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the config: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]}")
        model.inv_freq = rope_inv_freq(cfg).to(model.device)
        return model.to(dtype).eval()

    @classmethod
    def from_hf(cls, hf_model, device=None, dtype=None):
        """From a `transformers` LlamaForCausalLM object (same weights, same numerics)."""
        cfg = ModelConfig.from_hf(hf_model.config.to_dict())
        p = next(hf_model.parameters())
        return cls.from_state_dict(cfg, hf_model.state_dict(), device=device or p.device, dtype=dtype or p.dtype)


def load_model(path, device=None, dtype=None):
    """Load a Hugging Face Llama-family checkpoint folder (config.json + *.safetensors).

    dtype None keeps the checkpoint's dtype on a GPU and uses fp32 on CPU for half-precision
    checkpoints (CPU half math is slow and inexact). device None: CUDA if available, else CPU.
    """
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_model: {path!r} is not a checkpoint folder")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise FileNotFoundError(f"load_model: no config.json in {path!r}")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        other = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt", ".gguf"))]
        raise ValueError(f"load_model: no *.safetensors in {path!r}" +
                         (f" (found {other}; only safetensors are loaded — convert with save_pretrained("
                          "safe_serialization=True))" if other else ""))
    with open(cfg_file) as f:
        cfg = ModelConfig.from_hf(json.load(f))
    sd = {}
    for fn in files:
        sd.update(load_file(fn))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = sd["model.embed_tokens.weight" if "model.embed_tokens.weight" in sd else "embed_tokens.weight"].dtype
        if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
            dtype = torch.float32
    return LlamaEngine.from_state_dict(cfg, sd, device=device, dtype=dtype)
