"""The ahead-of-time compile audit (`python -m mtp_lab aot`): the quick audit end to end in a subprocess (without
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

from cli_helpers import hang_guard
from mtp_lab.aot import report
from mtp_lab.aot.cubin import count_sass_ops, issue_cycles, parse_ptxas_log, parse_res_usage, sass_structure
from mtp_lab.aot.driver import TensorInfo
from mtp_lab.aot.hardware import ARCHS, PRODUCTS, blocks_per_sm, waves
from mtp_lab.aot.launches import Case, matrix
from mtp_lab.aot.traffic import MIN_BYTES, floor_us, min_bytes

ROOT = Path(__file__).resolve().parents[1]


def _jit_kernels():
    """Every `@triton.jit def _x_kernel` in the kernel files (helpers that are not launched are not *_kernel)."""
    names = set()
    for f in (ROOT / "mtp_triton" / "kernels").glob("*.py"):
        names |= set(re.findall(r"@triton\.jit(?:\([^)]*\))?[^\n]*\ndef (\w+_kernel)\(", f.read_text()))
    return names


def _env_without_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@pytest.fixture(scope="module")
def quick_audit(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot")
    proc = subprocess.run([sys.executable, "-m", "mtp_lab", "aot", "--quick", "--out", str(out)],
                          cwd=ROOT, env=_env_without_interpreter(), capture_output=True, text=True, timeout=hang_guard(600))
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
        assert int(r["min_bytes"]) > 0 and not r["bytes_error"], (r["kernel"], r["bytes_error"])
        assert 0 < int(r["straight_instrs"]) <= int(r["sass_instrs"]), r["kernel"]
        assert r["interpreter"] == "False" and r["commit"] and r["triton"] and r["timestamp"]
    sm90 = [r for r in rows if r["target"] == "sm_90"]
    assert all(r["floor_us_H100"] and r["floor_us_H200"] and not r["floor_us_A100"] for r in sm90)
    # the exit status is the rule applied to the rows it wrote
    assert proc.returncode == report.exit_status(rows), proc.stdout + proc.stderr
    assert "python -m mtp_lab aot --quick --out" in md and "## Verdict" in md
    assert ("FAIL" in md) == bool(report.failures(rows))
    # the features the launchers grew: per-head LM heads, a draft vocabulary, a sliding window, run-time splits
    cases = {r["case"] for r in rows}
    assert {c.label for c in matrix(quick=True)} <= cases
    grids = {r["case"]: r["grid"] for r in rows if r["kernel"] == "_vocab_tile_kernel" and r["target"] == "sm_90"}
    assert grids["fused_draft vicuna-7b bf16 B1 H5 k10 per-head-lm"].endswith("x5")      # one grid slice per head
    merge = {r["case"]: r["spec"] for r in rows if r["kernel"] == "_merge_kernel" and r["target"] == "sm_90"}
    assert "HAS_MAP=True" in merge["fused_draft smollm2-135m bf16 B1 H4 k10 V'8192"]
    attn = [r for r in rows if r["kernel"] == "_tree_attention_kernel" and r["target"] == "sm_90"]
    assert any("USE_WINDOW=True" in r["spec"] for r in attn) and any("USE_WINDOW=False" in r["spec"] for r in attn)
    assert all("n_splits:i32" in r["spec"] for r in attn)                 # never a compiled-in constant
    assert {int(r["n_splits"]) for r in attn} >= {1, 8}


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
             out_ptr=_t((1, 2, 4, 8), 2), part_ptr=_t((1, 2, 4, 8), 2), lse_ptr=_t((1, 2, 4, 8), 2),
             count_ptr=_t((1,), 4), SPLIT=False, n_splits=1, USE_WINDOW=False, window=0)
    case = Case("tree_attention", B=1, T=2, ctx=20)
    assert min_bytes("_tree_attention_kernel", a, case) == 1680
    # three splits (a run-time count): out replaced by fp32 partials [3, 1, 2, 4, 8] 768 B + lse [3, 1, 2, 4] 96 B
    split = {**a, "SPLIT": True, "n_splits": 3, "part_ptr": _t((3, 1, 2, 4, 8), 4), "lse_ptr": _t((3, 1, 2, 4), 4)}
    assert min_bytes("_tree_attention_kernel", split, case) == 1680 - 128 + 864
    # sliding window 8: the root at position 20 sees positions 13..19 (7 tokens, blocks 0 and 1): cache
    # 2*7*2*8*2 = 448, table 2*4 + lens 4, node depths [2] int32 8: 128 + 448 + 128 + 4 + 12 + 8 + 128 = 856
    win = {**a, "USE_WINDOW": True, "window": 8, "count_ptr": _t((2,), 4)}
    assert min_bytes("_tree_attention_kernel", win, case) == 856
    # window 4: positions 17..19 in block 1 only: cache 2*3*2*8*2 = 192, table 4 + 4 -> 596
    assert min_bytes("_tree_attention_kernel", {**win, "window": 4}, case) == 596
    # a window longer than the context hides nothing: 1680 + the depths' 8 B
    assert min_bytes("_tree_attention_kernel", {**win, "window": 100}, case) == 1688
    # combine: R = 1 x 2 x 4 = 8 rows, Dh 8, 3 of a MAX_SPLITS 4 bucket: 3*8*(8+1)*4 = 864 read + 8*8*2 B fp16 out
    a = dict(R=8, Dh=8, n_splits=3, MAX_SPLITS=4, out_ptr=_t((1, 2, 4, 8), 2))
    assert min_bytes("_combine_splits_kernel", a, case) == 864 + 128
    assert min_bytes("_no_such_kernel", {}, case) is None
    assert floor_us(3.35e6, 3.35e12) == pytest.approx(1.0)


def test_min_bytes_drafting_by_hand():
    # B 1, H 2 (R = 2 rows), D 8, V 40 in tiles of 16 (NT 3), top-2; bf16 LM head [40, 8] 640 B; z as bf16 hi + lo
    # [1, 2, 8] 32 B each; keys [2, 3, 2] int64 96 B, m and s [2, 3] fp32 24 B each: 32 + 32 + 640 + 96 + 48 = 848
    a = dict(z_hi_ptr=_t((1, 2, 8), 2), z_lo_ptr=_t((1, 2, 8), 2), lm_ptr=_t((40, 8), 2), key_ptr=_t((2, 3, 2), 8),
             m_ptr=_t((2, 3), 4), s_ptr=_t((2, 3), 4), SPLIT=True)
    assert min_bytes("_vocab_tile_kernel", a, Case("fused_draft")) == 848
    # fp32 z (no split): z_lo is z_hi itself and not counted again: 64 + 640 + 96 + 48
    fp32 = {**a, "z_hi_ptr": _t((1, 2, 8), 4), "z_lo_ptr": _t((1, 2, 8), 4), "SPLIT": False}
    assert min_bytes("_vocab_tile_kernel", fp32, Case("fused_draft")) == 848
    # one LM head per draft head, [2, 40, 8]: the head bytes double (+640)
    assert min_bytes("_vocab_tile_kernel", {**a, "lm_ptr": _t((2, 40, 8), 2)}, Case("fused_draft")) == 1488
    # merge: keys 96 + m, s 48 read; ids [1, 2, 2] int64 32 + logprobs fp32 16 written = 192
    a = dict(key_ptr=_t((2, 3, 2), 8), m_ptr=_t((2, 3), 4), s_ptr=_t((2, 3), 4), map_ptr=_t((1, 2, 2), 8),
             ids_ptr=_t((1, 2, 2), 8), logp_ptr=_t((1, 2, 2), 4), HAS_MAP=False)
    assert min_bytes("_merge_kernel", a, Case("fused_draft")) == 192
    # with a 40-id draft vocabulary: + the 4 looked-up map entries, 32 B
    assert min_bytes("_merge_kernel", {**a, "HAS_MAP": True, "map_ptr": _t((40,), 8)}, Case("fused_draft")) == 224
    # ... never more than the whole map (a 3-id map: 24 B)
    assert min_bytes("_merge_kernel", {**a, "HAS_MAP": True, "map_ptr": _t((3,), 8)}, Case("fused_draft")) == 216


def test_min_bytes_acceptance_by_hand():
    # greedy, B 2, T 3: draft 48 + parents [3] 24 + target 48 read; accept_len 16 + nodes 48 + next 16 written
    a = dict(draft_ptr=_t((2, 3), 8), parents_ptr=_t((3,), 8), target_ptr=_t((2, 3), 8), accept_len_ptr=_t((2,), 8),
             accept_nodes_ptr=_t((2, 3), 8), next_ptr=_t((2,), 8))
    assert min_bytes("_tree_accept_kernel", a, Case("tree_accept")) == 200
    # sampling sums, B 1, T 2, V 40 fp32 (320 B), CHUNK 16 -> NC 3, CPP 2 -> NG 2: sums and nnz [1, 2, 3] 24 B
    # each, gsums and gnnz [1, 2, 2] 16 B each
    a = dict(probs_ptr=_t((1, 2, 40), 4), sums_ptr=_t((1, 2, 3), 4), nnz_ptr=_t((1, 2, 3), 4),
             gsums_ptr=_t((1, 2, 2), 4), gnnz_ptr=_t((1, 2, 2), 4))
    assert min_bytes("_tree_accept_sums_kernel", a, Case("tree_accept_sample")) == 400
    # walk: per sequence NG (2) group sums + counts 16, CPP (2) chunk sums + counts 16, one CHUNK of p 64,
    # p(x) of the T - 1 = 1 non-root node 4 = 100; tokens 16 + parents 16 + u_accept 8 + u_sample 4 + outputs 32
    a.update(NC=3, NG=2, CPP=2, CHUNK=16, draft_ptr=_t((1, 2), 8), parents_ptr=_t((2,), 8),
             u_accept_ptr=_t((1, 2), 4), u_sample_ptr=_t((1,), 4), accept_len_ptr=_t((1,), 8),
             accept_nodes_ptr=_t((1, 2), 8), next_ptr=_t((1,), 8))
    assert min_bytes("_tree_accept_walk_kernel", a, Case("tree_accept_sample")) == 176
    # a vocabulary smaller than the chunk (V 10): only 10 ids of it exist, 40 B instead of 64
    small = {**a, "probs_ptr": _t((1, 2, 10), 4)}
    assert min_bytes("_tree_accept_walk_kernel", small, Case("tree_accept_sample")) == 152


def test_launch_matrix_covers_the_launcher_features():
    full = matrix()
    labels = [c.label for c in full]
    assert len(labels) == len(set(labels))                                # one row set per call
    assert "fused_draft vicuna-7b bf16 B1 H5 k10 per-head-lm" in labels     # Medusa's own LM heads
    assert "fused_draft smollm2-135m bf16 B8 H4 k10 V'8192" in labels
    assert "fused_draft llama3-8b fp16 B1 H5 k10 V'32768" in labels
    assert "tree_attention mistral-7b bf16 B8 T64 ctx8192 window=4096" in labels
    assert {c.label for c in matrix(quick=True)} <= set(labels)
    # the calls of the audit before these features are all still made
    old = [c for c in full if not (c.per_head or c.draft_V or c.kwargs or c.model in ("vicuna-7b", "mistral-7b"))]
    assert len(old) == 192


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


_SASS = """
        /*0000*/                   LDC R1, c[0x0][0x37c] ;
        /*0010*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0020*/                   ISETP.GE.AND P0, PT, R2, 0x40, PT ;
        /*0030*/               @P0 BRA 0x80 ;
        /*0040*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0050*/                   LDG.E R5, desc[UR4][R6.64] ;
        /*0060*/                   ISETP.NE.AND P1, PT, R5, RZ, PT ;
        /*0070*/               @P1 BRA 0x40 ;
        /*0080*/                   STG.E desc[UR4][R8.64], R4 ;
        /*0090*/                   EXIT ;
        /*00a0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR7+0x13000], R4 ;
        /*00b0*/              @!P3 BRA 0xa0 ;
        /*00c0*/                   BRA 0x20 ;
        /*00d0*/                   BRA 0xd0;
        /*00e0*/                   NOP;
