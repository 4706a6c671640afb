"""Reproduce the published speedup tables on whatever hardware runs this, and put them side by side.

    python -m mtp_triton tables --out out/tables                       # both suites (llama7b needs a GPU)
    python -m mtp_triton tables --quick --out /tmp/t                    # tiny, CPU: checks the whole path
    python -m mtp_triton tables --shape llama7b --profiles seed80,0.9   # 7B shape, synthetic acceptance

Writes <out>/tables.csv (rows appended, each with env_info() and a run_id), <out>/tables.md and <out>/tables.png
(both drawn from the CSV rows of this run). What is measured, per suite:

1. The seed's depth sweep — serial, MTP-2, MTP-4, MTP-8 chains and the default tree: decode tok/s, ms/token,
   speedup, tokens/J (GPU energy from NVML; blank where it cannot be measured, never estimated), τ (tokens per
   step) and acceptance per depth.
     embedded  the embedded model with its trained heads (real acceptance); chain-8 only with >= 8 heads.
     llama7b   Llama-7B shape, random bf16 weights, GPU only; drafts from the SYNTHETIC OracleDrafter at chosen
               per-depth acceptance profiles (seed80, deepseek85/90), isolating the runtime's cost from head quality.
2. The analytic model: E[tokens/step] = Tree.expected_accept_len(acc) + 1 (the bonus token), divided by the
   measured verify-step cost ratio c(T) = time(T-node verify) / time(1-node verify):
        predicted speedup = (E[accepted drafts] + 1) / c(T)
   next to the measured speedup, and τ_measured / c(T) (what is left is drafting, accept, append and Python).
3. A per-phase profile (`profile_step`): draft / verify attention / other verify / accept / append / Python;
   on a GPU also a torch.profiler kernel table.
4. Hugging Face generate(do_sample=False) on the same weights as an outside serial baseline (`e2e.hf_row`).
"""
import argparse
import csv
import glob
import json
import os
import sys

import torch

from ..generate import prefill
from ..ops import get_ops
from ..tree import Tree
from . import e2e
from .common import append_rows, env_info, read_rows, time_fn
from .profile_step import PHASES, kernel_rows, phase_rows, plot_phases

PUBLISHED = os.path.join(e2e.ROOT, "data", "published")
CHAINS = (2, 4, 8)
SEED_CONFIGS = ("serial", "MTP-2", "MTP-4", "MTP-8")
DEFAULT_PROFILES = "seed80,deepseek85,deepseek90"


# ---- published numbers ------------------------------------------------------------------------------------
def load_published(folder=PUBLISHED):
    """All rows of data/published/*.csv, `value` / `value_high` as floats (None when blank), plus `file`."""
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "*.csv"))):
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                r["value"] = float(r["value"])
                r["value_high"] = float(r["value_high"]) if r.get("value_high") else None
                r["file"] = os.path.basename(path)
                rows.append(r)
    return rows


def seed_sweep(published):
    """{config: {metric: value}} of the seed's BM1684 table."""
    out = {}
    for r in published:
        if r["file"] == "seed_depth_sweep.csv":
            out.setdefault(r["config"], {})[r["metric"]] = r["value"]
    return out


# ---- the analytic model -----------------------------------------------------------------------------------
def expected_tokens_per_step(tree, acc):
    """E[tokens per step] = E[accepted drafts] + 1 (the bonus token), independent per-head accuracies acc [H, K]."""
    return tree.expected_accept_len(acc) + 1.0


def analytic_speedup(tree, acc, cost_ratio):
    """Predicted speedup over serial: tokens per step / (verify-step cost relative to a 1-node step)."""
    return expected_tokens_per_step(tree, acc) / cost_ratio


def acc_from_depth_rates(rates):
    """Measured P(accept length >= d) per depth -> conditional top-1 accuracies acc [H, 1] (rank 0 only)."""
    acc, prev = [], 1.0
    for r in rates:
        acc.append([r / prev if prev > 0 else 0.0])
        prev = r
    return torch.tensor(acc, dtype=torch.float64)


