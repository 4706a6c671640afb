"""EAGLE-3's draft model: one decoder block over the target's low, middle and high features, in EAGLE-3's files.

EAGLE-3 (Li et al. 2025, https://arxiv.org/abs/2503.01840) reads, at index m, the target's residual streams entering
three of its layers, taps = (2, L // 2, L - 3) (vLLM's eagle_aux_hidden_state_layer_ids), g_m = [g2; g15; g27] [3D]
for SmolLM2's L = 30, and the token after m, x_{m+1}:

    u_m = W_fc g_m                                                  W_fc [D, 3D]       (a committed position)
    a_m = [RMSNorm_in(E x_{m+1}); RMSNorm_hid(u_m)]                 [2D]: q, k and v are projected from a
    y_m = u_m + Attn(a)_m Wo;   y_m = y_m + MLP(RMSNorm_post(y_m))   one block of the target's family
    p(x_{m+2} | ...) = softmax(W_lm RMSNorm_out(y_m))               W_lm [V', D]: its own head, a draft vocabulary

A deeper node reads the block's own y (before the output norm) in place of u, and its own drafted token. The draft
vocabulary is EAGLE-3's pair d2t [V'] (draft id i is target id i + d2t[i]) and t2d [V] (bool: the target id is in
it). Training unrolls that recurrence (training-time test) as `DraftBlock.unroll` does for the MTP module; decoding
runs the block through the engine's paged-cache step (`drafters_mtp.ModuleDrafter`), fed by `forward_tree(taps=)`.

Files, as EAGLE-3's published drafters (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) and what vLLM's
`llama_eagle3.py` (Eagle3LlamaForCausalLM.load_weights) and SGLang's `llama_eagle3.py` read:
    config.json         a Llama config: architectures ["LlamaForCausalLMEagle3"], num_hidden_layers 1,
                        draft_vocab_size, the block's widths; optional target_hidden_size (must equal hidden_size
                        here), eagle_aux_hidden_state_layer_ids (default (2, L // 2, L - 3) of the target),
                        norm_before_residual (vLLM's: the residual is RMSNorm_hid(u)); our dynamic tree's settings
                        under "mtp_triton" (ignored by the others)
    model.safetensors   fc.weight [D, 3D]; midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight;
    (or pytorch_model   midlayer.self_attn.{q,k,v}_proj.weight [H Dh, 2D], midlayer.self_attn.o_proj.weight;
     .bin)              midlayer.mlp.{gate,up,down}_proj.weight; norm.weight; lm_head.weight [V', D];
                        d2t [V'] int64; t2d [V] bool; embed_tokens.weight if present is the target's and not read
"""
import json
import os

import torch
from safetensors.torch import load_file, save
from torch import nn

from .config import ModelConfig
from .files import write_bytes, write_json
from .heads import _check_token_map
from .loading import check_finite as check_finite_tensors
from .model import Block, RMSNorm
from .draft_block import DraftBlock

CONFIG_FILE, WEIGHTS_FILE, BIN_FILE = "config.json", "model.safetensors", "pytorch_model.bin"
ARCHITECTURE = "LlamaForCausalLMEagle3"
_IDENTITY = nn.Identity()
# our Block's names -> EAGLE-3's (midlayer.self_attn.*, midlayer.mlp.*)
_ATTN, _MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")