"""


def test_sass_structure_and_issue_floor():
    s = sass_structure(_SASS)
    # 13 instructions before the self-branch; two loops: 0x40..0x70 (4 instructions) and the wait loop 0xa0..0xb0
    # (2); the jump back from the out-of-line block (0xc0 -> 0x20) is not a loop
    assert s == dict(sass_instrs=13, sass_gld=2, loops=2, loop_instrs=6, straight_instrs=7)
    # 4 schedulers: 8 warps issue 2 warps' instructions on the busiest one, 4 warps 1
    assert issue_cycles(100, 8) == 200 and issue_cycles(100, 4) == 100 and issue_cycles(100, 1) == 100
    # the clock implied by the datasheet FP32 peak: 67 TFLOP/s / (132 SMs x 128 lanes x 2) ~ 1.98 GHz
    assert PRODUCTS["H100"].clock_hz == pytest.approx(1.98e9, rel=1e-2)
    assert PRODUCTS["A100"].clock_hz == pytest.approx(1.41e9, rel=1e-2)


def _walk_rows(target="sm_90"):
    common = dict(target=target, case=report.SAMPLING_CASE, status="ok", model="llama2-7b", dtype="fp32")
    return [dict(common, kernel="_tree_accept_sums_kernel", min_bytes=8_200_000, floor_us_H100=2.448,
                 floor_us_H200=1.708),
            dict(common, kernel="_tree_accept_walk_kernel", min_bytes=3_000, floor_us_H100=0.001, floor_us_H200=0.001,
                 num_warps=8, straight_instrs=1000, loop_instrs=20, loops=1, sass_gld=30)]


def test_sampling_estimate_from_rows():
    lines = report.sampling_estimate(_walk_rows())
    assert [line[0] for line in lines] == ["H100", "H200"]
    h100 = lines[0]
    clock = PRODUCTS["H100"].clock_hz
    # depth 0: 1000 instructions x 2 warps per scheduler; depth 63: (1000 + 20 x 63) x 2
    expect = [issue_cycles(1000 + 20 * d, 8) / clock * 1e6 for d in report.WALK_DEPTHS]
    assert h100[7] == " / ".join(f"{u:.3g}" for u in expect)
    assert h100[8] == f"{2.448 + 0.001 + expect[-1]:.3g}"
    assert report.sampling_estimate(_walk_rows("sm_120")) == []            # no product of that architecture


def test_baseline_section_compares_variants_on_common_calls():
    def row(case, variant, spec, kernel="_k", model="m"):
        return dict(target="sm_90", kernel=kernel, case=case, status="ok", model=model, dtype="bf16", variant=variant,
                    spec=spec, regs=1, shared_bytes=0, shared_limit=1, blocks_per_sm=1, num_warps=4, num_stages=2)
    before = [row("a", "v1", "S=1"), row("b", "v2", "S=2"), row("c", "v3", "S=4"), row("old", "v9", "")]
    now = [row("a", "w1", "n:i32"), row("b", "w1", "n:i32"), row("new", "w2", "x")]
    md = "\n".join(report.baseline_section((before, dict(commit="abc")), now, ["sm_90"]))
    assert "| _k | 2 (2) | S | 1 (1) | - |" in md          # calls a and b only: 2 variants before (S), 1 now
    assert "commit abc" in md and "2 launcher calls" in md


def test_worker_refuses_the_interpreter(tmp_path):
    env = {**_env_without_interpreter(), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "mtp_lab.aot.worker", "--targets", "sm_90", "--rows",
                           str(tmp_path / "r.json")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=hang_guard(300))
    assert proc.returncode == 2 and "TRITON_INTERPRET" in proc.stderr
    assert not (tmp_path / "r.json").exists()
