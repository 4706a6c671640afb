"""The audit's outputs: aot.csv (one row per launch and target, with the environment stamp) and aot.md (summary
tables made from those rows), and the rule that decides the exit status."""
import csv
import io
from collections import defaultdict

from ..records import md_table, read_rows, write_bytes, write_text
from .cubin import issue_cycles
from .hardware import PRODUCTS, SCHEDULERS_PER_SM, products_of

CSV_COLUMNS = [
    "target", "launcher", "case", "model", "dtype", "B", "T", "ctx", "H", "top_k", "per_head", "draft_V", "res_off",
    "kwargs",
    "kernel", "status", "error", "bytes_error",
    "variant", "grid", "programs", "n_splits", "num_warps", "num_stages", "regs", "ptxas_regs", "spill_stores",
    "spill_loads", "stack_frame", "stack_bytes", "local_bytes", "local_ops", "shared_bytes", "shared_limit",
    "static_shared", "tmem_cols", "hmma", "hgmma", "tcgen05_mma", "tensor_cores", "sass_instrs", "straight_instrs",
    "loop_instrs", "loops", "sass_gld", "sms", "blocks_per_sm", "occupancy_limit", "waves",
    "min_bytes", *[f"floor_us_{p}" for p in PRODUCTS], "spec", "ptxas",
]
ENV_COLUMNS = ["device", "interpreter", "torch", "triton", "python", "commit", "timestamp"]

# the shapes whose roofline floors the summary shows (those present in the rows: --quick has a subset)
HEADLINES = [
    "fused_draft llama3-8b bf16 B1 H4 k10", "fused_draft llama2-7b bf16 B8 H5 k10",
    "fused_draft vicuna-7b bf16 B1 H5 k10 per-head-lm", "fused_draft llama3-8b bf16 B1 H4 k10 V'32768",
    "fused_draft smollm2-135m bf16 B1 H4 k10 V'8192", "fused_draft smollm2-135m bf16 B1 H4 k10",
    "fused_draft smollm2-135m bf16 B1 H1 k8 V'8192 resblock-off",
    "tree_attention llama3-8b bf16 B1 T16 ctx8192", "tree_attention llama2-7b bf16 B8 T64 ctx8192",
    "tree_attention mistral-7b bf16 B1 T16 ctx8192 window=4096",
    "tree_attention smollm2-135m fp16 B8 T64 ctx512",
    "tree_accept B1 T16", "tree_accept_sample llama3-8b fp32 B1 T16", "tree_accept_sample llama2-7b fp32 B1 T64",
    "kv_append llama2-7b bf16 B1 T16 ctx8192", "kv_append llama3-8b bf16 B8 T64 ctx8192",
]
# the sampling acceptance the issue asked to stay under 20 us: V = 32k (Llama-2's 32000), a 64-node tree
SAMPLING_CASE = "tree_accept_sample llama2-7b fp32 B1 T64"
SAMPLING_TARGET_US = 20.0
WALK_DEPTHS = (0, 4, 63)        # accepted depth: nothing accepted, a typical Medusa step, a 64-node chain


def _int(v):
    return int(v) if v not in (None, "") else 0


def _spill(r):
    return _int(r.get("spill_stores")) + _int(r.get("spill_loads")) + _int(r.get("local_bytes"))


def problems(rows):
    """(row, kind, detail) for every reason the audit fails: a launch that did not compile (or a launcher that could
    not run / launched nothing), any spill (ptxas spill stores/loads, cuobjdump LOCAL, STL/LDL in the SASS),
    shared memory over the per-block limit, a kernel that cannot be resident at all (0 blocks per SM), or a byte
    formula (traffic.py) that failed on the kernel's arguments."""
    out = []
    for r in rows:
        if r.get("status") != "ok":
            out.append((r, r.get("status"), r.get("error", "")))
            continue
        if r.get("bytes_error"):
            out.append((r, "bytes", f"traffic formula failed: {r['bytes_error']}"))
        if _spill(r) or _int(r.get("local_ops")):
            out.append((r, "spill", f"spill stores {_int(r.get('spill_stores'))} B, loads {_int(r.get('spill_loads'))}"
                                    f" B, LOCAL {_int(r.get('local_bytes'))} B, {_int(r.get('local_ops'))} STL/LDL, at "
                                    f"{r.get('regs')} registers"))
        if _int(r.get("shared_bytes")) > _int(r.get("shared_limit")):
            out.append((r, "shared", f"{r.get('shared_bytes')} B > limit {r.get('shared_limit')} B"))
        elif r.get("blocks_per_sm") not in (None, "") and _int(r.get("blocks_per_sm")) == 0:
            out.append((r, "resident", f"0 blocks per SM ({r.get('occupancy_limit')})"))
    return out


