"""Benchmark plumbing: CSV rows that survive a Ctrl-C or a full disk (real signals and real file-size limits in
subprocesses), the output-folder check, trees by name, and bench modules that import without side effects."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from bench_helpers import EMBEDDED, ROOT, child_env, default_sigint, read_csv

import mtp_triton as mt
from mtp_lab.bench import common
from mtp_lab.bundle import pick_tree
from mtp_triton.tree import get_tree



def rows_of(n, start=0, pad=900, **extra):
    return [dict(i=start + k, name=f"row {start + k}", pad="x" * pad, **extra) for k in range(n)]


# ---- append_rows: the format ----
def test_append_rows_extends_the_header_and_keeps_the_rows(tmp_path):
    path = tmp_path / "sub" / "r.csv"
    common.append_rows(path, [dict(a=1, b="x")])
    common.append_rows(path, [dict(a=2, c=3.5)])                            # new column: the header grows
    common.append_rows(path, [dict(c=4, a=3)])                              # known columns: appended as they are
    assert read_csv(path) == [dict(a="1", b="x", c=""), dict(a="2", b="", c="3.5"), dict(a="3", b="", c="4")]
    assert open(path, "rb").read().startswith(b"a,b,c\r\n1,x,\r\n")          # lines end as csv writes them


def test_append_with_a_known_header_only_adds_bytes(tmp_path):
    path = tmp_path / "r.csv"
    common.append_rows(path, rows_of(3, pad=5))
    before = path.read_bytes()
    common.append_rows(path, rows_of(2, start=3, pad=5))
    after = path.read_bytes()
    assert after.startswith(before) and len(read_csv(path)) == 5


def test_append_rows_to_a_file_without_a_final_newline_rewrites_it(tmp_path):
    """The writer ends every row with a line end, so a last row without one was cut mid-write (a torn row, whatever
    its field count): the rewrite drops it and keeps every whole row."""
    path = tmp_path / "r.csv"
    path.write_bytes(b"i,name\r\n0,a\r\n1,b")                              # the row "1,b" lost its line end
    common.append_rows(path, [dict(i=2, name="c")])
    assert read_csv(path) == [dict(i="0", name="a"), dict(i="2", name="c")]


# ---- append_rows: interrupted and failed writes ----
INTERRUPT_MID_ROW = textwrap.dedent(r"""
    import os, signal, sys, time
    from mtp_lab.bench.common import append_rows

    class SigintWhenWritten:                       # the csv writer calls str() on it while the rows are written
        def __str__(self):
            os.kill(os.getpid(), signal.SIGINT)    # a real SIGINT, delivered in the middle of the write
            time.sleep(1)
            return "never"

    path, column = sys.argv[1], sys.argv[2]
    rows = [dict(i=k, name=f"new {k}", pad="y" * 900) for k in range(200)]
    rows[150][column] = SigintWhenWritten()
    append_rows(path, rows)
    print("NOT INTERRUPTED")
""")


@pytest.mark.parametrize("column", ["pad", "extra"], ids=["same-header", "new-column"])
def test_sigint_during_append_leaves_the_file_byte_identical(tmp_path, column):
    path = tmp_path / "r.csv"
    common.append_rows(path, rows_of(100))
    before = path.read_bytes()
    p = subprocess.run([sys.executable, "-c", INTERRUPT_MID_ROW, str(path), column], capture_output=True, text=True,
                       env=child_env(), timeout=120, preexec_fn=default_sigint)
    assert "KeyboardInterrupt" in p.stderr and "NOT INTERRUPTED" not in p.stdout, p.stdout + p.stderr
    assert path.read_bytes() == before
    assert [f for f in os.listdir(tmp_path) if f != "r.csv"] == []          # no temporary file left behind


APPEND_FOREVER = textwrap.dedent(r"""
    import sys
    from mtp_lab.bench.common import append_rows
    path, k = sys.argv[1], 0
    while True:                                    # batches of 500 rows; every 3rd batch adds a column
        extra = {f"col{k}": "z"} if k % 3 == 2 else {}
        append_rows(path, [dict(batch=k, i=j, pad="p" * 1000, **extra) for j in range(500)])
        print(k, flush=True)
        k += 1
