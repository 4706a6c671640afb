"""MTP draft heads (Medusa-style): one residual block per head, then an LM head.

Head h reads the target's final-norm hidden state x at a position t and proposes the token at t + h + 2
(the model's own LM head gives t + 1):
    z_h = x + silu(W_h x + b_h),   logits_h = lm_head_h @ z_h                  (Cai et al. 2024, Medusa)
lm_head_h is the model's LM head, shared by all heads (what our training script learns), or the head's own
[V, D] matrix (FasterDecoding's published Medusa checkpoints). W_h starts at zero in training (each head starts
as the LM head), so `init_heads` draws small random weights instead, for tests that need heads that disagree
with the model.

Optionally the heads also read the root, the token the model itself just chose at t + 1 (known when drafting: it
is the step's bonus token), through its input embedding e_r = E[root] and one projection P [D, D] shared by the heads:
    x' = x + P e_r,   z_h = x' + silu(W_h x' + b_h)                            (P = 0: the Medusa heads above)
A Medusa head has to guess token t + 1 before it can guess t + 2; reading it removes that guess, as EAGLE's draft
head does by reading the shifted token (Li et al. 2024, https://arxiv.org/abs/2401.15077). The drafting kernel is
unchanged: it is handed x' instead of x.

Optionally (token inputs, Q > 0) head h also reads the last min(h, Q) tokens drafted on its own path, y_1 .. y_h
(y_j: the node at depth j; y_0 is the root), through projections Q_q [D, D] shared by the heads, q = distance back:
    s_h = x' + sum_{q < min(h, Q)} Q_q e(y_{h - q}),   z_h = s_h + silu(W_h s_h + b_h)      (Q_q = 0: the heads above)
A Medusa head guesses t + h + 2 without knowing which t + 2 .. t + h + 1 it is continuing; with token inputs each
tree node's children depend on the path to it, as in Hydra's sequentially dependent heads (Ankner et al. 2024,
https://arxiv.org/abs/2402.05109). Drafting then runs depth by depth, one head per depth, over every parent at that
depth (`drafters.HeadsDrafter.draft_tree`).

Two optional extras travel with the heads:
  * a draft vocabulary token_map [V'] (strictly increasing token ids): drafting scores only those V' rows of
    the LM head and maps row r back to token token_map[r] (FR-Spec, Zhao et al. 2025,
    https://arxiv.org/abs/2502.14856) — V'/V of the drafting bytes and FLOPs;
  * a stored tree (Medusa-style choices, e.g. tuned on the heads' measured accuracies).
`draft_weights` hands the drafting kernel what to score, computed once per set of weights.

Files:
  ours    a folder with heads.safetensors (res_weight [H, D, D], res_bias [H, D]; optional lm_head [H, V, D],
          token_map [V'] int64, root_proj [D, D], token_proj [Q, D, D]) and heads.json (num_heads, hidden_size,
          format, optional tree, free metadata);
  Medusa  medusa_lm_head.safetensors or medusa_lm_head.pt: the state dict of
          nn.ModuleList([nn.Sequential(ResBlock(D), nn.Linear(D, V, bias=False)) for each head]), i.e. keys
          {i}.0.linear.weight [D, D], {i}.0.linear.bias [D], {i}.1.weight [V, D] (ResBlock(x) = x + silu(Wx + b));
          see https://github.com/FasterDecoding/Medusa/blob/main/medusa/model/medusa_model.py. A .pt is read with
          torch.load(weights_only=True): tensors only, never an arbitrary unpickle.
"""
import json
import operator
import os
import re

import torch
from torch import nn
from safetensors.torch import load_file, save

from .loading import check_finite as check_finite_tensors
from .files import write_bytes, write_json
from .tree import Tree

HEADS_FILE, MEDUSA_FILES = "heads.safetensors", ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_MEDUSA_KEY = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def _check_token_map(token_map, vocab_size=None):
    """A draft vocabulary: int64 [V'] of strictly increasing ids in [0, vocab_size)."""
    t = torch.as_tensor(token_map)
    if t.dim() != 1 or t.numel() == 0 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"token_map must be a non-empty 1-D tensor of integer token ids, got {t.dtype} "
                         f"{tuple(t.shape)}")
    t = t.to(torch.int64)
    if bool((t < 0).any()) or bool((t[1:] <= t[:-1]).any()):
        raise ValueError("token_map must hold strictly increasing token ids >= 0 (a sorted draft vocabulary)")
    if vocab_size is not None and int(t[-1]) >= vocab_size:
        raise ValueError(f"token_map has id {int(t[-1])}, outside the vocabulary of {vocab_size}")
    return t


