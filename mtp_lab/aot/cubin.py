"""What a compiled kernel costs on the GPU, read from its cubin with the NVIDIA tools bundled in Triton's wheel.

* `ptxas -v` (run again on the kernel's PTX with the flags Triton uses) prints registers, stack frame and
  **spill stores / loads**. Spills can show up there while `cuobjdump -res-usage` still says LOCAL:0 (the spilled
  registers live in the stack frame), so both are read.
* `cuobjdump -res-usage` prints REG, STACK, SHARED (static), LOCAL.
* `cuobjdump -sass` is counted for tensor-core instructions: HMMA (mma.sync, sm_80+), HGMMA (wgmma, sm_90a),
  UTC*MMA (tcgen05, sm_100a) — none means the dots ran on the FMA units — and for STL/LDL (local memory).
  Its structure is read too (`sass_structure`): instructions in the listing (each is one warp instruction when a
  warp executes it), global loads (LDG), and loops, found as backward branches: a `BRA` to a lower address closes
  a loop whose body is every instruction from the target up to the branch. `issue_cycles` turns that into a
  lower bound on a kernel's time from its instruction stream alone (see there).
"""
import functools
import os
import re
import subprocess
import tempfile

TENSOR_CORE_OPS = {"hmma": r"\bHMMA\b", "hgmma": r"\bHGMMA\b", "tcgen05_mma": r"\bUTC\w*MMA\b"}
LOCAL_OPS = r"\b(?:STL|LDL)(?:\.\w+)*\b"      # local-memory stores/loads in the SASS: spills (or local arrays)


def tool_dir():
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def ptxas_path(capability):
    """The ptxas Triton uses for this capability: ptxas-blackwell for sm_100 and later where the wheel has it."""
    d = tool_dir()
    if capability >= 100 and os.path.exists(os.path.join(d, "ptxas-blackwell")):
        return os.path.join(d, "ptxas-blackwell")
    return os.path.join(d, "ptxas")


def sm_name(capability):
    """The --gpu-name Triton passes: architecture-specific ("a") from sm_90 on, which wgmma / tcgen05 need."""
    return f"sm_{capability}{'a' if capability >= 90 else ''}"


@functools.lru_cache(maxsize=None)
def tool_version(path):
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError as exc:
        return f"unavailable ({exc})"
    m = re.search(r"release ([\d.]+), (V[\d.]+)", out)
    return m.group(2) if m else out.strip().splitlines()[-1] if out.strip() else "unknown"


@functools.lru_cache(maxsize=None)
def ptxas_supports(capability):
    """Whether the bundled ptxas lists this GPU name among its --gpu-name values. Returns (bool, reason)."""
    path = ptxas_path(capability)
    if not os.path.exists(path):
        return False, f"{path} not found"
    text = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=30).stdout
    allowed = set(re.findall(r"'(sm_\w+)'", text))
    name = sm_name(capability)
    if name not in allowed:
        return False, f"{os.path.basename(path)} {tool_version(path)} does not list {name}"
    return True, f"{os.path.basename(path)} {tool_version(path)}"


@functools.lru_cache(maxsize=None)
def triton_reg_alloc_flags():
    """['--regAllocOptLevel=2'] if the installed Triton's make_cubin passes it to ptxas (3.7.1 does, "to work around
    ptxas 13.x bug"), else []. It matters: with it, ptxas-blackwell 13.1 stops at 80 registers and spills 16 B in a
    kernel it compiles without spills (same 80 registers) when the flag is left out."""
    import inspect
    try:
        from triton.backends.nvidia.compiler import CUDABackend
        source = inspect.getsource(CUDABackend.make_cubin)
    except Exception:                     # source not available: assume the flag, as the newest Triton does
        return ("--regAllocOptLevel=2",)
    return ("--regAllocOptLevel=2",) if "--regAllocOptLevel=2" in source else ()


def _run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{os.path.basename(cmd[0])} failed ({r.returncode}): {(r.stderr or r.stdout)[-400:]}")
    return r.stdout + r.stderr


def parse_ptxas_log(log):
    """'N bytes stack frame, S bytes spill stores, L bytes spill loads' and 'Used R registers' -> dict."""
    out = {}
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if m:
        out.update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
    m = re.search(r"Used (\d+) registers", log)
    if m:
        out["ptxas_regs"] = int(m.group(1))
    return out


