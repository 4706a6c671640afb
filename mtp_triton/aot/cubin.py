"""What a compiled kernel costs on the GPU, read from its cubin with the NVIDIA tools bundled in Triton's wheel.

* `ptxas -v` (run again on the kernel's PTX with the flags Triton uses) prints registers, stack frame and
  **spill stores / loads**. Spills can show up there while `cuobjdump -res-usage` still says LOCAL:0 (the spilled
  registers live in the stack frame), so both are read.
* `cuobjdump -res-usage` prints REG, STACK, SHARED (static), LOCAL.
* `cuobjdump -sass` is counted for tensor-core instructions: HMMA (mma.sync, sm_80+), HGMMA (wgmma, sm_90a),
  UTC*MMA (tcgen05, sm_100a) — none means the dots ran on the FMA units — and for STL/LDL (local memory).
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
        # the flags of Triton's make_cubin (lineinfo, -v, --regAllocOptLevel=2); fmad follows enable_fp_fusion
        fmad = [] if getattr(compiled.metadata, "enable_fp_fusion", True) else ["--fmad=false"]
        log = _run([ptxas_path(capability), "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2",
                    f"--gpu-name={sm_name(capability)}", ptx, "-o", os.path.join(tmp, "again.cubin")])
        info = parse_ptxas_log(log)
        info.update(parse_res_usage(_run([os.path.join(d, "cuobjdump"), "-res-usage", cubin])))
        info.update(count_sass_ops(_run([os.path.join(d, "cuobjdump"), "-sass", cubin])))
    return info
