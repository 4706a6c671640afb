"""Benchmark: tree attention over a paged cache — Triton kernel vs SDPA with an explicit mask vs the reference.

What is measured (one layer, one verification step):
  * triton       `mtp_triton.kernels.tree_attention.tree_attention` on the paged cache, as a user calls it: its
                 value checks read the mask, lengths and block ids (host syncs: in the first H200 run, results/
                 nvidia-h200/, every checked call took 0.66 ms or more, at sizes where SDPA took 0.04 ms)
  * triton-launch  the same with check_values=False: what the decoding loop runs (it builds those inputs itself)
  * sdpa         `F.scaled_dot_product_attention` with an explicit [B, 1, T, ctx + T] bool mask over a cache
                 that is already contiguous (the gather not timed: SDPA's best case)
  * sdpa+gather  the same, timing the gather of the paged cache into a contiguous copy too (what a paged
                 engine must do to use SDPA)
  * reference    `mtp_triton.reference.tree_attention` (PyTorch, one sequence at a time)

Achieved bandwidth = KV bytes the step must read / time, with
    KV bytes = sum_b (cache_len_b + T) * Hkv * Dh * 2 (K and V) * element size,
and it is compared with `copy_bandwidth()` (measured device-to-device copy, read + write counted).

    python -m mtp_lab.bench.tree_attention --out results/tree_attention.csv --plot results/tree_attention.png

On a GPU: Llama-7B (32 q / 32 kv heads, Dh 128) and Llama-3-8B (32 / 8, Dh 128) layouts, context 1k-32k,
T in {1, 16, 64}, batch 1-16, bf16. On CPU the kernel runs in the Triton interpreter, so only tiny sizes
are run and every row says so (`scale` = "cpu-tiny", `interpreter` = True): those times measure the
interpreter, not the kernel.
"""
import itertools

import torch
import torch.nn.functional as F

from mtp_triton import reference
from mtp_triton.tree import TYPICAL_ACC, Tree
from .common import (bench_device, copy_bandwidth, env_info, kernel_args, kernel_parser, save_figure, save_rows,
                     sweep, time_fn)

LAYOUTS = {"llama-7b": (32, 32, 128), "llama3-8b": (32, 8, 128), "tiny": (4, 2, 32)}   # Hq, Hkv, Dh
GPU_GRID = dict(layouts=("llama-7b", "llama3-8b"), contexts=(1024, 4096, 8192, 32768), tree_sizes=(1, 16, 64),
                batches=(1, 4, 16))
CPU_GRID = dict(layouts=("tiny",), contexts=(64, 192), tree_sizes=(1, 16), batches=(1, 2))
PROVIDERS = ("triton", "triton-launch", "sdpa", "sdpa+gather", "reference")


def make_inputs(batch, context, T, Hq, Hkv, Dh, block_size=16, dtype=torch.bfloat16, device="cpu", seed=0):
    """tree_attention keyword arguments: every sequence holds `context` cached tokens in shuffled blocks; the tree is
    the root alone for T = 1, else the best (T - 1)-node Medusa-style tree."""
    tree = Tree.root_only() if T == 1 else Tree.from_accuracies(TYPICAL_ACC, T - 1)
    g = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = (context + T + block_size - 1) // block_size
    NB = batch * blocks_per_seq
    block_table = torch.randperm(NB, device=device, generator=g).view(batch, blocks_per_seq).to(torch.int32)
    rnd = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, generator=g)   # noqa: E731
    return dict(q=rnd(batch, T, Hq, Dh), k_cache=rnd(NB, block_size, Hkv, Dh), v_cache=rnd(NB, block_size, Hkv, Dh),
                block_table=block_table, cache_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
                k_tree=rnd(batch, T, Hkv, Dh), v_tree=rnd(batch, T, Hkv, Dh),
                tree_mask=tree.mask.to(device))


