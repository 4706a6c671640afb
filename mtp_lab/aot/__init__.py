"""Ahead-of-time compile audit: every Triton kernel of this package, compiled for real GPUs on a machine without one.

    python -m mtp_lab aot --out results/aot            # full launch matrix, every target the toolchain supports
    python -m mtp_lab aot --quick --out /tmp/aot       # a few shapes per launcher (CI)
    python -m mtp_lab aot --out results/aot --baseline results/aot/aot.csv   # ... and compare with the last one

Each public launcher (fused_draft, tree_attention, tree_accept, tree_accept_sample, kv_append) is called at real
model shapes (Llama-2-7B, Llama-3-8B, SmolLM2-135M; bf16/fp16; batch 1/8; trees of 1/16/64 nodes; 512/8192 cached
tokens; plus Medusa Vicuna-7B's per-head LM heads, draft vocabularies of SmolLM2 and Llama-3, and Mistral-7B's
sliding window) on meta tensors that claim to be on a GPU, so it takes its GPU branch and Triton's own binder picks
the specialisation; the kernels are compiled for sm_80 and sm_90 (and sm_100 / sm_120 where the bundled ptxas
supports them), never launched. For every launch: compile status, registers, spills, shared memory against the
limit, tensor-core instructions, SASS instruction counts, warps/stages, the run-time split count, programs vs SMs
(waves) and a bandwidth floor (compulsory bytes / HBM bandwidth) on H100, H200 and A100; for the sampling
acceptance at V = 32k, T = 64 also an instruction-issue floor from the walk kernel's SASS. Writes OUT/aot.csv and
OUT/aot.md.

Exit status: 0 when every launch compiled, nothing spills (any spill byte, on any target, fails: there is no
tolerance), shared memory fits, every kernel can be resident and every byte formula applies; 1 otherwise; 3 if a
worker process crashed. The compile work runs in a subprocess without TRITON_INTERPRET (the tests set it in their
own process; the audit needs the real @triton.jit kernels).
"""
import json
import os
import subprocess
import sys
import tempfile
import time

from ..cli import command_parser, int_at_least
from ..records import ensure_writable_dir
from .hardware import ARCHS


def _worker_env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the package's parent
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_workers(targets, quick, jobs=1):
    """Compile in `jobs` subprocesses (targets dealt out round-robin); returns the merged result dict."""
    chunks = [targets[i::jobs] for i in range(max(1, min(jobs, len(targets))))]
    with tempfile.TemporaryDirectory(prefix="mtp_aot_") as tmp:
        procs = []
        for i, chunk in enumerate(chunks):
            path = os.path.join(tmp, f"rows{i}.json")
            cmd = [sys.executable, "-m", "mtp_lab.aot.worker", "--targets", ",".join(chunk), "--rows", path]
            procs.append((subprocess.Popen(cmd + (["--quick"] if quick else []), env=_worker_env()), path))
        merged = dict(env={}, targets=[], rows=[], n_cases=0)
        for proc, path in procs:
            if proc.wait() != 0 or not os.path.exists(path):
                raise RuntimeError(f"aot worker exited with status {proc.returncode}")
            with open(path) as f:
                part = json.load(f)
            merged["env"] = merged["env"] or part["env"]
            merged["n_cases"] = part["n_cases"]
            merged["targets"] += part["targets"]
            merged["rows"] += part["rows"]
    order = {t: i for i, t in enumerate(targets)}
    merged["targets"].sort(key=lambda t: order[t["target"]])
    merged["rows"].sort(key=lambda r: order[r["target"]])
    return merged


def build_parser():
    """The `aot` command line (every number range-checked by argparse)."""
    ap = command_parser("python -m mtp_lab aot", __doc__.split("\n\n")[0], "out", "quick",
                        epilog=__doc__.split("\n\n")[-1], out=dict(default="results/aot", help="folder for aot.csv "
                        "and aot.md (default results/aot)"), quick=dict(help="a few shapes per launcher (CI)"))
    ap.add_argument("--targets", default="auto",
                    help=f"comma-separated subset of {','.join(ARCHS)}; auto (default): all of them, each used only "
                         "if the bundled ptxas supports it")
    ap.add_argument("--jobs", type=int_at_least(1), default=1,
                    help="worker processes (targets are split between them)")
    ap.add_argument("--baseline", default=None, metavar="CSV",
                    help="an earlier audit's aot.csv (read before OUT is written, so it may be OUT/aot.csv): aot.md "
                         "then compares compiled variants (recompiles) before and now on the calls both made")
    return ap


def main(argv=None):
    from . import report
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = build_parser()
    a = ap.parse_args(argv)
    ensure_writable_dir(a.out)                    # a bad --out (a file, no permission) fails now, not after compiling
    baseline = None
    if a.baseline:
        if not os.path.exists(a.baseline):
            ap.error(f"--baseline {a.baseline}: no such file")
        try:
            baseline = report.read_csv(a.baseline)     # before compiling: a CSV that is not an audit fails now
        except ValueError as e:
            ap.error(str(e))
    targets = list(ARCHS) if a.targets == "auto" else a.targets.split(",")
    unknown = [t for t in targets if t not in ARCHS]
    if unknown:
        ap.error(f"unknown target(s) {unknown}; choose from {list(ARCHS)}")
    t0 = time.perf_counter()
    try:
        result = run_workers(targets, a.quick, a.jobs)
    except RuntimeError as exc:
        print(f"aot: {exc}", file=sys.stderr)
        return 3
    seconds = time.perf_counter() - t0
    command = " ".join(["python -m mtp_lab aot", *argv])
    report.write_csv(os.path.join(a.out, "aot.csv"), result["rows"], result["env"])
    report.write_md(os.path.join(a.out, "aot.md"), result, command, seconds, baseline)
    fails = report.failures(result["rows"])
    print(f"aot: {len(result['rows'])} launch rows for {[t['target'] for t in result['targets'] if t['supported']]} "
          f"in {seconds:.0f} s -> {a.out}/aot.csv, aot.md; {len(fails)} problem(s)")
    for line in fails[:20]:
        print("  " + line)
    return report.exit_status(result["rows"])
