"""Batch-invariant linear layers and norms: the matmul half of the exact mode (its attention half is
`tree_attention(..., exact=True)`, kernels/tree_attention_ref.py, and the Triton kernel's exact variant).

Greedy bf16 MTP emits exactly the serial tokens only if every accepted node's logits have the bits serial decoding
computes there: two candidates often tie to within one rounding step, and any change in the order of a reduction flips
such a near-tie (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025,
https://thinkingmachines.ai/blog/defeating-nondeterminism-in-llm-inference/). A tree step changes two orders: (1) the
matmuls see T rows instead of 1 (this file), and (2) a node's ancestors come from the tree, not the cache (the
attention's business).

(1) is a property of the machine's matmuls, within limits: on oneDNN CPUs (AVX-512 BF16 and AMX), a bf16 matmul gives
each output row the same bits whatever the row's position, the number of columns or batch entries, and whatever the
number of rows from 2 to 32. Outside that range the kernel may change: on some CPUs a 1-row matmul takes another code
path, and on AMX CPUs oneDNN may block 33 rows or more differently for some shapes. So in
this mode every linear layer goes through `linear`, which never hands the matmul more than MATMUL_ROWS = 32 rows at
once, nor one row alone unless a probe of that layer on the running machine found its 1-row call exact (packed.py).
On a GPU the rule is stricter: cuBLAS picks its kernel (tile shape, split-K) by the problem's shape, so a 1-row and
a 25-row bf16 step can run through different kernels whose rows differ. There `linear` hands every call exactly
MATMUL_ROWS rows (the last piece padded with zero rows): one shape, one kernel, and a kernel computes each of its rows
alike. Torch's CUDA reductions also choose their launch by shape, so the norms go through `linear` too there
(`rowwise`). `row_invariance()` checks each of these properties, and the attention's, on the running machine, and
`generate` warns once if one fails.
"""
import torch

from .kernels.tree_attention_ref import CHUNK

MATMUL_ROWS = 32            # `linear` hands the matmul 2 .. MATMUL_ROWS rows at a time (a GPU: exactly MATMUL_ROWS)


