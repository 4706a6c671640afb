"""Files written whole: a failed write (Ctrl-C, a full disk, a file-size limit) leaves the old file as it was.

The bytes go to a temporary file in the same folder, are fsync'ed, and replace the old file in one rename
(os.replace). Heads, MTP modules and the step-cost table are saved through it. Standard library only.
"""
import contextlib
import json
import os
import tempfile


def _replace(path, data):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            os.fchmod(fd, _mode_of(path))
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_bytes(path, data):
    """Write a whole file so that a failed write leaves the old file as it was: the bytes go to a temporary file in
    the same folder, are fsync'ed, and replace the old file in one rename (os.replace). Returns the path."""
    _replace(path, bytes(data))
    return path


def write_text(path, text):
    """write_bytes for text (UTF-8)."""
    return write_bytes(path, text.encode("utf-8"))


def write_json(path, obj, indent=2):
    """write_bytes for JSON (UTF-8, a trailing newline)."""
    return write_text(path, json.dumps(obj, indent=indent) + "\n")


def _mode_of(path):
    """The permission bits the file has (or a new file would get under this umask)."""
    if os.path.exists(path):
        return os.stat(path).st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