class MTPHeads(nn.Module):
    """H heads on a D-wide hidden state; optional per-head LM heads, draft vocabulary and stored tree.

    vocab_size: give the heads their own LM heads lm_head [H, V, D] (zero until loaded); None shares the model's.
    token_map: draft vocabulary [V'] (see module docstring). tree: Medusa-style choices, e.g. [(0,), (1,), (0, 0)].
    root_input: the heads also read the root token through root_proj [D, D] (zero until trained or loaded).
    token_inputs: Q, how many drafted tokens of its path each head also reads, through token_proj [Q, D, D] (zero
    until trained or loaded; 0: none, every head sees the same input).
    """

    def __init__(self, num_heads, hidden_size, dtype=torch.float32, device=None, *, vocab_size=None,
                 token_map=None, tree=None, root_input=False, token_inputs=0):
        super().__init__()
        if num_heads < 1 or hidden_size < 1:
            raise ValueError(f"MTPHeads: need num_heads >= 1 and hidden_size >= 1, got {num_heads}, {hidden_size}")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"MTPHeads: vocab_size must be >= 1 or None, got {vocab_size}")
        if not 0 <= token_inputs < num_heads:
            raise ValueError(f"MTPHeads: token_inputs must be in [0, num_heads) = [0, {num_heads}), got {token_inputs} "
                             "(head h has only h drafted tokens before it)")
        self.res_weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size, dtype=dtype, device=device))
        self.res_bias = nn.Parameter(torch.zeros(num_heads, hidden_size, dtype=dtype, device=device))
        self.register_parameter("lm_head", None if vocab_size is None else nn.Parameter(
            torch.zeros(num_heads, vocab_size, hidden_size, dtype=dtype, device=device)))
        self.register_parameter("root_proj", nn.Parameter(
            torch.zeros(hidden_size, hidden_size, dtype=dtype, device=device)) if root_input else None)
        self.register_parameter("token_proj", nn.Parameter(
            torch.zeros(token_inputs, hidden_size, hidden_size, dtype=dtype, device=device)) if token_inputs else None)
        self.register_buffer("_token_map", None)
        self.token_map = token_map
        self.tree = tree
        self.meta = {}                     # what heads.json said when loaded (training record, tuning table, ...)
        self._draft_cache = None

    @property
    def num_heads(self):
        return self.res_weight.shape[0]

    @property
    def hidden_size(self):
        return self.res_weight.shape[1]

    @property
    def vocab_size(self):
        """V of the heads' own LM heads; None when they share the model's."""
        return None if self.lm_head is None else self.lm_head.shape[1]

    @property
    def token_map(self):
        """The draft vocabulary, int64 [V'] (None: the full vocabulary)."""
        return self._token_map

    @token_map.setter
    def token_map(self, value):
        device = self.res_weight.device
        self._token_map = None if value is None else _check_token_map(value, self.vocab_size).to(device)

    @property
    def tree(self):
        """The stored tree as a tuple of choices (None: let `generate` use its default)."""
        return self._tree

    @tree.setter
    def tree(self, choices):
        if choices is not None:
            if hasattr(choices, "__iter__") and not isinstance(choices, (str, bytes, dict)):
                choices = list(choices)
            Tree.from_choices(choices, num_heads=self.num_heads)   # ValueError unless a list of integer-rank paths
            choices = tuple(tuple(operator.index(r) for r in c) for c in choices)
        self._tree = choices

    @property
    def root_input(self):
        """Do the heads read the root token (x' = x + P e_root)?"""
        return self.root_proj is not None

    @property
    def token_inputs(self):
        """Q: how many drafted tokens of its path each head reads (0: none; the heads then draft in one call)."""
        return 0 if self.token_proj is None else self.token_proj.shape[0]

    def path_input(self, x, recent_emb):
        """s_h = x' + sum_{q < min(h, Q)} Q_q e(y_{h - q}): what head h's block reads (x' itself without token inputs).
        x [..., D]: x' (`head_input`); recent_emb [..., n, D]: the input embeddings of the tokens drafted on the path,
        nearest first (index q holds y_{h - q}); head h passes min(h, Q) or more (only the first Q are read; None or
        n = 0 for head 0)."""
        if self.token_proj is None or recent_emb is None:
            return x
        for q in range(min(self.token_inputs, recent_emb.shape[-2])):
            x = x + recent_emb[..., q, :].to(x.dtype) @ self.token_proj[q].to(x.dtype).T
        return x

    def block(self, s, h):
        """z_h = s + silu(W_h s + b_h): head h's residual block on its input s [..., D]."""
        return s + nn.functional.silu(s @ self.res_weight[h].to(s.dtype).T + self.res_bias[h].to(s.dtype))

    def head_input(self, x, root_emb=None):
        """x' = x + P e_root: what the residual blocks read (x itself for heads without root input).
        x [..., D]; root_emb [..., D], the model's input embedding of the root token (required with root input)."""
        if self.root_proj is None:
            return x
        if root_emb is None:
            raise ValueError("these heads read the root token: pass root_emb, the embedding of the token at t + 1")
        return x + root_emb.to(x.dtype) @ self.root_proj.to(x.dtype).T

    def forward(self, x, root_emb=None, path_emb=None):
        """x [..., D] (root_emb [..., D] for heads with root input; path_emb [..., H - 1, D], the drafted tokens
        y_1 .. y_{H-1} of one path, for heads with token inputs) -> z [..., H, D] (the inputs of the LM head(s))."""
        x = self.head_input(x, root_emb)
        if self.token_inputs:
            if path_emb is None or path_emb.shape[-2] < self.num_heads - 1:
                raise ValueError(f"these heads read the tokens drafted on their path: pass path_emb [..., "
                                 f"{self.num_heads - 1}, D], the embeddings of y_1 .. y_{self.num_heads - 1}")
            return torch.stack([self.block(self.path_input(x, path_emb[..., :h, :].flip(-2)), h)   # y_h, y_{h-1}, ..
                                for h in range(self.num_heads)], -2)
        pre = torch.einsum("...d,hed->...he", x, self.res_weight) + self.res_bias
        return x.unsqueeze(-2) + nn.functional.silu(pre)

    def draft_weights(self, model_lm_head_weight):
        """What the drafting kernel scores: (lm_head, token_map), for `fused_draft(..., token_map=token_map)`.

        model_lm_head_weight [V, D]: the target model's LM head (used when the heads have none of their own).
        lm_head: [V', D] (shared) or [H, V', D] (per head) — the rows of the draft vocabulary, pre-gathered —
        in the dtype and on the device of model_lm_head_weight, contiguous; V' = V without a draft vocabulary.
        token_map: int64 [V'] on that device (row r of lm_head is token token_map[r]), or None (row r is token r).
        Computed once and reused until a weight changes (in place or replaced) or the model's head is another one.
        """
        W = model_lm_head_weight.detach()
        if W.dim() != 2 or W.shape[1] != self.hidden_size:
            raise ValueError(f"draft_weights: the model's LM head must be [V, {self.hidden_size}], got "
                             f"{tuple(W.shape)}")
        V = W.shape[0]
        if self.lm_head is not None and self.lm_head.shape[1] != V:
            raise ValueError(f"draft_weights: the heads' own LM heads have {self.lm_head.shape[1]} rows but the "
                             f"model's vocabulary is {V}: they were trained for another model")
        own, tm = self.lm_head, self._token_map
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape)) for t in (W, own, tm)
                    if t is not None) + (own is None, tm is None)
        if self._draft_cache is not None and self._draft_cache[0] == key:
            return self._draft_cache[2]
        if tm is not None and int(tm[-1]) >= V:
            raise ValueError(f"draft_weights: token_map has id {int(tm[-1])}, outside the model's vocabulary {V}")
        rows = W if own is None else own.detach()                           # [V, D] or [H, V, D]
        if tm is not None:
            tm = tm.to(W.device)
            rows = rows.index_select(-2, tm.to(rows.device))                # [V', D] or [H, V', D]
        out = (rows.to(W.device, W.dtype).contiguous(), tm)
        self._draft_cache = (key, W, out)          # holding W keeps its storage (and so the key) from being reused
        return out

    def save(self, path, **meta):
        """Write heads.safetensors + heads.json into the folder `path`; meta goes to heads.json.

        Both files are rendered in memory first (metadata that is not JSON raises before any file is touched),
        then each is written atomically (`files.write_bytes`: temporary file, fsync, os.replace), tensors
        first: a full disk or a file-size limit leaves the previous heads byte-identical."""
        if "tree" in meta:
            raise ValueError("MTPHeads.save: set heads.tree to store a tree, not a metadata key")
        tensors = {"res_weight": self.res_weight, "res_bias": self.res_bias, "lm_head": self.lm_head,
                   "token_map": self._token_map, "root_proj": self.root_proj, "token_proj": self.token_proj}
        data = save({k: t.detach().contiguous().cpu() for k, t in tensors.items() if t is not None})
        info = {"num_heads": self.num_heads, "hidden_size": self.hidden_size, "format": "mtp_triton.heads/1"}
        if self.lm_head is not None:
            info["vocab_size"] = self.vocab_size
        if self.root_proj is not None:
            info["root_input"] = True
        if self.token_proj is not None:
            info["token_inputs"] = self.token_inputs
        if self._token_map is not None:
            info["draft_vocab_size"] = int(self._token_map.numel())
        if self._tree is not None:
            info["tree"] = [list(c) for c in self._tree]
        info.update(meta)
        try:
            json.dumps(info)
        except (TypeError, ValueError) as e:
            raise TypeError(f"MTPHeads.save: the metadata must be JSON-serialisable ({e}); nothing was written") \
                from None
        os.makedirs(path, exist_ok=True)
        write_bytes(os.path.join(path, HEADS_FILE), data)
        write_json(os.path.join(path, "heads.json"), info, indent=2)