def failures(rows):
    """One line per problem (see `problems`); empty when the audit passes."""
    return [f"{r.get('target')} {r.get('kernel')} [{r.get('case')}]: {kind}: {detail}"
            for r, kind, detail in problems(rows)]


def problem_groups(rows):
    """Problems grouped by (target, kernel, kind) -> (count, launches of that kernel on that target, worst row,
    its detail); the worst is the largest spill."""
    launches = defaultdict(int)
    for r in rows:
        launches[(r.get("target"), r.get("kernel"))] += 1
    groups = {}
    for r, kind, detail in problems(rows):
        key = (r.get("target"), r.get("kernel"), kind)
        n, total, worst, worst_detail = groups.get(key, (0, launches[key[:2]], None, ""))
        if worst is None or _spill(r) > _spill(worst):
            worst, worst_detail = r, detail
        groups[key] = (n + 1, total, worst, worst_detail)
    return groups


def exit_status(rows):
    return 1 if failures(rows) else 0


def write_csv(path, rows, env):
    """aot.csv: one row per launch, the environment stamp in every row; replaced whole (records.write_bytes)."""
    extra = sorted({k for r in rows for k in r} - set(CSV_COLUMNS) - set(ENV_COLUMNS))
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS + extra + ENV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        values = {k: ("" if v is None else v) for k, v in r.items()}
        w.writerow({**values, **{k: env.get(k, "") for k in ENV_COLUMNS}})
    write_bytes(path, buf.getvalue().encode("utf-8"))


# the columns a --baseline CSV needs (what baseline_section reads); an older audit may lack the newer others
BASELINE_COLUMNS = ["target", "launcher", "case", "kernel", "commit", "triton", "timestamp"]


def read_csv(path):
    """An earlier audit's aot.csv -> (rows, environment stamp of its first row). A CSV that is not an audit (no
    rows, or without the BASELINE_COLUMNS) is a ValueError naming --baseline, the file and the missing columns."""
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"--baseline {path}: no rows; give the aot.csv of an earlier `python -m mtp_lab aot` run")
    missing = [c for c in BASELINE_COLUMNS if c not in rows[0]]
    if missing:
        raise ValueError(f"--baseline {path}: not an audit CSV, it lacks the column(s) {', '.join(missing)}; give the "
                         "aot.csv of an earlier `python -m mtp_lab aot` run")
    return rows, {k: rows[0].get(k, "") for k in ENV_COLUMNS} if rows else {}


def _fmt_us(v):
    return "" if v in (None, "") else f"{float(v):.3g}"


def _table(header, lines):
    return md_table(header, lines).split("\n")


def _varying(specs):
    """The specialisation keys whose value differs between a kernel's variants (why it was recompiled)."""
    parsed = []
    for s in specs:
        d = {}
        for tok in s.split():
            key = tok.split("=")[0].split(":")[0]
            d[key] = tok
        parsed.append(d)
    keys = sorted({k for d in parsed for k in d})
    return [k for k in keys if len({d.get(k) for d in parsed}) > 1]


def _tc_text(rs):
    """Tensor-core instructions seen in a kernel's SASS (largest count over its variants), or 'none'."""
    counts = {n: max(_int(r.get(n)) for r in rs) for n in ("hmma", "hgmma", "tcgen05_mma")}
    return ", ".join(f"{n.upper()} x{c}" for n, c in counts.items() if c) or "none"


def deployment(r):
    """What one deployment fixes: model, dtype, LM-head layout, draft vocabulary and launcher keywords (window).
    Batch, tree size and context change while it serves."""
    return tuple(str(r.get(k) or "") for k in ("model", "dtype", "per_head", "draft_V", "res_off", "kwargs"))


