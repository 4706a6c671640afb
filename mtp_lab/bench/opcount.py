"""Ops per decoder layer per decode step: how many ATen calls one step of `generate` makes, divided by the layers.

    python -m mtp_lab.bench.opcount --out results/opcount.csv      # SmolLM2-135M, fp32 and bf16, serial and MTP

A step is one `mtp_step` call: draft, verify (the forward of every layer, the LM head), accept, append. Every ATen
call inside it is counted once, as the dispatcher sees it after composite ops decompose (a `TorchDispatchMode`): views,
slices and copies count like matmuls, since on a CPU each costs a dispatch of a few microseconds whatever it does.
The generate loop's own work between steps (emitting tokens, stop checks) is counted apart, per step ("loop").
The count is structural, not a timing: it does not depend on the machine's load, only on the model's switches
(qk_norm, bias, window), its dtype (the exact mode, packing) and the kernels. With `--kernels triton` the step runs
the Triton kernels (in Triton's interpreter on a CPU, which launches them as a GPU would): each launch counts as one
op, and the ATen calls the interpreter makes inside a launch do not count. Host reads are counted apart: the calls
that make the host wait for the device on a GPU (`.item()` / `int(t)` / `.tolist()`, `nonzero`, `equal`, ...),
which also break a CUDA graph's capture.
"""
import collections
import contextlib
import importlib
import os
import statistics
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtp_triton.packed import packs
from ..cli import add_common, command_parser, run
from .common import env_info, save_rows

OPS_GOAL = {"serial": 40, "mtp": 60}          # per layer per step (issue: a lean step on every device)


HOST_READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.equal", "aten.is_nonzero", "aten.masked_select",
              "aten.unique", "aten._unique")       # ATen calls whose result the host must wait for on a GPU
_IN_LAUNCH = [0]                                  # > 0 while a Triton kernel runs (its interpreter's calls not counted)


