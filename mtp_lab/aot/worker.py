"""The compile audit's worker process: compiles every case of the launch matrix for some targets, writes rows.

Runs as `python -m mtp_lab.aot.worker --targets sm_80,sm_90 --rows rows.json [--quick]`, started by
`python -m mtp_lab aot` with TRITON_INTERPRET removed from its environment (the kernels must be real
@triton.jit functions, which Triton decides when a kernel module is imported).
"""
import math
import sys
import time

import triton
import triton.language as tl

from ..cli import command_parser, run
from ..records import env_info, write_json
from . import cubin
from .driver import gpu_session
from .hardware import ARCHS, products_of, blocks_per_sm, waves
from .launches import matrix, run_case
from .traffic import floor_us, min_bytes


@triton.jit
def _probe_kernel(x_ptr, n, BLOCK: tl.constexpr):
    """A trivial kernel: does the whole toolchain (Triton -> PTX -> ptxas -> cuobjdump) work for a target?"""
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(x_ptr + offs, x + 1, mask=offs < n)


def probe(arch):
    """(True, toolchain) if this machine's Triton + bundled ptxas compile and read back a kernel for `arch`,
    else (False, why). Detected, not assumed: the wheel's ptxas decides which sm_1xx targets exist."""
    ok, why = cubin.ptxas_supports(arch.capability)
    if not ok:
        return False, why
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    try:
        k = triton.compile(ASTSource(fn=_probe_kernel, signature={"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                                     constexprs={"BLOCK": 128}), target=GPUTarget("cuda", arch.capability, 32))
        cubin.inspect_kernel(k, arch.capability)
    except Exception as exc:
        return False, f"probe kernel failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    return True, why


def spec_of(compiled):
    """The specialisation Triton compiled: constexprs (incl. ints specialised to 1) as name=value, other
    arguments as name:type, '/16' where Triton assumed 16-divisibility. Differences between two variants of
    a kernel are the reason it was compiled twice."""
    try:
        src = compiled.src
        parts = []
        for i, name in enumerate(src.fn.arg_names):
            if (i,) in src.constants:
                parts.append(f"{name}={src.constants[(i,)]}")
            else:
                div = any(a and a[0] == "tt.divisibility" for a in src.attrs.get((i,), []))
                parts.append(f"{name}:{src.signature[name]}{'/16' if div else ''}")
        return " ".join(parts)
    except Exception as exc:             # older/newer Triton without these fields: say so, don't fail the audit
        return f"unavailable ({type(exc).__name__})"


def _case_fields(case):
    d = case.as_dict()
    d["case"] = case.label
    return d


def make_row(arch, case, launch, inspected):
    """One CSV row: a launch of `case` compiled for `arch` (`launch` None: the launcher made no kernel call)."""
    row = dict(target=arch.name, **_case_fields(case))
    if launch is None:
        return row
    row.update(kernel=launch.kernel, grid="x".join(map(str, launch.grid)), programs=math.prod(launch.grid),
               n_splits=launch.args.get("n_splits"))        # split-KV count: a run-time argument, not compiled in
    if launch.compiled is None:
        row.update(status="compile_error", error=launch.error)
        return row
    k, md = launch.compiled, launch.compiled.metadata
    if k.hash not in inspected:
        inspected[k.hash] = cubin.inspect_kernel(k, arch.capability)
    info = inspected[k.hash]
    row.update(status="ok", error="", variant=k.hash[:12], num_warps=md.num_warps, num_stages=md.num_stages,
               shared_bytes=md.shared, shared_limit=arch.shared_per_block,
               tmem_cols=getattr(md, "tmem_size", None) or 0, **info)
    row["tensor_cores"] = "+".join(f"{n.upper()}" for n in cubin.TENSOR_CORE_OPS if info.get(n)) or "none"
    blocks, limiter = blocks_per_sm(arch, info["regs"], md.num_warps, md.shared)
    products = products_of(arch.name)
    sms = arch.launcher_sms if products else None
    row.update(blocks_per_sm=blocks, occupancy_limit=limiter, sms=sms,
               waves=waves(row["programs"], sms, blocks) if sms else None)
    try:
        nbytes = min_bytes(launch.kernel, launch.args, case)
    except Exception as exc:             # a formula out of step with its kernel's arguments: a finding, not a crash
        nbytes = None
        row["bytes_error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    row["min_bytes"] = nbytes
    for p in products:
        row[f"floor_us_{p.name}"] = None if nbytes is None else float(f"{floor_us(nbytes, p.hbm_bytes_per_s):.4g}")
    row["spec"] = spec_of(k)
    return row


def audit_target(arch, cases, device_id=0, log=print):
    """Compile every case for one architecture; returns its rows."""
    recorded = []                              # (case, [launches], launcher error)
    with gpu_session(arch, device_id) as launches:
        for case in cases:
            start = len(launches)
            error = ""
            try:
                run_case(case)
            except Exception as exc:
                error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"
            recorded.append((case, launches[start:], error))
    rows, inspected = [], {}
    for case, case_launches, error in recorded:
        for launch in case_launches:
            rows.append(make_row(arch, case, launch, inspected))
        if error or not case_launches:
            row = make_row(arch, case, None, inspected)
            row.update(kernel="-", status="launcher_error" if error else "no_launch",
                       error=error or "the launcher compiled no kernel")
            rows.append(row)
    log(f"[aot] {arch.name}: {len(cases)} cases, {len(rows)} launches, {len(inspected)} distinct compiled kernels")
    return rows


def main(argv=None):
    ap = command_parser("python -m mtp_lab.aot.worker", "compile the kernels for some targets (a worker of aot)",
                        "quick")
    ap.add_argument("--targets", required=True, help="comma-separated, e.g. sm_80,sm_90")
    ap.add_argument("--rows", required=True, help="JSON file to write")
    a = ap.parse_args(argv)
    from mtp_triton.kernels import interpreter_enabled
    if interpreter_enabled():
        print("mtp_lab.aot.worker: Triton's interpreter is on (TRITON_INTERPRET=1): the audit needs the real "
              "@triton.jit kernels; run it without TRITON_INTERPRET", file=sys.stderr)
        return 2
    env = env_info()
    cases = matrix(quick=a.quick)
    targets, rows = [], []
    for i, name in enumerate(a.targets.split(",")):
        arch = ARCHS[name]
        t0 = time.perf_counter()
        ok, why = probe(arch)
        entry = dict(target=name, supported=ok, toolchain=why,
                     ptxas=cubin.tool_version(cubin.ptxas_path(arch.capability)),
                     launcher_sms=arch.launcher_sms, launcher_sms_note=arch.launcher_sms_note)
        if ok:
            target_rows = audit_target(arch, cases, device_id=i)
            for r in target_rows:
                r["ptxas"] = entry["ptxas"]
            rows += target_rows
        else:
            print(f"[aot] {name}: skipped ({why})")
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        targets.append(entry)
    write_json(a.rows, dict(env=env, targets=targets, rows=rows, n_cases=len(cases)), indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
