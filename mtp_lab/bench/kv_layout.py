"""KV-cache layouts measured: contiguous vs paged vs block-interleaved, for the append and the read pattern.

The claim under test (an MTP-on-NPU engineering report, BM1684, section 2.2): a *block-interleaved* KV layout —
token p of a sequence goes to block p mod n, offset p // n — "cut memory access latency by 42 %" on the author's NPU
by avoiding bank conflicts. Three layouts of one layer's cache, each holding B sequences of `capacity` tokens,
one token row = Hkv x Dh contiguous elements:

    contiguous   cache [B, capacity, Hkv, Dh]            token p of seq b -> row b * capacity + p
    paged        pool [NB, BS, Hkv, Dh] + block table    token p -> row table[b, p // BS] * BS + p % BS
    interleaved  pool [NB, BLK, Hkv, Dh], n blocks/seq   token p -> row table[b, p % n] * BLK + p // n
                 (BLK = capacity / n tokens per block; the NPU report's n = 8)

Patterns (what a decoder does with the cache):
    read    the first `n_read` tokens of every sequence, in order (what attention reads each step);
    append  `n_new` tokens at each sequence's own cache_len (what kv_append writes each step).

Implementations timed:
    torch-slice    (contiguous only) one strided slice copy — the best case;
    torch-gather   the same op for every layout: index_select / index_copy_ of whole token rows with the
                   layout's row ids, so only the addresses differ;
    triton         (GPU only) a tile kernel shaped like attention's K/V loads: one program per
                   (BLOCK_N tokens, sequence, kv head) copying a [BLOCK_N, Dh] tile, row ids computed in-kernel.
On CPU the Triton kernel runs in the interpreter, so it is only checked for correctness there, never timed.
"""
import torch
import triton
import triton.language as tl

from .common import bench_device, env_info, kernel_parser, png_next_to, save_figure, save_rows, time_fn

LAYOUTS = ("contiguous", "paged", "interleaved")
_LAYOUT_ID = {name: i for i, name in enumerate(LAYOUTS)}
# GPU: 16 sequences of 4096 tokens; 1 / 8 / 32 KV heads of 128 (bf16 rows of 256 B, 2 KiB, 8 KiB)
GPU_SIZES = dict(B=16, capacity=4096, heads=(1, 8, 32), Dh=128, n_reads=(512, 4096), n_new=5, dtype=torch.bfloat16)
# CPU: small enough for a notebook, large enough (16 MiB caches at 8 heads) not to live in L2
CPU_SIZES = dict(B=4, capacity=2048, heads=(1, 8), Dh=128, n_reads=(256, 2048), n_new=5, dtype=torch.float16)


