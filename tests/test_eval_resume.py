"""No lost results in `python -m mtp_lab eval`: rows are written as requests finish, so a real SIGINT or a full
disk (`ulimit -f`) leaves the earlier results byte for byte and keeps the finished requests; --resume skips them;
a bad --out, a broken checkpoint or a bad count fails at once with one `error:` line.

The embedded model (data/tiny-stdlib-llama) at --quick sizes, one or two scenario sets: a few seconds a run."""
import csv
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from bench_helpers import EMBEDDED, ROOT, child_env, default_sigint, read_csv

from mtp_lab.__main__ import main as cli
from mtp_lab.bench import eval_harness
from mtp_lab.bench import evaluate as ev

QUICK = ["--model", EMBEDDED, "--quick", "--scenarios", "short_completion", "--no-edge", "--no-progress"]


def assert_whole_rows(path, before):
    """The file still starts with `before`, byte for byte, and every row after it is complete."""
    data = open(path, "rb").read()
    assert data.startswith(before)
    rows = read_csv(path)
    assert all(None not in r and None not in r.values() for r in rows), "a torn row"
    assert data.endswith(b"\r\n")
    return rows


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """An out folder holding the results of an earlier, complete run (A/B, long run, compatibility)."""
    out = str(tmp_path_factory.mktemp("earlier"))
    assert cli(["eval", *QUICK, "--long-run", "20", "--out", out]) == 0
    return out


def copy_of(earlier, tmp_path):
    out = str(tmp_path / "out")
    shutil.copytree(earlier, out)
    return out, open(os.path.join(out, "eval.csv"), "rb").read()


# ---- interrupted runs keep what they finished ----
def test_sigint_during_a_long_run_keeps_the_finished_requests(earlier, tmp_path):
    out, before = copy_of(earlier, tmp_path)
    csv_path = os.path.join(out, "eval.csv")
    n_before = len(read_csv(csv_path))
    p = subprocess.Popen([sys.executable, "-m", "mtp_lab", "eval", *QUICK, "--long-run", "1000000", "--out", out],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT,
                         preexec_fn=default_sigint)
    try:
        seen, deadline = 0, time.time() + 600          # generous: a slow, busy CPU
        while seen < 3 and time.time() < deadline and p.poll() is None:      # wait for 3 finished long-run requests
            time.sleep(0.2)
            seen = sum(r["section"] == "long_run" for r in read_csv(csv_path)[n_before:])
        assert seen >= 3, "no long-run rows appeared while the run was going"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130 and "interrupted" in err and "--resume" in err and "Traceback" not in err, err
    new = assert_whole_rows(csv_path, before)[n_before:]
    assert sum(r["section"] == "long_run" for r in new) >= seen
    ab = [r for r in new if r["section"] == "ab"]
    assert len(ab) == 4 and {r["mode"] for r in ab} == {"off", "on"}        # 2 items, both modes, all kept

    # --resume with the tokens the interrupted run finished: nothing runs again, one summary row is added
    done = [r for r in new if r["section"] == "long_run"]
    tokens = sum(max(int(r["new_tokens"]), 1) for r in done)
    assert cli(["eval", *QUICK, "--long-run", str(tokens), "--out", out, "--resume"]) == 0
    added = read_csv(csv_path)[n_before + len(new):]
    assert [r["section"] for r in added] == ["long_summary"]
    assert int(added[0]["requests"]) == len(done)
    assert "rows kept from earlier runs" in open(os.path.join(out, "report.md")).read()


