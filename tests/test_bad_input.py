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
    return subprocess.run([sys.executable, "-m", "mtp_triton", "generate", "--model", TINY, *args], cwd=ROOT,
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
    r = subprocess.run([sys.executable, "-m", "mtp_triton", "generate", "--model", "/no/such/model", "--prompt", "x"],
                       cwd=ROOT, capture_output=True, timeout=300, env=env)
    err = r.stderr.decode()
    assert r.returncode == 2 and "error:" in err and "Traceback" not in err


def test_cli_generates_and_keeps_the_tuning_table_off_stdout():
    r = _cli("--prompt", "def quicksort(", "--max-new-tokens", "8", "--tree", "auto")
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert "budget" not in r.stdout.decode() and "budget" in r.stderr.decode()
