"""Hostile input to the lab: torn rows, unsafe pickles, contradictory or duplicated flags, bad scenario files."""
import os

import pytest

from mtp_lab import records


# ---- 1. a torn last row (no line end) is left out by every CSV reader, and by a rewrite ------------------------
def _torn_csv(tmp_path):
    path = str(tmp_path / "prune.csv")
    records.append_rows(path, [{"threshold": "0.1", "identical": "True"}, {"threshold": "0.2", "identical": "True"}])
    with open(path, "rb+") as f:
        f.truncate(os.path.getsize(path) - 3)                        # "True\r\n" -> "Tru"
    return path


def test_torn_last_row_without_line_end_is_left_out(tmp_path):
    path = _torn_csv(tmp_path)
    assert records.read_rows(path) == [{"threshold": "0.1", "identical": "True"}]
    assert records.read_whole_rows(path) == ([{"threshold": "0.1", "identical": "True"}], 1)
    notes = []
    assert records.resume_rows(path, log=notes.append) == [{"threshold": "0.1", "identical": "True"}]
    assert len(notes) == 1 and "1 torn row" in notes[0]


def test_rewrite_drops_a_torn_last_row(tmp_path):
    path = _torn_csv(tmp_path)
    assert records.append_rows(path, [{"threshold": "0.2", "identical": "True"}]) == 1
    assert records.read_whole_rows(path) == ([{"threshold": "0.1", "identical": "True"},
                                              {"threshold": "0.2", "identical": "True"}], 0)
    os.makedirs(tmp_path / "b")
    path2 = _torn_csv(tmp_path / "b")
    assert records.append_rows(path2, [{"threshold": "0.3", "identical": "False", "new": "x"}]) == 1   # header grows
    assert [r["threshold"] for r in records.read_rows(path2)] == ["0.1", "0.3"]


# ---- 2. a checkpoint or cache pickle that runs code is refused, without running it ------------------------------
class _Payload:
    marker = None

    def __reduce__(self):
        return (open, (self.marker, "w"))                             # would create the marker file when unpickled


def _malicious(tmp_path, name):
    import torch
    _Payload.marker = str(tmp_path / "PWNED")
    path = str(tmp_path / name)
    torch.save({"step": 1, "params": [_Payload()]}, path)
    return path


def test_load_torch_refuses_a_pickle_that_runs_code(tmp_path):
    path = _malicious(tmp_path, "cache.pt")
    with pytest.raises(ValueError, match="cache .*cache.pt.*refused"):
        records.load_torch(path, "cache")
    assert not os.path.exists(tmp_path / "PWNED")


def test_loop_checkpoint_round_trip_and_malicious_checkpoint(tmp_path):
    import torch
    from mtp_lab.training.loop import Loop, LoopConfig
    ckpt = str(tmp_path / "ckpt.pt")
    p = torch.nn.Parameter(torch.randn(3, 2))
    gen = torch.Generator().manual_seed(0)
    loop = Loop([p], LoopConfig(steps=4, checkpoint=ckpt, log_every=1, checkpoint_minutes=0),
                state=(gen.get_state, gen.set_state))

    def step_fn(step):
        loss = (p ** 2).sum()
        loss.backward()
        return {"loss": float(loss.detach())}
    loop.run(step_fn)
    again = Loop([torch.nn.Parameter(torch.zeros(3, 2))], LoopConfig(steps=4, checkpoint=ckpt),
                 state=(gen.get_state, gen.set_state))
    assert again.resume() == 4                                        # what the lab saves loads with weights_only
    _malicious(tmp_path, "ckpt.pt")
    with pytest.raises(ValueError, match="checkpoint .*ckpt.pt"):
        again.resume()
    assert not os.path.exists(tmp_path / "PWNED")


# ---- 3. contradictory or duplicated flags are refused before any work ---------------------------------------------
from cli_helpers import TINY, assert_refused, run_cli  # noqa: E402


def test_generate_refuses_heads_folder_of_the_other_kind():
    r = run_cli("generate", "--model", TINY, "--heads", os.path.join(TINY, "heads"), "--drafter", "mtp",
                "--prompt", "def f", "--max-new-tokens", "2", timeout=120)
    assert_refused(r, "--heads", "--drafter")


def test_prune_refuses_duplicate_thresholds(tmp_path):
    r = run_cli("prune", "--model", TINY, "--thresholds", "0.1,0.1", "--out", tmp_path / "p", timeout=120)
    assert_refused(r, "--thresholds", "0.1", "more than once")


def test_aot_refuses_a_baseline_that_is_not_an_audit(tmp_path):
    other = tmp_path / "other.csv"
    other.write_text("a,b\r\n1,2\r\n")
    r = run_cli("aot", "--out", tmp_path / "aot", "--baseline", other, timeout=120)
    line = assert_refused(r, "--baseline", "other.csv", "case", "kernel", "commit")
    assert not (tmp_path / "aot" / "aot.csv").exists(), line


# ---- 4. bad scenario and answers files: one error line with file:line and field, before the model loads -----------
def _eval(tmp_path, folder):
    return run_cli("eval", "--model", TINY, "--scenario-dir", folder, "--out", tmp_path / "out", "--quick",
                   timeout=120)