class Layout:
    """Row ids of a layout: `rows(pos)` maps positions [B, n] to rows of the flat [rows, Hkv * Dh] storage.

    All three layouts hold the same B * capacity rows; paged and interleaved draw their blocks from one
    shuffled pool (an allocator after some churn hands out blocks in no particular order).
    """

    def __init__(self, name, B, capacity, block_size=16, n_interleave=8, seed=0, device="cpu"):
        if name not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {name!r}")
        self.name, self.B, self.capacity = name, B, capacity
        if name == "paged":
            self.bs = block_size
        elif name == "interleaved":
            if capacity % n_interleave:
                raise ValueError(f"interleaved: capacity {capacity} must be a multiple of n={n_interleave}")
            self.bs = capacity // n_interleave      # tokens per block
        else:
            self.bs = capacity                      # one "block" per sequence
        if capacity % self.bs:
            raise ValueError(f"{name}: capacity {capacity} must be a multiple of the block size {self.bs}")
        self.n_per_seq = capacity // self.bs         # blocks per sequence (interleaved: n)
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(B * self.n_per_seq, generator=g) if name != "contiguous" \
            else torch.arange(B * self.n_per_seq)
        self.block_table = perm.view(B, self.n_per_seq).to(torch.int32).to(device)   # [B, n_per_seq]

    @property
    def num_rows(self):
        return self.B * self.capacity

    def rows(self, pos):
        """pos [B, n] int64 positions -> [B, n] int64 rows of the flat storage."""
        b = torch.arange(self.B, device=pos.device)[:, None]
        table = self.block_table.long()
        if self.name == "contiguous":
            return b * self.capacity + pos
        if self.name == "paged":
            return table[b, pos // self.bs] * self.bs + pos % self.bs
        n = self.n_per_seq                                  # interleaved: p -> block p % n, offset p // n
        return table[b, pos % n] * self.bs + pos // n


@triton.jit
def _layout_copy_kernel(
    cache_ptr,                # [rows, Hkv * Dh] flat storage of one layer
    buf_ptr,                  # [B, n_tok, Hkv * Dh] dense tokens (read: output; append: input)
    block_table_ptr,          # [B, n_per_seq] int32
    start_ptr,                # [B] int32 first position per sequence (read: 0; append: cache_len)
    n_tok, n_per_seq, capacity, Hkv, Dh,
    LAYOUT: tl.constexpr,     # 0 contiguous, 1 paged, 2 interleaved
    WRITE: tl.constexpr,      # False: cache -> buf (read); True: buf -> cache (append)
    BLK: tl.constexpr,        # tokens per block
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    h = (pid_bh % Hkv).to(tl.int64)
    i = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                           # [BLOCK_N] token index
    tok_ok = i < n_tok
    p = tl.load(start_ptr + b).to(tl.int64) + i                           # position in the sequence
    if LAYOUT == 0:
        row = b * capacity + p
    elif LAYOUT == 1:
        row = tl.load(block_table_ptr + b * n_per_seq + p // BLK, mask=tok_ok, other=0).to(tl.int64) * BLK + p % BLK
    else:
        row = tl.load(block_table_ptr + b * n_per_seq + p % n_per_seq, mask=tok_ok, other=0).to(tl.int64) * BLK \
            + p // n_per_seq
    d = tl.arange(0, BLOCK_D)
    mask = tok_ok[:, None] & (d < Dh)[None, :]
    ROW = Hkv * Dh
    cache_off = row[:, None] * ROW + h * Dh + d[None, :]                  # [BLOCK_N, BLOCK_D]
    buf_off = (b * n_tok + i)[:, None] * ROW + h * Dh + d[None, :]
    if WRITE:
        tl.store(cache_ptr + cache_off, tl.load(buf_ptr + buf_off, mask=mask), mask=mask)
    else:
        tl.store(buf_ptr + buf_off, tl.load(cache_ptr + cache_off, mask=mask), mask=mask)


def triton_copy(layout, cache, buf, start, write, block_n=32):
    """Read (write=False: cache -> buf) or append (write=True: buf -> cache) with the Triton tile kernel.

    cache [layout.num_rows, Hkv, Dh]; buf [B, n_tok, Hkv, Dh]; start [B] int32 first position per sequence.
    """
    B, n_tok, Hkv, Dh = buf.shape
    if cache.shape != (layout.num_rows, Hkv, Dh) or not (cache.is_contiguous() and buf.is_contiguous()):
        raise ValueError("triton_copy: cache must be contiguous [rows, Hkv, Dh] matching buf [B, n, Hkv, Dh]")
    grid = (triton.cdiv(n_tok, block_n), B * Hkv)
    _layout_copy_kernel[grid](cache, buf, layout.block_table, start, n_tok, layout.n_per_seq, layout.capacity,
                              Hkv, Dh, LAYOUT=_LAYOUT_ID[layout.name], WRITE=write, BLK=layout.bs,
                              BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(Dh))


def _op(impl, pattern, lay, cache, buf, idx, start):
    """The callable timed for one (implementation, pattern, layout); None where it does not apply.

    cache [rows, Hkv, Dh]; buf [B, n, Hkv, Dh]; idx [B * n] the layout's row of each token of buf.
    """
    B, n, Hkv, Dh = buf.shape
    flat, flat_buf = cache.view(-1, Hkv * Dh), buf.view(B * n, Hkv * Dh)
    if impl == "torch-slice":                       # contiguous read only: one strided slice
        if lay.name != "contiguous" or pattern != "read":
            return None
        view = cache.view(B, lay.capacity, Hkv, Dh)
        return lambda: buf.copy_(view[:, :n])
    if impl == "torch-gather":                      # same op for every layout, only the rows differ
        if pattern == "read":
            return lambda: torch.index_select(flat, 0, idx, out=flat_buf)
        return lambda: flat.index_copy_(0, idx, flat_buf)
    if impl == "triton":
        return lambda: triton_copy(lay, cache, buf, start, write=(pattern == "append"))
    raise ValueError(f"unknown impl {impl!r}")


def layout_rows(full=None, device=None, block_size=16, n_interleave=8, seed=0, sizes=None):
    """Time every (pattern, layout, implementation, kv heads, tokens) once; returns rows (dicts) with env_info().

    full: GPU_SIZES (default: when CUDA is available), else CPU_SIZES; sizes: a dict overriding some of them.
    time_s is the median seconds per call; gbps counts bytes read + written.
    """
    device, on_gpu = bench_device(device)
    full = on_gpu if full is None else full
    s = dict(GPU_SIZES if full else CPU_SIZES, **(sizes or {}))
    impls = ["torch-slice", "torch-gather"] + (["triton"] if on_gpu else [])
    env = env_info(device)
    g = torch.Generator().manual_seed(seed)                       # small index tensors, on the CPU
    g_dev = torch.Generator(device=device).manual_seed(seed)      # the large ones, drawn in place
    rows = []
    B, cap, Dh = s["B"], s["capacity"], s["Dh"]
    for Hkv in s["heads"]:
        cache = torch.randn(B * cap, Hkv, Dh, generator=g_dev, device=device, dtype=s["dtype"])
        row_bytes = Hkv * Dh * cache.element_size()
        for name in LAYOUTS:
            lay = Layout(name, B, cap, block_size, n_interleave, seed, device)
            cases = [("read", n, torch.zeros(B, dtype=torch.int32)) for n in s["n_reads"]]
            starts = torch.randint(0, cap - s["n_new"] + 1, (B,), generator=g, dtype=torch.int32)
            cases.append(("append", s["n_new"], starts))
            for pattern, n, start in cases:
                start = start.to(device)
                pos = start.long()[:, None] + torch.arange(n, device=device)[None, :]      # [B, n]
                idx = lay.rows(pos).flatten()                                             # [B * n]
                buf = torch.randn(B, n, Hkv, Dh, generator=g_dev, device=device, dtype=s["dtype"])
                for impl in impls:
                    fn = _op(impl, pattern, lay, cache, buf, idx, start)
                    if fn is None:
                        continue
                    t = time_fn(fn, warmup=2, rep=5 if on_gpu else 11, device=device)
                    nbytes = 2 * B * n * row_bytes
                    rows.append(dict(kernel="kv_layout", pattern=pattern, layout=name, impl=impl, batch=B,
                                     capacity=cap, kv_heads=Hkv, head_dim=Dh, row_bytes=row_bytes, tokens=n,
                                     block_size=lay.bs, dtype=str(s["dtype"]).replace("torch.", ""),
                                     time_s=t, bytes=nbytes, gbps=nbytes / t / 1e9, full=full, **env))
    return rows


def plot(rows, path):
    """Bars of achieved GB/s per layout, one panel per (pattern, tokens), grouped by kv heads; torch-gather
    (and triton where measured). Drawn from the rows only."""
    from matplotlib.figure import Figure

    panels = sorted({(r["pattern"], int(r["tokens"])) for r in rows}, key=lambda x: (x[0] != "read", x[1]))
    impls = [i for i in ("torch-gather", "triton") if any(r["impl"] == i for r in rows)]
    fig = Figure(figsize=(3.6 * len(panels), 2.8 * len(impls)))
    axes = fig.subplots(len(impls), len(panels), squeeze=False)
    heads = sorted({int(r["kv_heads"]) for r in rows})
    for a, impl in enumerate(impls):
        for c, (pattern, n) in enumerate(panels):
            ax = axes[a][c]
            for k, name in enumerate(LAYOUTS):
                ys = []
                for h in heads:
                    m = [float(r["gbps"]) for r in rows if r["impl"] == impl and r["layout"] == name
                         and r["pattern"] == pattern and int(r["tokens"]) == n and int(r["kv_heads"]) == h]
                    ys.append(m[0] if m else 0.0)
                ax.bar([i + 0.27 * (k - 1) for i in range(len(heads))], ys, width=0.27, label=name)
            ax.set_xticks(range(len(heads)), [f"{h} kv heads" for h in heads])
            ax.set_title(f"{impl}: {pattern} {n} tok/seq", fontsize=9)
            ax.set_ylabel("GB/s (read + write)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"KV layouts on {rows[0]['device'] if rows else ''}", fontsize=10)
    return save_figure(fig, path)


def main(argv=None):
    ap = kernel_parser(__doc__, "results/kv_layout.csv", png_next_to_csv=True, module="mtp_lab.bench.kv_layout")
    ap.add_argument("--full", action="store_true", help="full sizes even on CPU (slow)")
    ap.add_argument("--n-interleave", type=int, default=8, help="blocks a sequence is interleaved over")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.full:
        print("no GPU: running at small CPU size (torch ops only; numbers are CPU numbers)")
    rows = layout_rows(full=True if args.full else None, n_interleave=args.n_interleave)
    save_rows(rows, args.out, plot, args.plot or png_next_to(args.out),
              line=lambda r: f"{r['pattern']:6} {r['layout']:11} {r['impl']:12} heads {r['kv_heads']:>2} tok "
                             f"{r['tokens']:>5}: {r['time_s'] * 1e6:9.1f} us  {r['gbps']:7.2f} GB/s")


if __name__ == "__main__":
    main()
