"""A damaged or mismatched MTP module folder is refused with a message that names the file and what is wrong."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mtp_triton as mt
from mtp_triton.mtp_module import MTPModule, load_module
from hf_models import make_hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"))
    path = tmp_path_factory.mktemp("module") / "m"
    MTPModule.from_target(model, torch.tensor([1, 5, 9])).save(str(path))
    return path


def _copy(saved, tmp_path, meta=None, tensors=None):
    out = tmp_path / "m"
    out.mkdir()
    m = json.loads((saved / "module.json").read_text())
    (out / "module.json").write_text(json.dumps(meta(m) if meta else m))
    sd = load_file(str(saved / "module.safetensors"))
    save_file(tensors(sd) if tensors else sd, str(out / "module.safetensors"))
    return str(out)


def test_a_folder_without_module_json_is_named_as_a_module_folder(saved, tmp_path):
    path = _copy(saved, tmp_path)
    (tmp_path / "m" / "module.json").unlink()
    with pytest.raises(ValueError, match="module.safetensors but no module.json"):
        mt.load_drafter(path)


def test_draft_settings_must_be_an_object_of_known_settings(saved, tmp_path):
    with pytest.raises(ValueError, match=r"module.json: draft must be an object"):
        load_module(_copy(saved, tmp_path, meta=lambda m: {**m, "draft": [1, 2]}))


def test_unknown_draft_setting_is_named(saved, tmp_path):
    with pytest.raises(ValueError, match=r"unknown settings \['widht'\]"):
        load_module(_copy(saved, tmp_path, meta=lambda m: {**m, "draft": {"widht": 3}}))


def test_integer_weights_are_refused_by_name(saved, tmp_path):
    path = _copy(saved, tmp_path, tensors=lambda sd: {**sd, "fc.weight": sd["fc.weight"].to(torch.int32)})
    with pytest.raises(ValueError, match=r"module.safetensors: tensors \['fc.weight'\] have the wrong dtype"):
        load_module(path)


def test_a_floating_token_map_is_refused(saved, tmp_path):
    path = _copy(saved, tmp_path, tensors=lambda sd: {**sd, "token_map": sd["token_map"].float()})
    with pytest.raises(ValueError, match=r"\['token_map'\] have the wrong dtype"):
        load_module(path)


@pytest.mark.parametrize("rope, words", [
    ({"rope_type": "linear"}, "needs positive finite factor"),                 # no factor: a KeyError at generate
    ({"rope_type": "linear", "factor": -2}, "needs positive finite factor"),   # accepted before
    ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
    ([1, 2], "rope_scaling must be an object"),
])
def test_module_json_rope_scaling_is_checked_when_it_loads(saved, tmp_path, rope, words):
    """module.json's config goes through the same RoPE checks as a checkpoint's config.json, when it loads."""
    path = _copy(saved, tmp_path, meta=lambda m: {**m, "config": {**m["config"], "rope_scaling": rope}})
    with pytest.raises(ValueError, match=f"module.json: config: .*{words}"):
        load_module(path)


def test_a_tree_larger_than_the_context_is_refused_before_any_work(monkeypatch):
    """with_draft(nodes=2100) on a 2048-context model failed after a minute of measuring step costs with a RuntimeError
    from torch.arange; a fixed tree of 99,999 nodes tried to allocate 640 GB. Both are refused at once."""
    import mtp_triton.costs as costs
    monkeypatch.setattr(costs, "step_cost", lambda *a, **k: pytest.fail("step costs measured before the refusal"))
    model = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"))
    ctx = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="more than the model's context length"):
        mt.generate(model, [[1, 2, 3]], 4, drafter=MTPModule.from_target(model).with_draft(nodes=ctx + 1))
    with pytest.raises(ValueError, match="more than the model's context length"):
        mt.generate(model, [[1, 2, 3]], 4, drafter=mt.init_heads(model, num_heads=2), tree=f"width-{ctx}")