def verify_step_seconds(model, tree, cache_len, kernels="auto", seed=0):
    """Seconds for one verify forward (tree_attention over a cache of cache_len tokens + LM head) of `tree`."""
    ops = get_ops(kernels, model.device)
    dev = model.device
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, cache_len), generator=g).tolist()
    cache = model.new_cache([cache_len + tree.size])
    prefill(model, prompt, cache, ops)
    t = tree.to(dev)
    tokens = torch.randint(0, model.config.vocab_size, (1, t.size), generator=g).to(dev)     # [1, T]
    positions = cache.cache_lens.long()[:, None] + t.depth[None, :]                          # [1, T]
    rows = torch.zeros(1, dtype=torch.int64, device=dev)

    def step():
        with torch.no_grad():
            h, _, _ = model.forward_tree(tokens, positions, t.mask, cache, rows, ops)
            return model.logits(h).argmax(-1)
    return time_fn(step, warmup=2, rep=5, device=dev)


# ---- one suite --------------------------------------------------------------------------------------------
def sweep_configs(drafting, tree):
    """[(name, tree or None for serial, note)]: serial, MTP-2/4/8 chains (when the heads allow), the default tree."""
    out = [("serial", None, "")]
    for n in CHAINS:
        if n <= drafting.num_heads:
            out.append((f"MTP-{n}", Tree.chain(n), ""))
        else:
            out.append((f"MTP-{n}", None, f"skipped: needs {n} heads, this drafter has {drafting.num_heads}"))
    out.append(("tree", tree, "default tree (tuned to the accuracies when known)"))
    return out


def suite_rows(target, draftings, max_new_tokens, *, kernels="auto", hf=True, phases=True, run_id=None,
               log=print):
    """Everything for one target: the sweep per drafting, the analytic model, phases, kernels, HF baseline."""
    model, dev = target.model, target.model.device
    env = env_info(dev)
    run_id = run_id or env["timestamp"]
    base = dict(env, run_id=run_id, **target.row(), batch=1, max_new_tokens=max_new_tokens)
    kw = dict(kernels=kernels, eos_token_id=target.eos_token_id)
    depth = max(d.num_heads for d in draftings)
    truth = e2e.serial_truth(model, target.prompts, max_new_tokens, depth, **kw)        # also the serial warm-up
    serial = e2e.run_generate(model, target.prompts, max_new_tokens, **kw)
    log(f"[{target.suite}] serial: {serial['decode_tokens_per_s']:.1f} tok/s ({env['device']})")
    rows, verify_cache = [], {}
    cache_len = int(target.prompt_len) + max_new_tokens // 2

    def verify_s(tree):
        key = tree.paths
        if key not in verify_cache:
            verify_cache[key] = verify_step_seconds(model, tree, cache_len, kernels)
        return verify_cache[key]

    t1 = verify_s(Tree.root_only())
    for d in draftings:
        tree = e2e.default_tree(target, d)
        sweep = {}
        for name, t, note in sweep_configs(d, tree):
            row = dict(base, table="sweep", drafter=d.label, synthetic_drafts=d.synthetic, config=name, note=note)
            if name == "serial":
                r = serial
            elif t is None:
                rows.append(row)
                continue
            else:
                e2e.run_generate(model, target.prompts[:1], min(16, max_new_tokens), drafting=d, truth=truth,
                                 tree=t, **kw)                                           # warm-up
                r = e2e.run_generate(model, target.prompts, max_new_tokens, drafting=d, truth=truth, tree=t, **kw)
            sweep[name] = (t, r)
            speedup = r["decode_tokens_per_s"] / serial["decode_tokens_per_s"]
            rows.append(dict(row, tree_size=r["tree_size"], depth=t.max_depth if t is not None else 0,
                             kernels=r["kernels"], tokens_per_s=r["decode_tokens_per_s"],
                             ms_per_token=1e3 / r["decode_tokens_per_s"], speedup=speedup,
                             speedup_pct=100 * (speedup - 1), tau=r["tokens_per_step"],
                             accept_rate_per_depth=json.dumps([round(x, 4) for x in r["accept_rate_per_depth"]]),
                             energy_j=r["energy_j"], tokens_per_j=r["tokens_per_j"],
                             identical_to_serial=r["tokens"] == serial["tokens"]))
            log(f"[{target.suite}] {d.label:28} {name:7} T={r['tree_size']:<3} {r['decode_tokens_per_s']:8.1f} "
                f"tok/s  x{speedup:.2f}  tau {r['tokens_per_step']:.2f}")
        rows += analytic_rows(d, sweep, t1, verify_s, dict(base, drafter=d.label, synthetic_drafts=d.synthetic))
    d0 = draftings[0]
    if phases:
        tree = e2e.default_tree(target, d0)
        V = model.config.vocab_size
        configs = [("serial", dict(kw, mtp=False)),
                   (f"tree-{tree.size}", lambda i: dict(kw, tree=tree, **d0.kwargs(truth[i: i + 1], V, i)))]
        pb = dict(base, drafter=d0.label)
        rows += phase_rows(model, target.prompts, max_new_tokens, configs, pb)
        for name, ckw in configs:
            try:
                rows += kernel_rows(model, target.prompts, min(max_new_tokens, 32), name, ckw, pb)
            except Exception as exc:                   # the profiler is a diagnostic: report, do not abort
                rows.append(dict(pb, table="kernels", config=name, kernel="(torch.profiler failed)",
                                 note=repr(exc)[:300]))
    if hf:
        try:
            rows.append(dict(e2e.hf_row(target, max_new_tokens, serial, dict(base, drafter="none")), table="hf"))
        except Exception as exc:                       # an HF version that cannot build the twin: say so, go on
            rows.append(dict(base, table="hf", provider="hf-generate", note=f"HF baseline failed: {exc!r}"[:300]))
    return rows


