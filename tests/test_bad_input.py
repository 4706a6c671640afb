"""Bad input gets a clear error, never a silently wrong result: generate()'s arguments and the text CLI."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import mtp_triton as mt
from hf_models import make_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "data", "tiny-stdlib-llama")


@pytest.fixture(scope="module")
def model():
    return mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"))


@pytest.mark.parametrize("t", [float("nan"), float("inf"), -0.5, "0.7", None])
def test_non_finite_or_negative_temperature_is_refused(model, t):
    with pytest.raises(ValueError, match="temperature"):
        mt.generate(model, [[1, 2, 3]], 4, temperature=t)


@pytest.mark.parametrize("t", [1e-45, 1e-30, 1e-8])
def test_tiny_temperature_is_its_limit_not_nan(model, t):
    """A temperature too small to resolve the logits samples the argmax (ties aside), instead of NaN -> id V-1."""
    greedy = mt.generate(model, [[5, 17, 33]], 12, mtp=False).tokens
    assert mt.generate(model, [[5, 17, 33]], 12, mtp=False, temperature=t, seed=0).tokens == greedy


def test_top_p_out_of_range_is_refused(model):
    for p in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="top_p"):
            mt.generate(model, [[1, 2, 3]], 4, temperature=0.8, top_p=p)


def test_eos_token_id_forms(model):
    free = mt.generate(model, [[5, 17, 33]], 24, mtp=False).tokens[0]
    eos = free[5]
    want = free[:free.index(eos) + 1]
    for form in (eos, [eos], (eos,), torch.tensor(eos), torch.tensor([eos]), np.int64(eos), [eos, 202],
                 torch.tensor([202, eos], dtype=torch.int32)):
        assert mt.generate(model, [[5, 17, 33]], 24, mtp=False, eos_token_id=form).tokens[0] == want, form


@pytest.mark.parametrize("bad", ["2", 2.0, [2.5], torch.tensor([1.0]), True, [True], 203, [-1]])
def test_bad_eos_token_id_is_refused(model, bad):
    with pytest.raises(ValueError, match="eos_token_id"):
        mt.generate(model, [[1, 2, 3]], 4, eos_token_id=bad)


def _cli(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "mtp_lab", "generate", "--model", TINY, *args], cwd=ROOT,
                          capture_output=True, timeout=300, env=env)


def test_cli_refuses_nan_temperature_with_one_line():
    r = _cli("--prompt", "def f(", "--temperature", "nan", "--max-new-tokens", "4")
    err = r.stderr.decode()
    assert r.returncode == 2 and "error:" in err and "temperature" in err and "Traceback" not in err


def test_cli_refuses_invalid_utf8_prompt():
    r = _cli("--prompt", b"def \xff(", "--max-new-tokens", "4")
    err = r.stderr.decode()
    assert r.returncode == 2 and "UTF-8" in err and "Traceback" not in err


def test_cli_reports_a_missing_model_without_traceback():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "mtp_lab", "generate", "--model", "/no/such/model", "--prompt", "x"],
                       cwd=ROOT, capture_output=True, timeout=300, env=env)
    err = r.stderr.decode()
    assert r.returncode == 2 and "error:" in err and "Traceback" not in err


def test_cli_generates_and_keeps_the_tuning_table_off_stdout():
    r = _cli("--prompt", "def quicksort(", "--max-new-tokens", "8", "--tree", "auto")
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert "budget" not in r.stdout.decode() and "budget" in r.stderr.decode()


# ---- the rest of what a hostile user found: temperature, seed, eos ids, runtime settings, block size ----------
@pytest.mark.parametrize("t", [1e-46, 1e-300, 5e-324])
def test_temperature_that_is_zero_in_float32_is_still_the_argmax(t):
    """Below fp32's smallest normal number the temperature would be 0 there (0 / 0 = NaN at the argmax)."""
    from mtp_triton.sampling import logits_to_probs
    logits = torch.randn(5, 37, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits, t)
    assert probs.dtype == torch.float32 and torch.isfinite(probs).all()
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.max(-1).values, torch.ones(5))


@pytest.fixture(scope="module")
def tiny():
    return mt.load_model(TINY, dtype=torch.float32), mt.load_heads(os.path.join(TINY, "heads"))


@pytest.mark.parametrize("mtp", [False, True], ids=["serial", "mtp"])
def test_tiny_model_at_temperature_1e_46_is_greedy(tiny, mtp):
    model, heads = tiny
    greedy = mt.generate(model, [[5, 6, 7, 8]], 12, heads=heads, mtp=mtp).tokens
    assert mt.generate(model, [[5, 6, 7, 8]], 12, heads=heads, mtp=mtp, temperature=1e-46, seed=0).tokens == greedy


@pytest.mark.parametrize("bad", [2 ** 64, -1, 1.5, "1", True, [1], torch.tensor(1.0)],
                         ids=["2**64", "negative", "float", "str", "bool", "list", "float-tensor"])
def test_bad_seed_is_refused(model, bad):
    with pytest.raises(ValueError, match="seed"):
        mt.generate(model, [[1, 2, 3]], 4, temperature=0.8, seed=bad)


