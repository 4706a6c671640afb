"""README: the results block is rendered from recorded rows, and the quickstart names real commands."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_results_block_matches_recorded_rows():
    r = subprocess.run([sys.executable, "scripts/render_readme_results.py", "--check"], cwd=ROOT)
    assert r.returncode == 0, "README results block is stale: run python scripts/render_readme_results.py"


def test_quickstart_commands():
    text = (ROOT / "README.md").read_text()
    assert "bash scripts/setup.sh && .venv/bin/python -m mtp_triton demo" in text
    assert "bash scripts/test.sh" in text
    assert "exec bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