def linear(layer, x):
    """layer(x) [..., N] for x [..., K] (layer: an nn.Linear or any row-wise function), computed in pieces so that
    each row rounds as it would in any other call. On a CPU: pieces of 2 .. MATMUL_ROWS rows (a 1-row piece is
    computed beside a copy of itself, unless the layer is `one_row_exact`: a packed linear whose probe found that its
    1-row call rounds as its many-row ones (packed.py); n = 33 splits as 31 + 2). On a GPU: pieces of exactly
    MATMUL_ROWS rows, the last padded with zero rows (one shape, so one cuBLAS kernel). While torch.compile traces, a
    layer that `splits_rows` itself (a packed linear's custom op, packed.py) gets all rows at once, so the graph does
    not depend on the row count."""
    if getattr(layer, "splits_rows", False) and torch.compiler.is_compiling():
        return layer(x)
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if rows.is_cuda:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, -n % MATMUL_ROWS))               # [ceil(n / 32) * 32, K]
        out = [layer(piece) for piece in rows.split(MATMUL_ROWS)]
        return (out[0] if len(out) == 1 else torch.cat(out))[:n].reshape(*x.shape[:-1], -1)
    if 2 <= n <= MATMUL_ROWS or (n == 1 and getattr(layer, "one_row_exact", False)):
        return layer(x)
    if n == 1:
        return layer(torch.cat([rows, rows]))[:1].reshape(*x.shape[:-1], -1)
    sizes = [MATMUL_ROWS] * (n // MATMUL_ROWS) + ([n % MATMUL_ROWS] if n % MATMUL_ROWS else [])
    if sizes[-1] == 1:
        sizes[-2:] = [MATMUL_ROWS - 1, 2]
    return torch.cat([layer(piece) for piece in rows.split(sizes)]).reshape(*x.shape[:-1], -1)


def rowwise(fn, x):
    """fn(x) for a row-wise function other than a matmul (the RMS norms: a reduction over each row): on a GPU through
    `linear`, since torch's CUDA reductions choose their launch (threads per row, blocks per row) by shape; on a CPU
    as it is (each row reduced alike at any row count, which `row_invariance` checks)."""
    return linear(fn, x) if x.is_cuda else fn(x)


def order_sensitive(rows, k, n, dtype, seed=0):
    """x [rows, k], w [n, k] in dtype on which x @ w.T rounds differently for nearly any change in the order of its
    sums over k: a third of the products are large (~2^10), a third cancel them exactly, a third are small (~2^-4),
    all interleaved, so the fp32 partial sums are large whenever a small product is added and lose bits of it that
    depend on when it is added. Probes use it to tell whether two matmul calls sum alike."""
    g = torch.Generator().manual_seed(seed)
    t = k // 3
    x = (1 + torch.rand(rows, k, generator=g)) * torch.randn(rows, k, generator=g).sign()
    x[:, t:2 * t] = x[:, :t]
    big = (1 + torch.rand(n, t, generator=g)) * 2.0 ** 10
    w = torch.cat([big, -big, torch.randn(n, k - 2 * t, generator=g) * 2.0 ** -4], 1)
    perm = torch.randperm(k, generator=g)
    return x[:, perm].to(dtype), w[:, perm].to(dtype)


def row_invariance(dtype=torch.bfloat16, device="cpu", trials=3):
    """Which of the exact mode's premises hold for `dtype` on `device`? -> {premise: bool}, each on the shapes of a
    small Llama and of Llama-2-7B:
      linear      `linear` gives a row the same bits in every call it makes (1 .. MATMUL_ROWS + 1 rows, at any
                  position): the 576 x 1536 MLP, the 49152-row LM head, a 4096 x 4096 projection
      norm        `rowwise` RMS norm gives a row the same bits at 1 .. 33 rows (D = 576 and 4096)
      attention   the exact attention's batched matmuls (kernels/tree_attention_ref.py: scores q @ k^T over Dh = 64
                  or 128, chunk partials p @ v over CHUNK keys) give a row the same bits whatever their row count
      cumsum      the double cumsum over chunks gives a row the same bits whatever the number of rows"""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)
    same_rows = lambda f, x, ms: all(torch.equal(f(x[..., -m:, :]), f(x)[..., -m:, :]) for m in ms)
    ms = (1, 2, 5, 17, MATMUL_ROWS)
    out = {}
    lin_ok = True
    for t in range(trials):
        k, n = ((576, 1536), (576, 49152), (4096, 4096))[t % 3]
        w = rand(n, k) * 0.05
        lin_ok &= same_rows(lambda v: linear(lambda r: torch.nn.functional.linear(r, w), v), rand(MATMUL_ROWS + 1, k),
                            ms)
    out["linear"] = lin_ok

    def rms(v):                                      # as model.RMSNorm, without its weight
        v32 = v.float()
        return (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(v.dtype)
    out["norm"] = all(same_rows(lambda v: rowwise(rms, v), rand(MATMUL_ROWS + 1, d), ms) for d in (576, 4096))
    out["attention"] = all(same_rows(lambda a: a @ b, rand(1, 99, k), (1, 3, 21, 63))
                           for k, n in ((64, 96), (128, 96), (CHUNK, 64), (CHUNK, 128)) for b in [rand(1, k, n)])
    c = torch.randn(40, 7, 128, generator=g).double().to(device)                   # [rows, chunks, Dh]
    out["cumsum"] = all(torch.equal(torch.cumsum(x[-m:], 1), torch.cumsum(x, 1)[-m:])   # o's (over chunks), l's (last)
                        for x in (c, c[..., 0].contiguous()) for m in (1, 3, 21))
    return out


def matmul_is_row_invariant(dtype=torch.bfloat16, device="cpu"):
    """Do all of `row_invariance`'s premises hold for `dtype` on `device`?"""
    return all(row_invariance(dtype, device).values())
