"""The evaluation's numbers: what one request's row carries, the aggregates over rows, the quality gates, the
long-run summary, and the failures a set of rows records.

Every function here reads rows as the harness makes them or as they come back from eval.csv (strings), so a
report can be recomputed from the CSV alone.
"""
import json
import math
import os
import statistics

import torch

from mtp_triton.ops import get_ops
from mtp_triton.stats import percentile

ALPHA = 1e-4                              # T > 0 gate: two-sided false-alarm rate of one check (Student t)
MIN_ITEMS = 5                             # ... and the fewest paired items it will judge (fewer: reported, no verdict)
FLOOR = {"mean_logprob": 0.02, "distinct_ratio": 0.01, "new_tokens": 0.5}
MEM_GROWTH_LIMIT = {"cpu": 64 << 20, "cuda": 1 << 20}     # bytes: CPU RSS is noisy, GPU allocations are exact


# ---- one request ----------------------------------------------------------------------------------------------
def request_metrics(stats, tree_size):
    """The per-request numbers a row carries, from generate()'s stats (histogram-derived counts included)."""
    hist = stats.accept_len_histogram
    steps_seq = sum(hist)
    depth = len(stats.accept_rate_per_depth)
    accepted = sum(i * n for i, n in enumerate(hist))
    nodes = stats.verified_nodes_per_step
    # drafts verified: the nodes each step really verified (fewer than the tree's with pruning, a depth limit or a
    # serial fallback step), else the whole tree per step
    drafted = round(steps_seq * (nodes - 1)) if nodes == nodes else steps_seq * (tree_size - 1)
    return dict(
        new_tokens=stats.new_tokens, steps=stats.steps, tokens_per_step=stats.tokens_per_step,
        decode_tokens_per_s=stats.decode_tokens_per_s, tokens_per_s=stats.tokens_per_s,
        ttft_s=stats.ttft_s, e2e_s=stats.total_s, itl_p50_s=stats.itl_p50_s, itl_p95_s=stats.itl_p95_s,
        itl_p99_s=stats.itl_p99_s, accept_rate_per_depth=json.dumps([round(r, 4) for r in stats.accept_rate_per_depth]),
        accept_len_histogram=json.dumps(hist), rejected_steps=sum(hist[:depth]) if depth else 0,
        drafted_tokens=drafted, accepted_drafts=accepted, wasted_drafts=drafted - accepted,
        fallback_count=stats.fallback_count, time_draft_s=stats.time_draft_s,
        time_verify_s=stats.time_verify_s, time_accept_s=stats.time_accept_s,
        time_append_s=stats.time_append_s, peak_memory_bytes=stats.peak_memory_bytes,
        cache_bytes=stats.cache_bytes, energy_j=stats.energy_j, kernels=stats.kernels, verified_nodes_per_step=nodes)


@torch.no_grad()
def mean_logprob(model, prompt, out):
    """Mean log p(out[j] | prompt, out[:j]) under the model (temperature 1, no top-p): one causal forward."""
    ids = list(prompt) + list(out)
    S, dev = len(ids), model.device
    cache = model.new_cache([S])
    tokens = torch.tensor([ids], device=dev)                                         # [1, S]
    mask = torch.tril(torch.ones(S, S, dtype=torch.bool, device=dev))                # [S, S] causal
    pos = torch.arange(S, device=dev)[None]                                          # [1, S]
    hidden, _, _ = model.forward_tree(tokens, pos, mask, cache, torch.tensor([0], device=dev), get_ops("torch", dev))
    logp = torch.log_softmax(model.logits(hidden[0, len(prompt) - 1: S - 1]).double(), dim=-1)   # [len(out), V]
    return float(logp.gather(1, tokens[0, len(prompt):, None]).mean())


