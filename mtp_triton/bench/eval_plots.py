"""The evaluation plots, drawn from the rows only: latency CDFs, speedup per scenario and output length,
acceptance per depth, the parameter sweep and the long run."""
import os

from .common import save_figure
from .eval_metrics import ab_table, aggregate, num, section_rows
from .eval_report import mib


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

    sw = section_rows(rows, "sweep")
    if sw:
        base = aggregate([r for r in sw if r["sweep_tree"] == "serial"])
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
        for name in dict.fromkeys(r["sweep_tree"] for r in sw if r["sweep_tree"] != "serial"):
            sel = [r for r in sw if r["sweep_tree"] == name]
            a = aggregate(sel)
            size = num(sel[0]["sweep_size"])
            style = {"chain": ("o", "tab:blue"), "medusa": ("s", "tab:green"), "width": ("^", "tab:red")}.get(
                name.split("-")[0], ("*", "tab:orange"))
            for axis, y in ((ax[0], a["tokens_per_step"]), (ax[1], a["decode_tokens_per_s"] / base["decode_tokens_per_s"])):
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
