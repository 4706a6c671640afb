"""Execute the lessons in place, so that their committed outputs come from the package as it is now.

    python scripts/run_notebooks.py                 # every notebooks/NN-*.ipynb (and NNa-*.ipynb)
    python scripts/run_notebooks.py 05 07           # some of them

Each notebook's first code cell prints `mtp_lab.provenance.stamp()` (versions). After the last cell, the hashes of
the package files the notebook's kernel imported go into its metadata ("mtp_triton": {"code": ...});
tests/test_notebooks.py checks them against the package, so a change to code a lesson ran, without re-running that
lesson, fails CI and names the files. On a CPU-only machine the kernels run in Triton's interpreter (the notebooks call
`mtp_triton.use_interpreter()` themselves); OMP_NUM_THREADS defaults to 1 here, as in CI.
"""
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
STAMP = "from mtp_lab.provenance import stamp; print(stamp())     # which code made these outputs"
MANIFEST = "import json; from mtp_lab.provenance import code_manifest; print(json.dumps(code_manifest()))"


def ensure_stamp(nb):
    """Put the stamp line at the end of the first code cell (once), unless it calls lesson.setup(), which prints it."""
    cell = next(c for c in nb.cells if c.cell_type == "code")
    if STAMP not in cell.source and "lesson.setup(" not in cell.source:
        cell.source = cell.source.rstrip() + "\n" + STAMP
    return nb


def run(path, timeout=900):
    import nbclient
    import nbformat
    nb = ensure_stamp(nbformat.read(path, as_version=4))
    nb.cells.append(nbformat.v4.new_code_cell(MANIFEST))      # run last, then taken out again
    env_before = dict(os.environ)
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    try:
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    code = json.loads(nb.cells.pop().outputs[0]["text"])
    nb.metadata["mtp_triton"] = {"code": code}
    nbformat.write(nb, path)
    return time.time() - t0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    paths = sorted((ROOT / "notebooks").glob("[0-9][0-9]*-*.ipynb"))
    if argv:
        paths = [p for p in paths if any(p.name.startswith(a) for a in argv)]
    for p in paths:
        print(f"{p.name}: {run(p):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
