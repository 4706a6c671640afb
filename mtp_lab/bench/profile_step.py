"""Where a decoding step's time goes, phase by phase — and, on a GPU, kernel by kernel.

    python -m mtp_lab.bench.profile_step --out results/profile.csv            # embedded model
    python -m mtp_lab.bench.profile_step --shape llama7b --out results/p.csv  # Llama-7B shape, GPU

Phases per step (from generate()'s own timers; CUDA events on a GPU, perf_counter on CPU):
    draft              fused_draft over all heads (or the synthetic oracle's propose(), host Python)
    verify-attention   the L tree_attention calls of the verify forward (timed inside it, see below)
    verify-other       the rest of the verify forward: Q/K/V/O and MLP GEMMs, norms, RoPE, embedding, LM head
    accept             argmax over the logits + tree_accept (a serial step: the argmax alone)
    append             kv_append + the cache-length / root bookkeeping
    python-overhead    decode wall time − the phases above: the host work between phases (emit loop, the one
                       host sync per step, tree pruning); on a GPU also the time the GPU waits for the host

The attention split wraps `tree_attention` of the ops that generate() asks for (`timed_attention`), so the
decoder itself is unchanged; the first L calls of each generate() are the prefill and are not counted. On a CPU the
plain packed step runs its layers from TorchScript (mtp_triton/scripted.py), where no Python wrapper can time the
attention: `phase_rows` runs the Python layer instead (the same results, a few ms slower per step).
On a GPU, `kernel_rows` adds a torch.profiler table: per-kernel GPU time of N decode steps (a run of N tokens
minus a run of 1 token, so prefill cancels), grouped into attention / GEMM / draft / accept / append / other.
"""
import contextlib
import importlib
import sys
from collections import defaultdict
from types import SimpleNamespace

import torch

from mtp_triton.generate import generate
from mtp_triton.stats import PhaseTimer
from .common import env_info, png_next_to, save_figure, save_rows
from .e2e import drafting_tree, parse_target, serial_truth, target_parser

PHASES = ("draft", "verify-attention", "verify-other", "accept", "append", "python-overhead")


@contextlib.contextmanager
def timed_attention(num_layers, device):
    """Inside this block, every generate() call times its decode-step attention calls into the yielded PhaseTimer,
    under "attention": the Triton kinds' `ops.tree_attention`, or the twins the engine calls itself on a step's
    layout (`mtp_triton.model.plain_attention`, and `attention` of the exact mode and the compiled kind).

    Implementation: generate() gets its kernels from `mtp_triton.generate.get_ops`; this swaps in a wrapper that, per
    generate() call, skips the first `num_layers` attention calls (the prefill forward) and times the rest.
    """
    gen_mod, model_mod = importlib.import_module("mtp_triton.generate"), importlib.import_module("mtp_triton.model")
    real = gen_mod.get_ops, model_mod.attention, model_mod.plain_attention
    timer = PhaseTimer(device)
    skip = [0]                                   # attention calls left to skip in this generate() (its prefill)

    def timed(fn):
        def run(*args, **kw):
            if skip[0] > 0:
                skip[0] -= 1
                return fn(*args, **kw)
            t0 = timer.start()
            out = fn(*args, **kw)
            timer.stop("attention", t0)
            return out
        return run

    def get_ops(kernels="auto", device="cpu"):
        ops = real[0](kernels, device)
        skip[0] = num_layers
        return SimpleNamespace(**dict(vars(ops), tree_attention=timed(ops.tree_attention)))

    gen_mod.get_ops, model_mod.attention, model_mod.plain_attention = get_ops, timed(real[1]), timed(real[2])
    try:
        yield timer
    finally:
        gen_mod.get_ops, model_mod.attention, model_mod.plain_attention = real


def _kw(gen_kw, i):
    return gen_kw(i) if callable(gen_kw) else gen_kw


