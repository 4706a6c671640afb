"""The evaluation's outputs, computed from the rows (as the harness made them or read back from eval.csv): report.md,
markdown tables with the hardware, versions and command that produced them, and its plots: latency CDFs, speedup per
scenario and output length, acceptance per depth, the parameter sweep and the long run."""
import os

from .. import records
from .common import save_figure
from .eval_metrics import ALPHA, FLOOR, MIN_ITEMS, ab_table, num, section_rows, sweep_groups


def fmt(x, nd=2):
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def md_table(header, body):
    return records.md_table(header, body, cell=fmt)


def mib(x):
    return None if x is None else x / 2 ** 20


def performance_tables(rows):
    """Markdown tables of the A/B rows: per scenario, per output length, observability, phases."""
    parts = []
    head = ["scenario", "req", "tok/s off", "tok/s on", "speedup", "TTFT ms off", "TTFT ms on", "e2e ms off",
            "e2e ms on", "e2e P95 off", "e2e P95 on", "e2e P99 off", "e2e P99 on", "ITL P50/P95/P99 ms off",
            "ITL P50/P95/P99 ms on"]
    itl = lambda a: f"{a['itl_p50_ms']:.2f} / {a['itl_p95_ms']:.2f} / {a['itl_p99_ms']:.2f}"
    body = [(k, on["requests"], off["decode_tokens_per_s"], on["decode_tokens_per_s"], sp, off["ttft_ms"], on["ttft_ms"],
             off["e2e_ms"], on["e2e_ms"], off["e2e_p95_ms"], on["e2e_p95_ms"], off["e2e_p99_ms"], on["e2e_p99_ms"],
             itl(off), itl(on)) for k, off, on, sp in ab_table(rows, "scenario")]
    parts.append(md_table(head, body))
    body = [(k, on["requests"], on["new_tokens"] / on["requests"], off["decode_tokens_per_s"], on["decode_tokens_per_s"],
             sp, off["ttft_ms"], on["ttft_ms"], off["e2e_ms"], on["e2e_ms"]) for k, off, on, sp in ab_table(rows, "length")]
    parts.append("By output length (each scenario set has short, medium and long items):\n\n" + md_table(
        ["output length", "req", "mean new tokens", "tok/s off", "tok/s on", "speedup", "TTFT ms off", "TTFT ms on",
         "e2e ms off", "e2e ms on"], body))
    table = ab_table(rows, "scenario")
    depth = max((len(on["accept_per_depth"]) for _, _, on, _ in table), default=0)
    body = [(k, on["tokens_per_step"], *[f"{a:.0%}" for a in on["accept_per_depth"]],
             *[""] * (depth - len(on["accept_per_depth"])), int(on["rejected_steps"]),
             f"{int(on['wasted_drafts'])} / {int(on['drafted_tokens'])}", int(on["fallback"])) for k, _, on, _ in table]
    parts.append("MTP observability (tau = tokens per verify step, bonus included; acceptance at depth d = share of steps "
                 "whose accepted path reached depth d; rejected steps = steps whose path stopped short of the tree's "
                 "depth):\n\n" + md_table(["scenario", "tau", *[f"acc d{d + 1}" for d in range(depth)], "rejected steps",
                                           "wasted / drafted tokens", "fallbacks"], body))
    body = []
    for k, off, on, _ in table:
        for mode, a in (("off", off), ("on", on)):
            body.append((k, mode, a["draft_ms_step"], a["verify_ms_step"], a["accept_ms_step"], a["append_ms_step"],
                         a["verify_ms_step"] / off["verify_ms_step"] if off["verify_ms_step"] else None))
    parts.append("Time per phase (ms per step) and verification overhead (verify time per step relative to the serial "
                 "step):\n\n" + md_table(["scenario", "MTP", "draft", "verify", "accept", "append", "verify / serial"], body))
    return parts


def sweep_table(rows):
    body = [(name, int(num(r0["sweep_size"])), int(num(r0["sweep_depth"])), int(num(r0["sweep_top_k"])),
             a["tokens_per_step"], f"{a['accept_per_depth'][0]:.0%}" if a["accept_per_depth"] else "",
             f"{a['accept_per_depth'][-1]:.0%}" if a["accept_per_depth"] else "", a["decode_tokens_per_s"], sp,
             a["verify_ms_step"]) for name, r0, a, sp in sweep_groups(rows)]
    return md_table(["tree", "nodes", "depth", "top-k", "tau", "acc d1", "acc deepest", "tok/s", "speedup",
                     "verify ms/step"], body)


