"""Prepacked weights on the CPU: the engine's linear layers as oneDNN matmuls on weights reordered once.

A matmul of a few rows streams its weight; with nn.Linear the weight is in PyTorch's row-major layout, and oneDNN
reorders it (bf16) or MKL runs a generic small-M path (fp32) on every call. `torch.ops.mkldnn._reorder_linear_weight`
reorders it once (this is what inductor's `freezing` pass does to the weights of a compiled model), and
`torch.ops.mkldnn._linear_pointwise` multiplies by the packed copy, so a decode step's few-row matmuls (and the
large LM head) skip that per-call work.

Where packing applies (`packing_applies` probes the running machine once per dtype):
  bf16  the packed matmul gives nn.Linear's bits at every row count, so packing changes no output at all and keeps
        every property of the plain layers, the row invariance that `invariant.linear` needs included.
  fp32  the packed matmul sums in another order than nn.Linear (results differ in the last bits, ~1e-6 relative,
        as two BLAS libraries differ), and gives each row the same bits whether it is computed with 2 or 32 others.
        fp32 decoding matches transformers token for token as before (tests/test_loading.py, the demo's count);
        `model.pack_weights = False` restores nn.Linear's bits.
Two fusions come with it, exact for the same reason (a row's bits do not depend on the number of columns): q, k and
v are one matmul [D -> (Hq + 2 Hkv) Dh], gate and up one [D -> 2F]. That turns 7 matmuls per layer into 4.

Cost: a second copy of the linear weights (the packed one), built on the first forward and rebuilt whenever a
weight changes (a new tensor or an in-place update), so training and `model.to` stay safe.
"""
import functools

import torch
import torch.nn.functional as F

from . import invariant


def _pointwise(x, packed, b):
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