# ---- loading ----------------------------------------------------------------------------------------------
def _heads_file(path):
    """-> (file, "mtp" | "medusa") for a heads folder or file."""
    if os.path.isdir(path):
        for name, kind in ((HEADS_FILE, "mtp"), (MEDUSA_FILES[0], "medusa"), (MEDUSA_FILES[1], "medusa")):
            if os.path.isfile(os.path.join(path, name)):
                return os.path.join(path, name), kind
        raise FileNotFoundError(f"load_heads: no {HEADS_FILE} (mtp_triton) or {' / '.join(MEDUSA_FILES)} (Medusa) "
                                f"in {path!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_heads: {path!r} does not exist (expected a folder with {HEADS_FILE})")
    if path.endswith(".pt"):
        return path, "medusa"
    if path.endswith(".safetensors"):
        return path, "mtp" if os.path.basename(path) == HEADS_FILE else "auto"
    raise ValueError(f"load_heads: {path}: unsupported format; expected {HEADS_FILE} (mtp_triton), "
                     f"{MEDUSA_FILES[0]} or {MEDUSA_FILES[1]} (Medusa, read with torch.load(weights_only=True))")


def _read(file):
    """All tensors of a .safetensors or (weights only) .pt file."""
    if file.endswith(".pt"):
        if os.path.getsize(file) == 0:
            raise ValueError(f"load_heads: {file} is empty (0 bytes): an interrupted download or copy? Get the file "
                             "again")
        try:
            sd = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:        # a corrupted file makes the unpickler raise nearly anything (IndexError, ...)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"load_heads: {file} is not a plain state dict of tensors (torch.load(weights_only="
                             f"True) refused it: {' '.join(str(first).split())}); the file may be truncated or "
                             "corrupted, or hold more than tensors") from None
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise ValueError(f"load_heads: {file} must hold a state dict (name -> tensor), got {type(sd).__name__}")
        return dict(sd)
    try:
        return load_file(file)
    except Exception as e:                                       # safetensors raises its own SafetensorError
        raise ValueError(f"load_heads: {file}: cannot read it as safetensors ({e})") from None