def write_report(result, path, command=""):
    """report.md: the verdict, then one section per measured dimension, from result.rows and result.info."""
    rows, info, fails = result.rows, result.info, result.failures
    r0 = next((r for r in rows if r.get("run_id") == info.get("run_id")), rows[0] if rows else {})   # this run's
    used = sorted({str(r["kernels"]) for r in rows if r.get("kernels")})
    ops = " + ".join("Triton interpreter" if k == "triton" and info["interpreter"] else
                     "PyTorch ops" if k == "torch" else "Triton kernels" for k in used) or info["kernels"]
    form = "chat messages in the model's chat template" if info.get("chat_template") else "raw text to continue"
    hw = f"{info['device']}, {ops}" + (" — CPU numbers; they say nothing about GPU speed" if info["cpu"] else "")
    L = ["# MTP evaluation report", "",
         f"- hardware: **{hw}**",
         f"- torch {r0.get('torch')}, triton {r0.get('triton')}, python {r0.get('python')}, commit {r0.get('commit')}, "
         f"{r0.get('timestamp')}, run {r0.get('run_id')}",
         f"- model: {info['model_name'] + ', ' if info.get('model_name') else ''}{info['model_bytes'] / 2**20:.1f} MiB "
         f"of weights ({info['dtype']}), context {info['context']}; "
         + ("the MTP module" if info.get("drafter") == "mtp" else f"{info['num_heads']} heads")
         + f" ({info['heads_bytes'] / 2**20:.2f} MiB)",
         f"- scenarios: {info['scenario_dir']} ({', '.join(info['scenarios'])}; {form})" if info.get("scenario_dir")
         else "",
         ("- tree: dynamic (at most " if info.get("drafter") == "mtp" else f"- tree: {info['tree']} (")
         + f"{info['tree_size']} nodes, depth {info['tree_depth']}); kernels {info['kernels']}; "
         f"temperature {info['temperature']}, top-p {info['top_p']}",
         f"- command: `{command}`" if command else "",
         f"- resumed (--resume): {info['kept_rows']} rows kept from earlier runs of this configuration"
         if info.get("kept_rows") else "", "",
         "## Verdict", ""]
    sec = {s: section_rows(rows, s) for s in ("ab", "quality", "sweep", "long_summary", "edge", "compat")}
    ab = sec["ab"]
    verdicts = (("quality", "quality gate", ab), ("edge", "edge inputs", sec["edge"]),
                ("long-run", "long-run stability", sec["long_summary"]), ("compat", "compatibility", sec["compat"]))
    for key, name, ran in verdicts:
        n = sum(f.startswith(f"[{key}]") for f in fails)
        L.append(f"- {name}: " + ("not run" if not ran else "**PASS**" if n == 0 else f"**FAIL** ({n} problems)"))
    if fails:
        L += ["", "Problems:", "", "```", *fails, "```"]
    L += ["", "## 1. Functional completeness", ""]
    off = [r for r in ab if r["mode"] == "off"]
    L.append(md_table(["check", "result"], [
        ("MTP off runs the serial path (1 node per step, tau = 1)",
         bool(off) and all(num(r["tree_size"]) == 1 and abs(num(r["tokens_per_step"]) - 1) < 1e-9 for r in off)),
        ("draft length / candidate count configurable", f"--tree (this run: {info['tree']}); sweep covers "
         f"{len(set(r['sweep_tree'] for r in sec['sweep']))} trees" if sec["sweep"] else "--tree, --sweep"),
        ("fallback to serial", "RuntimeConfig.fallback_threshold (--fallback); fallbacks this run: "
         f"{int(sum(num(r['fallback_count']) for r in ab))}"),
        ("statistics exposed", "acceptance per depth, accept-length histogram, phase times, TTFT, ITL percentiles"),
    ]))
    L += ["", "## 2. Quality", ""]
    if info["temperature"] == 0:
        body = []
        for sc in dict.fromkeys(r["scenario"] for r in ab):
            on = [r for r in ab if r["scenario"] == sc and r["mode"] == "on"]
            body.append((sc, len(on), sum(bool(num(r["identical"])) for r in on)))
        L.append("Greedy decoding: the MTP output must equal the serial output token for token.\n")
        L.append(md_table(["scenario", "requests", "identical"], body))
    else:
        L.append(f"Sampling (T = {info['temperature']}): outputs cannot match token for token, so the paired per-item "
                 f"differences (on - off) of three summaries are compared with a paired t-test: |mean diff| <= t(1 - "
                 f"{ALPHA:g}/2, n - 1) x its standard error + a floor ({', '.join(f'{k} {v}' for k, v in FLOOR.items())})"
                 f", so a correct engine fails one check with probability {ALPHA:g}; sets with fewer than {MIN_ITEMS} "
                 f"items get no verdict. With few items the tolerance is wide: more items (--max-prompts) make the "
                 f"check sharper.\n")
        body = [(r["scenario"], r["metric"], r["n"], num(r["off"]), num(r["on"]), num(r["diff"]), num(r["tolerance"]),
                 f"n/a (< {MIN_ITEMS} items)" if r["ok"] in (None, "", "None") else bool(num(r["ok"])))
                for r in sec["quality"]]
        L.append(md_table(["scenario", "summary", "n", "off", "on", "diff", "tolerance", "within"], body))
    if ab:
        L += ["", f"## 3. Performance ({'CPU' if info['cpu'] else info['device']}, batch 1)", "",
              "Decode tokens/s = (new tokens - 1) / (end-to-end - TTFT), summed over requests; latency percentiles "
              "are over requests; ITL percentiles are the per-request engine percentiles, averaged.", ""]
        L += [p + "\n" for p in performance_tables(rows)]
        L += ["## 4. Resources", ""]
        body = [(k, mib(off["peak_memory_bytes"]), mib(on["peak_memory_bytes"]), mib(off["cache_bytes"]),
                 mib(on["cache_bytes"]), off["energy_j"], on["energy_j"]) for k, off, on, _ in ab_table(rows, "scenario")]
        L.append(("Peak memory is the process RSS high-water mark on CPU (monotone over the run: not an A/B "
                  "measure); on GPU it is max_memory_allocated per request. " if info["cpu"] else
                  "Peak memory = torch.cuda.max_memory_allocated per request. ") +
                 f"MTP adds the heads ({info['heads_bytes'] / 2**20:.2f} MiB) and tree slack in the KV cache.\n")
        L.append(md_table(["scenario", "peak MiB off", "peak MiB on", "KV cache MiB off", "KV cache MiB on",
                           "energy J off", "energy J on"], body))
    if sec["sweep"]:
        L += ["", "## 5. Parameter sensitivity", "",
              "Same prompts, one per scenario set, MTP on with each tree; speedup against serial on the same prompts. "
              "chain-n = depth n, one candidate per head; medusa-N = N-node trees; width-k = k candidates per head.", "",
              sweep_table(rows)]
    if sec["long_summary"]:
        s = sec["long_summary"][0]
        L += ["", "## 6. Long-run stability", "", md_table(["metric", "value"], [
            ("requests / tokens", f"{s['requests']} / {int(num(s['tokens']))}"),
            ("errors / timeouts", f"{s['errors']} / {s['timeouts']}"),
            ("spot checks vs serial (mismatches)", f"{s['spot_checks']} ({s['spot_mismatches']})"),
            ("throughput first / last quarter (tok/s)", f"{fmt(num(s['tput_first']))} / {fmt(num(s['tput_last']))}"),
            ("throughput drift", "n/a" if s["drift"] in (None, "") else f"{num(s['drift']):+.1%}"),
            ("memory after warm-up / at end (MiB)", f"{fmt(mib(num(s['memory_warm_bytes'])), 1)} / "
                                                     f"{fmt(mib(num(s['memory_end_bytes'])), 1)}"),
            ("memory growth (MiB; limit)", f"{mib(num(s['memory_growth_bytes'])):+.2f} (limit "
                                           f"{mib(num(s['memory_growth_limit'])):.0f})"),
        ])]
    if sec["edge"]:
        L += ["", "## 7. Bad and edge inputs (temperature 0)", "",
              md_table(["case", "expected", "outcome", "ok", "detail"],
                       [(r["case"], r["expect"], r["outcome"],
                         "skipped" if r["expect"] == "skipped" else bool(num(r["ok"])),
                         str(r["detail"]).replace("\n", " ")[:120]) for r in sec["edge"]])]
    if sec["compat"]:
        L += ["", "## 8. Compatibility", "", md_table(["case", "identical"],
                                                     [(r["case"], bool(num(r["ok"]))) for r in sec["compat"]])]
    L += ["", "## Plots", ""] + [f"![{p}]({p})" for p in result.info.get("plots", [])]
    return records.write_text(path, "\n".join(L) + "\n")


