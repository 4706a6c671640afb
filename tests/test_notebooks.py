"""Every notebook executes top to bottom (CPU: Triton interpreter, small sizes) without an error."""
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    env_before = dict(os.environ)
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ.setdefault("TRITON_INTERPRET", "1" if not _cuda() else "0")
    os.environ["MTP_NOTEBOOK_OUT"] = str(tmp_path)     # notebooks write their CSV/PNG here in tests
    try:
        client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                         resources={"metadata": {"path": str(path.parent)}})
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


def _cuda():
    import torch
    return torch.cuda.is_available()


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_outputs_come_from_this_package(path):
    """The stamp the first code cell printed (package hash) is this package's: re-run the lessons after changing
    mtp_triton/ (python scripts/run_notebooks.py)."""
    import nbformat
    from mtp_triton.version import stamp

    nb = nbformat.read(path, as_version=4)
    printed = [o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if o.get("output_type") == "stream"]
    stamps = [line for text in printed for line in text.splitlines() if "package hash" in line]
    assert stamps, f"{path.name} has no stored outputs with the package stamp: run python scripts/run_notebooks.py"
    assert stamps[0].strip() == stamp(), f"{path.name} was executed with other package code ({stamps[0].strip()})"
