"""Execute the lessons in place, so that their committed outputs come from the package as it is now.

    python scripts/run_notebooks.py                 # every notebooks/NN-*.ipynb
    python scripts/run_notebooks.py 05 07           # some of them

Each notebook's first code cell prints `mtp_triton.version.stamp()` (the package's hash); tests/test_notebooks.py
checks that the stamp in the committed outputs matches the package, so a change to mtp_triton/ without re-running
the lessons fails CI. On a CPU-only machine the kernels run in Triton's interpreter (the notebooks call
`mtp_triton.use_interpreter()` themselves); OMP_NUM_THREADS defaults to 1 here, as in CI.
"""
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
STAMP = "from mtp_triton.version import stamp; print(stamp())     # which package code made these outputs"


def ensure_stamp(nb):
    """Put the stamp line at the end of the first code cell (once)."""
    cell = next(c for c in nb.cells if c.cell_type == "code")
    if STAMP not in cell.source:
        cell.source = cell.source.rstrip() + "\n" + STAMP
    return nb


def run(path, timeout=900):
    import nbclient
    import nbformat
    nb = ensure_stamp(nbformat.read(path, as_version=4))
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
    nbformat.write(nb, path)
    return time.time() - t0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    paths = sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb"))
    if argv:
        paths = [p for p in paths if any(p.name.startswith(a) for a in argv)]
    for p in paths:
        print(f"{p.name}: {run(p):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
