"""Results CSVs that survive a torn last row and concurrent writers (mtp_lab.records.append_rows / read_rows):
a row cut mid-line (kill -9, a power loss) is never read back as a finished row nor padded into one, and two
processes appending to one CSV, one of them growing the header, lose no row of either."""
import os
import subprocess
import sys
import textwrap

from bench_helpers import child_env, read_csv

from mtp_lab import records


def whole_file(path, n=3):
    records.append_rows(path, [dict(i=k, name=f"row {k}", value=k / 2) for k in range(n)])
    return path.read_bytes()


# ---- torn rows ----
def test_a_row_cut_mid_line_is_not_read_back(tmp_path):
    path = tmp_path / "r.csv"
    data = whole_file(path)
    path.write_bytes(data[:-6])                                       # the last row, cut as a kill -9 leaves it
    rows, torn = records.read_whole_rows(path)
    assert [r["i"] for r in rows] == ["0", "1"] and torn == 1
    assert records.read_rows(path) == rows


def test_appending_after_a_torn_row_drops_it_and_says_so(tmp_path, capsys):
    path = tmp_path / "r.csv"
    data = whole_file(path)
    path.write_bytes(data[:-6])
    records.append_rows(path, [dict(i=9, name="new", value=1.0)])
    assert read_csv(path) == [dict(i="0", name="row 0", value="0.0"), dict(i="1", name="row 1", value="0.5"),
                              dict(i="9", name="new", value="1.0")]         # not a padded '2,row 2,' row
    assert "dropped 1 torn row" in capsys.readouterr().err
    assert records.read_whole_rows(path)[1] == 0


def test_a_torn_row_is_dropped_when_the_header_grows_too(tmp_path, capsys):
    path = tmp_path / "r.csv"
    data = whole_file(path)
    path.write_bytes(data[:-6])
    records.append_rows(path, [dict(i=9, extra="x")])
    assert [r["i"] for r in read_csv(path)] == ["0", "1", "9"] and "dropped 1 torn row" in capsys.readouterr().err


def test_a_last_row_without_a_line_end_is_torn(tmp_path):
    """append_rows ends every row with a line end, so a last row without one was cut mid-write, even when it still
    has every field (a cut inside its last field: "b" of "bc"): it is left out and counted as torn."""
    path = tmp_path / "r.csv"
    path.write_bytes(b"i,name\r\n0,a\r\n\r\n1,b")
    assert records.read_whole_rows(path) == ([dict(i="0", name="a")], 1)


def test_resume_rows_reports_the_torn_rows(tmp_path):
    path = tmp_path / "r.csv"
    data = whole_file(path)
    path.write_bytes(data[:-6])
    said = []
    assert [r["i"] for r in records.resume_rows(path, said.append)] == ["0", "1"]
    assert len(said) == 1 and "1 torn row" in said[0] and str(path) in said[0] and "again" in said[0]
    assert records.resume_rows(tmp_path / "missing.csv", said.append) == [] and len(said) == 1


def test_kept_rows_reuse_whole_units_only():
    kept = records.KeptRows([dict(k="a", v="1"), dict(k="b", v="2"), dict(k="a", v="3")], key=lambda r: r["k"])
    assert kept.take("a") == [dict(k="a", v="3")]                     # a later row of the same key wins
    assert kept.take("a", "c") is None and kept.take() is None        # a unit is reused whole, or run again
    assert kept.used == 1


# ---- two writers on one CSV ----
WRITER = textwrap.dedent(r"""
    import sys
    from mtp_lab.records import append_rows
    path, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    for k in range(n):
        extra = {f"{who}{k}": "z"} if who == "B" else {}          # B grows the header with every batch
        append_rows(path, [dict(who=who, k=k, pad="p" * 200, **extra)])
""")


def test_two_writers_lose_no_rows(tmp_path):
    """Writer A appends 300 rows one by one while writer B adds 40 columns (each a rewrite of the whole file):
    every row of both is there, once."""
    path = tmp_path / "r.csv"
    records.append_rows(path, [dict(who="start", k=0, pad="")])
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), who, str(n)], env=child_env(),
                              stderr=subprocess.PIPE, text=True) for who, n in (("A", 300), ("B", 40))]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    rows = read_csv(path)
    assert all(None not in r and None not in r.values() for r in rows), "a torn row"
    got = sorted((r["who"], int(r["k"])) for r in rows if r["who"] != "start")
    assert got == sorted([("A", k) for k in range(300)] + [("B", k) for k in range(40)])
    assert [f for f in os.listdir(tmp_path) if f != "r.csv"] == []          # no lock or temporary file left


# ---- provenance ----
def test_git_commit_names_this_checkout_or_a_declared_commit(monkeypatch):
    monkeypatch.delenv("MTP_TRITON_COMMIT", raising=False)
    own = records.git_commit()
    assert "declared" not in own                                        # this checkout's own (or "unknown")
    monkeypatch.setenv("MTP_TRITON_COMMIT", "06fede6")                  # a copy whose .git is not its own
    assert records.git_commit() == "06fede6 (declared)"
    assert records.env_info()["commit"] == "06fede6 (declared)"


def test_a_child_process_limit_guards_a_hang_not_a_slow_machine(monkeypatch):
    """The subprocess limits of the CLI, audit and GPU-script tests are hang guards scaled for slow or shared machines
    (a suite run 8x slower than usual failed two tests on their own clocks before)."""
    from cli_helpers import hang_guard
    monkeypatch.delenv("MTP_TEST_TIME_SCALE", raising=False)
    assert hang_guard(300) == 1200
    monkeypatch.setenv("MTP_TEST_TIME_SCALE", "10")
    assert hang_guard(600) == 6000