def parse_res_usage(text):
    """cuobjdump -res-usage: 'REG:80 STACK:0 SHARED:1024 LOCAL:0 ...' of the (single) function -> dict."""
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", text)
    if not m:
        raise RuntimeError(f"cannot parse cuobjdump -res-usage output: {text[-300:]!r}")
    return dict(regs=int(m.group(1)), stack_bytes=int(m.group(2)), static_shared=int(m.group(3)),
                local_bytes=int(m.group(4)))


def count_sass_ops(sass):
    """Tensor-core instructions by kind, and local-memory instructions (local_ops), in a SASS listing."""
    counts = {k: len(re.findall(p, sass)) for k, p in TENSOR_CORE_OPS.items()}
    counts["local_ops"] = len(re.findall(LOCAL_OPS, sass))
    return counts


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_GLOBAL_LOAD = re.compile(r"^(?:@!?U?P\w+\s+)?(?:LDG|LDGSTS|UTMALDG)\b")
_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)")


def sass_structure(sass):
    """Instruction stream of a one-function SASS listing -> dict:
    sass_instrs: instructions, NOPs and the final branch-to-self not counted; sass_gld: global loads (LDG,
    LDGSTS = cp.async, UTMALDG = TMA); loops: backward branches (a jump back from an out-of-line block placed
    after the last EXIT, e.g. a barrier-wait retry, is not a loop); loop_instrs: the instructions inside any loop
    body (a body = the branch target .. the backward branch; overlapping and nested bodies counted once, as their
    union); straight_instrs = sass_instrs - loop_instrs: the instructions outside every loop."""
    instrs = []                                        # (address, text)
    for m in _SASS_LINE.finditer(sass):
        addr, text = int(m.group(1), 16), m.group(2).strip()
        b = _BRANCH.search(text)
        if b and int(b.group(1), 16) == addr:          # the end-of-code self-branch
            break
        if text != "NOP":
            instrs.append((addr, text))
    exits = [a for a, t in instrs if re.match(r"^(?:@!?U?P\w+\s+)?EXIT\b", t)]
    last_exit = max(exits) if exits else float("inf")
    bodies = []                                        # (first address, branch address)
    for addr, text in instrs:
        b = _BRANCH.search(text)
        if b and int(b.group(1), 16) < addr and (addr < last_exit or int(b.group(1), 16) > last_exit):
            bodies.append((int(b.group(1), 16), addr))
    in_loop = sum(1 for a, _ in instrs if any(lo <= a <= hi for lo, hi in bodies))
    return dict(sass_instrs=len(instrs), sass_gld=sum(1 for _, t in instrs if _GLOBAL_LOAD.search(t)),
                loops=len(bodies), loop_instrs=in_loop, straight_instrs=len(instrs) - in_loop)


def issue_cycles(instructions, num_warps, schedulers=4):
    """A lower bound on the cycles one program (thread block) needs: every warp issues `instructions` warp
    instructions, and an SM's `schedulers` warp schedulers (one per SM sub-partition, 4 on sm_80 / sm_90 / sm_100)
    each issue at most one warp instruction per cycle, so the busiest one issues ceil(num_warps / schedulers) warps'
    worth. No stall is counted: dependent-instruction latency, memory latency, barriers and launch time all add
    to it. cycles / clock is then a floor in seconds, like the bandwidth floor."""
    return instructions * -(-num_warps // schedulers)


def inspect_kernel(compiled, capability):
    """Resources of one compiled kernel (a triton CompiledKernel) -> dict of REG, spills, stack, local, static
    shared, tensor-core and local-memory instruction counts."""
    d = tool_dir()
    with tempfile.TemporaryDirectory(prefix="mtp_aot_") as tmp:
        cubin, ptx = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        # the flags of Triton's make_cubin (lineinfo, -v, and --regAllocOptLevel=2 where this Triton passes it);
        # fmad follows enable_fp_fusion
        fmad = [] if getattr(compiled.metadata, "enable_fp_fusion", True) else ["--fmad=false"]
        log = _run([ptxas_path(capability), "-lineinfo", *fmad, "-v", *triton_reg_alloc_flags(),
                    f"--gpu-name={sm_name(capability)}", ptx, "-o", os.path.join(tmp, "again.cubin")])
        info = parse_ptxas_log(log)
        info.update(parse_res_usage(_run([os.path.join(d, "cuobjdump"), "-res-usage", cubin])))
        sass = _run([os.path.join(d, "cuobjdump"), "-sass", cubin])
        info.update(count_sass_ops(sass))
        info.update(sass_structure(sass))
    return info
