"""Records: the stamp every row carries, CSV rows, and files written so that nothing is lost.

The base floor for everything that writes results: heads, training records, cards, CSV rows, reports and README
renders all write through `write_bytes` (temporary file in the same folder, fsync, then one `os.replace`), so an
interrupted run, a full disk or a file-size limit leaves the previous file byte-identical. `output_lock` refuses a
second writer on the same output folder. It imports only the standard library and torch.
"""
import contextlib
import csv
import datetime
import errno
import io
import json
import os
import platform
import subprocess
import tempfile

import torch


# ---- the stamp every row carries ----------------------------------------------------------------------------
def device_name(device=None):
    """The GPU's name, or 'CPU <arch> x<cores> (<model>; <bf16 matmul units>)': two CPUs of one architecture can
    differ several-fold in bf16 matmul speed (AVX-512 BF16 against AMX tiles), so rows keep which one ran."""
    if torch.cuda.is_available() and (device is None or str(device).startswith("cuda")):
        return torch.cuda.get_device_name()
    name = f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"
    model, flags = cpu_model_and_flags()
    units = [label for flag, label in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16")) if flag in flags]
    extra = "; ".join(x for x in (model, " ".join(units)) if x)
    return f"{name} ({extra})" if extra else name


def cpu_model_and_flags():
    """('model name', set of flags) from /proc/cpuinfo (Linux); ('', set()) elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return "", set()
    model = flags = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = value
    return model, set(flags.split())


def git_commit():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5)
        # dirty = tracked files differ from the commit, recorded results aside (a run that appends rows to
        # results/ before it stamps its next suite must not mark itself dirty)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/",
                                ":(exclude,top)results"], cwd=here, capture_output=True, text=True,
                               timeout=5).stdout.strip()
        return (out.stdout.strip() or "unknown") + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def env_info(device=None):
    """The stamp every row carries: where and with what it was measured."""
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = "none"
    return {
        "device": device_name(device),
        "interpreter": os.environ.get("TRITON_INTERPRET", "0") == "1",
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": git_commit(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ---- CSV rows -----------------------------------------------------------------------------------------------
def append_rows(path, rows):
    """Append dict rows to a CSV; the header is the union of the keys (an existing header is extended).

    Whatever happens during the write (Ctrl-C, a full disk, a file-size limit), the file keeps its previous
    bytes, or holds them plus all the new rows; never a torn row:
      * the header already has every new column: the rows are rendered first, appended with one write, and cut
        off again (ftruncate to the old size) if that write fails;
      * the header must grow: everything is written to a temporary file in the same folder, which then replaces
        the old file in one rename (os.replace); on failure the temporary file is removed.
    """
    rows = [dict(r) for r in rows]
    if not rows:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    header = _header(path)
    keys = list(header or [])
    for r in rows:
        keys += [k for k in r if k not in keys]
    if header and keys == header and _ends_with_newline(path):
        _append_bytes(path, _render(header, rows, with_header=False))
    else:
        old = read_rows(path) if header else []
        _replace(path, _render(keys, [{k: v for k, v in r.items() if k is not None} for r in old] + rows))


def read_rows(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _header(path):
    """The CSV's column names, or None when the file is missing or empty."""
    if not os.path.exists(path):
        return None
    with open(path, newline="", encoding="utf-8") as f:
        return next(csv.reader(f), None) or None


def _ends_with_newline(path):
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _render(keys, rows, with_header=True):
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, restval="")           # lines end in \r\n, as csv writes them
    if with_header:
        w.writeheader()
    w.writerows(rows)
    return buf.getvalue().encode("utf-8")


def _append_bytes(path, data):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:                        # KeyboardInterrupt included: take the partial rows back
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


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


def save_torch(obj, path):
    """torch.save through write_bytes: an interrupted save leaves the previous file intact."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return write_bytes(path, buf.getbuffer())


def _mode_of(path):
    """The permission bits the file has (or a new file would get under this umask)."""
    if os.path.exists(path):
        return os.stat(path).st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def ensure_writable_dir(path):
    """Create the folder `path` if needed and check that files can be made in it; raise OSError saying so.

    Call it before any compute, so that a bad --out fails in a second instead of after the whole run.
    Returns the path."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as e:
        raise OSError(f"cannot write to the output folder {path!r}: {e.strerror or e}. "
                      "Choose another --out, or fix its permissions.") from e
    return path


# ---- one writer per output folder -------------------------------------------------------------------------
@contextlib.contextmanager
def output_lock(folder, what="this output folder"):
    """Hold an exclusive lock on `folder` for the duration of a run; a second process asking for the same folder
    gets a RuntimeError at once (no waiting), instead of two runs appending to, or rewriting, the same files.

    The lock is an fcntl.flock on <folder>/.lock, released by the kernel when the process ends however it ends
    (kill -9 included), so a stale lock cannot outlive its run. Not on Windows (no fcntl): there it does nothing."""
    try:
        import fcntl
    except ImportError:                                            # pragma: no cover - not POSIX
        yield folder
        return
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise RuntimeError(f"another run is writing to {folder!r} ({what}); wait for it to finish, or choose "
                               "another --out") from None
        yield folder
    finally:
        os.close(fd)                                               # closing the descriptor releases the lock