def phase_rows(model, prompts, max_new_tokens, configs, base=None):
    """One row per (config, phase): generate() runs once per prompt (batch 1), its decode time split into PHASES;
    ms per step and the phase's share of the step.

    configs: list of (name, generate() keyword arguments or a function of the prompt index returning them: a
    synthetic drafter must be built for the prompt it drafts for).
    """
    rows, scripted = [], model.script_layers
    model.script_layers = False                     # the Python layer, whose attention calls can be timed (above)
    try:
        for name, kw in configs:
            rows += _phases(model, prompts, max_new_tokens, name, kw, base)
    finally:
        model.script_layers = scripted
    return rows


def _phases(model, prompts, max_new_tokens, name, kw, base):
    """phase_rows' rows of one config."""
    rows = []
    generate(model, prompts[:1], min(8, max_new_tokens), **_kw(kw, 0))             # warm-up
    tot, steps, decode_tokens = defaultdict(float), 0, 0
    with timed_attention(model.config.num_hidden_layers, model.device) as att:
        for i, p in enumerate(prompts):
            s = generate(model, [p], max_new_tokens, **_kw(kw, i)).stats.as_dict()
            for phase in ("draft", "verify", "accept", "append"):
                tot[phase] += s[f"time_{phase}_s"]
            tot["wall"] += s["total_s"] - s["ttft_s"]
            steps += s["steps"]
            decode_tokens += s["new_tokens"] - 1
        attention = att.result()["attention"]
    per = {"draft": tot["draft"], "verify-attention": attention, "verify-other": tot["verify"] - attention,
           "accept": tot["accept"], "append": tot["append"]}
    per["python-overhead"] = tot["wall"] - sum(per.values())
    per = {k: v / max(steps, 1) for k, v in per.items()}                       # seconds per step
    step = sum(per.values())
    for ph in PHASES:
        rows.append(dict(base or {}, table="phases", config=name, phase=ph, ms_per_step=1e3 * per[ph],
                         fraction=per[ph] / step if step > 0 else float("nan"), step_ms=1e3 * step,
                         tau=decode_tokens / max(steps, 1), tokens_per_s=decode_tokens / tot["wall"]))
    return rows


# ---- GPU: torch.profiler kernel table ---------------------------------------------------------------------
# kernel name fragments -> category (ours: _tree_attention_kernel + _combine_splits_kernel, the drafting kernels
# _resblock_kernel / _vocab_tile_kernel / _merge_kernel, _tree_accept*_kernel, _kv_append_kernel)
CATEGORIES = (("attention", ("tree_attention", "combine_splits", "attn", "flash", "sdpa")),
              ("draft", ("draft", "resblock", "vocab_tile", "_merge_kernel")),
              ("accept", ("accept",)), ("append", ("kv_append", "append")),
              ("gemm", ("gemm", "gemv", "cutlass", "xmma", "cublas", "matmul", "nvjet", "splitk", "sm90_", "sm80_")))


def kernel_category(name):
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other (elementwise, norms, copies)"


