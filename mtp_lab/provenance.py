"""Which code produced an output: the version line a lesson prints first, and the code manifest it is stamped with.

A lesson's outputs come from the package and lab files its kernel imported. `scripts/run_notebooks.py` stores their
hashes in the notebook's metadata (`code_manifest`, after the last cell ran); `tests/test_notebooks.py` recomputes
them (`changed_files`) and names the files that changed since, so a lesson is re-run exactly when code it ran has
changed, and not when, say, a training script it never imports does. Paths are relative to the repository root
("mtp_triton/model.py", "mtp_lab/bench/common.py").
"""
import os
import sys

from mtp_triton.version import __version__, file_hash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("mtp_triton", "mtp_lab")


def code_manifest(modules=None, root=ROOT):
    """{relpath: hash} of the package's and the lab's files among `modules` (default: every module imported)."""
    modules = sys.modules if modules is None else modules
    out = {}
    for name, mod in list(modules.items()):
        path = getattr(mod, "__file__", None)
        if name.split(".")[0] in PACKAGES and path:
            rel = os.path.relpath(os.path.abspath(path), root).replace(os.sep, "/")
            out[rel] = file_hash(rel, root)
    return dict(sorted(out.items()))


def changed_files(manifest, root=ROOT):
    """The files of a `code_manifest` whose content differs now (or that are gone), sorted."""
    def now(rel):
        try:
            return file_hash(rel, root)
        except FileNotFoundError:
            return None
    return sorted(rel for rel, h in manifest.items() if now(rel) != h)


def stamp():
    """The line a lesson prints first: the package version and the versions of what it runs on."""
    import torch
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "not installed"
    return (f"mtp_triton {__version__}, python {sys.version.split()[0]}, torch {torch.__version__}, "
            f"triton {tv}")
