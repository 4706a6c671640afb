"""The model's configuration: `ModelConfig`, and reading it from a Hugging Face config (config.json or a
`transformers` config dict) with errors that name the file and what is wrong.

Supported families (`FAMILIES`): Llama, Mistral (sliding window), Qwen2 / Qwen2.5 (q/k/v bias), Qwen3 (q/k norm).
Anything else is refused when the config is read, with the model type and what this engine lacks for it.
"""
import json
import math
import os
from dataclasses import dataclass, field

ROPE_TYPES = ("default", "linear", "llama3")


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
    attention_bias: bool = False         # bias on q, k, v and o (Llama's attention_bias, Qwen3's)
    qkv_bias: bool = False               # bias on q, k, v only (Qwen2)
    qk_norm: bool = False                # RMSNorm(head_dim) on q and k before RoPE (Qwen3)
    sliding_window: int = None           # None = full attention
    layer_types: tuple = None            # per layer "full_attention" | "sliding_attention"; None = all slide
    mlp_bias: bool = False
    eos_token_id: object = None
    model_type: str = "llama"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads}) (GQA)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ValueError(f"rope_scaling must be an object (or null), got {self.rope_scaling!r}")
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
        bad = _bad_rope_numbers(kind, self.rope_scaling or {})
        if bad:
            raise ValueError(f"rope_scaling: rope_type {kind!r} needs positive finite {', '.join(bad)}, got "
                             f"{self.rope_scaling}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"sliding_window must be None or a positive int, got {w!r}")
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {
                    "full_attention", "sliding_attention"}:
                raise ValueError(f"layer_types must list 'full_attention' or 'sliding_attention' for each of the "
                                 f"{self.num_hidden_layers} layers, got {list(self.layer_types)}")

    def window(self, layer):
        """The sliding window of `layer` (None: the layer sees the whole cache)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @classmethod
    def from_hf(cls, d, source="config"):
        """From a Hugging Face config dict (transformers 4.x/5.x spellings); see `config_from_hf`."""
        return config_from_hf(d, source)


# model_type -> (architecture name, family switches, transformers' default max_position_embeddings)
FAMILIES = {
    "llama": ("LlamaForCausalLM", {}, 2048),
    "mistral": ("MistralForCausalLM", {}, 4096 * 32),
    "qwen2": ("Qwen2ForCausalLM", {"qkv_bias": True}, 32768),
    "qwen3": ("Qwen3ForCausalLM", {"qk_norm": True}, 32768),
}
_ARCH_TO_TYPE = {arch: t for t, (arch, _, _) in FAMILIES.items()}

# What the engine lacks for model types people try (the message names it; the list is not exhaustive).
_MISSING = {
    "gemma": "embeddings scaled by sqrt(hidden_size), a GeGLU (gelu) MLP and RMSNorm with (1 + weight)",
    "gemma2": "Gemma's embedding scale, GeGLU MLP and (1 + weight) RMSNorm, plus post-norms, logit soft-capping "
              "and alternating local/global attention",
    "gemma3": "Gemma's embedding scale, GeGLU MLP and (1 + weight) RMSNorm, plus post-norms, q/k norm and "
              "per-layer RoPE bases",
    "gemma3_text": "Gemma's embedding scale, GeGLU MLP and (1 + weight) RMSNorm, plus post-norms, q/k norm and "
                   "per-layer RoPE bases",
    "phi3": "fused qkv_proj and gate_up_proj weights and partial / LongRoPE rotary embeddings",
    "phi": "LayerNorm, a GeLU MLP, partial rotary embeddings and parallel attention + MLP",
    "olmo2": "norms after attention and MLP instead of before (post-norm) and q/k RMSNorm over the whole "
             "projection",
    "olmo": "LayerNorm without weights and q/k/v clipping",
    "mixtral": "a mixture-of-experts MLP",
    "qwen2_moe": "a mixture-of-experts MLP",
    "qwen3_moe": "a mixture-of-experts MLP",
    "deepseek_v2": "multi-head latent attention and a mixture-of-experts MLP",
    "deepseek_v3": "multi-head latent attention and a mixture-of-experts MLP",
}
_ROPE_MISSING = {
    "dynamic": "dynamic NTK scaling (RoPE rescaled with the sequence length)",
    "yarn": "YaRN (per-frequency interpolation plus an attention temperature)",
    "longrope": "LongRoPE (separate short/long rescale factors per frequency)",
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


# ---- config -------------------------------------------------------------------------------------
def read_config(folder):
    """config.json of `folder` as a dict; errors name the file."""
    file = os.path.join(folder, "config.json")
    if not os.path.exists(file):
        raise FileNotFoundError(f"no config.json in {folder!r}")
    try:
        with open(file, encoding="utf-8") as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(d).__name__}")
    return d


def _model_type(d, source):
    mt, archs = d.get("model_type"), d.get("architectures") or []
    if mt is not None and not isinstance(mt, str):
        raise ValueError(f"{source}: model_type must be a string such as 'llama', got {mt!r}")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"{source}: architectures must be a list of strings, got {archs!r}")
    if mt is None:
        known = [a for a in archs if a in _ARCH_TO_TYPE]
        if not archs:
            raise ValueError(f"{source}: neither model_type nor architectures is set, so the model family is "
                             f"unknown (supported model_type: {', '.join(FAMILIES)})")
        if not known:
            raise ValueError(f"{source}: architectures {archs} (no model_type) is not supported; supported: "
                             f"{', '.join(_ARCH_TO_TYPE)}")
        mt = _ARCH_TO_TYPE[known[0]]
    if mt not in FAMILIES:
        why = f": this engine lacks {_MISSING[mt]}" if mt in _MISSING else ""
        raise ValueError(f"{source}: model_type {mt!r} is not supported{why}. Supported: {', '.join(FAMILIES)} "
                         f"(pre-norm RMSNorm decoders with RoPE and a SwiGLU MLP)")
    if archs and not any(a in _ARCH_TO_TYPE for a in archs):
        raise ValueError(f"{source}: architectures {archs} is not a supported causal LM (supported: "
                         f"{', '.join(_ARCH_TO_TYPE)})")
    return mt


# the numbers each RoPE scaling needs (positive and finite)
ROPE_NEEDS = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _bad_rope_numbers(kind, rope):
    """The settings rope_type `kind` needs that `rope` lacks or holds as no positive finite number."""
    return [k for k in ROPE_NEEDS.get(kind, ())
            if not (_number(rope.get(k)) and math.isfinite(rope[k]) and rope[k] > 0)]


def _rope(d, source):
    for key in ("rope_parameters", "rope_scaling"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise ValueError(f"{source}: {key} must be an object (or null), got {d[key]!r}")
    rope = dict(d.get("rope_parameters") or {})
    rope.update(d.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{source}: per-layer-type RoPE parameters {sorted(rope)} are not supported")
    theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        what = _ROPE_MISSING.get(kind, "an unknown RoPE variant")
        raise ValueError(f"{source}: rope_type {kind!r} ({what}) is not supported (supported: "
                         f"{', '.join(ROPE_TYPES)})")
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{source}: partial_rotary_factor {partial} (RoPE on part of each head) is not supported")
    lacking = [k for k in ROPE_NEEDS.get(kind, ()) if not _number(rope.get(k))]
    if lacking:
        raise ValueError(f"{source}: rope_type {kind!r} needs numeric {', '.join(lacking)} in rope_scaling / "
                         "rope_parameters")
    bad = [f"{k}={rope[k]!r}" for k in _bad_rope_numbers(kind, rope)]
    if bad:
        raise ValueError(f"{source}: rope_type {kind!r} needs positive finite {', '.join(bad).replace('=', ', got ')}")
    if not (_number(theta) and math.isfinite(theta) and theta > 0):
        raise ValueError(f"{source}: rope_theta must be a positive finite number, got {theta!r}")
    return theta, {} if kind == "default" else dict(rope, rope_type=kind)


def _sliding(d, mt, n_layers):
    """(sliding_window, layer_types) as transformers reads them for this family."""
    if mt == "mistral":
        return d.get("sliding_window"), None
    if mt in ("qwen2", "qwen3") and d.get("use_sliding_window") and _positive_int(n_layers):
        window = d.get("sliding_window")
        types = d.get("layer_types") or ["sliding_attention" if window is not None and i >= d.get(
            "max_window_layers", 28) else "full_attention" for i in range(n_layers)]
        return window, types
    return None, None                                   # Llama has none; Qwen without use_sliding_window


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(v):
    return _int(v) and v > 0


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _flag(d, key, source):
    """A boolean field: absent or null -> False; true/false as JSON booleans (a string "false" is refused, not
    read as True)."""
    v = d.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ValueError(f"{source}: {key} must be true or false (a JSON boolean), got {v!r}")
    return v


def config_from_hf(d, source="config"):
    """ModelConfig from a Hugging Face config dict, or a ValueError naming `source` and what is wrong."""
    if not isinstance(d, dict):
        raise ValueError(f"{source}: expected a config dict, got {type(d).__name__}")
    mt = _model_type(d, source)
    flags = {k: _flag(d, k, source) for k in ("tie_word_embeddings", "attention_bias", "mlp_bias",
                                             "use_sliding_window")}
    eps = d.get("rms_norm_eps", 1e-6)
    if not (_number(eps) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"{source}: rms_norm_eps must be a positive finite number, got {eps!r}")
    _, switches, default_ctx = FAMILIES[mt]
    for key in _REQUIRED:
        if key not in d:
            raise ValueError(f"{source}: missing required key {key!r} (a {mt} config needs "
                             f"{', '.join(_REQUIRED)})")
    for key in (*_REQUIRED, "max_position_embeddings"):
        if key in d and d[key] is None:
            raise ValueError(f"{source}: {key} is null; it must be a positive int")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (this engine's MLP uses silu)")
    heads, D, head_dim = d["num_attention_heads"], d["hidden_size"], d.get("head_dim")
    if head_dim is None and _positive_int(heads) and _positive_int(D):
        if D % heads:
            raise ValueError(f"{source}: hidden_size {D} is not a multiple of num_attention_heads {heads}, and "
                             "there is no head_dim")
        head_dim = D // heads
    theta, rope = _rope(d, source)
    window, layer_types = _sliding(d, mt, d["num_hidden_layers"])
    eos = d.get("eos_token_id")
    if not (eos is None or _int(eos) or (isinstance(eos, list) and all(_int(e) for e in eos))):
        raise ValueError(f"{source}: eos_token_id must be null, an int or a list of ints, got {eos!r}")
    try:
        return ModelConfig(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads, head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta) if _number(theta) else theta,
            rope_scaling=rope,
            max_position_embeddings=d.get("max_position_embeddings", default_ctx),
            tie_word_embeddings=flags["tie_word_embeddings"],
            attention_bias=flags["attention_bias"] and mt in ("llama", "qwen3"),
            mlp_bias=flags["mlp_bias"] and mt == "llama",
            sliding_window=window, layer_types=layer_types, eos_token_id=eos, model_type=mt, **switches)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


# ---- weights ------------------------------------------------------------------------------------