def analytic_rows(drafting, sweep, t1, verify_s, base):
    """Predicted vs measured speedup per measured MTP config (see the module docstring)."""
    chains = [n for n in sweep if n.startswith("MTP-")]
    acc, source = drafting.acc, ("oracle profile (exact for the synthetic drafter)" if drafting.synthetic
                                 else "heads/accuracy.json")
    if acc is None and chains:
        longest = max(chains, key=lambda n: int(n.split("-")[1]))
        acc = acc_from_depth_rates(sweep[longest][1]["accept_rate_per_depth"])
        source = f"measured {longest} acceptance (rank 0 only: a lower bound for trees)"
    ser_tps = sweep["serial"][1]["decode_tokens_per_s"]
    rows = []
    for name, (t, r) in sweep.items():
        if t is None:
            continue
        ratio = verify_s(t) / t1
        e_tok = expected_tokens_per_step(t, acc) if acc is not None else None
        rows.append(dict(base, table="analytic", config=name, tree_size=t.size, acc_source=source if acc is not None
                         else "unknown", expected_tokens_per_step=e_tok, verify_ms_T=1e3 * verify_s(t),
                         verify_ms_1=1e3 * t1, verify_cost_ratio=ratio,
                         predicted_speedup=e_tok / ratio if e_tok is not None else None,
                         tau=r["tokens_per_step"], predicted_from_tau=r["tokens_per_step"] / ratio,
                         measured_speedup=r["decode_tokens_per_s"] / ser_tps))
    return rows


