"""Benchmark: fused drafting kernel vs the unfused PyTorch path (and torch.compile of it, GPU only).

    python -m mtp_lab.bench.drafting --out results/drafting.csv [--plot results/drafting.png]

On a GPU: Llama-7B-like shapes (D 4096, V 32000 / 128256, H 4-5, B 1-8) in bf16. On CPU: tiny shapes, and the
Triton kernel runs in the interpreter (numpy) — those rows are labelled `cpu-interpreter` and say nothing about GPU
speed; they only prove the pipeline runs.

Drafting is bandwidth-bound, so the headline metric is the bandwidth achieved on the LM-head read,
V * D * bytes / time, next to the measured device copy bandwidth (`copy_bandwidth()`, read + write counted).
`total_GBps` counts every weight byte read (ResBlocks + LM head), the true traffic of one draft step.
"""
import torch
import torch.nn.functional as F

from mtp_triton import reference
from .common import (bench_device, copy_bandwidth, env_info, kernel_args, kernel_parser, save_figure, save_rows,
                     time_fn)

GPU_SHAPES = [  # (B, H, D, V)
    (1, 4, 4096, 32000), (8, 4, 4096, 32000), (1, 5, 4096, 32000),
    (1, 4, 4096, 128256), (8, 4, 4096, 128256), (1, 5, 4096, 128256),
]
CPU_SHAPES = [(1, 4, 64, 1000), (4, 4, 64, 1000)]


def unfused_draft(hidden, res_weight, res_bias, lm_head, top_k):
    """The plain PyTorch path a Medusa-style implementation runs, in the model's dtype (the baseline, not the spec):
    H ResBlock GEMVs, one LM-head GEMM for all heads that writes [B, H, V] logits, then log_softmax and topk."""
    H = res_weight.shape[0]
    z = torch.stack([hidden + F.silu(F.linear(hidden, res_weight[h], res_bias[h])) for h in range(H)], dim=1)
    logits = z @ lm_head.T                                               # [B, H, V] in memory
    logp = torch.log_softmax(logits.float(), dim=-1)                     # read + write [B, H, V]
    ids = torch.topk(logits, top_k, dim=-1).indices                      # read [B, H, V]
    return ids, logp.gather(-1, ids)