def kv_bytes(inputs):
    """Bytes of K and V a step must read: (cache + tree) tokens x Hkv x Dh x 2 x element size."""
    _, T, _, Dh = inputs["q"].shape
    Hkv = inputs["k_cache"].shape[2]
    tokens = int(inputs["cache_lens"].long().sum()) + T * inputs["q"].shape[0]
    return tokens * Hkv * Dh * 2 * inputs["q"].element_size()


def gather_cache(inputs):
    """Paged cache + tree -> contiguous K, V [B, Hkv, ctx + T, Dh] (all sequences share one length here)."""
    kc, vc, bt = inputs["k_cache"], inputs["v_cache"], inputs["block_table"]
    B, n = bt.shape[0], int(inputs["cache_lens"][0])
    BS = kc.shape[1]
    pos = torch.arange(n, device=kc.device)
    blk, slot = bt.long()[:, pos // BS], (pos % BS)[None, :].expand(B, n)        # [B, n]
    k = torch.cat([kc[blk, slot], inputs["k_tree"]], dim=1).transpose(1, 2)      # [B, Hkv, n + T, Dh]
    v = torch.cat([vc[blk, slot], inputs["v_tree"]], dim=1).transpose(1, 2)
    return k, v


def sdpa_mask(inputs):
    """[B, 1, T, ctx + T] bool: all of the cache, then the tree's ancestor mask."""
    B, T = inputs["q"].shape[:2]
    n = int(inputs["cache_lens"][0])
    tree = inputs["tree_mask"].expand(B, T, T)
    cache = torch.ones(B, T, n, dtype=torch.bool, device=tree.device)
    return torch.cat([cache, tree], dim=2)[:, None]


def sdpa_tree_attention(q, k, v, mask):
    """q [B, T, Hq, Dh]; k, v [B, Hkv, S, Dh]; mask [B, 1, T, S] -> [B, T, Hq, Dh]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=q.shape[2] != k.shape[1])
    return out.transpose(1, 2)


def run(layouts=None, contexts=None, tree_sizes=None, batches=None, providers=PROVIDERS, dtype=None, device=None,
        block_size=16, copy_bw=None, progress=False):
    """Benchmark every (layout, context, T, batch, provider); returns a list of row dicts stamped with env_info.

    Defaults: the full grid on a GPU (bf16), a tiny grid on CPU (fp32, interpreter: call
    mtp_triton.use_interpreter() first; main() does).
    """
    from mtp_triton.kernels.tree_attention import tree_attention

    device, on_gpu = bench_device(device)
    g = sweep(GPU_GRID if on_gpu else CPU_GRID, layouts=layouts, contexts=contexts, tree_sizes=tree_sizes,
              batches=batches)
    dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
    copy_bw = copy_bw or copy_bandwidth(device)
    env = env_info(device)
    scale = "gpu-full" if on_gpu else "cpu-tiny"
    rows = []
    for layout, context, T, batch in itertools.product(g["layouts"], g["contexts"], g["tree_sizes"], g["batches"]):
        Hq, Hkv, Dh = LAYOUTS[layout]
        inputs = make_inputs(batch, context, T, Hq, Hkv, Dh, block_size, dtype, device)
        nbytes = kv_bytes(inputs)
        mask = sdpa_mask(inputs)
        k, v = gather_cache(inputs)
        fns = {
            "triton": lambda: tree_attention(**inputs),
            "triton-launch": lambda: tree_attention(**inputs, check_values=False),
            "sdpa": lambda: sdpa_tree_attention(inputs["q"], k, v, mask),
            "sdpa+gather": lambda: sdpa_tree_attention(inputs["q"], *gather_cache(inputs), sdpa_mask(inputs)),
            "reference": lambda: reference.tree_attention(**inputs),
        }
        expected = sdpa_tree_attention(inputs["q"], k, v, mask).float()
        for provider in providers:
            seconds = time_fn(fns[provider], device=device)
            err = (fns[provider]().float() - expected).abs().max().item()
            row = dict(kernel="tree_attention", provider=provider, scale=scale, layout=layout, Hq=Hq, Hkv=Hkv, Dh=Dh,
                       batch=batch, context=context, T=T, dtype=str(dtype).replace("torch.", ""),
                       block_size=block_size, seconds=seconds, kv_bytes=nbytes, gbps=nbytes / seconds / 1e9,
                       copy_gbps=copy_bw / 1e9, frac_of_copy=nbytes / seconds / copy_bw, max_abs_err_vs_sdpa=err,
                       **env)
            rows.append(row)
            if progress:
                print(f"{layout:10s} ctx {context:6d} T {T:3d} B {batch:3d} {provider:12s} {seconds * 1e6:10.1f} us "
                      f"{row['gbps']:8.1f} GB/s ({100 * row['frac_of_copy']:5.1f} % of copy) err {err:.1e}",
                      flush=True)
    return rows


def plot(rows, path=None):
    """Achieved GB/s vs context: one panel per (layout, T), a line per provider and batch; copy bandwidth dashed.

    rows: dicts as `run` returns or as read back from the CSV (strings). Returns the matplotlib figure.
    """
    from matplotlib.figure import Figure

    num = lambda r, k: float(r[k])                                       # noqa: E731
    panels = sorted({(r["layout"], int(num(r, "T"))) for r in rows})
    layouts = sorted({p[0] for p in panels})
    Ts = sorted({p[1] for p in panels})
    fig = Figure(figsize=(4.2 * len(Ts), 3.2 * len(layouts)))
    axes = fig.subplots(len(layouts), len(Ts), squeeze=False, sharey=True)
    colors = {p: f"C{i}" for i, p in enumerate(PROVIDERS)}
    batches = sorted({int(num(r, "batch")) for r in rows})
    styles = dict(zip(batches, ["-", "--", ":", "-."] * 4))
    for i, layout in enumerate(layouts):
        for j, T in enumerate(Ts):
            ax = axes[i][j]
            sel = [r for r in rows if r["layout"] == layout and int(num(r, "T")) == T]
            for provider in PROVIDERS:
                for batch in batches:
                    pts = sorted((num(r, "context"), num(r, "gbps")) for r in sel
                                 if r["provider"] == provider and int(num(r, "batch")) == batch)
                    if pts:
                        ax.plot(*zip(*pts), styles[batch], color=colors[provider], marker="o", ms=3,
                                label=f"{provider} B{batch}")
            if sel:
                ax.axhline(num(sel[0], "copy_gbps"), color="k", ls="--", lw=0.8, label="copy bandwidth")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{layout}, T = {T}", fontsize=9)
            ax.set_xlabel("cached tokens per sequence")
            if j == 0:
                ax.set_ylabel("KV bytes read / time (GB/s)")
    where = rows[0]["device"] + (" (Triton interpreter, tiny sizes)" if str(rows[0]["interpreter"]) == "True" else "")
    fig.suptitle(f"tree attention, {rows[0]['dtype']} - {where}", fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path, bbox_inches="tight")
    return fig


def main(argv=None):
    ap = kernel_parser(__doc__, "results/tree_attention.csv", module="mtp_lab.bench.tree_attention")
    ap.add_argument("--contexts", type=int, nargs="*", help="cached tokens per sequence (default: the grid)")
    ap.add_argument("--tree-sizes", type=int, nargs="*", help="T values (default: the grid)")
    ap.add_argument("--batches", type=int, nargs="*", help="batch sizes (default: the grid)")
    ap.add_argument("--layouts", nargs="*", choices=sorted(LAYOUTS), help="head layouts (default: the grid)")
    ap.add_argument("--providers", nargs="*", choices=PROVIDERS, default=list(PROVIDERS))
    args = kernel_args(ap, argv, "mtp_lab.bench.tree_attention", "No CUDA GPU: running tiny sizes in the Triton "
                       "interpreter (times measure the interpreter, not the kernel).")
    rows = run(args.layouts, args.contexts, args.tree_sizes, args.batches, tuple(args.providers), progress=True)
    save_rows(rows, args.out, plot, args.plot)


if __name__ == "__main__":
    main()