# ---- the whole run ----------------------------------------------------------------------------------------
def run_tables(out, shapes=("embedded", "llama7b"), *, quick=False, device=None, model_path=e2e.EMBEDDED,
               profiles=None, max_new_tokens=None, num_prompts=None, kernels="auto", hf=True, log=print,
               command=None):
    """Measure every suite that can run here, append the rows to <out>/tables.csv, write tables.md and tables.png.

    Returns (rows of this run, {"csv", "md", "png": paths}). A suite that cannot run here (llama7b on CPU without
    quick) adds one row with table="skipped" and the reason."""
    os.makedirs(out, exist_ok=True)
    env = env_info(device)
    run_id = env["timestamp"]
    rows = []
    profiles = profiles or ("seed80" if quick else DEFAULT_PROFILES)
    for shape in shapes:
        try:
            target = e2e.load_target(shape, model_path, device, quick=quick, num_prompts=num_prompts)
        except RuntimeError as exc:
            log(f"[{shape}] skipped: {exc}")
            rows.append(dict(env, run_id=run_id, table="skipped", suite=shape, note=str(exc)))
            continue
        if target.model.device.type != "cuda":
            log(f"[{shape}] CPU run: these are CPU numbers (torch ops), not GPU numbers")
        if shape == "llama7b":
            draftings = [e2e.oracle_drafting(p) for p in profiles.split(",") if p.strip()]
        else:
            draftings = [e2e.heads_drafting(target)]
        n = max_new_tokens or (12 if quick else 128)
        new = suite_rows(target, draftings, n, kernels=kernels, hf=hf, run_id=run_id, log=log)
        if command:
            new = [dict(r, command=command) for r in new]
        rows += new
        write_outputs(out, run_id, new)          # after every suite: a later timeout keeps what was measured
        del target
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    skipped = [r for r in rows if r["table"] == "skipped"]
    return rows, write_outputs(out, run_id, skipped)


def write_outputs(out, run_id, new_rows):
    """Append new_rows to <out>/tables.csv, then redraw tables.md and tables.png from the CSV rows of run_id."""
    paths = {k: os.path.join(out, f"tables.{k}") for k in ("csv", "md", "png")}
    append_rows(paths["csv"], new_rows)
    mine = [r for r in read_rows(paths["csv"]) if r.get("run_id") == run_id] if os.path.exists(paths["csv"]) else []
    published = load_published()
    with open(paths["md"], "w") as f:
        f.write(markdown(mine, published))
    plot(mine, published, paths["png"])
    return paths


# ---- rendering (from CSV rows: every value may be a string) -----------------------------------------------
def _f(x):
    try:
        v = float(x)
        return None if v != v else v
    except (TypeError, ValueError):
        return None


def _n(x, fmt="{:.1f}"):
    v = _f(x)
    return "—" if v is None else fmt.format(v)


def _table(headers, body):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def _where(r):
    cpu = " — **CPU numbers**" if str(r.get("device", "")).startswith("CPU") else ""
    return (f"{r.get('model')} ({r.get('dtype')}, {r.get('layers')} layers, {r.get('model_params_M')} M params) on "
            f"{r.get('device')}{cpu}; batch {r.get('batch', 1)}, prompt length {r.get('prompt_len')} tokens, "
            f"{r.get('max_new_tokens')} new tokens, {r.get('num_prompts')} prompt(s); kernels {r.get('kernels', '?')}")


