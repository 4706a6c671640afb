"""The package version, and one hash of the package's code (it keys the step-cost table: new code, new costs)."""
import hashlib
import os

__version__ = "0.1.0"

HERE = os.path.dirname(os.path.abspath(__file__))


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
