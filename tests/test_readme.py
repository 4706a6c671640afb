"""README: the results block is rendered from recorded rows, and the quickstart names real commands."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_results_block_matches_recorded_rows():
    r = subprocess.run([sys.executable, "scripts/render_readme_results.py", "--check"], cwd=ROOT)
    assert r.returncode == 0, "README results block is stale: run python scripts/render_readme_results.py"


def test_quickstart_commands():
    text = (ROOT / "README.md").read_text()
    assert "bash scripts/setup.sh && .venv/bin/python -m mtp_lab demo" in text
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


@pytest.mark.parametrize("card", ["smollm2-135m-instruct-heads", "smollm2-135m-instruct-mtp", "smollm2-135m-instruct-eagle3",
                                  "smollm2-135m-instruct-answers", "tiny-stdlib-llama"])
def test_data_cards_match_their_records(card, monkeypatch):
    """Each data card (data/<card>/README.md) is what its make_card.py renders from the records and rows now (the
    heads' card once kept an older demo run's numbers): rendered in memory, nothing written, plots not redrawn."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"card_{card}", ROOT / "data" / card / "make_card.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    written = {}
    monkeypatch.setattr(mod, "write_text", lambda path, text: written.update({str(path): text}))
    if hasattr(mod, "replot"):
        monkeypatch.setattr(mod, "replot", lambda: None)
    mod.main()
    card_md = ROOT / "data" / card / "README.md"
    assert str(card_md) in written, f"make_card.py of {card} did not render README.md"
    assert written[str(card_md)] == card_md.read_text(), (f"data/{card}/README.md is stale: run "
                                                          f"python data/{card}/make_card.py")