def _medusa_tensors(sd, file):
    """Medusa's {i}.0.linear.weight / {i}.0.linear.bias / {i}.1.weight -> res_weight, res_bias, lm_head."""
    heads, unexpected = {}, []
    for k, v in sd.items():
        m = _MEDUSA_KEY.match(k)
        if m is None:
            unexpected.append(k)
        else:
            heads.setdefault(int(m[1]), {})[f"{m[2]}.{m[3]}"] = v
    if unexpected or not heads:
        raise ValueError(f"load_heads: {file} is not a Medusa head state dict: unexpected keys {unexpected[:5]} "
                         "(expected {i}.0.linear.weight, {i}.0.linear.bias, {i}.1.weight per head i)")
    H = len(heads)
    if sorted(heads) != list(range(H)):
        raise ValueError(f"load_heads: {file}: head indices {sorted(heads)} are not 0..{H - 1}")
    for i, parts in heads.items():
        blocks = sum(k.endswith(".linear.weight") for k in parts)
        if blocks != 1:
            raise ValueError(f"load_heads: {file}: head {i} has {blocks} ResBlocks (medusa_num_layers={blocks}); "
                             "these heads have exactly one ResBlock each")
        if set(parts) != {"0.linear.weight", "0.linear.bias", "1.weight"}:
            raise ValueError(f"load_heads: {file}: head {i} has {sorted(parts)}; expected 0.linear.weight, "
                             "0.linear.bias and 1.weight")
    lm0 = heads[0]["1.weight"]
    if lm0.dim() != 2:
        raise ValueError(f"load_heads: {file}: head 0 has 1.weight {tuple(lm0.shape)}, expected [V, D]")
    V, D = lm0.shape
    for i in range(H):                         # every head: the same hidden size D and vocabulary V as head 0
        for k, shape in (("0.linear.weight", (D, D)), ("0.linear.bias", (D,)), ("1.weight", (V, D))):
            got = tuple(heads[i][k].shape)
            if got != shape:
                raise ValueError(f"load_heads: {file}: head {i} has {k} {got}, expected {shape} as head 0's "
                                 f"1.weight is {(V, D)}: every head must read the same hidden size and score the "
                                 "same vocabulary")
    w = torch.stack([heads[i]["0.linear.weight"] for i in range(H)])
    b = torch.stack([heads[i]["0.linear.bias"] for i in range(H)])
    lm = torch.stack([heads[i]["1.weight"] for i in range(H)])
    return {"res_weight": w, "res_bias": b, "lm_head": lm}