def markdown(rows, published):
    """The side-by-side tables (markdown) of one run's rows."""
    seed = seed_sweep(published)
    src = next(r["source"] for r in published if r["file"] == "seed_depth_sweep.csv")
    e0 = rows[0] if rows else {}
    out = [f"# Speedup tables: published vs measured\n\nMeasured on {e0.get('device')} (torch {e0.get('torch')}, "
           f"triton {e0.get('triton')}, interpreter {e0.get('interpreter')}), commit {e0.get('commit')}, "
           f"{e0.get('timestamp')}. Decode tok/s excludes the time to first token; speedup is over serial decoding "
           "on the same engine, weights and prompts.\n"]
    for r in rows:
        if r.get("table") == "skipped":
            out.append(f"\n*{r['suite']}: {r['note']}*\n")
    out.append("\n## 1. The seed's depth sweep\n\nPublished: Llama-7B on a BM1684, batch and prompt length not "
               f"stated ({src}).\n")
    sweep = [r for r in rows if r.get("table") == "sweep"]
    for key in dict.fromkeys((r["suite"], r["drafter"]) for r in sweep):
        grp = [r for r in sweep if (r["suite"], r["drafter"]) == key]
        out.append(f"\n**Ours — {key[0]}, drafts: {key[1]}.** {_where(grp[0])}.\n\n")
        body = []
        for r in grp:
            p = seed.get(r["config"], {})
            pub_speed = p.get("speedup_pct", 0.0 if r["config"] == "serial" else None)
            body.append([r["config"] + (f" (T={r['tree_size']})" if r.get("tree_size") else ""),
                         _n(p.get("throughput")), _n(p.get("latency")), _n(pub_speed, "{:+.1f} %"),
                         _n(p.get("energy_efficiency")), _n(r.get("tokens_per_s")), _n(r.get("ms_per_token"), "{:.2f}"),
                         _n(r.get("speedup_pct"), "{:+.1f} %"), _n(r.get("tokens_per_j")), _n(r.get("tau"), "{:.2f}"),
                         {"True": "yes", "False": "**no**"}.get(str(r.get("identical_to_serial")), "—"),
                         r.get("accept_rate_per_depth") or r.get("note", "")])
        out.append(_table(["config", "pub. tok/s", "pub. ms/tok", "pub. speedup", "pub. tok/J", "ours tok/s",
                           "ours ms/tok", "ours speedup", "ours tok/J", "τ", "same tokens as serial",
                           "acceptance per depth / note"], body))
    out.append("\n## 2. Other systems (published) and our best configuration\n\n")
    body = []
    for r in published:
        if r["metric"] in ("speedup", "mean_accepted_tokens", "second_token_acceptance_pct", "draft_acceptance_pct"):
            v = f"{r['value']:g}" + (f"–{r['value_high']:g}" if r["value_high"] else "") + f" {r['unit']}"
            body.append([r["system"], r["config"], r["model"], r["hardware"], r["batch"], r["metric"], v, r["source"]])
    for (sysname, cfg, model, hw, batch, src2), (a, b) in _pairs(published).items():
        body.append([sysname, cfg, model, hw, batch, "speedup (computed from the tok/s pair)",
                     f"{b / a:.2f} x ({a:g} → {b:g} tok/s)", src2])
    for key in dict.fromkeys((r["suite"], r["drafter"]) for r in sweep):
        grp = [r for r in sweep if (r["suite"], r["drafter"]) == key and _f(r.get("speedup"))
               and r["config"] != "serial"]
        if grp:
            b = max(grp, key=lambda r: _f(r["speedup"]))
            body.append([f"ours ({key[0]}, {key[1]})", b["config"], b["model"], b["device"], b.get("batch", 1),
                         "speedup / τ", f"{_f(b['speedup']):.2f} x / {_n(b['tau'], '{:.2f}')}", "measured here"])
    out.append(_table(["system", "config", "model", "hardware", "batch", "metric", "value", "source"], body))
    ana = [r for r in rows if r.get("table") == "analytic"]
    if ana:
        out.append("\n## 3. Analytic model vs measured\n\npredicted = (E[accepted drafts] + 1) / c(T), with c(T) = "
                   "measured verify time of a T-node step / a 1-node step. `from τ` uses the measured tokens per "
                   "step instead of the expected ones: what separates it from the measured speedup is drafting, "
                   "accept, append and Python overhead.\n\n")
        out.append(_table(["suite", "drafts", "config", "T", "E[tokens/step]", "c(T)", "predicted", "from τ",
                           "measured", "accuracies from"],
                          [[r["suite"], r["drafter"], r["config"], r["tree_size"],
                            _n(r["expected_tokens_per_step"], "{:.2f}"), _n(r["verify_cost_ratio"], "{:.2f}"),
                            _n(r["predicted_speedup"], "{:.2f}"), _n(r["predicted_from_tau"], "{:.2f}"), _n(r["measured_speedup"], "{:.2f}"), r["acc_source"]]
                           for r in ana]))
    ph = [r for r in rows if r.get("table") == "phases"]
    if ph:
        out.append("\n## 4. Where a step's time goes (ms per step)\n\n")
        body = []
        for key in dict.fromkeys((r["suite"], r["config"]) for r in ph):
            g = {r["phase"]: r for r in ph if (r["suite"], r["config"]) == key}
            any_r = next(iter(g.values()))
            body.append([key[0], key[1]] + [_n(g[p]["ms_per_step"], "{:.3f}") if p in g else "—" for p in PHASES]
                        + [_n(any_r["step_ms"], "{:.3f}"), _n(any_r["tau"], "{:.2f}"), any_r["device"]])
        out.append(_table(["suite", "config", *PHASES, "step ms", "τ", "hardware"], body))
    cat = [r for r in rows if r.get("table") == "kernel_categories"]
    if cat:
        out.append("\n### GPU time by kernel category (torch.profiler, decode steps only)\n\n")
        out.append(_table(["suite", "config", "category", "GPU ms/step", "share"],
                          [[r["suite"], r["config"], r["category"], _n(r.get("gpu_ms_per_step"), "{:.3f}"),
                            _n((_f(r.get("fraction")) or 0) * 100, "{:.1f} %")] for r in cat]))
    ker = [r for r in rows if r.get("table") == "kernels"]
    if ker:
        out.append("\n### GPU kernels (torch.profiler, decode steps only)\n\n")
        out.append(_table(["suite", "config", "kernel", "category", "calls/step", "GPU ms/step", "share"],
                          [[r["suite"], r["config"], f"`{r['kernel'][:60]}`", r.get("category") or r.get("note", ""),
                            _n(r.get("calls_per_step")), _n(r.get("gpu_ms_per_step"), "{:.3f}"),
                            _n((_f(r.get("fraction")) or 0) * 100, "{:.1f} %")] for r in ker]))
    hf = [r for r in rows if r.get("table") == "hf"]
    if hf:
        out.append("\n## 5. Hugging Face generate() on the same weights (serial, batch 1)\n\n")
        out.append(_table(["suite", "model", "hardware", "HF tok/s", "HF / our serial", "HF tok/J", "note"],
                          [[r["suite"], r.get("model"), r.get("device"), _n(r.get("tokens_per_s")),
                            _n(r.get("speedup_vs_serial"), "{:.2f}"), _n(r.get("tokens_per_j")), r.get("note", "")]
                           for r in hf]))
    return "".join(out)