def _profile_kernels(fn):
    """{kernel name: (GPU µs, calls)} of the CUDA kernels `fn` launches (self time of device-side events only)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type == DeviceType.CUDA and e.self_device_time_total:
            out[e.key] = (float(e.self_device_time_total), int(e.count))
    return out


def kernel_rows(model, prompts, max_new_tokens, name, gen_kw, base=None, top=10):
    """Per-kernel GPU time of the decode steps of prompt 0 (profile of N tokens minus profile of 1 token).

    [] on CPU. gen_kw as in `phase_rows`."""
    if model.device.type != "cuda":
        return []
    p, gen_kw = prompts[:1], _kw(gen_kw, 0)
    generate(model, p, max_new_tokens, **gen_kw)                                       # warm-up
    full = _profile_kernels(lambda: generate(model, p, max_new_tokens, **gen_kw))
    first = _profile_kernels(lambda: generate(model, p, 1, **gen_kw))
    steps = generate(model, p, max_new_tokens, **gen_kw).stats.steps
    return kernel_table(full, first, steps, name, base, top)


def kernel_table(full, first, steps, name, base=None, top=10):
    """Rows from two profiles {kernel: (µs, calls)}: decode-only time = full − first, per step, by category."""
    diff = {k: (full[k][0] - first.get(k, (0.0, 0))[0], full[k][1] - first.get(k, (0.0, 0))[1]) for k in full}
    diff = {k: v for k, v in diff.items() if v[0] > 0}
    total = sum(t for t, _ in diff.values())
    steps = max(steps, 1)
    rows, cats = [], defaultdict(float)
    for k, (t, n) in diff.items():
        cats[kernel_category(k)] += t
    for cat, t in sorted(cats.items(), key=lambda kv: -kv[1]):
        rows.append(dict(base or {}, table="kernel_categories", config=name, category=cat,
                         gpu_ms_per_step=t * 1e-3 / steps, fraction=t / total))
    for k, (t, n) in sorted(diff.items(), key=lambda kv: -kv[1][0])[:top]:
        rows.append(dict(base or {}, table="kernels", config=name, kernel=k[:90], category=kernel_category(k),
                         calls_per_step=n / steps, gpu_ms_per_step=t * 1e-3 / steps, fraction=t / total))
    return rows


def plot_phases(rows, ax=None, path=None):
    """Stacked bars: ms per step by phase, one bar per config (from `phase_rows` rows or CSV rows)."""
    from matplotlib.figure import Figure
    rows = [r for r in rows if r.get("table") == "phases"]
    fig = None
    if ax is None:
        fig = Figure(figsize=(6, 3), dpi=80)
        ax = fig.subplots()
    configs = list(dict.fromkeys(r["config"] for r in rows))
    left = [0.0] * len(configs)
    colors = dict(zip(PHASES, ("tab:purple", "tab:blue", "tab:cyan", "tab:green", "tab:orange", "tab:grey")))
    for ph in PHASES:
        vals = [sum(max(float(r["ms_per_step"]), 0.0) for r in rows if r["config"] == c and r["phase"] == ph)
                for c in configs]
        ax.barh(configs, vals, left=left, color=colors[ph], label=ph)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("ms per decoding step")
    ax.legend(fontsize=7, loc="lower right")
    if fig is not None:
        fig.tight_layout()
        if path:
            save_figure(fig, path)
    return ax


def main(argv=None):
    ap = target_parser("python -m mtp_lab.bench.profile_step", __doc__, "out/profile.csv",
                       "CSV to append rows to (the PNG goes next to it)")
    a = parse_target(ap, argv, "no GPU: CPU phase times at tiny size (as --quick, torch ops) — the split on a GPU is "
                               "very different", 64)
    if a is None:
        return 0
    t, d, n = a.target, a.drafting, a.max_new_tokens
    tree = drafting_tree(t, d)
    kw = dict(kernels=a.kernels, eos_token_id=t.eos_token_id)
    truth = serial_truth(t.model, t.prompts, n, d.num_heads, eos=t.eos_token_id, kernels=a.kernels)
    env = env_info(t.model.device)
    base = dict(env, run_id=env["timestamp"], **t.row(), max_new_tokens=n, drafter=d.label)
    V = t.model.config.vocab_size
    configs = [("serial", dict(kw, mtp=False)),
               (f"tree-{tree.size}", lambda i: dict(kw, **d.kwargs(truth[i: i + 1], V, i, tree)))]
    rows = phase_rows(t.model, t.prompts, n, configs, base)
    for name, ckw in configs:
        rows += kernel_rows(t.model, t.prompts, n, name, ckw, base)
    for r in rows:
        if r["table"] == "phases":
            print(f"{r['config']:10} {r['phase']:17} {r['ms_per_step']:9.3f} ms/step {100 * r['fraction']:5.1f} %")
        else:
            print(f"{r['config']:10} {r['table']:17} {r.get('kernel', r.get('category'))[:60]:60} "
                  f"{r['gpu_ms_per_step']:8.3f} ms/step")
    save_rows(rows, a.out, lambda rows, png: plot_phases(rows, path=png), png_next_to(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
