"""Where a CPU decode step's time goes, op by op: the library defaults on SmolLM2-135M-Instruct, serial and MTP.

    python scripts/cpu_profile.py --out results/cpu/profile [--prompts 3] [--max-new-tokens 48]

For each dtype (the checkpoint's fp32, and bf16) and each configuration (our serial `mtp=False`, and MTP with the
shipped heads and every default), on held-out chat prompts (the first of each category):

    step_ms        decode seconds / steps of an unprofiled run (generate's own stats; prefill excluded)
    floor_step_ms  the model's weight bytes one step streams / this machine's measured copy bandwidth
                   (bench.roofline; the drafter's weights are not counted)
    op_calls       op calls per decode step (ops with a positive self time): torch.profiler events of an N-token
                   run minus a 1-token run (the prefill and the first token cancel), divided by the profiled run's
                   decode steps
    <cat>_ms       self CPU time per step of the ops of each category, by exact op name: gemm (mm, addmm, bmm,
                   linear and the packed/mkldnn linears), layout (view, reshape, slice, index, cat, copy_,
                   _to_copy, empty, ...: moving, allocating or re-describing data), other (elementwise, reductions,
                   softmax, ...)
    host_ms        profiled step time minus the ops' self time: the Python between the ops and the dispatcher's
                   bookkeeping (the profiler adds its own cost per op, so profiled steps are slower: the op
                   fractions, not their sum, are what carries over to an unprofiled step)

Writes <out>/profile.csv (one row per dtype and configuration, plus the top ops as rows with table=ops) and
prints the summary table. Every row carries env_info() and the command.
"""
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mtp_triton as mt  # noqa: E402
from mtp_lab.bench.roofline import roofline_fields  # noqa: E402
from mtp_lab.cli import command_parser, int_at_least  # noqa: E402
from mtp_lab.bundle import CHAT_PROMPTS, HEADS, SMOLLM2, encode, pick_prompts, read_prompts  # noqa: E402
from mtp_lab.records import append_rows, env_info, md_table  # noqa: E402

GEMM = ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "mkldnn_linear", "_linear_pointwise", "mkl_linear")
LAYOUT = ("view", "_unsafe_view", "reshape", "slice", "select", "index", "index_select", "index_put_",
          "_index_put_impl_", "cat", "copy_", "stack", "narrow", "expand", "permute", "transpose", "unsqueeze",
          "squeeze", "as_strided", "contiguous", "clone", "empty", "empty_like", "empty_strided", "split",
          "split_with_sizes", "unbind", "roll", "pad", "constant_pad_nd", "t", "flatten", "alias", "detach", "lift",
          "lift_fresh", "to", "_to_copy", "resolve_conj", "resolve_neg", "new_empty", "zeros", "zeros_like",
          "full", "fill_", "zero_")


def category(op):
    """gemm | layout | other, by the op's exact name (aten::mm, mkldnn::_linear_pointwise, ...)."""
    name = op.split("::")[-1]
    return "gemm" if name in GEMM else "layout" if name in LAYOUT else "other"