def test_full_disk_keeps_the_earlier_results_byte_identical(earlier, tmp_path):
    """A file-size limit a little above eval.csv: the run stops with one error line; the earlier bytes stay and the
    rows of the requests that fit are there, whole."""
    out, before = copy_of(earlier, tmp_path)
    csv_path = os.path.join(out, "eval.csv")
    n_before = len(read_csv(csv_path))
    per_row = len(before) / (n_before + 1)
    blocks = -int(-(len(before) + 2.5 * per_row) // 1024)                   # room for one A/B pair, maybe two

    cmd = [sys.executable, "-m", "mtp_lab", "eval", *QUICK, "--long-run", "400", "--out", out]
    p = subprocess.run(["bash", "-c", f"ulimit -f {blocks} && exec \"$@\"", "bash", *cmd], capture_output=True,
                       text=True, env=child_env(), cwd=ROOT, timeout=300)
    assert p.returncode == 2 and "File too large" in p.stderr and "--resume" in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and sum(line.startswith("error:") for line in p.stderr.splitlines()) == 1
    new = assert_whole_rows(csv_path, before)[n_before:]
    assert len(new) >= 2 and sum(r["section"] == "ab" for r in new) % 2 == 0             # whole requests
    assert os.path.getsize(csv_path) <= blocks * 1024


def test_resume_runs_only_the_unfinished_requests(tmp_path, monkeypatch):
    """Ctrl-C on the 7th generate call (warm-up 2, then 2 per A/B item: the 3rd item); --resume then runs the 3rd
    and 4th items, not the first two; in the end every request has exactly one row."""
    out = str(tmp_path / "out")
    args = ["eval", *QUICK, "--scenarios", "short_completion", "repl_dialogue", "--out", out]
    real, calls = eval_harness.generate, []

    def interrupt_at(n):
        def gen(*a, **kw):
            calls.append(kw.get("mtp"))
            if len(calls) == n:
                raise KeyboardInterrupt
            return real(*a, **kw)
        return gen
    monkeypatch.setattr(eval_harness, "generate", interrupt_at(7))
    try:
        assert cli(args) == 130
    except KeyboardInterrupt:                                             # would stop pytest itself
        pytest.fail("main() let the KeyboardInterrupt through instead of keeping the rows and exiting 130")
    first = read_csv(os.path.join(out, "eval.csv"))
    assert [(r["scenario"], r["mode"]) for r in first] == [("short_completion", "off"), ("short_completion", "on")] * 2

    calls.clear()
    monkeypatch.setattr(eval_harness, "generate", interrupt_at(0))       # count only
    assert cli(args + ["--resume"]) == 0
    rows = read_csv(os.path.join(out, "eval.csv"))
    ab = [r for r in rows if r["section"] == "ab"]
    keys = [(r["scenario"], r["item"], r["mode"]) for r in ab]
    assert len(keys) == len(set(keys)) == 8                               # 2 sets x 2 items x 2 modes, once each
    assert len({r["run_id"] for r in ab[:4]}) == 1 and ab[0]["run_id"] != ab[-1]["run_id"]
    assert len(calls) == 2 + 2 * 2 + 5                                    # warm-up, 2 items, compat (4 + batch)
    assert [r["section"] for r in rows].count("compat") == 1


def test_resume_after_a_torn_last_row_runs_its_request_again(earlier, tmp_path, capsys):
    """kill -9 in the middle of a row: the last row of eval.csv is cut mid-line. --resume leaves it out and says so,
    runs its request again (both modes), and leaves whole rows only; so does every later --resume."""
    out, before = copy_of(earlier, tmp_path)
    path = os.path.join(out, "eval.csv")
    lines = before.split(b"\r\n")
    last_ab = max(i for i, r in enumerate(read_csv(path)) if r["section"] == "ab") + 1       # line 0: the header
    with open(path, "wb") as f:                           # the rows up to the last A/B row, which is cut mid-line
        f.write(b"\r\n".join(lines[:last_ab]) + b"\r\n" + lines[last_ab][: len(lines[last_ab]) // 2])
    args = ["eval", *QUICK, "--long-run", "20", "--out", out, "--resume"]
    assert cli(args) == 0
    assert "1 torn row(s) in" in capsys.readouterr().err
    rows = assert_whole_rows(path, b"\r\n".join(lines[:last_ab]) + b"\r\n")
    ab = [(r["item"], r["mode"]) for r in rows if r["section"] == "ab"]
    assert len(ab) == 5 and len(set(ab)) == 4             # 3 kept rows, the cut item's pair run again
    assert cli(args) == 0 and "torn" not in capsys.readouterr().err


def test_resume_of_a_finished_run_runs_nothing(earlier, tmp_path, monkeypatch):
    out, before = copy_of(earlier, tmp_path)
    calls = []
    monkeypatch.setattr(eval_harness, "generate", lambda *a, **kw: calls.append(1))
    assert cli(["eval", *QUICK, "--long-run", "20", "--out", out, "--resume"]) == 0
    assert calls == [] and open(os.path.join(out, "eval.csv"), "rb").read() == before
    assert "rows kept from earlier runs" in open(os.path.join(out, "report.md")).read()      # report.md redone


def test_resume_reports_the_failures_the_kept_rows_record(earlier, tmp_path, capsys):
    out, _ = copy_of(earlier, tmp_path)
    path = os.path.join(out, "eval.csv")
    rows = read_csv(path)
    for r in rows:
        if r["section"] == "ab":
            r["identical"], r["first_diff"] = "False", "3"                 # as a broken engine would have left them
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert cli(["eval", *QUICK, "--long-run", "20", "--out", out, "--resume"]) == 1
    err = capsys.readouterr().err
    assert "differs from serial at new token 3 (kept from an earlier run)" in err


def test_resume_key_changes_with_the_configuration(loaded_embedded):
    model, heads, tok = loaded_embedded
    a = eval_harness.config_id(ev.EvalConfig.quick(), model, heads)
    assert a == eval_harness.config_id(ev.EvalConfig.quick(), model, heads)
    for change in (dict(seed=1), dict(tree="chain-2"), dict(temperature=0.5), dict(max_new_cap=8)):
        assert eval_harness.config_id(ev.EvalConfig.quick(**change), model, heads) != a, change
    import torch
    w = next(heads.parameters()).view(-1)
    old = w[0].item()
    with torch.no_grad():
        w[0] += 1e-3
    try:
        assert eval_harness.config_id(ev.EvalConfig.quick(), model, heads) != a      # other weights, other key
    finally:
        with torch.no_grad():
            w[0] = old


@pytest.fixture(scope="module")
def loaded_embedded():
    import mtp_triton as mt
    model = mt.load_model(EMBEDDED)
    return model, mt.load_heads(os.path.join(EMBEDDED, "heads")), None


# ---- failing early and clearly ----
def test_unwritable_out_fails_before_any_compute(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ev, "load_bundle", lambda *a, **kw: pytest.fail("loaded a model"))   # what eval loads with
    taken = tmp_path / "taken"
    taken.write_text("a file")
    assert ev.main([*QUICK, "--out", str(taken / "eval")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write to the output folder") and len(err.splitlines()) == 1


def test_tables_unwritable_out_fails_before_any_compute(tmp_path, capsys, monkeypatch):
    from mtp_lab.bench import e2e, tables
    monkeypatch.setattr(e2e, "load_target", lambda *a, **kw: pytest.fail("measured something"))
    taken = tmp_path / "taken"
    taken.write_text("a file")
    assert tables.main(["--quick", "--out", str(taken / "t")]) == 2
    assert capsys.readouterr().err.startswith("error: cannot write to the output folder")


@pytest.mark.parametrize("damage", ["truncated-weights", "no-tokenizer", "bad-config"])
def test_broken_checkpoint_is_one_error_line(tmp_path, capsys, damage):
    d = tmp_path / "model"
    shutil.copytree(EMBEDDED, d, ignore=shutil.ignore_patterns("records", "heads_joint", "*.md", "*.py"))
    if damage == "truncated-weights":
        with open(d / "model.safetensors", "r+b") as f:
            f.truncate(3000)
    elif damage == "no-tokenizer":
        os.remove(d / "tokenizer.json")
        os.remove(d / "tokenizer_config.json")
    else:
        (d / "config.json").write_text("{ not json")
    assert ev.main(["--model", str(d), "--quick", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("flag,value", [("--max-prompts", "0"), ("--max-prompts", "-1"), ("--max-new-cap", "0"),
                                        ("--long-run", "-5")])
def test_counts_below_their_minimum_are_refused(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as e:                                  # argparse: usage + the reason, exit 2
        ev.main(["--model", str(tmp_path / "nowhere"), "--out", str(tmp_path), flag, value])
    assert e.value.code == 2
    assert f"argument {flag}: must be >= " in capsys.readouterr().err


def test_config_and_loader_refuse_counts_below_one():
    for kw in (dict(max_prompts=0), dict(max_prompts=-1), dict(max_new_cap=0), dict(long_run=-1),
               dict(sweep_prompts=0)):
        with pytest.raises(ValueError, match="must be >= "):
            ev.EvalConfig(**kw)
    with pytest.raises(ValueError, match="max_prompts must be >= 1"):
        ev.load_scenarios(("short_completion",), 0)
    assert len(ev.load_scenarios(("short_completion",), 1)["short_completion"]) == 1