@pytest.mark.parametrize("form", [np.int64(3), np.uint8(3), torch.tensor(3)], ids=["np.int64", "np.uint8", "tensor"])
def test_integer_like_seeds_are_the_int(model, form):
    want = mt.generate(model, [[5, 17, 33]], 8, temperature=0.9, seed=3, mtp=False).tokens
    assert mt.generate(model, [[5, 17, 33]], 8, temperature=0.9, seed=form, mtp=False).tokens == want


def test_numpy_eos_ids_work_like_a_list(model):
    free = mt.generate(model, [[5, 17, 33]], 24, mtp=False).tokens[0]
    eos = free[5]
    want = free[:free.index(eos) + 1]
    for form in (np.array([eos]), np.array([202, eos], dtype=np.int32), np.array(eos)):
        assert mt.generate(model, [[5, 17, 33]], 24, mtp=False, eos_token_id=form).tokens[0] == want
    with pytest.raises(ValueError, match="eos_token_id"):
        mt.generate(model, [[5, 17, 33]], 4, eos_token_id=np.array([1.0]))


@pytest.mark.parametrize("kw", [dict(fallback_steps="3"), dict(fallback_steps=1.5), dict(fallback_window=0),
                                dict(fallback_window=True), dict(fallback_steps=-1),
                                dict(fallback_deficit=float("nan")), dict(fallback_threshold=1.5),
                                dict(fallback_threshold="0.2")],
                         ids=lambda kw: "-".join(f"{k}={v!r}" for k, v in kw.items()))
def test_runtime_config_names_the_bad_field(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        mt.RuntimeConfig(**kw)


def test_runtime_as_a_dict(model):
    want = mt.generate(model, [[5, 17, 33]], 8, mtp=False, runtime=mt.RuntimeConfig(fallback_steps=2)).tokens
    assert mt.generate(model, [[5, 17, 33]], 8, mtp=False, runtime={"fallback_steps": 2}).tokens == want
    with pytest.raises(ValueError, match="fallback_step"):
        mt.generate(model, [[5, 17, 33]], 8, mtp=False, runtime={"fallback_step": 2})
    with pytest.raises(ValueError, match="runtime must be"):
        mt.generate(model, [[5, 17, 33]], 8, mtp=False, runtime="fallback_steps=2")


@pytest.mark.parametrize("bad", [2.5, 0, True, "16"])
def test_bad_block_size_is_refused(model, bad):
    with pytest.raises(ValueError, match="block_size"):
        mt.generate(model, [[1, 2, 3]], 4, block_size=bad)


def test_heads_of_another_hidden_size_are_refused_by_name(tmp_path):
    from mtp_lab.bundle import load_bundle
    D = mt.load_model(TINY).config.hidden_size
    mt.MTPHeads(2, D + 8).save(str(tmp_path / "heads"))
    with pytest.raises(ValueError, match="hidden state of size"):
        load_bundle(TINY, str(tmp_path / "heads"))


# ---- the demo and generate commands: one error: line, exit status 2, before the model loads ---------------
from cli_helpers import assert_refused, run_cli  # noqa: E402


@pytest.mark.parametrize("args, words", [
    (["demo", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["demo", "--per-category", "0"], ["--per-category"]),
    (["demo", "--tree", "bogus"], ["bogus"]),
    (["demo", "--prune-below", "0"], ["--prune-below"]),
    (["generate", "--model", TINY, "--prompt", "x", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["generate", "--model", TINY, "--prompt", "x", "--seed", str(2 ** 64)], ["seed"]),
    (["generate", "--model", TINY, "--prompt", "x", "--temperature", "0.7", "--top-p", "0"], ["top_p"]),
], ids=["demo-max-new-0", "demo-per-category-0", "demo-tree-bogus", "demo-prune-0", "generate-max-new-0",
        "generate-seed-2**64", "generate-top-p-0"])
def test_demo_and_generate_refuse_bad_flags(args, words):
    assert_refused(run_cli(*args), *words)


@pytest.mark.parametrize("content, words", [
    (None, ["prompts.jsonl", "no such file"]),
    ('{"text": "a"}\n{"text": "b', ["prompts.jsonl:2", "torn"]),
    ('{"prompt": "a"}\n', ["prompts.jsonl:1", "text"]),
    (b'{"text": "\xff"}\n', ["UTF-8"]),
], ids=["missing", "torn", "no-text", "not-utf8"])
def test_demo_refuses_a_bad_prompts_file(tmp_path, content, words):
    path = tmp_path / "prompts.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert_refused(run_cli("demo", "--model", TINY, "--prompts", path, "--out", tmp_path / "out"), *words)


def test_cli_tiny_temperature_prints_the_greedy_text():
    greedy = run_cli("generate", "--model", TINY, "--prompt", "def f(", "--max-new-tokens", "6")
    tiny = run_cli("generate", "--model", TINY, "--prompt", "def f(", "--max-new-tokens", "6", "--temperature",
                   "1e-46", "--seed", "0")
    assert greedy.returncode == tiny.returncode == 0, tiny.stderr[-2000:]
    assert tiny.stdout == greedy.stdout


def test_cli_one_token_output_says_tau_is_not_available():
    r = run_cli("generate", "--model", TINY, "--prompt", "def f(", "--max-new-tokens", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tau n/a" in r.stderr and "nan" not in r.stderr