@torch.library.custom_op("mtp_triton::packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None, n: int) -> torch.Tensor:
    """x [M, K] -> [M, n] through a packed weight, in the row pieces of `invariant.linear` (2 .. MATMUL_ROWS rows).
    `torch.compile` sees this op whole: inductor cannot lower `_linear_pointwise` on a packed weight that is an input
    rather than a frozen constant (compiled.py), and splitting the rows here, out of the compiler's sight, keeps
    one graph for every node count (split in the graph, each count above MATMUL_ROWS would be a graph of its own)."""
    return invariant.linear(lambda r: _pointwise(r, packed, b), x)


@_packed_linear_op.register_fake
def _(x, packed, b, n):
    return x.new_empty(x.shape[0], n)


class PackedLinear:
    """x [..., K] -> x @ w.T + b [..., N] through the packed copy of w [N, K] (bf16 or fp32, CPU). Eager calls go
    straight to oneDNN; inside `torch.compile` the same call goes through the custom op above, which computes the rows
    in invariant.linear's pieces (the only caller while compiling is the exact path's invariant.linear, which hands
    it all rows: `splits_rows`). Eager calls do not take the op: its Python wrapper would add to every one of a
    step's matmul calls."""

    splits_rows = True                      # while compiling; read by invariant.linear

    def __init__(self, w, b):
        self.w, self.b, self.n = w, b, w.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
        self.one_row_exact = one_row_exact(w.shape[1], w.shape[0], w.dtype, b is not None)

    def __call__(self, x):
        if x.requires_grad and torch.is_grad_enabled():     # the packed op has no backward: the plain matmul
            return F.linear(x, self.w, self.b)
        if not torch.compiler.is_compiling():
            return _pointwise(x, self.packed, self.b)           # any leading dims, in one call
        out = torch.ops.mtp_triton.packed_linear(x.reshape(-1, x.shape[-1]), self.packed, self.b, self.n)
        return out.view(*x.shape[:-1], self.n)


@functools.lru_cache(maxsize=None)
def one_row_exact(k, n, dtype, bias, rows=8):
    """Does a packed [k -> n] matmul on this machine give a row alone the bits it gets among `rows` others? Then
    `invariant.linear` hands a serial step's single row straight to it (`PackedLinear.one_row_exact`) rather than beside
    a copy of itself (half the rows to multiply). oneDNN picks a kernel by shape and machine, and a 1-row kernel may
    sum in another order, which random inputs show only now and then (bf16 output hides most of it: a layer can pass
    a few random rows and still decode differently). So the probe sums inputs on which the order shows in nearly
    every output (`invariant.order_sensitive`). Once per shape and process."""
    x, w = invariant.order_sensitive(rows, k, n, dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
    b = torch.zeros(n, dtype=dtype) if bias else None
    many = _pointwise(x, packed, b)
    return all(torch.equal(_pointwise(x[i:i + 1], packed, b), many[i:i + 1]) for i in range(rows))


@functools.lru_cache(maxsize=None)
def packing_applies(dtype):
    """Can this machine pack `dtype` weights with the properties the module docstring lists? A probe on the shapes of
    a small Llama (576 -> 960, 1536 -> 576, 576 -> 3072, with and without a bias), a few ms, once per process:
    bf16: the bits of nn.Linear at 1 .. 33 rows; fp32: within 1e-5 of nn.Linear. Both: each row the same bits among
    2 .. 32 rows (the calls `invariant.linear` makes, and the tree steps of an fp32 model)."""
    if dtype not in (torch.bfloat16, torch.float32) or not torch.backends.mkldnn.is_available():
        return False
    try:
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        g = torch.Generator().manual_seed(0)
        for k, n in ((576, 960), (1536, 576), (576, 3072)):
            w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
            b = (torch.randn(n, generator=g) * 0.05).to(dtype)
            f, fb = PackedLinear(w, None), PackedLinear(w, b)
            x = torch.randn(33, k, generator=g).to(dtype)
            full = fb(x[:32])
            for m in (1, 2, 7, 25, 32, 33):
                for fn, want in ((f, F.linear(x[:m], w)), (fb, F.linear(x[:m], w, b))):
                    got = fn(x[:m])
                    if not (torch.equal(got, want) if dtype == torch.bfloat16 else
                            torch.allclose(got, want, rtol=1e-5, atol=1e-5)):
                        return False
                if 2 <= m <= 32 and not torch.equal(fb(x[32 - m:32]), full[32 - m:]):
                    return False
        return True
    except (RuntimeError, AttributeError):       # a torch build without these ops
        return False


def packed_linear(w, b=None):
    """x [..., K] -> x @ w.T + b [..., N] for w [N, K] on the CPU as a prepacked matmul, where `packing_applies` to
    w's dtype (bf16: nn.Linear's bits); else None. For weights outside the engine (the drafter's)."""
    if w.device.type != "cpu" or not packing_applies(w.dtype):
        return None
    return PackedLinear(w.contiguous(), b)


def _cat(*ts):
    return None if ts[0] is None else torch.cat(ts).contiguous()


class Packed:
    """The packed layers of one LlamaEngine: per layer qkv, o, gate_up, down (PackedLinear), and lm_head."""

    def __init__(self, model):
        self.slots = [(m._parameters, name, w) for m in model.modules() for name, w in m._parameters.items()
                      if w is not None]                               # every weight, and where the model holds it
        self.key = self.key_of()
        self.qkv, self.o, self.gate_up, self.down = [], [], [], []
        for blk in model.layers:
            q, k, v = blk.q_proj, blk.k_proj, blk.v_proj
            self.qkv.append(PackedLinear(_cat(q.weight, k.weight, v.weight), _cat(q.bias, k.bias, v.bias)))
            self.o.append(PackedLinear(blk.o_proj.weight, blk.o_proj.bias))
            self.gate_up.append(PackedLinear(_cat(blk.gate_proj.weight, blk.up_proj.weight),
                                           _cat(blk.gate_proj.bias, blk.up_proj.bias)))
            self.down.append(PackedLinear(blk.down_proj.weight, blk.down_proj.bias))
        self.lm_head = PackedLinear(model.lm_head.weight, None)

    def __deepcopy__(self, memo):
        """A copied model packs its own weights on first use (oneDNN's packed tensors cannot be deep-copied)."""
        return None

    def layer(self, l):
        """Layer l's (qkv, o, gate_up, down)."""
        return self.qkv[l], self.o[l], self.gate_up[l], self.down[l]

    def key_of(self):
        """Storage and in-place version of every weight: a change to any of them means packing again."""
        return [(w.data_ptr(), w._version) for _, _, w in self.slots]

    def holds(self, model):
        """Are these still `model`'s weights, unchanged? False after a weight is replaced (a new Parameter), moved or
        converted (`model.to`: new storage), or updated in place (its version counter). The check walks the weights
        packing saw, a cheaper walk than `model.parameters()` (a step asks twice)."""
        return (len(self.qkv) == len(model.layers) and all(d.get(n) is w for d, n, w in self.slots)
                and self.key_of() == self.key)


def packs(model):
    """Does `model` decode on packed weights (a bf16 or fp32 model on the CPU, `model.pack_weights` on, and the probe
    passes on this machine)?"""
    return model.pack_weights and model.device.type == "cpu" and packing_applies(model.dtype)


def packed_layers(model):
    """model's Packed layers, built now or reused; None where `packs(model)` is False, or while autograd is recording:
    packing is an inference path, and with grad enabled the nn.Linear layers keep gradients flowing to the
    parameters."""
    if torch.is_grad_enabled() or not packs(model):
        return None
    p = model.__dict__.get("_packed")
    if p is None or not p.holds(model):
        p = model.__dict__["_packed"] = Packed(model)
    return p