def test_eval_refuses_an_empty_scenario_folder(tmp_path):
    (tmp_path / "s").mkdir()
    assert_refused(_eval(tmp_path, tmp_path / "s"), "scenario folder", str(tmp_path / "s"), "no")


@pytest.mark.parametrize("line, words", [
    ('{"id": "a", "text": "def f", "max_new_tokens": 4}', ["length"]),
    ('{"id": "a", "length": "short", "max_new_tokens": 4}', ["text"]),
    ('{"id": "a", "length": "short", "text": "def f"}', ["max_new_tokens"]),
    ('{"id": "a", "length": "short", "text": "def f", "max_new_tokens": -5}', ["max_new_tokens", "-5"]),
    ('{"id": "a", "length": "short", "text": "def', ["not valid JSON"]),
])
def test_eval_refuses_bad_scenario_items(tmp_path, line, words):
    (tmp_path / "s").mkdir()
    good = '{"id": "g", "length": "short", "text": "def g", "max_new_tokens": 4}'
    (tmp_path / "s" / "mine.jsonl").write_text(good + "\n" + line + "\n")
    assert_refused(_eval(tmp_path, tmp_path / "s"), "mine.jsonl:2", *words)


def test_train_heads_mtp_refuses_answers_without_mode(tmp_path):
    answers = tmp_path / "answers.jsonl"
    answers.write_text('{"id": "a", "mode": "greedy", "prompt_ids": [1], "answer_ids": [2]}\n'
                       '{"id": "b", "prompt_ids": [1], "answer_ids": [2]}\n')
    r = run_cli("train_heads", "mtp", "--model", TINY, "--answers", answers, "--work", tmp_path / "w",
                "--out", tmp_path / "o", "--steps", "1", timeout=120)
    assert_refused(r, "answers.jsonl:2", "mode")


# ---- 5. an unwritable --out is refused before any model load ---------------------------------------------------------
def test_train_heads_refuse_an_unwritable_out_before_loading(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    answers = tmp_path / "answers.jsonl"
    answers.write_text('{"id": "a", "mode": "greedy", "prompt_ids": [1], "answer_ids": [2]}\n')
    missing_model = tmp_path / "no-model"                    # loading it would fail: the --out check must come first
    r = run_cli("train_heads", "mtp", "--model", missing_model, "--answers", answers, "--work", tmp_path / "w",
                "--out", blocker / "out", timeout=120)
    assert_refused(r, "output folder", "--out")
    r = run_cli("train_heads", "distill", "--model", missing_model, "--work", tmp_path / "w2",
                "--out", blocker / "out", timeout=120)
    assert_refused(r, "output folder", "--out")


def test_eval_refuses_a_negative_seed_at_parse_time(tmp_path):
    r = run_cli("eval", "--model", tmp_path / "no-model", "--seed", "-5", "--out", tmp_path / "o", timeout=120)
    assert_refused(r, "--seed", "-5")


@pytest.mark.parametrize("temperature, seed, fixed", [(1.0, 11, True), (1.0, None, False), (0.0, 11, False)])
def test_seeded_sampling_from_the_command_line_verifies_fixed_trees(monkeypatch, temperature, seed, fixed):
    """`generate --temperature T --seed S` gave other text on other runs: the CPU default sizes each step's tree by
    measured (timing-dependent) costs, and the random numbers follow the verified trees. With a seed, the command
    now verifies fixed trees (size_by_cost=False), so its samples depend on the seed alone."""
    from mtp_lab import demo

    seen = {}

    def fake_generate(model, prompts, n, **kw):
        seen.update(kw)
        raise ValueError("stop here")                  # the command turns it into one error line

    monkeypatch.setattr(demo, "generate", fake_generate)
    argv = ["--model", TINY, "--prompt", "def f", "--max-new-tokens", "2", "--temperature", str(temperature)]
    assert demo.text_generate(argv + (["--seed", str(seed)] if seed is not None else [])) == 2
    rt = seen["runtime"]
    assert (rt is not None and rt.size_by_cost is False) == fixed


def test_a_drafter_kind_the_model_does_not_ship_is_named_as_such(tmp_path):
    """--drafter mtp on the tiny model said 'load_heads: ... expected a folder with heads.safetensors'."""
    r = run_cli("generate", "--model", TINY, "--drafter", "mtp", "--prompt", "def f", "--max-new-tokens", "2",
                timeout=120)
    line = assert_refused(r, "ships no MTP module", "--drafter")
    assert "heads.safetensors" not in line


def test_no_mtp_needs_no_drafter(tmp_path):
    """`generate --no-mtp` on a model folder without a drafter decodes serially (it was refused for the missing heads,
    which it does not use)."""
    import shutil
    for f in os.listdir(TINY):
        if os.path.isfile(os.path.join(TINY, f)):
            shutil.copy(os.path.join(TINY, f), tmp_path / f)
    r = run_cli("generate", "--model", tmp_path, "--prompt", "def f(", "--raw", "--no-mtp", "--max-new-tokens", "4",
                timeout=120)
    assert r.returncode == 0 and "4 tokens" in r.stderr and "tau 1.00" in r.stderr, r.stderr[-2000:]