def op_times(fn):
    """{op name: (self CPU µs, calls)} of the ops (aten::, mkldnn::, ...) `fn` runs."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: (float(e.self_cpu_time_total), int(e.count)) for e in prof.key_averages() if "::" in e.key}


def profile_config(model, prompts, n, eos, kw):
    """(row fields, {op: (µs per step, calls per step)}) of the decode steps of `prompts`, one at a time.

    step_ms and tau come from unprofiled runs; the op times, op calls and profiled_step_ms from profiled ones, each
    divided by the profiled runs' own decode steps (a cost-sized MTP run's steps follow its timings, so a run slowed
    by the profiler may take a different number of steps)."""
    step_s = steps = decoded = prof_s = prof_steps = 0.0
    ops = defaultdict(lambda: [0.0, 0])
    for p in prompts:
        s = mt.generate(model, [p], n, eos_token_id=eos, **kw).stats           # unprofiled: the step's wall time
        step_s, steps, decoded = step_s + s.total_s - s.ttft_s, steps + s.steps, decoded + s.new_tokens - 1
        timed = {}

        def run(k):
            timed[k] = mt.generate(model, [p], k, eos_token_id=eos, **kw).stats
        full, first = op_times(lambda: run(n)), op_times(lambda: run(1))
        prof_s += timed[n].total_s - timed[n].ttft_s                   # decode seconds of the profiled run
        prof_steps += timed[n].steps - timed[1].steps                  # its decode steps (the 1-token run has none)
        for k, (t, c) in full.items():
            ops[k][0] += t - first.get(k, (0.0, 0))[0]
            ops[k][1] += c - first.get(k, (0.0, 0))[1]
    per = {k: (t / prof_steps, c / prof_steps) for k, (t, c) in ops.items() if t > 0}
    by = defaultdict(float)
    for k, (t, _) in per.items():
        by[category(k)] += t / 1e3
    prof_ms, ops_ms = 1e3 * prof_s / prof_steps, sum(by.values())
    fields = dict(steps=int(steps), profiled_steps=int(prof_steps), tau=round(decoded / steps, 3),
                  step_ms=round(1e3 * step_s / steps, 3), profiled_step_ms=round(prof_ms, 3),
                  op_calls=round(sum(c for _, c in per.values()), 1),
                  **{f"{c}_ms": round(by[c], 3) for c in ("gemm", "layout", "other")},
                  host_ms=round(prof_ms - ops_ms, 3), gemm_fraction=round(by["gemm"] / prof_ms, 4))
    return fields, per


def main(argv=None):
    ap = command_parser("python scripts/cpu_profile.py", __doc__, "out", "max-new-tokens",
                        out=os.path.join("out", "profile"), max_new_tokens=48)
    ap.add_argument("--prompts", type=int_at_least(1), default=3, help="prompts (the first of each category)")
    ap.add_argument("--top", type=int_at_least(1), default=12, help="ops listed per dtype and configuration")
    a = ap.parse_args(argv)
    cmd = "python scripts/cpu_profile.py " + " ".join(argv if argv is not None else sys.argv[1:])
    tok = mt.load_tokenizer(SMOLLM2)
    ids = [encode(tok, r["text"]) for r in pick_prompts(read_prompts(CHAT_PROMPTS), 1)[: a.prompts]]
    rows, body = [], []
    for dtype in (None, torch.bfloat16):
        model, heads = mt.load_model(SMOLLM2, dtype=dtype), mt.load_heads(HEADS[SMOLLM2])
        base = dict(env_info(model.device), dtype=str(model.dtype).replace("torch.", ""),
                    threads=torch.get_num_threads(), prompts=len(ids), max_new_tokens=a.max_new_tokens, command=cmd)
        for name, kw in (("serial", dict(mtp=False)), ("mtp (defaults)", dict(heads=heads))):
            mt.generate(model, [ids[0]], 8, eos_token_id=tok.eos_token_id, **kw)       # warm-up: c(T), caches
            fields, per = profile_config(model, ids, a.max_new_tokens, tok.eos_token_id, kw)
            tau = fields["tau"]
            floor = roofline_fields(model, tau * 1e3 / fields["step_ms"], tau)      # tokens/s = tau / step seconds
            row = dict(base, table="steps", config=name, **fields, floor_step_ms=floor["floor_step_ms"],
                       floor_fraction=floor["floor_fraction"], copy_gb_s=floor["copy_gb_s"])
            rows.append(row)
            body.append((base["dtype"], name, row["step_ms"], row["floor_step_ms"], f"{row['floor_fraction']:.0%}",
                         row["op_calls"], row["profiled_step_ms"], row["gemm_ms"], row["layout_ms"], row["other_ms"],
                         row["host_ms"], f"{row['gemm_fraction']:.0%}"))
            for k, (t, c) in sorted(per.items(), key=lambda kv: -kv[1][0])[: a.top]:
                rows.append(dict(base, table="ops", config=name, op=k, category=category(k),
                                 self_ms_per_step=round(t / 1e3, 4), calls_per_step=round(c, 2)))
        del model
    os.makedirs(a.out, exist_ok=True)
    append_rows(os.path.join(a.out, "profile.csv"), rows)
    print(md_table(["dtype", "configuration", "step ms", "floor ms", "of floor", "op calls/step", "profiled ms",
                    "gemm ms", "layout ms", "other ms", "host ms", "gemm share"], body))
    for r in rows:
        if r["table"] == "ops":
            print(f"{r['dtype']:9} {r['config']:15} {r['op'][:40]:40} {r['category']:7} "
                  f"{r['self_ms_per_step']:8.3f} ms/step {r['calls_per_step']:8.1f} calls/step")
    print(f"wrote {a.out}/profile.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
