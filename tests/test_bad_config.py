"""Badly typed or out-of-range config values are refused by name, never read silently (a string "false" is not
True, a RoPE factor of 0 is not infinite frequencies); a truncated GGUF and a missing GPU get one clear line."""
import json
import os
import shutil

import pytest
import torch

import mtp_triton as mt
from cli_helpers import TINY, assert_refused, run_cli
from mtp_triton.config import config_from_hf, read_config
from mtp_triton.loading import packaged_file


def _cfg(**changes):
    d = read_config(TINY)
    d.update(changes)
    return d


@pytest.mark.parametrize("changes, words", [
    (dict(tie_word_embeddings="false"), ["tie_word_embeddings", "boolean"]),
    (dict(attention_bias=1), ["attention_bias"]),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0}), ["factor"]),
    (dict(rope_scaling={"rope_type": "linear", "factor": -2}), ["factor"]),
    (dict(rope_scaling={"rope_type": "linear", "factor": float("inf")}), ["factor"]),
    (dict(rope_parameters=[1, 2]), ["rope_parameters"]),
    (dict(rope_scaling="linear"), ["rope_scaling"]),
    (dict(model_type=["llama"]), ["model_type"]),
    (dict(rope_theta=0, rope_parameters={"rope_type": "default", "rope_theta": 0}), ["rope_theta"]),
    (dict(rms_norm_eps=-1e-6), ["rms_norm_eps"]),
], ids=["tie-string", "bias-int", "factor-0", "factor-neg", "factor-inf", "rope_parameters-list",
        "rope_scaling-string", "model_type-list", "theta-0", "eps-neg"])
def test_bad_config_field_is_refused_by_name(changes, words):
    with pytest.raises(ValueError) as e:
        config_from_hf(_cfg(**changes), source="config.json")
    for w in words + ["config.json"]:
        assert w in str(e.value)


def test_good_linear_rope_still_loads():
    assert config_from_hf(_cfg(rope_scaling={"rope_type": "linear", "factor": 2.0})).rope_scaling["factor"] == 2.0


@pytest.mark.parametrize("name, want", [("float32", torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16),
                                        (torch.float32, torch.float32)])
def test_dtype_names(name, want):
    assert mt.load_model(TINY, dtype=name).dtype == want


@pytest.mark.parametrize("bad", ["float33", torch.int64, 3])
def test_bad_dtype_is_refused(bad):
    with pytest.raises(ValueError, match="dtype"):
        mt.load_model(TINY, dtype=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_line():
    with pytest.raises(ValueError, match="CUDA is not available"):
        mt.load_model(TINY, device="cuda")
    assert_refused(run_cli("generate", "--model", TINY, "--prompt", "x", "--device", "cuda"), "CUDA is not available")


def test_cli_refuses_a_string_tie_flag(tmp_path):
    bad = tmp_path / "tiny"
    shutil.copytree(TINY, bad)            # with its heads: a model folder without them is refused for that first
    d = json.loads((bad / "config.json").read_text())
    d["tie_word_embeddings"] = "false"
    (bad / "config.json").write_text(json.dumps(d))
    assert_refused(run_cli("generate", "--model", bad, "--prompt", "x", "--no-mtp"), "config.json",
                   "tie_word_embeddings")


def test_truncated_gguf_is_one_line(tmp_path):
    try:
        real = packaged_file("smollm2-135m-instruct")
    except Exception as e:                                     # the registry package is not installed
        pytest.skip(f"no packaged GGUF: {e}")
    cut = tmp_path / "cut.gguf"
    with open(real, "rb") as f:
        cut.write_bytes(f.read(4096))
    with pytest.raises(ValueError, match="truncated"):
        mt.load_model(str(cut))
    assert_refused(run_cli("generate", "--model", cut, "--prompt", "x"), "cut.gguf", "truncated")
