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


def test_the_newest_run_wins_whatever_its_commit_or_id():
    # CSVs keep earlier runs; commits and run ids are hex, so "newest" must come from the timestamps
    import importlib.util
    spec = importlib.util.spec_from_file_location("render", ROOT / "scripts" / "render_readme_results.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    rows = [dict(commit="c0712b5", run_id="f0", timestamp="2026-12-01T10:22:53"),
            dict(commit="85cfe57", run_id="a1", timestamp="2026-12-01T12:33:20"),
            dict(commit="85cfe57", run_id="a1", timestamp="2026-12-01T12:33:12")]
    for key in ("commit", "run_id", "timestamp"):
        assert {r["commit"] for r in render._latest(rows, key)} == {"85cfe57"}, key