""")


@pytest.mark.parametrize("delay", [0.0, 0.013, 0.031], ids=lambda d: f"after{int(d * 1000)}ms")
def test_sigint_at_any_moment_keeps_whole_batches(tmp_path, delay):
    """A child appends batches for ever; a SIGINT at some moment: the file holds the rows from before plus whole
    batches, never a torn row (today's rewrite-in-place would lose rows or tear one)."""
    path = tmp_path / "r.csv"
    common.append_rows(path, [dict(batch=-1, i=j, pad="q" * 1000) for j in range(1000)])
    p = subprocess.Popen([sys.executable, "-c", APPEND_FOREVER, str(path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=child_env(), preexec_fn=default_sigint)
    try:
        for _ in range(3):                                                  # a few batches written
            assert p.stdout.readline(), p.stderr.read()
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
    finally:
        p.kill()
    rows = read_csv(path)
    batches = {}
    for r in rows:
        assert None not in r and None not in r.values(), "a torn row"
        assert r["pad"] in ("p" * 1000, "q" * 1000), "a torn value"
        batches.setdefault(int(r["batch"]), []).append(int(r["i"]))
    assert batches[-1] == list(range(1000))                                   # the earlier rows, all of them
    done = sorted(b for b in batches if b >= 0)
    assert done == list(range(len(done))) and len(done) >= 3
    assert all(batches[b] == list(range(500)) for b in done)                  # whole batches only


FILL_THE_DISK = textwrap.dedent(r"""
    import sys
    from mtp_lab.bench.common import append_rows
    path, column = sys.argv[1], sys.argv[2]
    append_rows(path, [{"i": k, "name": f"new {k}", column: "y" * 900} for k in range(64)])
""")


@pytest.mark.parametrize("column", ["pad", "extra"], ids=["same-header", "new-column"])
def test_full_disk_leaves_the_file_byte_identical(tmp_path, column):
    """`ulimit -f 64` (64 KiB per file): 40 rows of ~0.9 KB are there, 64 more do not fit."""
    path = tmp_path / "r.csv"
    common.append_rows(path, rows_of(40))
    before = path.read_bytes()
    assert 32 * 1024 < len(before) < 64 * 1024
    p = subprocess.run(["bash", "-c", 'ulimit -f 64 && exec "$0" -c "$1" "$2" "$3"', sys.executable, FILL_THE_DISK,
                        str(path), column], capture_output=True, text=True, env=child_env(), timeout=120)
    assert p.returncode != 0 and "File too large" in p.stderr, p.stderr
    assert path.read_bytes() == before
    assert [f for f in os.listdir(tmp_path) if f != "r.csv"] == []


def test_write_text_replaces_whole_files(tmp_path):
    path = tmp_path / "a" / "report.md"
    common.write_text(path, "one\n")
    common.write_text(path, "two\n")
    assert path.read_text() == "two\n" and os.listdir(path.parent) == ["report.md"]


# ---- the output folder ----
def test_ensure_writable_dir_creates_the_folder(tmp_path):
    out = tmp_path / "a" / "b"
    assert common.ensure_writable_dir(str(out)) == str(out)
    assert out.is_dir() and list(out.iterdir()) == []                        # the probe file is gone


@pytest.mark.parametrize("sub", ["", "below"], ids=["a-file", "below-a-file"])
def test_ensure_writable_dir_refuses_clearly(tmp_path, sub):
    f = tmp_path / "taken"
    f.write_text("a file, not a folder")
    with pytest.raises(OSError, match="cannot write to the output folder .*--out"):
        common.ensure_writable_dir(str(f / sub) if sub else str(f))


# ---- command-line pieces ----
def test_int_at_least():
    import argparse
    parse = common.int_at_least(1)
    assert parse("3") == 3
    for bad, message in (("0", "must be >= 1, got 0"), ("-1", "must be >= 1, got -1"), ("x", "expected an integer")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(bad)


# ---- trees by name (tree.get_tree, bundle.pick_tree): the eval harness's and train_heads' uses ----
@pytest.mark.parametrize("name,num_heads,size,depth", [
    ("medusa-16", None, 17, 3), ("chain-4", None, 5, 4), ("chain-6", 6, 7, 6), ("width-2", 3, 7, 3),
    ("tuned", 4, 17, 3),
], ids=lambda x: str(x))
def test_tree_by_name(name, num_heads, size, depth):
    t = get_tree(name, num_heads)
    assert (t.size, t.max_depth) == (size, depth)


def test_tree_by_name_tuned_from_accuracies():
    acc = [[0.8, 0.1], [0.5, 0.1], [0.3, 0.05]]
    t = get_tree("tuned-9", accuracy=acc)                               # train_heads: measured accuracies
    assert t.size == 10 and t.max_depth <= 3
    heads = os.path.join(EMBEDDED, "heads")
    with open(os.path.join(heads, "accuracy.json")) as f:
        stored = json.load(f)
    from mtp_triton.tree import Tree
    t = pick_tree("tuned", mt.load_heads(heads), heads)             # eval: budget from accuracy.json
    assert t.paths == Tree.from_accuracies(stored["acc"], stored["tree_budget"]).paths
    assert pick_tree("tuned-5", mt.load_heads(heads), heads).size == 6
    with pytest.raises(ValueError, match="needs the heads' accuracies"):
        get_tree("tuned-9")
    with pytest.raises(ValueError, match="exceeds the 2 heads"):
        get_tree("chain-3", 2)


# ---- importing a benchmark changes no environment variable ----
PROBE = r"""
import importlib, json, os, sys
before = dict(os.environ)
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))))
"""


@pytest.mark.parametrize("module", ["mtp_lab.bench.drafting", "mtp_lab.bench.tree_attention",
                                    "mtp_lab.bench.kv_append", "mtp_lab.bench.evaluate",
                                    "mtp_lab.bench.tables"])
def test_bench_import_changes_no_environment(module):
    env = dict(child_env(), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == []


def test_kernel_bench_cli_without_a_gpu_switches_to_the_interpreter(tmp_path):
    """kv_append imports its kernel at the top, so main() re-runs itself with TRITON_INTERPRET=1."""
    out = tmp_path / "a.csv"
    env = dict(child_env(), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "mtp_lab.bench.kv_append", "--out", str(out), "--models", "tiny-cpu",
                        "--batches", "1", "--accept-lens", "0"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_csv(out)
    assert rows and all(r["interpreter"] == "True" for r in rows)