def current_memory(device):
    """Bytes in use now: GPU tensors (memory_allocated) or this process's resident set (CPU)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil
        return psutil.Process().memory_info().rss


# ---- the greedy gate ------------------------------------------------------------------------------------------
def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def describe_mismatch(tok, where, serial, mtp, prompt=()):
    """A loud, readable account of where two greedy outputs part (context = prompt tail + the common prefix)."""
    i = first_difference(serial, mtp)
    dec = (lambda ids: tok.decode(ids)) if tok is not None else (lambda ids: str(ids))
    return (f"{where}: MTP output differs from serial at new token {i} (serial {len(serial)} tokens, MTP {len(mtp)})\n"
            f"    context : ...{dec((list(prompt) + serial[:i])[-24:])!r}\n"
            f"    serial  : {dec(serial[i:i + 12])!r}  ids {serial[i:i + 6]}\n"
            f"    MTP     : {dec(mtp[i:i + 12])!r}  ids {mtp[i:i + 6]}")


# ---- rows -> aggregates ---------------------------------------------------------------------------------------
def num(x):
    """Number from a row value (rows read back from CSV hold strings); None for a blank."""
    if x is None or x in ("", "None"):
        return None
    return float(x == "True") if x in ("True", "False") else float(x)


def section_rows(rows, section, **match):
    """The rows of one section whose fields equal `match` (compared as strings: CSV rows hold strings)."""
    return [r for r in rows if r.get("section") == section and all(str(r.get(k)) == str(v) for k, v in match.items())]


def aggregate(rows):
    """Per request group: tokens/s over summed time, latency percentiles over requests, acceptance per depth."""
    if not rows:
        return None
    tok = sum(num(r["new_tokens"]) for r in rows)
    dec_tok = sum(num(r["new_tokens"]) - 1 for r in rows)
    dec_time = sum(num(r["e2e_s"]) - num(r["ttft_s"]) for r in rows)
    steps = sum(num(r["steps"]) for r in rows)
    e2e = [num(r["e2e_s"]) for r in rows]
    hists = [json.loads(r["accept_len_histogram"]) for r in rows]
    rates = [json.loads(r["accept_rate_per_depth"]) for r in rows]
    depth = max((len(x) for x in rates), default=0)
    seq = [sum(h) for h in hists]
    acc = [sum(x[d] * n for x, n in zip(rates, seq) if d < len(x)) / max(sum(n for x, n in zip(rates, seq) if d < len(x)), 1)
           for d in range(depth)]
    mem = [num(r["peak_memory_bytes"]) for r in rows if num(r["peak_memory_bytes"]) is not None]
    energy = [num(r["energy_j"]) for r in rows if num(r.get("energy_j")) is not None]
    per_step = lambda key: 1e3 * sum(num(r[key]) for r in rows) / max(steps, 1)          # noqa: E731  ms per step
    def mean_ms(key):        # requests of one new token have no inter-token latency: nan when none has one
        xs = [num(r[key]) for r in rows if num(r[key]) is not None]
        return 1e3 * statistics.mean(xs) if xs else float("nan")
    return dict(
        requests=len(rows), new_tokens=tok, decode_tokens_per_s=dec_tok / max(dec_time, 1e-12),
        ttft_ms=mean_ms("ttft_s"), e2e_ms=1e3 * statistics.mean(e2e),
        e2e_p95_ms=1e3 * percentile(e2e, 95), e2e_p99_ms=1e3 * percentile(e2e, 99),
        itl_p50_ms=mean_ms("itl_p50_s"), itl_p95_ms=mean_ms("itl_p95_s"), itl_p99_ms=mean_ms("itl_p99_s"),
        tokens_per_step=dec_tok / max(sum(seq), 1), accept_per_depth=acc,
        rejected_steps=sum(num(r["rejected_steps"]) for r in rows), wasted_drafts=sum(num(r["wasted_drafts"]) for r in rows),
        drafted_tokens=sum(num(r["drafted_tokens"]) for r in rows), fallback=sum(num(r["fallback_count"]) for r in rows),
        draft_ms_step=per_step("time_draft_s"), verify_ms_step=per_step("time_verify_s"),
        accept_ms_step=per_step("time_accept_s"), append_ms_step=per_step("time_append_s"),
        peak_memory_bytes=max(mem) if mem else None, cache_bytes=max(num(r["cache_bytes"]) for r in rows),
        energy_j=sum(energy) if energy else None)


def ab_table(rows, by="scenario"):
    """[(key, off aggregate, on aggregate, speedup)] for the A/B rows grouped by `by` (scenario or length)."""
    ab = section_rows(rows, "ab")
    keys = list(dict.fromkeys(r[by] for r in ab))
    out = []
    for k in keys + ["all"]:
        sel = ab if k == "all" else [r for r in ab if r[by] == k]
        off, on = aggregate([r for r in sel if r["mode"] == "off"]), aggregate([r for r in sel if r["mode"] == "on"])
        if off and on:
            out.append((k, off, on, on["decode_tokens_per_s"] / off["decode_tokens_per_s"]))
    return out


def sweep_groups(rows):
    """[(tree, its first row, aggregate, speedup)] for the sweep rows grouped by tree, in their order (serial first);
    speedup = decode tokens/s over serial's on the same prompts."""
    sw = section_rows(rows, "sweep")
    base = aggregate([r for r in sw if r["sweep_tree"] == "serial"])
    out = []
    for name in dict.fromkeys(r["sweep_tree"] for r in sw):
        sel = [r for r in sw if r["sweep_tree"] == name]
        a = aggregate(sel)
        out.append((name, sel[0], a, a["decode_tokens_per_s"] / base["decode_tokens_per_s"]))
    return out


# ---- the T > 0 gate -------------------------------------------------------------------------------------------
def sampled_quality(rows, scenario):
    """T > 0: paired on-minus-off differences per item of mean log-prob, distinct ratio and length."""
    ab = section_rows(rows, "ab", scenario=scenario)
    off = {r["item"]: r for r in ab if r["mode"] == "off"}
    on = {r["item"]: r for r in ab if r["mode"] == "on"}
    items = [i for i in off if i in on]
    out = []
    for metric in FLOOR:
        a = [num(on[i][metric]) for i in items]
        b = [num(off[i][metric]) for i in items]
        d = [x - y for x, y in zip(a, b)]
        se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) >= MIN_ITEMS else None
        tol = None if se is None else t_critical(ALPHA, len(d) - 1) * se + FLOOR[metric]
        out.append(dict(metric=metric, n=len(d), on=statistics.mean(a), off=statistics.mean(b), diff=statistics.mean(d),
                        tolerance=tol, ok=None if tol is None else abs(statistics.mean(d)) <= tol))
    return out


