"""The ahead-of-time compile audit (`python -m mtp_triton aot`): the quick audit end to end in a subprocess (without
the interpreter this test process runs under), and its pieces: byte formulas, occupancy and waves, the exit rule,
the parsers of ptxas / cuobjdump output."""
import csv
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_triton.aot import report
from mtp_triton.aot.cubin import count_sass_ops, parse_ptxas_log, parse_res_usage
from mtp_triton.aot.driver import TensorInfo
from mtp_triton.aot.hardware import ARCHS, blocks_per_sm, waves
from mtp_triton.aot.launches import Case
from mtp_triton.aot.traffic import MIN_BYTES, floor_us, min_bytes

ROOT = Path(__file__).resolve().parents[1]


def _jit_kernels():
    """Every `@triton.jit def _x_kernel` in the kernel files (helpers that are not launched are not *_kernel)."""
    names = set()
    for f in (ROOT / "mtp_triton" / "kernels").glob("*.py"):
        names |= set(re.findall(r"@triton\.jit[^\n]*\ndef (\w+_kernel)\(", f.read_text()))
    return names


def _env_without_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@pytest.fixture(scope="module")
def quick_audit(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot")
    proc = subprocess.run([sys.executable, "-m", "mtp_triton", "aot", "--quick", "--out", str(out)],
                          cwd=ROOT, env=_env_without_interpreter(), capture_output=True, text=True, timeout=600)
    with open(out / "aot.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return proc, rows, (out / "aot.md").read_text()


def test_quick_audit_compiles_every_kernel_for_every_target(quick_audit):
    proc, rows, md = quick_audit
    assert rows, proc.stdout + proc.stderr
    targets = {r["target"] for r in rows}
    assert {"sm_80", "sm_90"} <= targets                       # the bundled ptxas 12.8 has both
    kernels = _jit_kernels()
    assert len(kernels) >= 8
    for t in targets:
        seen = {r["kernel"] for r in rows if r["target"] == t}
        assert kernels <= seen, f"{t}: the quick launch matrix never compiles {sorted(kernels - seen)}"
    bad = [(r["target"], r["kernel"], r["status"], r["error"]) for r in rows if r["status"] != "ok"]
    assert not bad, bad
    for r in rows:
        assert 1 <= int(r["regs"]) <= 255 and int(r["num_warps"]) >= 1 and int(r["programs"]) >= 1
        assert int(r["min_bytes"]) > 0, r["kernel"]
        assert r["interpreter"] == "False" and r["commit"] and r["triton"] and r["timestamp"]
    sm90 = [r for r in rows if r["target"] == "sm_90"]
    assert all(r["floor_us_H100"] and r["floor_us_H200"] and not r["floor_us_A100"] for r in sm90)
    # the exit status is the rule applied to the rows it wrote
    assert proc.returncode == report.exit_status(rows), proc.stdout + proc.stderr
    assert "python -m mtp_triton aot --quick --out" in md and "## Verdict" in md
    assert ("FAIL" in md) == bool(report.failures(rows))


def test_every_kernel_has_a_byte_formula():
    assert _jit_kernels() <= set(MIN_BYTES)


def _t(shape, itemsize, dtype="x"):
    return TensorInfo(tuple(shape), dtype, itemsize)


def test_min_bytes_by_hand():
    # kv_append, L 2, B 3, row Hkv*Dh = 8, bf16: 2 (K, V) x 2 (read + write) x 2 x 3 x 8 x 2 B + 3 x 24 B of indices
    a = dict(k_tree_ptr=_t((2, 3, 5, 2, 4), 2), ROW=8)
    assert min_bytes("_kv_append_kernel", a, Case("kv_append")) == 384 + 72
    # resblock: x [2, 4] bf16 16 B, w [3, 4, 4] 96 B, b [3, 4] 24 B, z [2, 3, 4] fp32 96 B (z_lo unused)
    a = dict(x_ptr=_t((2, 4), 2), w_ptr=_t((3, 4, 4), 2), b_ptr=_t((3, 4), 2), z_hi_ptr=_t((2, 3, 4), 4),
             z_lo_ptr=_t((2, 3, 4), 4), SPLIT_OUT=False)
    assert min_bytes("_resblock_kernel", a, Case("fused_draft")) == 232
    # ... and as bf16 hi + lo halves: 2 x 48 B instead of 96 B fp32
    a.update(z_hi_ptr=_t((2, 3, 4), 2), z_lo_ptr=_t((2, 3, 4), 2), SPLIT_OUT=True)
    assert min_bytes("_resblock_kernel", a, Case("fused_draft")) == 232
    # tree attention, B 1, T 2, Hq 4, Hkv 2, Dh 8, fp16, 20 cached tokens in blocks of 16:
    # q 128 + cache 2*20*2*8*2 = 1280 + tree K/V 2*64 + mask 4 + table 2*4 + lens 4 + out 128 = 1680
    a = dict(q_ptr=_t((1, 2, 4, 8), 2), k_tree_ptr=_t((1, 2, 2, 8), 2), mask_ptr=_t((2, 2), 1), Hkv=2, BS=16,
             NUM_SPLITS=1)
    case = Case("tree_attention", B=1, T=2, ctx=20)
    assert min_bytes("_tree_attention_kernel", a, case) == 1680
    # three splits: out replaced by fp32 partials + lse, 3 x 1 x 2 x 4 x (8 + 1) x 4 B = 864
    assert min_bytes("_tree_attention_kernel", {**a, "NUM_SPLITS": 3}, case) == 1680 - 128 + 864
    assert min_bytes("_no_such_kernel", {}, case) is None
    assert floor_us(3.35e6, 3.35e12) == pytest.approx(1.0)


def test_blocks_per_sm_and_waves():
    sm90, sm80 = ARCHS["sm_90"], ARCHS["sm_80"]
    # 255 registers round up to 256 per thread = 8192 per warp: 8 warps per SM = 2 blocks of 4 warps
    assert blocks_per_sm(sm90, 255, 4, 0) == (2, "regs")
    # 32 registers, 4 warps: registers would allow 16 blocks, threads (2048 / 128) also 16
    assert blocks_per_sm(sm90, 32, 4, 0)[0] == 16
    # 80 KiB shared + 1 KiB reserved on sm_80 (164 KiB per SM): 2 blocks
    assert blocks_per_sm(sm80, 32, 4, 80 * 1024) == (2, "shared")
    assert blocks_per_sm(sm80, 32, 4, sm80.shared_per_block + 1) == (0, "shared")
    assert sm90.shared_per_block == 227 * 1024 and sm80.shared_per_block == 163 * 1024
    assert waves(1002, 132, 2) == math.ceil(1002 / 264) == 4
    assert waves(1002, 108, 2) == 5 and waves(1, 132, 2) == 1
    assert waves(10, 132, 0) is None


def _ok_row(**kw):
    row = dict(target="sm_90", kernel="_k", case="c", status="ok", regs=64, spill_stores=0, spill_loads=0,
               local_bytes=0, local_ops=0, shared_bytes=1024, shared_limit=232448, blocks_per_sm=4)
    row.update(kw)
    return row


@pytest.mark.parametrize("bad", [dict(spill_stores=16), dict(spill_loads=4), dict(local_bytes=8),
                                 dict(local_ops=2), dict(shared_bytes=232449), dict(status="compile_error"),
                                 dict(status="launcher_error"), dict(status="no_launch"), dict(blocks_per_sm=0)],
                         ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_exit_status_rule(bad):
    assert report.exit_status([_ok_row(), _ok_row(regs=255)]) == 0
    assert report.failures([_ok_row()]) == []
    rows = [_ok_row(), _ok_row(**bad)]
    assert report.exit_status(rows) == 1
    assert len(report.failures(rows)) == 1
    # CSV round trip: every value a string
    assert report.exit_status([{k: str(v) for k, v in r.items()} for r in rows]) == 1


def test_tool_output_parsers():
    log = ("ptxas info    : Function properties for _vocab_tile_kernel\n"
           "    24 bytes stack frame, 16 bytes spill stores, 20 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 24 bytes cumulative stack size\n")
    assert parse_ptxas_log(log) == dict(stack_frame=24, spill_stores=16, spill_loads=20, ptxas_regs=255)
    res = (" Function _k:\n  REG:80 STACK:0 SHARED:1024 LOCAL:8 CONSTANT[0]:584 TEXTURE:0 SURFACE:0 SAMPLER:0\n")
    assert parse_res_usage(res) == dict(regs=80, stack_bytes=0, static_shared=1024, local_bytes=8)
    sass = ("  HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\n  HGMMA.64x64x16.F32.BF16 gdesc[UR4], RZ ;\n"
            "  UTCHMMA gdesc[UR8], tmem[UR4] ;\n  STL [R1+0x4], R5 ;\n  LDL.64 R6, [R1+0x8] ;\n"
            "  FFMA R1, R2, R3, R4 ;\n")
    assert count_sass_ops(sass) == dict(hmma=1, hgmma=1, tcgen05_mma=1, local_ops=2)


def test_worker_refuses_the_interpreter(tmp_path):
    env = {**_env_without_interpreter(), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "mtp_triton.aot.worker", "--targets", "sm_90", "--rows",
                           str(tmp_path / "r.json")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "TRITON_INTERPRET" in proc.stderr
    assert not (tmp_path / "r.json").exists()