META_INTS = ("num_heads", "hidden_size", "vocab_size", "draft_vocab_size", "token_inputs")   # heads.json's counts


def _read_meta(folder, H, D, file):
    """heads.json next to our heads.safetensors ({} if absent): a JSON object in UTF-8 whose fields that describe
    the tensors (META_INTS, root_input) have their types; num_heads and hidden_size are checked against the file."""
    meta_file = os.path.join(folder, "heads.json")
    if not os.path.exists(meta_file):
        return {}
    try:
        with open(meta_file, encoding="utf-8") as f:
            meta = json.load(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"load_heads: {meta_file}: not UTF-8 text (byte {e.start}: {e.reason}); heads.json is "
                         "JSON in UTF-8") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"load_heads: {meta_file}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"load_heads: {meta_file}: must hold a JSON object ({{\"num_heads\": ..., ...}}), got "
                         f"{type(meta).__name__ if meta is not None else 'null'}")
    for key in META_INTS:
        v = meta.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"load_heads: {meta_file}: {key} must be an int, got {v!r} (a {type(v).__name__})")
    if not isinstance(meta.get("root_input", False), bool):
        raise ValueError(f"load_heads: {meta_file}: root_input must be true or false, got {meta['root_input']!r}")
    if meta.get("num_heads", H) != H or meta.get("hidden_size", D) != D:
        raise ValueError(f"load_heads: {meta_file} says {meta.get('num_heads')} heads of size "
                         f"{meta.get('hidden_size')}, but {file} holds {H} of size {D}")
    return meta


def load_heads(path, device=None, dtype=None, *, check_finite=True):
    """Load heads: a folder or file saved by `MTPHeads.save` / the training script, or a Medusa checkpoint
    (a folder with medusa_lm_head.safetensors / .pt, or the file itself). dtype None keeps the file's.

    Bad files raise a ValueError naming the file (and the tensor or heads.json field) and what is wrong.
    check_finite: refuse tensors holding NaN/Inf (a corrupted file drafts garbage), as `load_model` does."""
    file, kind = _heads_file(path)
    tensors = _read(file)
    if check_finite:
        check_finite_tensors(tensors, file)
    if kind == "auto":                       # a .safetensors under another name: ours or Medusa's, by its keys
        kind = "mtp" if "res_weight" in tensors else "medusa"
    if kind == "medusa":
        tensors = _medusa_tensors(tensors, file)
    allowed = {"res_weight", "res_bias", "lm_head", "token_map", "root_proj", "token_proj"}
    if not {"res_weight", "res_bias"} <= set(tensors) <= allowed:
        raise ValueError(f"load_heads: {file} must hold res_weight and res_bias (optionally lm_head, token_map, "
                         f"root_proj, token_proj), found {sorted(tensors)}")
    w, b, lm = tensors["res_weight"], tensors["res_bias"], tensors.get("lm_head")
    if w.dim() != 3 or w.shape[1] != w.shape[2] or tuple(b.shape) != (w.shape[0], w.shape[1]):
        raise ValueError(f"load_heads: {file}: bad shapes res_weight {tuple(w.shape)}, res_bias {tuple(b.shape)}")
    H, D = w.shape[:2]
    if lm is not None and (lm.dim() != 3 or lm.shape[0] != H or lm.shape[2] != D):
        raise ValueError(f"load_heads: {file}: bad shapes lm_head {tuple(lm.shape)}, expected [{H}, V, {D}]")
    rp = tensors.get("root_proj")
    if rp is not None and tuple(rp.shape) != (D, D):
        raise ValueError(f"load_heads: {file}: bad shape root_proj {tuple(rp.shape)}, expected [{D}, {D}]")
    tp = tensors.get("token_proj")
    if tp is not None and (tp.dim() != 3 or tuple(tp.shape[1:]) != (D, D) or not 1 <= tp.shape[0] < H):
        raise ValueError(f"load_heads: {file}: bad shape token_proj {tuple(tp.shape)}, expected [Q, {D}, {D}] with "
                         f"1 <= Q < {H}")
    meta_file = os.path.join(os.path.dirname(file), "heads.json")
    meta = _read_meta(os.path.dirname(file), H, D, file) if kind == "mtp" else {}
    for key, n, what in (("vocab_size", None if lm is None else lm.shape[1], "lm_head"),
                         ("draft_vocab_size", None if tensors.get("token_map") is None else
                          tensors["token_map"].numel(), "token_map")):
        if meta.get(key) is not None and meta[key] != n:
            raise ValueError(f"load_heads: {meta_file} says {key} {meta[key]}, but {file} has "
                             f"{f'{what} for {n}' if n is not None else f'no {what}'}")
    if meta.get("root_input") and rp is None:
        raise ValueError(f"load_heads: {file}: heads.json says root_input but the file has no root_proj")
    if meta.get("token_inputs", 0) != (0 if tp is None else tp.shape[0]):
        raise ValueError(f"load_heads: {file}: heads.json says token_inputs {meta.get('token_inputs', 0)} but the "
                         f"file has {'no token_proj' if tp is None else f'token_proj for {tp.shape[0]}'}")
    heads = MTPHeads(H, D, dtype=dtype or w.dtype, device=device, vocab_size=None if lm is None else lm.shape[1],
                     root_input=rp is not None, token_inputs=0 if tp is None else tp.shape[0])
    heads.meta = dict(meta)
    try:
        heads.token_map = tensors.get("token_map")
    except ValueError as e:
        raise ValueError(f"load_heads: {file}: {e}") from None
    try:
        heads.tree = meta.get("tree")
    except ValueError as e:
        raise ValueError(f"load_heads: {meta_file}: tree: {e}") from None
    with torch.no_grad():
        heads.res_weight.copy_(w)
        heads.res_bias.copy_(b)
        if lm is not None:
            heads.lm_head.copy_(lm)
        if rp is not None:
            heads.root_proj.copy_(rp)
        if tp is not None:
            heads.token_proj.copy_(tp)
    return heads.eval()


def init_heads(model, num_heads=4, seed=0, scale=1.0):
    """Random (non-identity) heads for `model` (an mtp_triton model or anything with .hidden_size)."""
    D = model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(num_heads, D, D, generator=g, dtype=torch.float64) * (scale / D ** 0.5)
    b = torch.randn(num_heads, D, generator=g, dtype=torch.float64) * 0.1 * scale
    p = next(iter(model.parameters()))
    heads = MTPHeads(num_heads, D, dtype=p.dtype, device=p.device)
    with torch.no_grad():
        heads.res_weight.copy_(w)
        heads.res_bias.copy_(b)
    return heads.eval()