def kernel_summary(rows, target_order=()):
    """Per (kernel, target): launches, distinct variants (overall, and the most within one deployment — model,
    dtype, LM-head layout, draft vocabulary, window — i.e. the recompiles one deployment meets as batch, tree and
    context change) with the specialisation keys that differ there, the run-time split counts seen, worst
    registers (and where), spills, largest shared, tensor cores, warps/stages, fewest resident blocks."""
    groups = defaultdict(list)
    for r in rows:
        if r.get("status") == "ok":
            groups[(r["kernel"], r["target"])].append(r)
    order = {t: i for i, t in enumerate(target_order)}
    lines = []
    for (kernel, target), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 99), kv[0][1])):
        worst = max(rs, key=lambda r: (_int(r["regs"]), _spill(r)))
        shared = max(rs, key=lambda r: _int(r["shared_bytes"]))
        per_model = defaultdict(dict)
        for r in rs:
            per_model[deployment(r)][r["variant"]] = r.get("spec", "")
        splits = sorted({_int(r.get("n_splits")) for r in rs if r.get("n_splits") not in (None, "")})
        within = sorted({k for specs in per_model.values() for k in _varying(specs.values())})
        lines.append(dict(
            kernel=kernel, target=target, launches=len(rs), variants=len({r["variant"] for r in rs}),
            variants_per_model=max(len(v) for v in per_model.values()), varying=", ".join(within) or "-",
            n_splits=",".join(map(str, splits)) or "-",
            regs=_int(worst["regs"]), regs_case=worst["case"],
            spill=max(_spill(r) for r in rs),
            shared=f"{_int(shared['shared_bytes'])} / {_int(shared['shared_limit'])}", tensor_cores=_tc_text(rs),
            warps_stages=", ".join(sorted({f"{r['num_warps']}/{r['num_stages']}" for r in rs})),
            min_blocks=min(_int(r["blocks_per_sm"]) for r in rs)))
    return lines


def fmt_bytes(n):
    n = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.3g} {unit}"
        n /= 1000


def _pivot(summary, targets):
    """One line per kernel: worst REG / spill bytes / tensor cores / variants, one cell per target."""
    by = defaultdict(dict)
    for s in summary:
        by[s["kernel"]][s["target"]] = s
    lines = []
    for kernel, per in by.items():
        cell = lambda t, f: f(per[t]) if t in per else "-"
        lines.append([kernel,
                      " / ".join(cell(t, lambda s: str(s["regs"])) for t in targets),
                      " / ".join(cell(t, lambda s: str(s["spill"])) for t in targets),
                      " / ".join(cell(t, lambda s: s["tensor_cores"]) for t in targets),
                      " / ".join(cell(t, lambda s: f"{s['variants']} ({s['variants_per_model']})") for t in targets)])
    return lines


def _variant_counts(rows, labels):
    """(kernel, target) -> (variants, most per deployment, keys that differ) over the rows of these case labels."""
    return {(s["kernel"], s["target"]): (s["variants"], s["variants_per_model"], s["varying"])
            for s in kernel_summary([r for r in rows if r.get("case") in labels])}


def baseline_section(baseline, rows, targets):
    """Recompiles before (an earlier audit's CSV) and now, on the launcher calls both audits made: one line per
    kernel, cells per target."""
    base_rows, base_env = baseline
    common = {r.get("case") for r in base_rows} & {r.get("case") for r in rows}
    before, now = _variant_counts(base_rows, common), _variant_counts(rows, common)

    def cells(counts, kernel):
        per = [counts.get((kernel, t)) for t in targets]
        if not any(per):
            return "-", "-"
        keys = sorted({k for c in per if c for k in c[2].split(", ") if k != "-"})
        return " / ".join(f"{c[0]} ({c[1]})" if c else "-" for c in per), ", ".join(keys) or "-"

    lines = [[k, *cells(before, k), *cells(now, k)] for k in sorted({k for k, _ in before} | {k for k, _ in now})]
    return ["## Recompiles: before and now", "",
            f"Variants per target ({' / '.join(targets)}; in brackets: the most within one deployment) on the "
            f"{len(common)} launcher calls both this audit and the baseline made, and the specialisation keys that "
            f"differ within a deployment. Baseline: commit {base_env.get('commit')}, Triton {base_env.get('triton')}, "
            f"{base_env.get('timestamp')}. '-': the kernel does not exist in that audit.", "",
            *_table(["kernel", "variants before", "recompiled for (before)", "variants now", "recompiled for (now)"],
                    lines), ""]


