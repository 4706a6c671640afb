"""Bad input to `train_heads` and `aot` gets one `error:` line and exit status 2, before any model loads or any
kernel compiles; and every file the training, aot and card code writes is written atomically (a full disk leaves
the previous file byte-identical)."""
import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from cli_helpers import ROOT, TINY, assert_refused, run_cli

HELDOUT_CHAT = os.path.join(ROOT, "data", "chat", "heldout_chat.jsonl")


def _frozen(tmp_path, *extra):
    """`train_heads frozen` on a model folder that does not exist: input checks must refuse before it is read."""
    return run_cli("train_heads", "frozen", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "out"),
                   *extra, timeout=120)


# ---- numeric flags (issue item 10) ----------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [("--steps", "-3"), ("--steps", "0"), ("--batch", "0")])
def test_train_heads_refuses_bad_numbers(tmp_path, flag, value):
    assert_refused(_frozen(tmp_path, flag, value), flag, value)


def _numeric_actions(parser, where):
    """(where, option, action) of every option of `parser` (and its subcommands) that takes a number."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _numeric_actions(sub, f"{where} {name}")
        elif action.option_strings and action.nargs in (None, "?") and action.const is None and (
                action.type in (int, float) or (isinstance(action.default, (int, float))
                                                and not isinstance(action.default, bool))):
            yield where, action.option_strings[0], action


def test_every_numeric_flag_has_a_checked_type():
    """No number is parsed by bare int() / float(): each flag says what range it takes (cli.int_at_least /
    cli.float_in), so `--steps -3`, `--batch 0` or `--lr nan` never reach the recipe."""
    from mtp_lab import aot, train_heads
    found = list(_numeric_actions(train_heads.build_parser(), "train_heads")) + list(
        _numeric_actions(aot.build_parser(), "aot"))
    assert len(found) > 40
    unchecked = [f"{where} {opt}" for where, opt, a in found if a.type in (None, int, float)]
    assert not unchecked, unchecked
    for where, opt, a in found:                     # a default must pass its own check
        assert a.default is None or a.type(str(a.default)) == a.default, (where, opt)


def test_relations_between_flags_are_checked_before_the_model_loads(tmp_path):
    r = _frozen(tmp_path, "--self-generated", "4", "--prompt-len", "64", "--seq-len", "32")
    assert_refused(r, "--prompt-len", "--seq-len")


# ---- bad --data files (issue item 11) -------------------------------------------------------------------------
def _write(path, data):
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("name, data, words", [
    ("torn.jsonl", b'{"text": "def f(): pass"}\n{"text": "def g(): ret', ["torn.jsonl:2", "JSON", "torn"]),
    ("notext.jsonl", b'{"text": "a"}\n{"body": "b"}\n', ["notext.jsonl:2", "text"]),
    ("latin1.txt", b"def f():\n    return '\xe9'\n", ["latin1.txt", "UTF-8"]),
    ("missing.jsonl", None, ["missing.jsonl", "--data"]),
])
def test_train_heads_refuses_bad_data_files(tmp_path, name, data, words):
    path = _write(tmp_path / name, data) if data is not None else str(tmp_path / name)
    good = _write(tmp_path / "good.jsonl", b'{"text": "x = 1"}\n{"text": "y = 2"}\n')
    assert_refused(_frozen(tmp_path, "--data", good, path), *words)


# ---- retree's held-out guard (issue items 7 and 11) -----------------------------------------------------------
def test_retree_refuses_a_copy_of_the_heldout_prompts_before_the_model_loads(tmp_path):
    """Three held-out chat prompts copied into another file (re-spaced, re-cased, new ids): the tree must not be
    chosen on them. The refusal names both files and comes before the model is read (it does not exist here)."""
    rows = [json.loads(line) for line in open(HELDOUT_CHAT, encoding="utf-8")][:3]
    hc = tmp_path / "hc.jsonl"
    hc.write_text("".join(json.dumps(dict(r, id=f"copy{i}", text="  " + r["text"].upper().replace(" ", "\n  ")))
                          + "\n" for i, r in enumerate(rows)) + json.dumps(dict(id="mine", text="hello")) + "\n")
    r = run_cli("train_heads", "retree", "--model", str(tmp_path / "no-model"), "--heads", os.path.join(TINY, "heads"),
                "--tune", str(hc), "--report", str(hc), "--never-tune", HELDOUT_CHAT, "--work", str(tmp_path / "w"),
                timeout=120)
    line = assert_refused(r, "hc.jsonl", "heldout_chat.jsonl", "3 prompt")
    assert rows[0]["id"] in line


# ---- aot --out (issue item 11) --------------------------------------------------------------------------------
def test_aot_refuses_an_existing_file_as_out_before_compiling(tmp_path):
    out = tmp_path / "aot-out"
    out.write_text("not a folder\n")
    r = run_cli("aot", "--quick", "--out", str(out), timeout=60)      # compiling takes longer than the limit
    assert_refused(r, "--out", "aot-out")
    assert "[aot]" not in r.stdout and out.read_text() == "not a folder\n"


# ---- atomic writes (issue item 1) -----------------------------------------------------------------------------
OWNED = ["mtp_lab/train_heads.py", "mtp_lab/corpus.py", "scripts/render_readme_results.py",
         "data/smollm2-135m-instruct-heads/make_card.py", "data/smollm2-135m-instruct-mtp/make_card.py",
         "data/smollm2-135m-instruct-eagle3/make_card.py",
         "data/tiny-stdlib-llama/make_card.py",
         "data/chat/make_prompts.py", "data/scenarios/make_scenarios.py"] + [
    f"mtp_lab/{d}/{f}" for d in ("training", "aot") for f in sorted(os.listdir(os.path.join(ROOT, "mtp_lab", d)))
    if f.endswith(".py")]
# open(..., "w"/"wb"/"x"), torch.save(, json.dump( and savefig(path) straight to a file (savefig into a buffer names
# its format=); transformers' save_pretrained of a model folder is the library's own
NON_ATOMIC = re.compile(r"""open\([^)]*["'](?:w|wb|x|xb|w\+)["']|torch\.save\(|json\.dump\(|\.savefig\((?![^)]*format=)""")
# files written on purpose another way: tool inputs in a temporary folder (cubin.py); append-only JSONL logs whose
# torn last line a rerun cuts off and redoes (answers.py, self_prompts.py append through records.open_log)
ALLOWED = {"mtp_lab/aot/cubin.py": 2}


def test_outputs_go_through_the_one_atomic_writer():
    """Every file these modules write goes through mtp_lab.records (temporary file, fsync, os.replace)."""
    found = {}
    for rel in OWNED:
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            hits = [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(f, 1) if NON_ATOMIC.search(line)]
        if len(hits) != ALLOWED.get(rel, 0):
            found[rel] = hits
    assert not found, found


WRITERS = r'''
import json, os, sys, torch
from mtp_lab.aot import report
from mtp_lab.training import loop, retree
from mtp_triton.tree import Tree
d = sys.argv[1]
def curve(folder):
    rec = loop.Recorder(folder, "run")
    for i in range(200):
        rec.log(step=i, loss=1.0 / (i + 1), note="x" * 40)
    rec.write()


big = [dict(budget=i, nodes=i + 1, choices=[[0]] * 40, tau_simulated=1.0) for i in range(60)]
jobs = {
    "heads/heads.json": lambda p: retree.store_tree(os.path.dirname(p), Tree.from_choices([(0,), (1,)]), big),
    "rec/run_curve.csv": lambda p: curve(os.path.dirname(p)),
    "rec/run_curve.png": lambda p: loop.plot_curve([dict(step=i, loss=1.0 / (i + 1)) for i in range(50)], p, "t"),
    "ckpt.pt": lambda p: loop.Loop([torch.nn.Parameter(torch.zeros(4096))], loop.LoopConfig(steps=1, checkpoint=p)
                                   ).save(),
    "aot/aot.csv": lambda p: report.write_csv(p, [dict(target="sm_90", kernel="k" * 50)] * 100, {}),
}
for name, job in jobs.items():
    try:
        job(os.path.join(d, name))
        print(name, "written")
    except (OSError, RuntimeError) as e:        # torch.save straight to a file fails with a RuntimeError
        print(name, "refused:", type(e).__name__, e)
'''


def test_a_full_disk_leaves_every_previous_file_byte_identical(tmp_path):
    """Under `ulimit -f 3` (3 KiB) every writer fails; each previous file must be exactly as it was (a plain
    open(path, "w") would leave a 3,072-byte torn file, and load_heads would then fail on it)."""
    names = ["heads/heads.json", "rec/run_curve.csv", "rec/run_curve.png", "ckpt.pt", "aot/aot.csv"]
    before = {}
    for n in names:
        (tmp_path / n).parent.mkdir(exist_ok=True)
        before[n] = json.dumps({"previous": n}).encode() + b"\n"        # heads.json is read before it is rewritten
        (tmp_path / n).write_bytes(before[n])
    script = tmp_path / "writers.py"
    script.write_text(WRITERS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(["bash", "-c", f'ulimit -f 3; exec "{sys.executable}" "{script}" "{tmp_path}"'], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(f"{n} refused" in r.stdout for n in names), r.stdout + r.stderr[-2000:]
    for n in names:
        assert (tmp_path / n).read_bytes() == before[n], n
    left = [f for d in ("", "rec", "heads", "aot") for f in os.listdir(tmp_path / d) if f.endswith(".tmp")]
    assert not left, left
