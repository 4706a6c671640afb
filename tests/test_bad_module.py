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
