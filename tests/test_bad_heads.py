"""Hostile heads checkpoints, heads.json files and trees: each is refused with a ValueError naming the file (and
field or tensor) and what is wrong; a failed save leaves the previous heads byte-identical; the default tree fits
heads of any depth.

The CLI cases run `python -m mtp_lab generate` on the tiny model with a bad --heads folder, and check for one
`error:` line and exit status 2 (tests/cli_helpers.py).
"""
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from cli_helpers import TINY, assert_refused, run_cli
from mtp_triton.heads import MTPHeads, load_heads
from mtp_triton.tree import PRESETS, Tree, get_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def saved_heads(folder, H=2, D=8, **kw):
    """A small heads folder (heads.safetensors + heads.json); returns its heads.json path."""
    heads = MTPHeads(H, D, **kw)
    with torch.no_grad():
        heads.res_weight.normal_(generator=torch.Generator().manual_seed(0))
    heads.save(str(folder))
    return os.path.join(str(folder), "heads.json")


def edit_meta(meta_file, **fields):
    with open(meta_file) as f:
        meta = json.load(f)
    with open(meta_file, "w") as f:
        json.dump(dict(meta, **fields), f)


# ---- trees: non-integer ranks, trees that are not lists of paths --------------------------------------------
@pytest.mark.parametrize("choices,match", [
    ([(0.7,), (1.9,)], "integer"),               # was truncated silently to ((0,), (1,))
    ([(0,), (0, 1.0)], "integer"),
    ([(True,)], "integer"),
    ([("0",)], "integer"),
    ([[None]], "integer"),
    (5, "list of paths"),
    (None, "list of paths"),
    ([0, 1], "tuple of ranks"),
], ids=["floats", "float-in-path", "bool", "string-rank", "null-rank", "int", "none", "flat-list"])
def test_tree_refuses_non_integer_ranks_and_non_lists(choices, match):
    with pytest.raises(ValueError, match=match):
        Tree.from_choices(choices)
    if choices is not None:                                         # (tree=None: the heads store no tree)
        with pytest.raises(ValueError, match=match):                # the heads' stored tree goes the same way
            MTPHeads(2, 8, tree=choices)


def test_tree_accepts_integer_likes():
    import numpy as np
    t = Tree.from_choices([(np.int64(0),), [torch.tensor(1)], (0, 0)])
    assert t.paths == ((), (0,), (1,), (0, 0)) and all(type(r) is int for p in t.paths for r in p)


@pytest.mark.parametrize("tree", [[[0.7], [1.9]], 5, [[None]], "medusa-16", {"0": [0]}],
                         ids=["float-ranks", "int", "null-rank", "string", "dict"])
def test_load_heads_refuses_a_bad_stored_tree(tmp_path, tree):
    edit_meta(saved_heads(tmp_path), tree=tree)
    with pytest.raises(ValueError, match=r"heads\.json.*tree"):
        load_heads(str(tmp_path))


# ---- heads.json: not a JSON object, not UTF-8, badly typed fields ----------------------------------------
@pytest.mark.parametrize("text,match", [
    (b"[1, 2]", "JSON object"), (b"null", "JSON object"), (b'"heads"', "JSON object"),
    (b'{"num_heads": 2, "note": "\xff\xfe"}', "UTF-8"), (b'{"num_heads": 2', "not valid JSON"),
], ids=["list", "null", "string", "not-utf8", "torn"])
def test_heads_json_must_be_an_object_in_utf8(tmp_path, text, match):
    meta_file = saved_heads(tmp_path)
    with open(meta_file, "wb") as f:
        f.write(text)
    with pytest.raises(ValueError, match=match) as e:
        load_heads(str(tmp_path))
    assert "heads.json" in str(e.value)


@pytest.mark.parametrize("field,value,match", [
    ("num_heads", "8", "num_heads must be an int"), ("num_heads", 2.0, "num_heads must be an int"),
    ("num_heads", True, "num_heads must be an int"), ("hidden_size", "8", "hidden_size must be an int"),
    ("token_inputs", "0", "token_inputs must be an int"), ("root_input", "false", "root_input must be true or false"),
    ("vocab_size", 99, "vocab_size 99"), ("draft_vocab_size", 3, "draft_vocab_size 3"),
], ids=["num_heads-str", "num_heads-float", "num_heads-bool", "hidden-str", "token_inputs-str", "root_input-str",
        "vocab-mismatch", "draft-vocab-mismatch"])