def sampling_estimate(rows, case=SAMPLING_CASE, depths=WALK_DEPTHS):
    """Lines of the sampling-acceptance estimate at `case` (per target with products): the bandwidth floor of its
    two kernels, and for the walk kernel an issue floor from its SASS: (instructions outside loops + instructions
    in loops x depth) warp instructions, `hardware.SCHEDULERS_PER_SM` schedulers (`cubin.issue_cycles`), at the
    product's clock. The walk's only loop is the `while` over accepted nodes (`depth` iterations); the count is
    a floor: no stall, memory latency or launch time is in it."""
    lines = []
    by_target = defaultdict(dict)
    for r in rows:
        if r.get("case") == case and r.get("status") == "ok":
            by_target[r["target"]][r["kernel"]] = r
    for target, ks in by_target.items():
        walk, sums = ks.get("_tree_accept_walk_kernel"), ks.get("_tree_accept_sums_kernel")
        if not walk or not sums:
            continue
        warps = _int(walk.get("num_warps"))
        for p in products_of(target):
            floor = sum(float(k.get(f"floor_us_{p.name}") or 0) for k in (sums, walk))
            issue = [issue_cycles(_int(walk.get("straight_instrs")) + _int(walk.get("loop_instrs")) * d, warps,
                                  SCHEDULERS_PER_SM) / p.clock_hz * 1e6 for d in depths]
            lines.append([p.name, target, fmt_bytes(_int(sums.get("min_bytes")) + _int(walk.get("min_bytes"))),
                          _fmt_us(sums.get(f"floor_us_{p.name}")), _fmt_us(walk.get(f"floor_us_{p.name}")),
                          f"{walk.get('straight_instrs')} + {walk.get('loop_instrs')} x depth ({walk.get('loops')} "
                          f"loop{'s' if _int(walk.get('loops')) != 1 else ''}), {warps} warps, {walk.get('sass_gld')} "
                          f"global loads",
                          f"{p.clock_hz / 1e9:.2f}", " / ".join(_fmt_us(u) for u in issue),
                          _fmt_us(floor + max(issue))])
    return lines


def sampling_section(rows):
    lines = sampling_estimate(rows)
    if not lines:
        return []
    d = " / ".join(map(str, WALK_DEPTHS))
    return ["## Sampling acceptance at V = 32k, T = 64", "",
            f"`{SAMPLING_CASE}` (target: < {SAMPLING_TARGET_US:g} µs). Bandwidth floors as above; the walk kernel "
            "(one program per sequence) is not bandwidth-bound, so its SASS gives a second floor: warp instructions "
            "it issues (outside loops once, the walk loop once per accepted node) x warps per scheduler "
            f"(4 schedulers per SM) / clock (derived from the datasheet FP32 peak), at accepted depth {d}. Floors "
            "only: stalls (dependent loads — the walk's gathers, then the group, chunk and id loads of the residual "
            "draw, one after the other — barriers), and two kernel launches come on top; a GPU run decides.", "",
            *_table(["GPU", "target", "min bytes", "sums floor µs", "walk bytes floor µs", "walk SASS",
                     "clock GHz", f"walk issue floor µs (depth {d})", "sum of floors µs (deepest)"], lines), ""]


