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
engine's paged-cache step (`engine`, `drafters_mtp.ModuleDrafter`); both come from `draft_block.DraftBlock`, which
EAGLE-3's drafter (eagle3.py) shares. `load_drafter` reads any drafter folder: this module's, EAGLE-3's or heads.

Files: a folder with module.safetensors (fc, the norms, the block's projections, token_map) and module.json
(format "mtp_triton.module/1", the block's config fields, the dynamic tree's defaults, free metadata).
"""
import dataclasses
import json
import os

import torch
from safetensors.torch import load_file, save
from torch import nn

from .heads import _check_token_map
from .loading import check_finite as check_finite_tensors
from .draft_block import DRAFT_DEFAULTS, DraftBlock  # noqa: F401  (DRAFT_DEFAULTS: public here too)
from .eagle3 import is_eagle3_folder, load_eagle3
from .model import Block, ModelConfig, RMSNorm
from .files import write_bytes, write_json
from .heads import load_heads

MODULE_FILE, MODULE_META, FORMAT = "module.safetensors", "module.json", "mtp_triton.module/1"


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
        """u = W_fc [enorm(E x); hnorm(h)]: embed [V, D] the target's embedding, h [..., D], tokens [...] ->
        [..., D]."""
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
    if is_module_folder(path):
        return load_module(path, device, dtype)
    if is_eagle3_folder(path):
        return load_eagle3(path, device, dtype)
    if os.path.exists(os.path.join(path, MODULE_FILE)):
        raise ValueError(f"load_drafter: {path} holds {MODULE_FILE} but no {MODULE_META}: an MTP module folder "
                         f"needs both (MTPModule.save writes them)")
    return load_heads(path, device, dtype)