def test_heads_json_fields_are_typed_and_checked(tmp_path, field, value, match):
    edit_meta(saved_heads(tmp_path), **{field: value})
    with pytest.raises(ValueError, match=match) as e:
        load_heads(str(tmp_path))
    assert "heads.json" in str(e.value)


def test_num_heads_as_a_string_is_not_reported_as_a_mismatch(tmp_path):
    """It used to say 'says 8 heads of size 64, but ... holds 8 of size 64'."""
    edit_meta(saved_heads(tmp_path, H=3), num_heads="3")
    with pytest.raises(ValueError, match=r"num_heads must be an int, got '3' \(a str\)"):
        load_heads(str(tmp_path))


# ---- Medusa .pt / .safetensors files that are not what they claim -----------------------------------------
def test_empty_pt_names_the_file(tmp_path):
    f = tmp_path / "medusa_lm_head.pt"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match=r"medusa_lm_head\.pt.*empty"):
        load_heads(str(tmp_path))


def test_corrupted_pt_files_are_value_errors_naming_the_file(tmp_path):
    """Random bytes, truncations and flipped bytes of a real torch.save file: torch.load raises whatever it
    meets (IndexError, KeyError, UnpicklingError, RuntimeError, ...); load_heads turns each into a ValueError."""
    f = str(tmp_path / "medusa_lm_head.pt")
    torch.save({"0.0.linear.weight": torch.zeros(4, 4), "0.0.linear.bias": torch.zeros(4),
                "0.1.weight": torch.zeros(7, 4)}, f)
    with open(f, "rb") as fh:
        good = fh.read()
    rng = random.Random(0)
    for i in range(90):
        if i % 3 == 0:
            data = bytes(rng.randrange(256) for _ in range(rng.randint(1, 600)))
        elif i % 3 == 1:
            data = good[:rng.randint(1, len(good) - 1)]
        else:
            data = bytearray(good)
            for _ in range(5):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data)
        with open(f, "wb") as fh:
            fh.write(data)
        try:
            load_heads(f, check_finite=False)
        except ValueError as e:
            assert "medusa_lm_head.pt" in str(e), (i, str(e))


def test_medusa_heads_with_different_vocab_sizes(tmp_path):
    sd = {"0.0.linear.weight": torch.zeros(8, 8), "0.0.linear.bias": torch.zeros(8), "0.1.weight": torch.zeros(13, 8),
          "1.0.linear.weight": torch.zeros(8, 8), "1.0.linear.bias": torch.zeros(8), "1.1.weight": torch.zeros(11, 8)}
    save_file(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=r"medusa_lm_head\.safetensors: head 1 has 1\.weight \(11, 8\).*\(13, 8\)"):
        load_heads(str(tmp_path))
    sd["1.0.linear.weight"], sd["1.1.weight"] = torch.zeros(6, 6), torch.zeros(13, 8)     # another hidden size
    save_file(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=r"head 1 has 0\.linear\.weight \(6, 6\)"):
        load_heads(str(tmp_path))


# ---- NaN / inf in the tensors -----------------------------------------------------------------------------
@pytest.mark.parametrize("tensor,value", [("res_weight", float("nan")), ("res_bias", float("inf")),
                                          ("lm_head", -float("inf"))])
def test_non_finite_heads_are_refused_unless_asked(tmp_path, tensor, value):
    heads = MTPHeads(2, 8, vocab_size=11)
    with torch.no_grad():
        getattr(heads, tensor).view(-1)[3] = value
    heads.save(str(tmp_path))
    with pytest.raises(ValueError, match=rf"heads\.safetensors: tensor '{tensor}' has 1 non-finite.*check_finite=False"):
        load_heads(str(tmp_path))
    back = load_heads(str(tmp_path), check_finite=False)
    assert not bool(torch.isfinite(getattr(back, tensor)).all())


def test_non_finite_medusa_heads_name_the_file_and_key(tmp_path):
    sd = {"0.0.linear.weight": torch.zeros(8, 8), "0.0.linear.bias": torch.zeros(8), "0.1.weight": torch.zeros(13, 8)}
    sd["0.1.weight"][4, 2] = float("nan")
    torch.save(sd, str(tmp_path / "medusa_lm_head.pt"))
    with pytest.raises(ValueError, match=r"medusa_lm_head\.pt: tensor '0\.1\.weight' has 1 non-finite"):
        load_heads(str(tmp_path))


