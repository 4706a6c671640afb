"""The eval and prune commands refuse bad flags and files in one `error:` line, exit status 2, before the model loads;
a second run on the same --out is refused while the first holds it."""
import pytest

from cli_helpers import TINY, assert_refused, run_cli
from mtp_lab.records import output_lock


@pytest.mark.parametrize("args, words", [
    (["prune", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["prune", "--per-category", "0"], ["--per-category"]),
    (["prune", "--thresholds", "0.05,2"], ["--thresholds"]),
    (["eval", "--model", TINY, "--temperature", "0.7", "--top-p", "0"], ["top_p"]),
], ids=["prune-max-new-0", "prune-per-category-0", "prune-threshold-2", "eval-top-p-0"])
def test_bad_flags_are_one_line(tmp_path, args, words):
    assert_refused(run_cli(*args, "--out", tmp_path / "out"), *words)


@pytest.mark.parametrize("content, words", [
    (None, ["p.jsonl", "no such file"]),
    ('{"text": "a"}\n{"text": "b', ["p.jsonl:2", "torn"]),
    ('{"prompt": "a"}\n', ["p.jsonl:1", "text"]),
], ids=["missing", "torn", "no-text"])
def test_prune_refuses_a_bad_prompts_file(tmp_path, content, words):
    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_text(content)
    assert_refused(run_cli("prune", "--model", TINY, "--prompts", path, "--out", tmp_path / "out"), *words)


@pytest.mark.parametrize("command", ["prune", "eval"])
def test_a_second_run_on_the_same_out_is_refused(tmp_path, command):
    out = tmp_path / "out"
    with output_lock(str(out)):                                    # the first run, still going
        r = run_cli(command, "--model", TINY, "--out", out)
    assert_refused(r, "another run", str(out))
