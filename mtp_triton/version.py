"""Which package code produced an output: a hash of every .py file under mtp_triton/ (sorted by path).

Notebooks print it in their first cell, so a test can tell when a committed notebook's outputs come from other code
than the package in the repository (then they must be re-executed: `python scripts/run_notebooks.py`).
"""
import hashlib
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def package_hash(root=HERE, length=12):
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).replace(os.sep, "/").encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:length]


def stamp():
    """The line a notebook prints: `mtp_triton <version>, package hash <hash>`."""
    from . import __version__
    return f"mtp_triton {__version__}, package hash {package_hash()}"