# ---- saving: a failed save leaves the previous heads byte-identical -----------------------------------------
def folder_bytes(folder):
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


def test_save_under_a_file_size_limit_keeps_the_previous_heads(tmp_path):
    """`ulimit -f`: the new heads.safetensors is larger than the limit, so its write fails (EFBIG) half way; the
    old heads.safetensors and heads.json stay as they were, and no temporary file is left behind."""
    saved_heads(tmp_path, H=2, D=8)
    before = folder_bytes(str(tmp_path))
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from mtp_triton.heads import MTPHeads
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # EFBIG instead of being killed
        heads = MTPHeads(4, 96, tree=[(0,), (1,), (0, 0)])       # 4*96*96*4 B = 147 KB of res_weight
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        try:
            heads.save({str(tmp_path)!r}, note="new")
        except OSError as e:
            print("refused:", e)
        else:
            print("saved")
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused:" in r.stdout, r.stdout
    assert folder_bytes(str(tmp_path)) == before
    load_heads(str(tmp_path))


def test_save_with_unserialisable_metadata_touches_nothing(tmp_path):
    saved_heads(tmp_path)
    before = folder_bytes(str(tmp_path))
    heads = MTPHeads(3, 8)
    with pytest.raises(TypeError, match="JSON"):
        heads.save(str(tmp_path), note=object())
    assert folder_bytes(str(tmp_path)) == before


def test_save_goes_through_one_replace_per_file(tmp_path, monkeypatch):
    """A failure when the new heads.safetensors would replace the old one: nothing changed."""
    saved_heads(tmp_path)
    before = folder_bytes(str(tmp_path))

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        MTPHeads(3, 8).save(str(tmp_path))
    assert folder_bytes(str(tmp_path)) == before


# ---- the default tree fits the heads --------------------------------------------------------------------
@pytest.mark.parametrize("H", [1, 2, 3])
def test_default_tree_fits_shallow_heads(H):
    t = get_tree(None, num_heads=H)
    assert 1 <= t.max_depth <= H
    assert t.size == min(17, 1 + 10 ** H)          # the default budget of 16 nodes (TYPICAL_ACC has 10 ranks a head)


def test_default_tree_unchanged_for_deep_heads():
    deep = Tree.from_choices(PRESETS["medusa-16"])
    for H in (None, 4, 5, 8):
        assert get_tree(None, num_heads=H).paths == deep.paths
    with pytest.raises(ValueError, match="exceeds the 2 heads"):           # an explicit preset is not cut
        get_tree("medusa-16", num_heads=2)


def test_two_heads_decode_with_the_default_tree():
    """With no tree given and none stored, generate uses the default: it used to be medusa-16, 3 deep, refused for
    2 heads ("tree depth 3 exceeds the 2 heads available")."""
    import mtp_triton as mt
    from hf_models import make_hf
    model = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"))
    heads = MTPHeads(2, model.config.hidden_size, dtype=model.dtype)
    with torch.no_grad():
        heads.res_weight.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(1))
    prompt = [[5, 6, 7, 8]]
    mtp = mt.generate(model, prompt, 12, heads=heads, kernels="torch")
    assert mtp.tokens == mt.generate(model, prompt, 12, mtp=False, kernels="torch").tokens


# ---- the CLI: one error line, exit status 2 --------------------------------------------------------------
@pytest.mark.parametrize("case,words", [
    ("json-list", ["heads.json", "JSON object"]),
    ("num-heads-str", ["heads.json", "num_heads must be an int"]),
    ("empty-pt", ["medusa_lm_head.pt", "empty"]),
])
def test_cli_refuses_bad_heads_in_one_line(tmp_path, case, words):
    folder = tmp_path / "heads"
    if case == "empty-pt":
        folder.mkdir()
        (folder / "medusa_lm_head.pt").write_bytes(b"")
    else:
        meta_file = saved_heads(folder, H=2, D=64)
        if case == "json-list":
            with open(meta_file, "w") as f:
                f.write("[]")
        else:
            edit_meta(meta_file, num_heads="2")
    r = run_cli("generate", "--model", TINY, "--heads", folder, "--prompt", "x", "--max-new-tokens", 2)
    assert_refused(r, *words)