def t_critical(alpha, df):
    """x with P(|T| > x) = alpha for Student's t with df degrees of freedom.

    With x = sqrt(df) tan(theta) the density becomes proportional to cos(theta)^(df - 1) on [0, pi/2), a bounded
    integrand, so a trapezoid rule gives the central mass P(|T| <= x) accurately; df = 1 gives tan(pi/2 (1 - alpha)).
    """
    theta = torch.linspace(0, math.pi / 2, 200001, dtype=torch.float64)
    f = torch.cos(theta) ** (df - 1)
    mass = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum((f[1:] + f[:-1]) / 2, 0)])
    mass = mass / mass[-1]                                                   # P(|T| <= sqrt(df) tan(theta))
    i = int(torch.searchsorted(mass, torch.tensor([1 - alpha], dtype=torch.float64)))
    w = (1 - alpha - mass[i - 1]) / (mass[i] - mass[i - 1])
    return math.sqrt(df) * math.tan(float(theta[i - 1] + w * (theta[i] - theta[i - 1])))


# ---- stability ------------------------------------------------------------------------------------------------
def long_run_summary(rows, device, memory_rows=None):
    """Throughput drift (first vs last quarter), errors, timeouts, spot checks and memory growth of a long run.

    memory_rows: the rows whose memory readings count (default: all); a resumed run passes only its own, since
    the memory of an earlier process says nothing about this one's growth."""
    ok = [r for r in rows if not r["error"]]
    q = max(1, len(ok) // 4)
    first, last = ok[:q], ok[-q:]
    tput = lambda rs: sum(num(r["new_tokens"]) for r in rs) / max(sum(num(r["request_s"]) for r in rs), 1e-12)  # noqa: E731
    mem = [num(r["memory_bytes"]) for r in (rows if memory_rows is None else memory_rows)]
    warm = mem[min(len(mem) - 1, q)] if mem else 0.0
    growth = (mem[-1] - warm) if mem else 0.0
    limit = MEM_GROWTH_LIMIT.get(torch.device(device).type, MEM_GROWTH_LIMIT["cpu"])
    return dict(requests=len(rows), tokens=int(sum(num(r["new_tokens"]) for r in ok)), errors=len(rows) - len(ok),
                timeouts=sum(bool(num(r["timeout"])) for r in rows),
                spot_checks=sum(r["spot_check"] != "" for r in rows), spot_mismatches=sum(r["spot_check"] == "MISMATCH" for r in rows),
                tput_first=tput(first) if first else None, tput_last=tput(last) if last else None,
                drift=(tput(last) / tput(first) - 1) if first and last else None,
                memory_start_bytes=mem[0] if mem else None, memory_warm_bytes=warm, memory_end_bytes=mem[-1] if mem else None,
                memory_growth_bytes=growth, memory_growth_limit=limit, memory_growth_flag=growth > limit)


# ---- what the rows say failed ---------------------------------------------------------------------------------
def failures_in_rows(rows):
    """[(section, message)] for every failed check that rows record: how a resumed run re-reports the failures of
    the requests it kept (the full mismatch context was printed by the run that measured them)."""
    out = []
    for r in rows:
        s, earlier = r.get("section"), " (kept from an earlier run)"
        if s == "ab" and r.get("mode") == "on" and num(r.get("temperature")) == 0 and not num(r.get("identical")):
            out.append(("quality", f"{r['scenario']}/{r['item']}: MTP output differs from serial at new token "
                                   f"{r.get('first_diff')}{earlier}"))
        elif s == "sweep" and num(r.get("temperature")) == 0 and num(r.get("identical")) == 0:
            out.append(("quality", f"sweep {r['sweep_tree']} {r['item']}: MTP output differs from serial{earlier}"))
        elif s == "quality" and num(r.get("ok")) == 0:
            out.append(("quality", f"{r['scenario']}: {r['metric']} differs beyond the tolerance{earlier}"))
        elif s == "long_run" and (r.get("error") or num(r.get("timeout")) or r.get("spot_check") == "MISMATCH"):
            out.append(("long-run", f"request {r['request']}: {r.get('error') or ('timeout' if num(r.get('timeout')) else 'spot check MISMATCH')}{earlier}"))
        elif s == "long_summary" and num(r.get("memory_growth_flag")):
            out.append(("long-run", f"memory grew by {num(r['memory_growth_bytes']) / 2**20:.1f} MiB after warm-up{earlier}"))
        elif s in ("edge", "compat") and not num(r.get("ok")):
            out.append((s, f"{r['case']}: {r.get('outcome') or r.get('detail')}{earlier}"))
    return out
