"""The package version, and which package code produced an output.

A lesson's outputs come from the package files its kernel imported. `scripts/run_notebooks.py` stores their
hashes in the notebook's metadata (`code_manifest`, after the last cell ran); `tests/test_notebooks.py` recomputes
them (`changed_files`) and names the files that changed since, so a lesson is re-run exactly when code it ran has
changed, and not when, say, a training script it never imports does.
"""
import hashlib
import os
import sys

__version__ = "0.1.0"

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.basename(HERE)


def file_hash(relpath, root=HERE, length=12):
    """sha256[:length] of one package file (relpath: "/"-separated, relative to the package folder)."""
    with open(os.path.join(root, *relpath.split("/")), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:length]


def package_hash(root=HERE, length=12):
    """One hash of every .py file under the package (sorted by path)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
                h.update(rel.encode())
                h.update(file_hash(rel, root, 64).encode())
    return h.hexdigest()[:length]


def code_manifest(modules=None):
    """{relpath: hash} of the package's files among `modules` (default: every module this process has imported)."""
    modules = sys.modules if modules is None else modules
    out = {}
    for name, mod in list(modules.items()):
        path = getattr(mod, "__file__", None)
        if (name == PACKAGE or name.startswith(PACKAGE + ".")) and path:
            rel = os.path.relpath(os.path.abspath(path), HERE).replace(os.sep, "/")
            out[rel] = file_hash(rel)
    return dict(sorted(out.items()))


def changed_files(manifest, root=HERE):
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
    return (f"{PACKAGE} {__version__}, python {sys.version.split()[0]}, torch {torch.__version__}, "
            f"triton {tv}")