def write_md(path, result, command, seconds, baseline=None):
    rows, env, targets = result["rows"], result["env"], result["targets"]
    fails = failures(rows)
    ok = [r for r in rows if r.get("status") == "ok"]
    md = [
        "# Ahead-of-time compile audit",
        "",
        f"Made by `{command}` in {seconds:.0f} s on {env.get('device')} — no GPU: every kernel compiled for the "
        f"targets below by Triton {env.get('triton')} (torch {env.get('torch')}, Python {env.get('python')}), "
        f"commit {env.get('commit')}, {env.get('timestamp')}. Launches are made by the public launchers on "
        "meta tensors at the shapes listed, so Triton's own binder chose the specialisations; compiled, never run.",
        "",
        "Registers/stack/LOCAL from `cuobjdump -res-usage`, spills from `ptxas -v`, tensor-core instructions from "
        "`cuobjdump -sass` (tools bundled with Triton). `shared` is what Triton asks the driver for, against the "
        "per-block opt-in limit. Roofline floors are compulsory HBM bytes / datasheet bandwidth (formulas in "
        "`mtp_lab/aot/traffic.py`, sources in `mtp_lab/aot/hardware.py`): lower bounds, not measurements.",
        "",
        "## Targets",
        "",
        *_table(["target", "audited", "toolchain", "launchers saw SMs", "seconds"],
                [[t["target"], "yes" if t["supported"] else "skipped", t["toolchain"],
                  f"{t['launcher_sms']} ({t['launcher_sms_note']})", t["seconds"]] for t in targets]),
        "",
        f"## Verdict: {'FAIL' if fails else 'PASS'}",
        "",
        f"{result['n_cases']} launcher calls per target, {len(rows)} launch rows, {len(ok)} compiled; "
        f"{len(fails)} problem(s)" + (":" if fails else "."),
        "",
    ]
    if fails:
        md += ["Grouped by target, kernel and kind; the worst launch of each group is shown (all rows in aot.csv).",
               "", *_table(["target", "kernel", "problem", "launches", "worst case", "worst"],
                           [[t, k, kind, f"{n} of {total}", worst.get("case"), detail]
                            for (t, k, kind), (n, total, worst, detail) in problem_groups(rows).items()]), ""]
    audited = [t["target"] for t in targets if t["supported"]]
    summary = kernel_summary(rows, audited)
    slash = " / ".join(audited)
    md += ["## Per kernel, all targets", "",
           f"Cells are {slash}. Variants: distinct compiled kernels over the whole matrix (in brackets: the most "
           "within one deployment — model, dtype, LM-head layout, draft vocabulary, window — i.e. what it compiles "
           "as batch, tree size and context change).",
           "",
           *_table(["kernel", "worst REG", "spill bytes", "tensor cores (SASS)", "variants"],
                   _pivot(summary, audited)), "",
           "## Per kernel and target", "",
           "worst REG (and the case), spills (ptxas stores + loads + LOCAL, bytes), largest shared / per-block limit, "
           "tensor-core instructions (largest count), num_warps/num_stages, fewest resident blocks per SM, the "
           "specialisation keys that differ between variants of one deployment (why it recompiles), and the "
           "run-time split-KV counts the launches used (a kernel argument: they share compiled variants).", "",
           *_table(["kernel", "target", "launches", "variants", "per deployment", "worst REG", "at", "spill B",
                    "shared B", "tensor cores", "warps/stages", "min blocks/SM", "recompiled for", "n_splits seen"],
                   [[s["kernel"], s["target"], s["launches"], s["variants"], s["variants_per_model"], s["regs"],
                     s["regs_case"], s["spill"], s["shared"], s["tensor_cores"], s["warps_stages"],
                     s["min_blocks"], s["varying"], s["n_splits"]] for s in summary]), ""]
    if baseline:
        md += baseline_section(baseline, rows, audited)
    md += sampling_section(ok)
    head = [r for r in ok if r["case"] in HEADLINES and r["target"] in ("sm_90", "sm_80")]
    if head:
        cols = [f"floor_us_{p}" for p in PRODUCTS]
        by_key = defaultdict(dict)
        for r in head:
            key = (HEADLINES.index(r["case"]), r["case"], r["kernel"])
            by_key[key][r["target"]] = r
        lines = []
        for (_, case, kernel), per in sorted(by_key.items()):
            r90, r80 = per.get("sm_90", {}), per.get("sm_80", {})
            any_r = r90 or r80
            grids = " / ".join(dict.fromkeys(r.get("grid") for r in (r90, r80) if r))
            lines.append([case, kernel, grids, r90.get("waves", ""), r80.get("waves", ""),
                          fmt_bytes(_int(any_r.get("min_bytes"))),
                          *[_fmt_us(r90.get(c, r80.get(c))) for c in cols]])
        md += ["## Roofline floors at headline shapes", "",
               "Per launch (tree_attention: one layer; a step runs it once per layer). grid: sm_90 / sm_80 where "
               "they differ (the launchers size split-KV by SM count); min bytes at sm_90's grid. waves = programs / "
               "(SMs x resident blocks per SM), rounded up.", "",
               *_table(["case", "kernel", "grid", "waves H100/H200", "waves A100", "min bytes",
                        *[f"floor µs {p} ({PRODUCTS[p].hbm_bytes_per_s / 1e12:g} TB/s)" for p in PRODUCTS]],
                       lines), ""]
    md += ["## Sources", "", *[f"- {p.name}: {p.source}" for p in PRODUCTS.values()], ""]
    write_text(path, "\n".join(md))