def _pairs(published):
    """(system, config, ...) -> (serial tok/s, method tok/s) for sources that give both throughputs."""
    tp = [r for r in published if r["metric"] == "throughput"]
    out = {}
    for r in tp:
        if r["config"] == "serial":
            continue
        base = [s for s in tp if s["system"] == r["system"] and s["config"] == "serial" and s["model"] == r["model"]
                and s["batch"] == r["batch"] and s["file"] == r["file"]]
        if base:
            out[(r["system"], r["config"], r["model"], r["hardware"], r["batch"], r["source"])] = (base[0]["value"],
                                                                                                   r["value"])
    return out


def plot(rows, published, path=None):
    """2 x 2 figure from one run's rows: the depth sweep, predicted vs measured, verify cost c(T), phases.

    Built without pyplot (no global backend switch), so a notebook can display the returned Figure."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(11, 7.5), dpi=80)
    ax = fig.subplots(2, 2)
    seed = seed_sweep(published)
    sweep = [r for r in rows if r.get("table") == "sweep" and _f(r.get("speedup"))]
    configs = list(SEED_CONFIGS) + ["tree"]
    groups = [("published BM1684 Llama-7B", {c: 1 + seed[c]["speedup_pct"] / 100 if c != "serial" else 1.0
                                            for c in SEED_CONFIGS})]
    for key in dict.fromkeys((r["suite"], r["drafter"]) for r in sweep):
        groups.append((f"{key[0]}: {key[1]}"[:40], {r["config"]: _f(r["speedup"]) for r in sweep
                                                    if (r["suite"], r["drafter"]) == key}))
    w = 0.8 / len(groups)
    for i, (label, vals) in enumerate(groups):
        ax[0, 0].bar([j + i * w for j in range(len(configs))], [vals.get(c, 0) or 0 for c in configs], width=w,
                     label=label)
    ax[0, 0].axhline(1, color="k", lw=0.8)
    ax[0, 0].set_xticks([j + 0.4 - w / 2 for j in range(len(configs))], configs)
    ax[0, 0].set_ylabel("speedup over serial (x)")
    ax[0, 0].set_title("the seed's depth sweep (missing bar = not run)", fontsize=9)
    ax[0, 0].legend(fontsize=6)
    ana = [r for r in rows if r.get("table") == "analytic"]
    lim = 1.0
    for key in dict.fromkeys((r["suite"], r["drafter"]) for r in ana):
        g = [r for r in ana if (r["suite"], r["drafter"]) == key]
        xs = [_f(r["predicted_speedup"]) for r in g]
        ys = [_f(r["measured_speedup"]) for r in g]
        pts = [(x, y, r["config"]) for x, y, r in zip(xs, ys, g) if x is not None and y is not None]
        if pts:
            ax[0, 1].scatter([p[0] for p in pts], [p[1] for p in pts], label=f"{key[0]}: {key[1]}"[:40])
            for x, y, c in pts:
                ax[0, 1].annotate(c, (x, y), fontsize=6)
            lim = max(lim, *[p[0] for p in pts], *[p[1] for p in pts])
    ax[0, 1].plot([0, lim * 1.1], [0, lim * 1.1], "k--", lw=0.8, label="measured = predicted")
    ax[0, 1].set_xlabel("predicted speedup (E[tokens/step] / c(T))")
    ax[0, 1].set_ylabel("measured speedup")
    ax[0, 1].set_title("analytic model vs measured", fontsize=9)
    ax[0, 1].legend(fontsize=6)
    for key in dict.fromkeys((r["suite"], r["device"]) for r in ana):
        pts = sorted({(int(r["tree_size"]), _f(r["verify_cost_ratio"])) for r in ana
                      if (r["suite"], r["device"]) == key})
        ax[1, 0].plot([1] + [p[0] for p in pts], [1.0] + [p[1] for p in pts], "o-", label=f"{key[0]} on {key[1][:24]}")
    if ana:
        tmax = max(int(r["tree_size"]) for r in ana)
        ax[1, 0].plot([1, tmax], [1, tmax], ":", color="grey", label="c(T) = T (compute-bound)")
    ax[1, 0].set_xlabel("tree nodes T")
    ax[1, 0].set_ylabel("verify cost c(T) = time(T) / time(1)")
    ax[1, 0].set_title("what a verify step of T nodes costs", fontsize=9)
    ax[1, 0].legend(fontsize=6)
    ph = [dict(r, config=f"{r['suite']}: {r['config']}") for r in rows if r.get("table") == "phases"]
    plot_phases(ph, ax=ax[1, 1])
    ax[1, 1].set_title("per-phase profile", fontsize=9)
    dev = rows[0].get("device", "?") if rows else "?"
    fig.suptitle(f"published vs measured — {dev}" + (" (CPU numbers)" if str(dev).startswith("CPU") else ""),
                 fontsize=10)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=80)
    return fig


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mtp_triton tables", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("out", "tables"), help="folder for tables.csv / .md / .png")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU CI); llama7b runs at a tiny shape")
    ap.add_argument("--model", default=e2e.EMBEDDED, help="checkpoint folder with heads/ (the embedded suite)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--shape", nargs="+", default=["embedded", "llama7b"], choices=["embedded", "llama7b"])
    ap.add_argument("--profiles", default=None,
                    help=f"synthetic acceptance profiles for llama7b (default {DEFAULT_PROFILES}; quick: seed80); "
                         "names, probabilities (0.8) or per-depth lists (0.9/0.8/0.7)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    a = ap.parse_args(argv)
    if a.profiles:
        for p in a.profiles.split(","):
            e2e.parse_profile(p)                                    # fail early on a bad profile
    if not torch.cuda.is_available():
        print("no GPU: CPU run — every number below is a CPU number (torch ops" + (", tiny sizes)" if a.quick else ")"))
    rows, paths = run_tables(a.out, a.shape, quick=a.quick, device=a.device, model_path=a.model,
                             profiles=a.profiles, max_new_tokens=a.max_new_tokens, num_prompts=a.num_prompts,
                             kernels=a.kernels, hf=not a.no_hf,
                             command="python -m mtp_triton tables " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"wrote {len(rows)} rows: {paths['csv']}, {paths['md']}, {paths['png']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