def make_inputs(B, H, D, V, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(B, D, generator=g, device=device, dtype=dtype)
    res_weight = torch.randn(H, D, D, generator=g, device=device, dtype=dtype) / D ** 0.5
    res_bias = torch.randn(H, D, generator=g, device=device, dtype=dtype) * 0.1
    lm_head = torch.randn(V, D, generator=g, device=device, dtype=dtype) / D ** 0.25
    return hidden, res_weight, res_bias, lm_head


def run(shapes=None, top_k=10, dtype=torch.bfloat16, providers=None, device=None):
    """Time every provider on every shape; returns rows (dicts) stamped with env_info().

    Without CUDA, call mtp_triton.use_interpreter() first (main() does)."""
    from mtp_triton.kernels.drafting import fused_draft         # imported here: the interpreter choice comes first
    device, on_gpu = bench_device(device)
    env = env_info(device)
    mode = "gpu" if on_gpu and not env["interpreter"] else "cpu-interpreter"
    shapes = shapes or (GPU_SHAPES if mode == "gpu" else CPU_SHAPES)
    providers = providers or ["triton-fused", "torch-unfused", "torch-compile"]
    note = ""
    if "torch-compile" in providers and mode != "gpu":
        providers = [p for p in providers if p != "torch-compile"]
        note = "torch.compile skipped on CPU; "
    if mode != "gpu":
        note += "CPU + Triton interpreter: not indicative of GPU speed"
    copy_bps = copy_bandwidth(device)
    fns = {"triton-fused": fused_draft, "torch-unfused": unfused_draft,
           "torch-compile": torch.compile(unfused_draft) if "torch-compile" in providers else None}
    rows = []
    for B, H, D, V in shapes:
        inputs = make_inputs(B, H, D, V, dtype, device)
        elt = inputs[0].element_size()
        lm_bytes = V * D * elt
        total_bytes = (H * D * D + H * D + V * D + B * D) * elt
        ref_ids, ref_logp = reference.fused_draft(*inputs, top_k)
        times = {}
        for p in providers:
            fn = fns[p]
            ids, logp = fn(*inputs, top_k)                               # warm-up (compiles)
            err = (logp.float() - ref_logp).abs().max().item()
            agree = (ids == ref_ids).float().mean().item()
            t = time_fn(lambda: fn(*inputs, top_k), warmup=1, rep=3 if mode != "gpu" else 5, device=device)
            times[p] = t
            rows.append(dict(
                kernel="fused_draft", provider=p, mode=mode, B=B, H=H, D=D, V=V, top_k=top_k,
                dtype=str(dtype).replace("torch.", ""), time_us=t * 1e6,
                lm_head_bytes=lm_bytes, lm_head_GBps=lm_bytes / t / 1e9,
                total_bytes=total_bytes, total_GBps=total_bytes / t / 1e9,
                copy_GBps=copy_bps / 1e9, lm_head_frac_of_copy=lm_bytes / t / copy_bps,
                max_logprob_err=err, ids_agree=agree, note=note, **env))
        for r in rows[-len(providers):]:
            r["speedup_vs_unfused"] = times["torch-unfused"] / r["time_us"] * 1e6 if "torch-unfused" in times \
                else float("nan")
    return rows


def plot(rows, path=None):
    """Time per shape and provider (left) and LM-head bandwidth as a fraction of copy bandwidth (right)."""
    from matplotlib.figure import Figure

    def shape(r):
        return f"B{r['B']} H{r['H']}\nV{r['V']}"

    shapes = list(dict.fromkeys(shape(r) for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig = Figure(figsize=(11, 3.8), dpi=80)
    ax_t, ax_b = fig.subplots(1, 2)
    width = 0.8 / max(len(providers), 1)
    for i, p in enumerate(providers):
        mine = {shape(r): r for r in rows if r["provider"] == p}
        xs = [j + i * width for j, s in enumerate(shapes) if s in mine]
        ax_t.bar(xs, [float(mine[s]["time_us"]) for s in shapes if s in mine], width, label=p)
        ax_b.bar(xs, [100 * float(mine[s]["lm_head_frac_of_copy"]) for s in shapes if s in mine], width, label=p)
    for ax in (ax_t, ax_b):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, fontsize=8)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time per draft step (µs)")
    ax_b.set_ylabel("LM-head read bandwidth, % of copy bw")
    ax_b.legend(fontsize=8)
    first = rows[0] if rows else {}
    fig.suptitle(f"fused_draft — {first.get('device', '?')} ({first.get('mode', '?')}, "
                 f"{first.get('dtype', '?')}, top_k={first.get('top_k', '?')})", fontsize=10)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig


def main(argv=None):
    ap = kernel_parser(__doc__, "results/drafting.csv", module="mtp_lab.bench.drafting")
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--shapes", default=None, help='"B,H,D,V;B,H,D,V" (default: Llama-7B-like on GPU, tiny on CPU)')
    ap.add_argument("--providers", default=None, help="comma list of triton-fused,torch-unfused,torch-compile")
    args = kernel_args(ap, argv, "mtp_lab.bench.drafting",
                       "no GPU: tiny shapes, Triton interpreter on CPU (the numbers only show the pipeline runs)")
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";") if s.strip()] if args.shapes else None
    rows = run(shapes=shapes, top_k=args.top_k, dtype=getattr(torch, args.dtype),
               providers=args.providers.split(",") if args.providers else None)
    save_rows(rows, args.out, plot, args.plot,
              line=lambda r: f"{r['provider']:>14} B{r['B']} H{r['H']} D{r['D']} V{r['V']}: {r['time_us']:10.1f} us  "
                             f"LM head {r['lm_head_GBps']:8.1f} GB/s ({100 * r['lm_head_frac_of_copy']:5.1f} % of "
                             f"copy)  x{r['speedup_vs_unfused']:.2f} vs unfused  err {r['max_logprob_err']:.1e}")


if __name__ == "__main__":
    main()
