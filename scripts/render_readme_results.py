"""Render README.md's results block from recorded rows (never typed by hand).

    python scripts/render_readme_results.py          # rewrite the block between the markers
    python scripts/render_readme_results.py --check  # exit 1 if README.md is out of date (used by a test)

Sources: results/*/demo.csv, results/*/eval/eval.csv, data/tiny-stdlib-llama/records/tau_generate.json.
"""
import csv
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- results:begin (scripts/render_readme_results.py) -->", "<!-- results:end -->"


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _stamp(r):
    return f"{r['device']}, torch {r['torch']}, triton {r['triton']}, commit {r['commit']}, {r['timestamp'][:10]}"


def render():
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "results", "*", "demo.csv"))):
        rows = _rows(path)
        ser = [r for r in rows if r["mode"] == "serial"][-1]
        mtp = [r for r in rows if r["mode"] == "mtp"][-1]
        rel = os.path.relpath(path, ROOT)
        s, m = float(ser["decode_tokens_per_s"]), float(mtp["decode_tokens_per_s"])
        out.append(f"**Main demo** (`{mtp['command']}`; {_stamp(mtp)}; batch {mtp['batch']}, "
                   f"{mtp['max_new_tokens']} new tokens, kernels {mtp['kernels']}, tree `{mtp['tree']}` → "
                   f"{mtp['tree_size']} nodes; rows: `{rel}`):\n")
        out.append("| | decode tokens/s | tokens per step (τ) | output identical to serial |")
        out.append("|---|---|---|---|")
        out.append(f"| serial | {s:.1f} | 1.00 | — |")
        out.append(f"| MTP | {m:.1f} ({m / s:.2f}×) | {float(mtp['tokens_per_step']):.2f} | {mtp['identical']} |\n")
    for path in sorted(glob.glob(os.path.join(ROOT, "results", "*", "eval", "eval.csv"))):
        rows = [r for r in _rows(path) if r["section"] == "ab"]
        rel = os.path.relpath(path, ROOT)
        out.append(f"**Evaluation harness** (`{rows[0]['command']}`; {_stamp(rows[0])}; greedy, batch 1; rows: "
                   f"`{rel}`, report: `{os.path.dirname(rel)}/report.md`):\n")
        out.append("| scenario | requests | decode tok/s off → on | speedup | τ | identical |")
        out.append("|---|---|---|---|---|---|")
        for sc in sorted({r["scenario"] for r in rows}) + ["all"]:
            sel = [r for r in rows if sc in ("all", r["scenario"])]
            rate = {}
            for mode in ("off", "on"):
                rr = [r for r in sel if r["mode"] == mode]
                rate[mode] = sum(int(r["new_tokens"]) - 1 for r in rr) / sum(
                    float(r["e2e_s"]) - float(r["ttft_s"]) for r in rr)
            on = [r for r in sel if r["mode"] == "on"]
            tau = sum(int(r["new_tokens"]) - 1 for r in on) / max(sum(int(r["steps"]) for r in on), 1)
            same = sum(r["identical"] == "True" for r in on)
            out.append(f"| {sc} | {len(on)} | {rate['off']:.1f} → {rate['on']:.1f} | {rate['on'] / rate['off']:.2f}× | "
                       f"{tau:.2f} | {same}/{len(on)} |")
        out.append("")
    tau_file = os.path.join(ROOT, "data", "tiny-stdlib-llama", "records", "tau_generate.json")
    if os.path.exists(tau_file):
        with open(tau_file) as f:
            t = json.load(f)
        env = t.get("env", {})
        out.append(f"**Embedded model, τ by tree** ({t['num_prompts']} held-out third-party prompts, "
                   f"{t['new_tokens']} new tokens, greedy; {env.get('device', '?')}, commit {env.get('commit', '?')}; "
                   f"`data/tiny-stdlib-llama/records/tau_generate.json`, see the model card):\n")
        out.append("| tree | " + " | ".join(t["trees"]) + " |")
        out.append("|---" * (len(t["trees"]) + 1) + "|")
        out.append("| nodes | " + " | ".join(str(v["nodes"]) for v in t["trees"].values()) + " |")
        out.append("| τ | " + " | ".join(f"{v['tau']:.2f}" for v in t["trees"].values()) + " |")
        out.append("| identical to serial | " + " | ".join(str(v["identical_to_serial"]) for v in t["trees"].values())
                   + " |\n")
    gpu = sorted(d for d in glob.glob(os.path.join(ROOT, "results", "*"))   # results/aot: compiled here, not a GPU run
                 if "cpu" not in os.path.basename(d) and os.path.basename(d) != "aot")
    if not any(os.path.isdir(d) for d in gpu):
        out.append("**GPU:** no GPU measurement is recorded yet — `scripts/gpu_check.sh` (GPU tests, the four kernel "
                   "benchmarks, end-to-end A/B with and without CUDA graphs, the tables) is ready for the next "
                   "session that is lent one; its rows will land in `results/<gpu>/`.")
    return "\n".join(out).rstrip() + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    path = os.path.join(ROOT, "README.md")
    text = open(path).read()
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = text[:a] + "\n" + render() + text[b:]
    if "--check" in argv:
        return 0 if new == text else 1
    with open(path, "w") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
