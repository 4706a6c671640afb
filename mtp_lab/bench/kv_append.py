"""kv_append benchmark: the one-launch Triton append vs PyTorch loops.

Providers (all write the same elements; see tests/test_kv_append.py):
    triton            mtp_triton.kernels.kv_append.kv_append — input checks (one host sync) + ONE launch
    triton-launch     the launch alone (`_launch_kv_append`), for an engine that validated its inputs once
    torch-per-layer   index math once, then per layer `k_cache[l][blk, slot] = k_tree[l][b, node]` for K and V:
                      the loop an engine writes without a kernel (~4 kernels per layer)
    torch-vectorized  the same with one advanced-indexing assignment over all layers (2 gathers + 2 scatters)
    torch-reference   mtp_triton.reference.kv_append (the correctness twin, vectorised over the batch and layers)

Bytes moved per call: 2 (K and V) x L x sum_b(accept_len[b] + 1) x Hkv x Dh x elt, read once and written once;
gbps = 2 x that / time. The ceiling column is this device's measured copy bandwidth (common.copy_bandwidth).

GPU: Llama-7B (32 layers, 32 KV heads, Dh 128) and Llama-3-8B (8 KV heads), bf16, batch 1-16, accept length
0-8 of a 64-node tree, cache lengths ~512-1024 tokens in 16-token blocks. CPU: a tiny model through the Triton
interpreter — those times measure the interpreter, not the kernel, and are labelled so.
"""
import itertools

import torch

from mtp_triton import reference
from mtp_triton.kernels.kv_append import _launch_kv_append, kv_append
from .common import (bench_device, copy_bandwidth, env_info, kernel_args, kernel_parser, png_next_to, save_figure,
                     save_rows, sweep, time_fn)

MODELS = {
    "llama-7b": dict(L=32, Hkv=32, Dh=128),
    "llama-3-8b": dict(L=32, Hkv=8, Dh=128),
    "tiny-cpu": dict(L=4, Hkv=2, Dh=64),
}
GPU_GRID = dict(models=("llama-7b", "llama-3-8b"), batches=(1, 2, 4, 8, 16), accept_lens=(0, 1, 2, 4, 8), T=64,
                cache_len=1024, block_size=16)
CPU_GRID = dict(models=("tiny-cpu",), batches=(1, 4), accept_lens=(0, 4), T=8, cache_len=24, block_size=4)
STEP_ARGS = ("k_cache", "v_cache", "block_table", "cache_lens", "k_tree", "v_tree", "accept_nodes", "accept_len")
PROVIDERS = ("triton", "triton-launch", "torch-per-layer", "torch-vectorized", "torch-reference")


