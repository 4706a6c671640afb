"""Ops per decoder layer per decode step: how many ATen calls one step of `generate` makes, divided by the layers.

    python -m mtp_lab.bench.opcount --out results/opcount.csv      # SmolLM2-135M, fp32 and bf16, serial and MTP

A step is one `mtp_step` call: draft, verify (the forward of every layer, the LM head), accept, append. Every ATen
call inside it is counted once, as the dispatcher sees it after composite ops decompose (a `TorchDispatchMode`): views,
slices and copies count like matmuls, since on a CPU each costs a dispatch of a few microseconds whatever it does.
The generate loop's own work between steps (emitting tokens, stop checks) is counted apart, per step ("loop").
The count is structural, not a timing: it does not depend on the machine's load, only on the model's switches
(qk_norm, bias, window), its dtype (the exact mode, packing) and the kernels; Triton launches are not counted here
(the CPU path runs the PyTorch twins).
"""
import collections
import contextlib
import importlib
import os
import statistics
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..cli import add_common, command_parser, run
from .common import env_info, save_rows

OPS_GOAL = {"serial": 40, "mtp": 60}          # per layer per step (issue: a lean step on every device)


class _Count(TorchDispatchMode):
    """Counts the ATen calls made while active (by name in `by_name`, in all in `total`)."""

    def __init__(self):
        super().__init__()
        self.by_name = collections.Counter()

    @property
    def total(self):
        return sum(self.by_name.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_name[str(func)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counted_steps(everything):
    """Inside this block every generate() call counts the ATen calls of each `mtp_step` call (a `_Count` per step,
    appended to the yielded list) and notes `everything.total` (a `_Count` active around the block) when the first
    step starts, in the list's attribute `before`."""
    gen = importlib.import_module("mtp_triton.generate")
    real = gen.mtp_step
    steps = _Steps()

    def step(*args, **kw):
        if steps.before is None:
            steps.before = everything.total
        with _Count() as c:
            out = real(*args, **kw)
        steps.append(c)
        return out

    gen.mtp_step = step
    try:
        yield steps
    finally:
        gen.mtp_step = real


class _Steps(list):
    before = None


def count_ops(model, prompt, max_new_tokens, **gen_kw):
    """Run generate(model, [prompt], max_new_tokens, **gen_kw) counting its decode steps' ATen calls.
    -> dict(steps, step_ops (median per step), per_layer (step_ops / layers), loop_ops (the decode loop's calls
    outside the steps, per step: from the first step's start to the end), top (the 8 most frequent ops of the median
    step: [(name, count)]))."""
    from mtp_triton.generate import generate
    everything = _Count()                   # outside the steps' modes: it sees their calls too
    with everything, counted_steps(everything) as steps:
        generate(model, [prompt], max_new_tokens, **gen_kw)
    if not steps:
        raise ValueError("no decode step ran: ask for at least 2 new tokens")
    totals = [c.total for c in steps]
    step_ops = statistics.median(totals)
    mid = steps[min(range(len(totals)), key=lambda i: abs(totals[i] - step_ops))]
    loop_ops = (everything.total - steps.before - sum(totals)) / len(steps)
    return dict(steps=len(steps), step_ops=step_ops, per_layer=step_ops / model.config.num_hidden_layers,
                loop_ops=loop_ops, top=mid.by_name.most_common(8))


def main(argv=None):
    from mtp_lab.bundle import DRAFTERS, DTYPES, SMOLLM2, encode, heads_dir_for, load_bundle
    ap = command_parser("python -m mtp_lab.bench.opcount", __doc__, "model", model=SMOLLM2)
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated dtypes (default %(default)s)")
    add_common(ap, "kernels", "threads", "out", out="results/opcount.csv", kernels="torch")
    a = ap.parse_args(argv)
    dtypes = a.dtypes.split(",")
    if not set(dtypes) <= set(DTYPES):
        raise ValueError(f"--dtypes: choose from {', '.join(DTYPES)}, got {a.dtypes!r}")
    torch.set_num_threads(a.threads)
    kinds = [k for k in DRAFTERS if os.path.exists(heads_dir_for(a.model, k))]    # the drafters the model ships
    rows = []
    for name in dtypes:
        model, _, tok = load_bundle(a.model, device="cpu", dtype=DTYPES[name], drafter=kinds[0])
        prompt = encode(tok, "Explain what a hash table is and when to use one.")
        runs = [("serial", None)] + [(f"mtp-{k}", load_bundle(a.model, device="cpu", drafter=k)[1]) for k in kinds]
        for mode, drafter in runs:
            got = count_ops(model, prompt, 16, mtp=drafter is not None, drafter=drafter, kernels=a.kernels,
                            runtime=dict(size_by_cost=False))        # the whole tree every step: a fixed count
            goal = OPS_GOAL["serial" if drafter is None else "mtp"]
            rows.append(dict(env_info(model.device), model=a.model, dtype=name, mode=mode, kernels=a.kernels,
                             layers=model.config.num_hidden_layers, steps=got["steps"], step_ops=got["step_ops"],
                             ops_per_layer=round(got["per_layer"], 1), loop_ops_per_step=round(got["loop_ops"], 1),
                             goal=goal, top_ops=" ".join(f"{n}:{c}" for n, c in got["top"]),
                             command="python -m mtp_lab.bench.opcount " + " ".join(argv or sys.argv[1:])))
    save_rows(rows, a.out, line=lambda r: f"{r['dtype']} {r['mode']:10s}: {r['ops_per_layer']} ops per layer per "
              f"step (goal <= {r['goal']}), {r['loop_ops_per_step']} loop ops per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