def plot_all(rows, out, label=""):
    """PNG plots from the rows; returns the file names written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []

    def save(fig, name):
        save_figure(fig, os.path.join(out, name), close=True)
        written.append(name)

    ab = section_rows(rows, "ab")
    if ab:
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
        for mode, color in (("off", "grey"), ("on", "tab:blue")):
            sel = [r for r in ab if r["mode"] == mode]
            per_tok = sorted(1e3 * (num(r["e2e_s"]) - num(r["ttft_s"])) / max(num(r["new_tokens"]) - 1, 1) for r in sel)
            e2e = sorted(1e3 * num(r["e2e_s"]) for r in sel)
            for a, xs in ((ax[0], per_tok), (ax[1], e2e)):
                a.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color=color,
                       label="MTP " + mode)
        ax[0].set_xlabel("decode ms / token (per request)")
        ax[1].set_xlabel("end-to-end latency, ms (per request)")
        ax[1].set_xscale("log")
        for a in ax:
            a.set_ylabel("fraction of requests")
            a.legend(fontsize=8)
        ax[0].set_title(f"latency CDF {label}", fontsize=9)
        save(fig, "latency_cdf.png")

        fig, ax = plt.subplots(1, 2, figsize=(9, 3.2), gridspec_kw={"width_ratios": [3, 2]})
        for a, by in ((ax[0], "scenario"), (ax[1], "length")):
            t = ab_table(rows, by)
            a.bar(range(len(t)), [sp for *_, sp in t], color=["tab:blue"] * (len(t) - 1) + ["tab:orange"])
            a.set_xticks(range(len(t)))
            a.set_xticklabels([k.replace("_", "\n") for k, *_ in t], fontsize=7)
            a.axhline(1.0, color="k", lw=0.8)
            a.set_ylabel("decode tok/s, on / off")
        ax[0].set_title(f"speedup per scenario {label}", fontsize=9)
        ax[1].set_title("by output length", fontsize=9)
        save(fig, "speedup.png")

        fig, ax = plt.subplots(figsize=(5, 3.2))
        for k, _, on, _ in ab_table(rows, "scenario"):
            acc = on["accept_per_depth"]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=k, lw=2.5 if k == "all" else 1)
        ax.set_xlabel("depth")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
        ax.set_title(f"acceptance per depth {label}", fontsize=9)
        save(fig, "acceptance.png")

    sweep = sweep_groups(rows)
    if sweep:
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
        for name, r0, a, speedup in (g for g in sweep if g[0] != "serial"):
            size = num(r0["sweep_size"])
            style = {"chain": ("o", "tab:blue"), "medusa": ("s", "tab:green"), "width": ("^", "tab:red")}.get(
                name.split("-")[0], ("*", "tab:orange"))
            for axis, y in ((ax[0], a["tokens_per_step"]), (ax[1], speedup)):
                axis.scatter([size], [y], marker=style[0], color=style[1])
                axis.annotate(name, (size, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
        ax[0].set_ylabel("tau (tokens / step)")
        ax[1].set_ylabel("speedup vs serial")
        ax[1].axhline(1.0, color="k", lw=0.8)
        for axis in ax:
            axis.set_xscale("log", base=2)
            axis.set_xlabel("tree nodes (root included)")
        ax[0].set_title(f"sensitivity: chain (o), medusa (s), width (^), tuned (*) {label}", fontsize=8)
        save(fig, "sensitivity.png")

    lr = [r for r in section_rows(rows, "long_run") if not r["error"]]
    if lr:
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.0))
        ax[0].plot([num(r["new_tokens"]) / num(r["request_s"]) for r in lr], lw=0.8)
        ax[0].set_xlabel("request")
        ax[0].set_ylabel("tokens/s")
        ax[1].plot([mib(num(r["memory_bytes"])) for r in lr], lw=0.8)
        ax[1].set_xlabel("request")
        ax[1].set_ylabel("memory in use, MiB")
        ax[0].set_title(f"long run {label}", fontsize=9)
        save(fig, "long_run.png")
    return written