def default_taps(num_layers):
    """EAGLE-3's feature layers for an L-layer target: (2, L // 2, L - 3), as vLLM's default."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Module(DraftBlock):
    """EAGLE-3's drafter (module docstring). cfg: the block's ModelConfig (the target's family, widths and RoPE);
    token_map: the draft vocabulary [V'] (strictly increasing target ids; None: all V); taps: the target layers read
    (None: EAGLE-3's default three, `default_taps` of the target the drafter is bound to)."""

    def __init__(self, cfg, token_map=None, taps=None, draft=None, norm_before_residual=False):
        super().__init__()
        self._setup(cfg, draft)
        D, eps, V = cfg.hidden_size, cfg.rms_norm_eps, cfg.vocab_size
        if taps is not None:
            taps = tuple(taps) if isinstance(taps, (list, tuple)) else taps
            if not isinstance(taps, tuple) or not taps or any(isinstance(j, bool) or not isinstance(j, int) or j < 0
                                                              for j in taps):
                raise ValueError(f"taps must be a non-empty list of target layer ids >= 0, got {taps!r}")
        self.taps = taps
        self.norm_before_residual = bool(norm_before_residual)
        self.fc = nn.Linear((3 if taps is None else len(taps)) * D, D, bias=False)
        self.block = Block(self.config)
        Hq, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias or cfg.qkv_bias
        self.block.q_proj = nn.Linear(2 * D, Hq * Dh, bias=bias)     # q, k, v read [RMSNorm_in(E x); RMSNorm_hid(u)]
        self.block.k_proj = nn.Linear(2 * D, Hkv * Dh, bias=bias)
        self.block.v_proj = nn.Linear(2 * D, Hkv * Dh, bias=bias)
        self.block.hidden_norm = RMSNorm(D, eps)
        self.norm = RMSNorm(D, eps)
        ids = torch.arange(V) if token_map is None else _check_token_map(token_map, V)
        self.lm_head = nn.Linear(D, len(ids), bias=False)
        self.register_buffer("d2t", ids - torch.arange(len(ids)))
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True))

    @property
    def token_map(self):
        """The draft vocabulary's target ids [V'] (i + d2t[i]), or None when it is the whole vocabulary."""
        if len(self.d2t) == self.config.vocab_size:
            return None
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    @classmethod
    def from_target(cls, model, token_map=None, taps=None, draft=None):
        """A fresh drafter for `model`, in fp32 on its device. It starts as a tempered logit lens on the deepest tap:
        fc picks that tap's stream, the block's two output projections (o, down) are zero, so y = u; its q, k, v read
        u as the target's last layer does; the LM head is the target's rows and the output norm a fifth of the
        target's final norm (the lens foresees the token at m + 1, not the one wanted at m + 2, and confidently:
        tempered 5x, its soft cross-entropy starts below the uniform draft's on SmolLM2's answers)."""
        taps = default_taps(model.config.num_hidden_layers) if taps is None else taps
        m = cls(model.config, token_map, taps, draft).to(model.device)
        D = model.config.hidden_size
        last = model.layers[-1]
        with torch.no_grad():
            m.block.load_state_dict({k: v for k, v in last.state_dict().items()
                                     if not k.startswith(("q_proj", "k_proj", "v_proj"))}, strict=False)
            for name in ("q_proj", "k_proj", "v_proj"):
                ours, theirs = getattr(m.block, name), getattr(last, name)
                ours.weight.zero_()
                ours.weight[:, D:] = theirs.weight
                if ours.bias is not None:
                    ours.bias.copy_(theirs.bias)
            m.block.hidden_norm.weight.copy_(last.input_layernorm.weight)
            m.block.o_proj.weight.zero_()
            m.block.down_proj.weight.zero_()
            m.fc.weight.zero_()
            m.fc.weight[:, -D:] = torch.eye(D)
            m.norm.weight.copy_(model.norm.weight / 5)
            m.lm_head.weight.copy_(model.lm_head.weight[torch.arange(len(m.d2t)) + m.d2t])
        return m.float()

    def step_inputs(self, embed, h, tokens, own=False):
        """(u, a): u = W_fc h for the target's features h [..., len(taps) D] (own False) or u = h, the block's own y
        [..., D] (own True); a = [RMSNorm_in(E x); RMSNorm_hid(u)] [..., 2D]; the residual is u (RMSNorm_hid(u) with
        norm_before_residual)."""
        u = h if own else self.fc(h)
        hu = self.block.hidden_norm(u)
        a = torch.cat([self.block.input_layernorm(embed[tokens].to(u.dtype)), hu], -1)
        return (hu if self.norm_before_residual else u), a

    @property
    def recurrent(self):
        """y itself: a deeper node reads the block's output before the output norm."""
        return _IDENTITY

    def head_input(self, y):
        return self.norm(y)

    def lm_rows(self, lm_weight):
        """Its own LM head [V', D] (the target's `lm_weight` is not read)."""
        return self.lm_head.weight

    # ---- files -------------------------------------------------------------------------------------------
    def save(self, path, **meta):
        """Write config.json + model.safetensors (EAGLE-3's names, module docstring) into the folder `path`."""
        os.makedirs(path, exist_ok=True)
        sd = {_file_name(k): v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        write_bytes(os.path.join(path, WEIGHTS_FILE), save(sd))
        c = self.config
        config = dict(architectures=[ARCHITECTURE], model_type="llama", hidden_size=c.hidden_size,
                      intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, num_hidden_layers=1,
                      rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                      max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size,
                      draft_vocab_size=len(self.d2t), target_hidden_size=c.hidden_size, hidden_act="silu",
                      attention_bias=c.attention_bias, mlp_bias=c.mlp_bias, tie_word_embeddings=False,
                      torch_dtype=str(self.fc.weight.dtype).removeprefix("torch."),
                      **({} if self.taps is None else dict(eagle_aux_hidden_state_layer_ids=list(self.taps))),
                      norm_before_residual=self.norm_before_residual,
                      mtp_triton=dict(draft=self.draft, **{**self.meta, **meta}))
        write_json(os.path.join(path, CONFIG_FILE), config)


def _file_name(ours):
    """Our state-dict name -> EAGLE-3's: block.q_proj.weight -> midlayer.self_attn.q_proj.weight, block.gate_proj..
    -> midlayer.mlp.gate_proj.., block.* -> midlayer.*; the rest as it is."""
    if not ours.startswith("block."):
        return ours
    rest = ours[len("block."):]
    part = rest.split(".")[0]
    return "midlayer." + ("self_attn." if part in _ATTN else "mlp." if part in _MLP else "") + rest


def is_eagle3_folder(path):
    """A folder whose config.json names EAGLE-3's architecture (or holds a draft_vocab_size beside an fc weight)."""
    cfg = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path) or not os.path.exists(cfg):
        return False
    try:
        c = json.load(open(cfg))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(c, dict) and ARCHITECTURE in (c.get("architectures") or [])


def load_eagle3(path, device=None, dtype=None, *, check_finite=True):
    """An Eagle3Module from an EAGLE-3 drafter folder (module docstring; taps None when config.json names none: the
    default three of the target it is bound to). Bad files: a ValueError naming the file and field."""
    cfg_file = os.path.join(path, CONFIG_FILE)
    try:
        raw = json.load(open(cfg_file))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"load_eagle3: {cfg_file} is not a readable JSON file: {e}") from None
    if not isinstance(raw, dict) or raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"load_eagle3: {cfg_file}: EAGLE-3's drafter is one block (num_hidden_layers 1), got "
                         f"{raw.get('num_hidden_layers') if isinstance(raw, dict) else raw!r}")
    D = raw.get("hidden_size")
    if raw.get("target_hidden_size", D) != D:
        raise ValueError(f"load_eagle3: {cfg_file}: target_hidden_size {raw['target_hidden_size']} != hidden_size "
                         f"{D}; a drafter narrower than its target is not supported here")
    try:
        cfg = ModelConfig.from_hf({k: v for k, v in raw.items() if k != "architectures"}, source=cfg_file)
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"load_eagle3: {cfg_file}: {e}") from None
    file = os.path.join(path, WEIGHTS_FILE)
    if os.path.exists(file):
        try:
            sd = load_file(file)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for torn files
            raise ValueError(f"load_eagle3: {file} is not a readable safetensors file: {e}") from None
    elif os.path.exists(os.path.join(path, BIN_FILE)):
        file = os.path.join(path, BIN_FILE)
        try:
            sd = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a torn or foreign pickle
            raise ValueError(f"load_eagle3: {file} is not a readable weights file: {e}") from None
    else:
        raise ValueError(f"load_eagle3: {path} has {CONFIG_FILE} but neither {WEIGHTS_FILE} nor {BIN_FILE}")
    sd.pop("embed_tokens.weight", None)                        # the target's own embedding is used
    for name in ("d2t", "t2d"):
        if name in sd and sd[name].is_floating_point():
            raise ValueError(f"load_eagle3: {file}: {name} must hold integers or booleans, got {sd[name].dtype}")
    if check_finite:
        check_finite_tensors(sd, file)
    taps = raw.get("eagle_aux_hidden_state_layer_ids")
    Vd = raw.get("draft_vocab_size", cfg.vocab_size)
    d2t = sd.pop("d2t", torch.zeros(Vd, dtype=torch.int64)).to(torch.int64)
    t2d = sd.pop("t2d", None)
    if d2t.dim() != 1 or len(d2t) != Vd:
        raise ValueError(f"load_eagle3: {file}: d2t has shape {tuple(d2t.shape)}, draft_vocab_size is {Vd}")
    ids = torch.arange(Vd) + d2t
    ours = raw.get("mtp_triton") if isinstance(raw.get("mtp_triton"), dict) else {}
    try:
        m = Eagle3Module(cfg, None if Vd == cfg.vocab_size and bool((d2t == 0).all()) else ids, taps,
                         ours.get("draft"), raw.get("norm_before_residual", False))
    except ValueError as e:
        raise ValueError(f"load_eagle3: {path}: {e}") from None
    if t2d is not None and not torch.equal(t2d.to(torch.bool), m.t2d):
        raise ValueError(f"load_eagle3: {file}: t2d does not mark the ids d2t maps to")
    expected = {_file_name(k): v for k, v in m.state_dict().items() if k not in ("d2t", "t2d")}
    bad = sorted(k for k in set(sd) | set(expected) if k not in sd or k not in expected
                 or sd[k].shape != expected[k].shape)
    if bad:
        raise ValueError(f"load_eagle3: {file} does not match {cfg_file}: missing, unexpected or mis-shaped tensors "
                         f"{bad[:5]}")
    m = m.to(sd["fc.weight"].dtype)
    mine = {k: sd[_file_name(k)] for k in m.state_dict() if k not in ("d2t", "t2d")}
    m.load_state_dict(dict(mine, d2t=m.d2t, t2d=m.t2d))
    m.meta = {k: v for k, v in ours.items() if k != "draft"}
    return m.to(device=device, dtype=dtype or sd["fc.weight"].dtype).eval()