class _Count(TorchDispatchMode):
    """Counts the ATen calls made while active (by name in `by_name`, in all in `total`), Triton kernel launches as
    one op each ("triton:<kernel>"), and host reads apart (`syncs`)."""

    def __init__(self):
        super().__init__()
        self.by_name = collections.Counter()
        self.syncs = 0

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    @property
    def total(self):
        return sum(self.by_name.values())

    @property
    def launches(self):
        return sum(n for name, n in self.by_name.items() if name.startswith("triton:"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _IN_LAUNCH[0]:
            name = str(func)
            self.by_name[name] += 1
            self.syncs += name.startswith(HOST_READS)
        return func(*args, **(kwargs or {}))


_ACTIVE = []                                      # the _Count modes now active (a launch counts in each)


@contextlib.contextmanager
def counted_launches():
    """Inside this block every Triton kernel launch (compiled or interpreted) counts as one op in each active _Count,
    and the ATen calls made inside the launch do not count."""
    from triton.runtime import interpreter, jit
    reals = {cls: cls.run for cls in (jit.JITFunction, interpreter.InterpretedFunction)}

    def wrap(real):
        def run(self, *args, grid, warmup, **kwargs):
            if not warmup:
                for c in _ACTIVE:
                    c.by_name[f"triton:{getattr(self, '__name__', 'kernel')}"] += 1
            _IN_LAUNCH[0] += 1
            try:
                return real(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                _IN_LAUNCH[0] -= 1
        return run

    for cls, real in reals.items():
        cls.run = wrap(real)
    try:
        yield
    finally:
        for cls, real in reals.items():
            cls.run = real


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
    """Run generate(model, [prompt], max_new_tokens, **gen_kw) counting its decode steps' ATen calls and kernel
    launches. -> dict(steps, step_ops (median per step), per_layer (step_ops / layers), loop_ops (the decode loop's
    calls outside the steps, per step: from the first step's start to the end), launches and syncs (host reads) of
    the median step, top (the 8 most frequent ops of the median step: [(name, count)]))."""
    from mtp_triton.generate import generate
    everything = _Count()                   # outside the steps' modes: it sees their calls too
    launches = counted_launches() if gen_kw.get("kernels") == "triton" else contextlib.nullcontext()
    with launches, everything, counted_steps(everything) as steps:
        generate(model, [prompt], max_new_tokens, **gen_kw)
    if not steps:
        raise ValueError("no decode step ran: ask for at least 2 new tokens")
    totals = [c.total for c in steps]
    step_ops = statistics.median(totals)
    mid = steps[min(range(len(totals)), key=lambda i: abs(totals[i] - step_ops))]
    loop_ops = (everything.total - steps.before - sum(totals)) / len(steps)
    return dict(steps=len(steps), step_ops=step_ops, per_layer=step_ops / model.config.num_hidden_layers,
                loop_ops=loop_ops, launches=mid.launches, syncs=mid.syncs, top=mid.by_name.most_common(8))


def main(argv=None):
    from mtp_lab.bundle import DRAFTERS, DTYPES, SMOLLM2, encode, heads_dir_for, load_bundle
    ap = command_parser("python -m mtp_lab.bench.opcount", __doc__, "model", model=SMOLLM2)
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated dtypes (default %(default)s)")
    ap.add_argument("--unpacked", action="store_true",
                    help="the linear layers as nn.Linear calls, as a GPU runs them (no prepacked CPU weights)")
    add_common(ap, "kernels", "threads", "out", "max-new-tokens", out="results/opcount.csv", kernels="torch",
               max_new_tokens=16)
    a = ap.parse_args(argv)
    if a.kernels == "triton" and not torch.cuda.is_available():
        import mtp_triton
        mtp_triton.use_interpreter()                          # the kernels on the CPU: Triton's interpreter
    dtypes = a.dtypes.split(",")
    if not set(dtypes) <= set(DTYPES):
        raise ValueError(f"--dtypes: choose from {', '.join(DTYPES)}, got {a.dtypes!r}")
    torch.set_num_threads(a.threads)
    kinds = [k for k in DRAFTERS if os.path.exists(heads_dir_for(a.model, k))]    # the drafters the model ships
    rows = []
    for name in dtypes:
        model, _, tok = load_bundle(a.model, device="cpu", dtype=DTYPES[name], drafter=kinds[0])
        model.pack_weights = not a.unpacked
        prompt = encode(tok, "Explain what a hash table is and when to use one.")
        runs = [("serial", None)] + [(f"mtp-{k}", load_bundle(a.model, device="cpu", drafter=k)[1]) for k in kinds]
        for mode, drafter in runs:
            got = count_ops(model, prompt, a.max_new_tokens, mtp=drafter is not None, drafter=drafter,
                            kernels=a.kernels, runtime=dict(size_by_cost=False))        # the whole tree every step: a fixed count
            goal = OPS_GOAL["serial" if drafter is None else "mtp"]
            rows.append(dict(env_info(model.device), model=a.model, dtype=name, mode=mode, kernels=a.kernels,
                             packed=packs(model),
                             layers=model.config.num_hidden_layers, steps=got["steps"], step_ops=got["step_ops"],
                             ops_per_layer=round(got["per_layer"], 1), loop_ops_per_step=round(got["loop_ops"], 1),
                             launches_per_step=got["launches"], host_reads_per_step=got["syncs"],
                             goal=goal, top_ops=" ".join(f"{n}:{c}" for n, c in got["top"]),
                             command="python -m mtp_lab.bench.opcount " + " ".join(argv or sys.argv[1:])))
    save_rows(rows, a.out, line=lambda r: f"{r['dtype']} {r['mode']:10s}: {r['ops_per_layer']} ops per layer per "
              f"step (goal <= {r['goal']}), {r['loop_ops_per_step']} loop ops, {r['launches_per_step']} kernel "
              f"launches and {r['host_reads_per_step']} host reads per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
