"""The speedup tables rendered: published numbers (data/published/*.csv) beside one run's measured rows, as
markdown and as one 2 x 2 figure. Everything here reads CSV rows (every value may be a string)."""
import glob
import os

from ..bundle import ROOT
from ..records import md_table, read_rows
from .common import save_figure
from .profile_step import PHASES, plot_phases

PUBLISHED = os.path.join(ROOT, "data", "published")
NPU_REPORT = "npu_report_bm1684_llama7b.csv"             # the MTP-on-NPU engineering report's depth sweep
NPU_CONFIGS = ("serial", "MTP-2", "MTP-4", "MTP-8")


# ---- published numbers ------------------------------------------------------------------------------------
def load_published(folder=PUBLISHED):
    """All rows of data/published/*.csv, `value` / `value_high` as floats (None when blank), plus `file`."""
    return [dict(r, value=float(r["value"]), value_high=float(r["value_high"]) if r.get("value_high") else None,
                 file=os.path.basename(path))
            for path in sorted(glob.glob(os.path.join(folder, "*.csv"))) for r in read_rows(path)]


def npu_sweep(published):
    """{config: {metric: value}} of the NPU report's BM1684 table (serial, MTP-2/4/8; Llama-7B)."""
    out = {}
    for r in published:
        if r["file"] == NPU_REPORT:
            out.setdefault(r["config"], {})[r["metric"]] = r["value"]
    return out


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


def _share(r):
    return _n((_f(r.get("fraction")) or 0) * 100, "{:.1f} %")


def _of(rows, kind):
    """The rows of one kind (their `table` field: sweep, analytic, phases, ...)."""
    return [r for r in rows if r.get("table") == kind]


def _groups(rows, *cols):
    """{(the values of cols): the rows holding them}, keys in the order they first appear."""
    out = {}
    for r in rows:
        out.setdefault(tuple(r[c] for c in cols), []).append(r)
    return out


def _block(heading, headers, body):
    """A heading and its markdown table; "" when the table has no rows."""
    return heading + md_table(headers, body) + "\n" if body else ""


def _where(r):
    cpu = " — **CPU numbers**" if str(r.get("device", "")).startswith("CPU") else ""
    return (f"{r.get('model')} ({r.get('dtype')}, {r.get('layers')} layers, {r.get('model_params_M')} M params) on "
            f"{r.get('device')}{cpu}; batch {r.get('batch', 1)}, prompt length {r.get('prompt_len')} tokens, "
            f"{r.get('max_new_tokens')} new tokens, {r.get('num_prompts')} prompt(s); kernels {r.get('kernels', '?')}")