def make_step(L, Hkv, Dh, B, T, accept, cache_len=1024, BS=16, dtype=torch.bfloat16, device="cpu", seed=0):
    """Inputs of one append: B sequences with cache lengths in [cache_len / 2, cache_len], shuffled blocks,
    each accepting `accept` drafts (nodes drawn from 1..T-1 in increasing order, as a tree path is)."""
    g = torch.Generator().manual_seed(seed)
    cache_lens = torch.randint(cache_len // 2, cache_len + 1, (B,), generator=g, dtype=torch.int32)
    per_seq = -(-(cache_len + T) // BS)                                    # blocks per sequence, with room
    NB = B * per_seq
    block_table = torch.randperm(NB, generator=g).view(B, per_seq).to(torch.int32)
    accept_len = torch.full((B,), accept, dtype=torch.int64)
    accept_nodes = torch.full((B, T), -1, dtype=torch.int64)
    accept_nodes[:, 0] = 0
    for b in range(B):
        accept_nodes[b, 1:accept + 1] = (torch.randperm(T - 1, generator=g)[:accept] + 1).sort().values
    big = dict(dtype=dtype, device=device)
    g_dev = torch.Generator(device=device).manual_seed(seed)               # the large tensors are drawn in place
    return dict(
        k_cache=torch.zeros(L, NB, BS, Hkv, Dh, **big), v_cache=torch.zeros(L, NB, BS, Hkv, Dh, **big),
        block_table=block_table.to(device), cache_lens=cache_lens.to(device),
        k_tree=torch.randn(L, B, T, Hkv, Dh, generator=g_dev, **big),
        v_tree=torch.randn(L, B, T, Hkv, Dh, generator=g_dev, **big),
        accept_nodes=accept_nodes.to(device), accept_len=accept_len.to(device))


def _flat_indices(block_table, cache_lens, accept_nodes, accept_len, BS):
    """(b, block, slot, node) of every token written, flattened over the batch (one host sync: nonzero)."""
    T = accept_nodes.shape[1]
    j = torch.arange(T, device=accept_nodes.device)
    bi, ji = (j[None, :] <= accept_len[:, None]).nonzero(as_tuple=True)      # [N] live (b, j) pairs
    pos = cache_lens[bi].long() + ji
    return bi, block_table[bi, pos // BS].long(), pos % BS, accept_nodes[bi, ji]


def per_layer_append(k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, accept_nodes, accept_len):
    """Baseline: the index math once, then two advanced-indexing copies per layer (a launch-bound loop)."""
    bi, blk, slot, node = _flat_indices(block_table, cache_lens, accept_nodes, accept_len, k_cache.shape[2])
    for layer in range(k_cache.shape[0]):
        k_cache[layer][blk, slot] = k_tree[layer][bi, node]
        v_cache[layer][blk, slot] = v_tree[layer][bi, node]


def vectorized_append(k_cache, v_cache, block_table, cache_lens, k_tree, v_tree, accept_nodes, accept_len):
    """Baseline: one advanced-indexing copy over all layers for K and one for V."""
    bi, blk, slot, node = _flat_indices(block_table, cache_lens, accept_nodes, accept_len, k_cache.shape[2])
    k_cache[:, blk, slot] = k_tree[:, bi, node]
    v_cache[:, blk, slot] = v_tree[:, bi, node]


def bench_kv_append(full=None, device=None, models=None, batches=None, accept_lens=None, T=None,
                    providers=PROVIDERS, dtype=None, seed=0):
    """Time every provider; returns rows (dicts, each with env_info()).

    full (default: CUDA available): GPU_GRID, Llama shapes; otherwise CPU_GRID, the tiny CPU model through the
    interpreter. Any argument overrides its default.
    """
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        raise ValueError(f"unknown provider(s) {unknown}; choose from {PROVIDERS}")
    device, on_gpu = bench_device(device)
    full = on_gpu if full is None else full
    g = sweep(GPU_GRID if full else CPU_GRID, models=models, batches=batches, accept_lens=accept_lens, T=T)
    dtype = dtype or (torch.bfloat16 if on_gpu else torch.float16)
    env = env_info(device)
    ceiling = copy_bandwidth(device)
    rows = []
    for model, B, a in itertools.product(g["models"], g["batches"], g["accept_lens"]):
        cfg = MODELS[model]
        step = make_step(cfg["L"], cfg["Hkv"], cfg["Dh"], B, g["T"], a, g["cache_len"], g["block_size"], dtype, device,
                         seed)
        args = [step[k] for k in STEP_ARGS]
        fns = {"triton": lambda: kv_append(*args),
               "triton-launch": lambda: _launch_kv_append(*args, max_tokens=a + 1),
               "torch-per-layer": lambda: per_layer_append(*args),
               "torch-vectorized": lambda: vectorized_append(*args),
               "torch-reference": lambda: reference.kv_append(*args)}
        nbytes = 2 * 2 * cfg["L"] * B * (a + 1) * cfg["Hkv"] * cfg["Dh"] * step["k_cache"].element_size()
        times = {p: time_fn(fns[p], warmup=1, rep=5 if full else 3, device=device) for p in providers}
        for p in providers:
            rows.append(dict(
                kernel="kv_append", provider=p, model=model, layers=cfg["L"], kv_heads=cfg["Hkv"],
                head_dim=cfg["Dh"], dtype=str(dtype).replace("torch.", ""), batch=B, accept_len=a,
                tree_nodes=g["T"], time_s=times[p], bytes=nbytes, gbps=nbytes / times[p] / 1e9,
                ceiling_gbps=ceiling / 1e9,
                speedup_vs_per_layer=(times["torch-per-layer"] / times[p]
                                      if "torch-per-layer" in times else float("nan")),
                full=full, **env))
        del step, args
    return rows


def plot(rows, path):
    """Time per call vs batch (at the largest accept length) and vs accept length (at the smallest batch),
    one column per model, one line per provider. Drawn from the rows only."""
    from matplotlib.figure import Figure

    models = list(dict.fromkeys(r["model"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig = Figure(figsize=(5 * len(models), 6.4))
    axes = fig.subplots(2, len(models), squeeze=False)
    for c, model in enumerate(models):
        mr = [r for r in rows if r["model"] == model]
        a_max = max(int(r["accept_len"]) for r in mr)
        b_min = min(int(r["batch"]) for r in mr)
        for row, (xkey, fixkey, fixval) in enumerate((("batch", "accept_len", a_max), ("accept_len", "batch", b_min))):
            ax = axes[row][c]
            for p in providers:
                pts = sorted((int(r[xkey]), float(r["time_s"]) * 1e6) for r in mr
                             if r["provider"] == p and int(r[fixkey]) == fixval)
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
            ax.set_yscale("log")
            ax.set_xlabel(xkey.replace("_", " "))
            ax.set_ylabel("time per call (us)")
            ax.set_title(f"{model}, {fixkey.replace('_', ' ')} = {fixval}", fontsize=9)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    interp = " (Triton interpreter: not kernel speed)" if rows and str(rows[0]["interpreter"]) == "True" else ""
    fig.suptitle(f"kv_append on {rows[0]['device'] if rows else ''}{interp}", fontsize=10)
    return save_figure(fig, path)


def main(argv=None):
    ap = kernel_parser(__doc__, "results/kv_append.csv", png_next_to_csv=True, module="mtp_lab.bench.kv_append")
    ap.add_argument("--models", nargs="*", default=None, choices=sorted(MODELS))
    ap.add_argument("--batches", nargs="*", type=int, default=None)
    ap.add_argument("--accept-lens", nargs="*", type=int, default=None)
    args = kernel_args(ap, argv, "mtp_lab.bench.kv_append",
                       "no GPU: tiny CPU size through the Triton interpreter (times measure the interpreter)")
    rows = bench_kv_append(models=args.models, batches=args.batches, accept_lens=args.accept_lens)
    save_rows(rows, args.out, plot, args.plot or png_next_to(args.out),
              line=lambda r: f"{r['model']:11} B {r['batch']:>2} accept {r['accept_len']} {r['provider']:16} "
                             f"{r['time_s'] * 1e6:10.1f} us {r['gbps']:8.2f} GB/s  x{r['speedup_vs_per_layer']:.2f} "
                             "vs per-layer")


if __name__ == "__main__":
    main()
