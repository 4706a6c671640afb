"""Every notebook executes top to bottom (CPU: Triton interpreter, small sizes) without an error."""
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]*-*.ipynb"))


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
    """The package files the lesson ran (hashed in its metadata by scripts/run_notebooks.py) are unchanged: re-run
    a lesson after changing code it imports (python scripts/run_notebooks.py NN)."""
    import nbformat
    from mtp_lab.provenance import changed_files

    nb = nbformat.read(path, as_version=4)
    code = nb.metadata.get("mtp_triton", {}).get("code")
    assert code and "mtp_triton/__init__.py" in code, (f"{path.name} has no record of the code it ran: run "
                                            f"python scripts/run_notebooks.py {path.name[:2]}")
    changed = changed_files(code)
    assert not changed, (f"{path.name} ran other package code: {', '.join(changed)} changed since; re-run "
                         f"python scripts/run_notebooks.py {path.name[:2]}")


def test_code_manifest_and_changed_files(tmp_path):
    """The manifest lists the package's imported files only; changed_files names an edited or deleted file."""
    import sys

    import mtp_lab.provenance as v
    import mtp_triton.version

    assert v.code_manifest({"mtp_triton.version": mtp_triton.version, "mtp_lab.provenance": v,
                            "os": sys.modules["os"]}) == {
        "mtp_lab/provenance.py": v.file_hash("mtp_lab/provenance.py", v.ROOT),
        "mtp_triton/version.py": v.file_hash("mtp_triton/version.py", v.ROOT)}
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    manifest = {n: v.file_hash(n, str(tmp_path)) for n in ("a.py", "b.py")}
    assert v.changed_files(manifest, str(tmp_path)) == []
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "b.py").unlink()
    assert v.changed_files(manifest, str(tmp_path)) == ["a.py", "b.py"]


KERNEL_LESSONS = ("02", "03a", "03b", "04")


def _cells(path):
    import nbformat
    return nbformat.read(path, as_version=4).cells


def _output_lines(cell):
    text = "".join(o.get("text", "") if o.get("output_type") == "stream"
                   else o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", []))
    return len(text.splitlines())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_lesson_stays_readable(path):
    """A lesson is at most ~500 code lines, no markdown cell runs past 300 words and no output past 40 lines, and its
    first code cell is lesson.setup() (device, interpreter, versions)."""
    cells = _cells(path)
    code = [c for c in cells if c.cell_type == "code"]
    assert sum(len(c.source.splitlines()) for c in code) <= 550
    assert "lesson.setup(" in code[0].source
    assert max(len(c.source.split()) for c in cells if c.cell_type == "markdown") <= 300
    assert max(_output_lines(c) for c in code) <= 40


@pytest.mark.parametrize("prefix", KERNEL_LESSONS)
def test_a_kernel_lesson_ends_in_a_benchmark_plot(prefix):
    """The last figure of a kernel lesson is drawn by lesson.bench_plot, after every exercise."""
    path = next(p for p in NOTEBOOKS if p.name.startswith(prefix + "-"))
    code = [c for c in _cells(path) if c.cell_type == "code"]
    plots = [i for i, c in enumerate(code) if "bench_plot(" in c.source]
    assert plots and any(o.get("data", {}).get("image/png") for o in code[plots[-1]].outputs)
    assert all(i < plots[-1] for i, c in enumerate(code) if "lesson.exercise(" in c.source)


def test_an_exercise_is_red_until_solved_and_its_solution_must_pass(monkeypatch):
    """lesson.exercise: no answer or a wrong one shows a red box and hands back the solution; a right one a green
    box; a shipped solution that fails its own check stops the notebook."""
    monkeypatch.syspath_prepend(str(ROOT / "notebooks"))
    import lesson
    shown = []
    monkeypatch.setattr(lesson, "_box", lambda ok, text: shown.append((ok, text)))

    def check(fn):
        assert fn(3) == 9, "3 squared is 9"

    square, wrong = (lambda x: x * x), (lambda x: x + 6 if x != 3 else 0)
    assert lesson.exercise("1", None, square, check) is square and shown[-1][0] is False
    assert lesson.exercise("1", wrong, square, check) is square and shown[-1][0] is False
    assert "3 squared is 9" in shown[-1][1]
    mine = lambda x: x ** 2                                            # noqa: E731
    assert lesson.exercise("1", mine, square, check) is mine and shown[-1][0] is True
    with pytest.raises(AssertionError):
        lesson.exercise("1", None, wrong, check)
