"""environment.yml parses and pins the same versions as pyproject.toml."""
import pathlib
import tomllib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pins(lines):
    out = {}
    for line in lines:
        if "==" in line and not line.startswith("-"):
            name, ver = line.split("==")
            out[name.strip().lower()] = ver.strip()
    return out


def test_environment_yml_matches_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["name"] == "mtp-triton"
    assert "python=3.11" in env["dependencies"]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    env_pins = _pins(pip)
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    proj_pins = _pins(proj["dependencies"] + proj["optional-dependencies"]["dev"])
    assert env_pins == proj_pins
    assert proj_pins["torch"] == "2.13.0" and proj_pins["triton"] == "3.7.1"   # the pair torch's CUDA wheel needs
    assert any(line.startswith("-e .") for line in pip)