def markdown(rows, published):
    """The side-by-side tables (markdown) of one run's rows."""
    npu = npu_sweep(published)
    src = next(r["source"] for r in published if r["file"] == NPU_REPORT)
    e0 = rows[0] if rows else {}
    out = [f"# Speedup tables: published vs measured\n\nMeasured on {e0.get('device')} (torch {e0.get('torch')}, "
           f"triton {e0.get('triton')}, interpreter {e0.get('interpreter')}), commit {e0.get('commit')}, "
           f"{e0.get('timestamp')}. Decode tok/s excludes the time to first token; speedup is over serial decoding "
           "on the same engine, weights and prompts.\n"]
    out += [f"\n*{r['suite']}: {r['note']}*\n" for r in _of(rows, "skipped")]
    out.append("\n## 1. Depth sweep: MTP-2 / MTP-4 / MTP-8 (chains of 2, 4, 8 drafts) against serial\n\n"
               f"Published: Llama-7B on a BM1684 NPU, batch and prompt length not stated ({src}). Ours: each suite "
               "below, measured by this run, on the hardware it names; MTP-n is a chain-n tree, `tree` the default "
               "(for trained heads: the tree stored with them).\n")
    sweeps = _groups(_of(rows, "sweep"), "suite", "drafter")
    for (suite, drafter), grp in sweeps.items():
        body = []
        for r in grp:
            p = npu.get(r["config"], {})
            pub_speed = p.get("speedup_pct", 0.0 if r["config"] == "serial" else None)
            body.append([r["config"] + (f" (T={r['tree_size']})" if r.get("tree_size") else ""),
                         _n(p.get("throughput")), _n(p.get("latency")), _n(pub_speed, "{:+.1f} %"),
                         _n(p.get("energy_efficiency")), _n(r.get("tokens_per_s")), _n(r.get("ms_per_token"), "{:.2f}"),
                         _n(r.get("speedup_pct"), "{:+.1f} %"), _n(r.get("tokens_per_j")), _n(r.get("tau"), "{:.2f}"),
                         {"True": "yes", "False": "**no**"}.get(str(r.get("identical_to_serial")), "—"),
                         r.get("accept_rate_per_depth") or r.get("note", "")])
        out.append(_block(f"\n**Ours — {suite}, drafts: {drafter}.** {_where(grp[0])}.\n\n",
                          ["config", "pub. tok/s", "pub. ms/tok", "pub. speedup", "pub. tok/J", "ours tok/s",
                           "ours ms/tok", "ours speedup", "ours tok/J", "τ", "same tokens as serial",
                           "acceptance per depth / note"], body))
    body = []
    for r in published:
        if r["metric"] in ("speedup", "mean_accepted_tokens", "second_token_acceptance_pct", "draft_acceptance_pct"):
            v = f"{r['value']:g}" + (f"–{r['value_high']:g}" if r["value_high"] else "") + f" {r['unit']}"
            body.append([r["system"], r["config"], r["model"], r["hardware"], r["batch"], r["metric"], v, r["source"]])
    for (sysname, cfg, model, hw, batch, src2), (a, b) in _pairs(published).items():
        body.append([sysname, cfg, model, hw, batch, "speedup (computed from the tok/s pair)",
                     f"{b / a:.2f} x ({a:g} → {b:g} tok/s)", src2])
    for (suite, drafter), grp in sweeps.items():
        grp = [r for r in grp if _f(r.get("speedup")) and r["config"] != "serial"]
        if grp:
            b = max(grp, key=lambda r: _f(r["speedup"]))
            body.append([f"ours ({suite}, {drafter})", b["config"], b["model"], b["device"], b.get("batch", 1),
                         "speedup / τ", f"{_f(b['speedup']):.2f} x / {_n(b['tau'], '{:.2f}')}", "measured here"])
    out.append(_block("\n## 2. Other systems (published) and our best configuration\n\n",
                      ["system", "config", "model", "hardware", "batch", "metric", "value", "source"], body))
    out.append(_block("\n## 3. Analytic model vs measured\n\npredicted = (E[accepted drafts] + 1) / c(T), with c(T) = "
                      "measured verify time of a T-node step / a 1-node step. `from τ` uses the measured tokens per "
                      "step instead of the expected ones: what separates it from the measured speedup is drafting, "
                      "accept, append and Python overhead.\n\n",
                      ["suite", "drafts", "config", "T", "E[tokens/step]", "c(T)", "predicted", "from τ", "measured",
                       "accuracies from"],
                      [[r["suite"], r["drafter"], r["config"], r["tree_size"],
                        *[_n(r[k], "{:.2f}") for k in ("expected_tokens_per_step", "verify_cost_ratio",
                                                      "predicted_speedup", "predicted_from_tau", "measured_speedup")],
                        r["acc_source"]] for r in _of(rows, "analytic")]))
    body = []
    for (suite, config), grp in _groups(_of(rows, "phases"), "suite", "config").items():
        g = {r["phase"]: r for r in grp}
        first = next(iter(g.values()))
        body.append([suite, config] + [_n(g[p]["ms_per_step"], "{:.3f}") if p in g else "—" for p in PHASES]
                    + [_n(first["step_ms"], "{:.3f}"), _n(first["tau"], "{:.2f}"), first["device"]])
    out.append(_block("\n## 4. Where a step's time goes (ms per step)\n\n",
                      ["suite", "config", *PHASES, "step ms", "τ", "hardware"], body))
    out.append(_block("\n### GPU time by kernel category (torch.profiler, decode steps only)\n\n",
                      ["suite", "config", "category", "GPU ms/step", "share"],
                      [[r["suite"], r["config"], r["category"], _n(r.get("gpu_ms_per_step"), "{:.3f}"), _share(r)]
                       for r in _of(rows, "kernel_categories")]))
    out.append(_block("\n### GPU kernels (torch.profiler, decode steps only)\n\n",
                      ["suite", "config", "kernel", "category", "calls/step", "GPU ms/step", "share"],
                      [[r["suite"], r["config"], f"`{r['kernel'][:60]}`", r.get("category") or r.get("note", ""),
                        _n(r.get("calls_per_step")), _n(r.get("gpu_ms_per_step"), "{:.3f}"), _share(r)]
                       for r in _of(rows, "kernels")]))
    out.append(_block("\n## 5. Hugging Face generate() on the same weights (greedy and prompt-lookup, batch 1)\n\n",
                      ["suite", "model", "hardware", "provider", "HF tok/s", "HF / our serial", "HF tok/J", "note"],
                      [[r["suite"], r.get("model"), r.get("device"), r.get("provider"), _n(r.get("tokens_per_s")),
                        _n(r.get("speedup_vs_serial"), "{:.2f}"), _n(r.get("tokens_per_j")), r.get("note", "")]
                       for r in _of(rows, "hf")]))
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
    npu = npu_sweep(published)
    sweep = [r for r in _of(rows, "sweep") if _f(r.get("speedup"))]
    configs = list(NPU_CONFIGS) + ["tree"]
    groups = [("published BM1684 Llama-7B", {c: 1 + npu[c]["speedup_pct"] / 100 if c != "serial" else 1.0
                                            for c in NPU_CONFIGS})]
    for (suite, drafter), g in _groups(sweep, "suite", "drafter").items():
        groups.append((f"{suite}: {drafter}"[:40], {r["config"]: _f(r["speedup"]) for r in g}))
    w = 0.8 / len(groups)
    for i, (label, vals) in enumerate(groups):
        ax[0, 0].bar([j + i * w for j in range(len(configs))], [vals.get(c, 0) or 0 for c in configs], width=w,
                     label=label)
    ax[0, 0].axhline(1, color="k", lw=0.8)
    ax[0, 0].set_xticks([j + 0.4 - w / 2 for j in range(len(configs))], configs)
    ax[0, 0].set_ylabel("speedup over serial (x)")
    ax[0, 0].set_title("depth sweep: MTP-2/4/8 vs serial (missing bar = not run)", fontsize=9)
    ax[0, 0].legend(fontsize=6)
    ana = _of(rows, "analytic")
    lim = 1.0
    for (suite, drafter), g in _groups(ana, "suite", "drafter").items():
        pts = [(_f(r["predicted_speedup"]), _f(r["measured_speedup"]), r["config"]) for r in g]
        pts = [p for p in pts if p[0] is not None and p[1] is not None]
        if pts:
            ax[0, 1].scatter([p[0] for p in pts], [p[1] for p in pts], label=f"{suite}: {drafter}"[:40])
            for x, y, c in pts:
                ax[0, 1].annotate(c, (x, y), fontsize=6)
            lim = max(lim, *[p[0] for p in pts], *[p[1] for p in pts])
    ax[0, 1].plot([0, lim * 1.1], [0, lim * 1.1], "k--", lw=0.8, label="measured = predicted")
    ax[0, 1].set_xlabel("predicted speedup (E[tokens/step] / c(T))")
    ax[0, 1].set_ylabel("measured speedup")
    ax[0, 1].set_title("analytic model vs measured", fontsize=9)
    ax[0, 1].legend(fontsize=6)
    for (suite, device), g in _groups(ana, "suite", "device").items():
        pts = sorted({(int(r["tree_size"]), _f(r["verify_cost_ratio"])) for r in g})
        ax[1, 0].plot([1] + [p[0] for p in pts], [1.0] + [p[1] for p in pts], "o-", label=f"{suite} on {device[:24]}")
    if ana:
        tmax = max(int(r["tree_size"]) for r in ana)
        ax[1, 0].plot([1, tmax], [1, tmax], ":", color="grey", label="c(T) = T (compute-bound)")
    ax[1, 0].set_xlabel("tree nodes T")
    ax[1, 0].set_ylabel("verify cost c(T) = time(T) / time(1)")
    ax[1, 0].set_title("what a verify step of T nodes costs", fontsize=9)
    ax[1, 0].legend(fontsize=6)
    ph = [dict(r, config=f"{r['suite']}: {r['config']}") for r in _of(rows, "phases")]
    plot_phases(ph, ax=ax[1, 1])
    ax[1, 1].set_title("per-phase profile", fontsize=9)
    dev = rows[0].get("device", "?") if rows else "?"
    fig.suptitle(f"published vs measured — {dev}" + (" (CPU numbers)" if str(dev).startswith("CPU") else ""),
                 fontsize=10)
    fig.tight_layout()
    if path:
        save_figure(fig, path)                                # atomic: an interrupted save keeps the old image
    return fig


