"""Records: the stamp every row carries, CSV and JSONL rows, tables, and files written so that nothing is lost.

The base floor for everything that writes results: heads, training records, cards, CSV rows, reports and README
renders all write through `write_bytes` (the package's `mtp_triton/files.py`, re-exported here: temporary file in the
same folder, fsync, then one `os.replace`), so an interrupted run, a full disk or a file-size limit leaves the
previous file byte-identical. `output_lock` refuses a second writer on the same output folder. Beside the standard
library and torch it imports only the package's `files` and `ops` (the machine's name).
"""
import contextlib
import csv
import datetime
import errno
import hashlib
import io
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile

import torch

from mtp_triton.files import _mode_of, _replace, write_bytes, write_json, write_text  # noqa: F401
from mtp_triton.ops import cpu_model_and_flags, device_name  # noqa: F401


# ---- the stamp every row carries ----------------------------------------------------------------------------
def git_commit():
    """The checkout's short commit, "-dirty" if tracked files differ from it; "unknown" outside git. A copy whose git
    metadata is not its own (a GPU machine that is sent the working tree: its .git may be an older one) is named by
    the caller instead: MTP_TRITON_COMMIT=<commit> makes this return "<commit> (declared)"."""
    declared = os.environ.get("MTP_TRITON_COMMIT")
    if declared:
        return f"{declared} (declared)"
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
    Returns the number of torn rows dropped from the file (see below; normally 0).

    Whatever happens during the write (Ctrl-C, a full disk, a file-size limit), the file keeps its previous
    bytes, or holds them plus all the new rows; never a torn row:
      * the header already has every new column: the rows are rendered first, appended with one write, and cut
        off again (ftruncate to the old size) if that write fails;
      * the header must grow: everything is written to a temporary file in the same folder, which then replaces
        the old file in one rename (os.replace); on failure the temporary file is removed.
    Several processes may append to one CSV at once: each write holds an exclusive flock on the CSV itself while it
    reads the header and appends or rewrites, so no writer drops another's rows.
    A torn row (one with another number of fields than the header: a writer killed mid-row by kill -9 or a power
    loss) is dropped when the file is rewritten, with a note on stderr naming the file; read_rows never returns one.
    """
    rows = [dict(r) for r in rows]
    if not rows:
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with _csv_lock(path, exclusive=True):
        header = _header(path)
        keys = list(header or [])
        for r in rows:
            keys += [k for k in r if k not in keys]
        if header and keys == header and _ends_with_newline(path):
            _append_bytes(path, _render(header, rows, with_header=False))
            return 0
        old, torn = _parse(path) if header else ([], 0)
        _replace(path, _render(keys, old + rows))
    if torn:
        print(f"note: dropped {torn} torn row(s) from {path} (a run stopped in the middle of writing them)",
              file=sys.stderr)
    return torn


def read_rows(path):
    """The whole rows of a CSV as dicts of strings (header -> value); torn rows are left out (read_whole_rows)."""
    return read_whole_rows(path)[0]


def read_whole_rows(path):
    """(whole rows, number of torn rows left out) of a CSV. A torn row has another number of fields than the header
    (a row cut mid-line by kill -9 or a power loss); blank lines are skipped. A last row without a line end is torn
    too, whatever its number of fields (append_rows ends every row with one; a row cut after "Tru" of "True" still
    has all its fields)."""
    with _csv_lock(path, exclusive=False):
        return _parse(path)


def resume_rows(path, log=print):
    """--resume: the whole rows of `path` ([] when there is no such file); when torn rows were left out,
    log(one line) says how many, so that the requests they belonged to visibly run again."""
    if not os.path.exists(path):
        return []
    rows, torn = read_whole_rows(path)
    if torn:
        log(f"--resume: {torn} torn row(s) in {path} left out (a run stopped while writing them); their requests "
            "run again")
    return rows


def row_key(row, fields):
    """A row's identity for --resume: its values of `fields` as strings (equal for a typed row and the same row read
    back from a CSV)."""
    return tuple(str(row.get(k)) for k in fields)


class KeptRows:
    """--resume: the rows an earlier run wrote, by key(row) (a later row with the same key wins; key: a function, or
    the names of the fields that make `row_key`). A unit of work (a request, a prompt's configurations, a suite) is
    reused only if every row it needs is there: take()."""

    def __init__(self, rows, key):
        self.by_key = {}
        for r in rows:
            self.by_key[key(r) if callable(key) else row_key(r, key)] = r
        self.used = 0                         # rows handed out by take()

    def take(self, *keys):
        """The kept rows of these keys if all are there (they count as used), else None: run the unit again."""
        rows = [self.by_key.get(k) for k in keys]
        if not rows or any(r is None for r in rows):
            return None
        self.used += len(rows)
        return rows

    def matching(self, test):
        """The kept rows whose key passes test(key), counted as used (a unit whose rows are not known ahead)."""
        rows = [r for k, r in self.by_key.items() if test(k)]
        self.used += len(rows)
        return rows


def _parse(path):
    """(whole rows, torn rows). The writer ends every row with a line end, so a last row without one was cut in
    the middle of its write (even when its number of fields is right: "True" cut to "Tru"): it is torn."""
    cut = not _ends_with_newline(path)
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        rows, torn = [], 0
        if not header:
            return rows, torn
        last_whole = False                              # whether the last record read went into rows
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                break
            except csv.Error:                           # e.g. a NUL byte or an unfinished quote: a torn row
                torn += 1
                last_whole = False
                continue
            if not fields:
                continue
            if len(fields) != len(header):
                torn += 1
                last_whole = False
                continue
            rows.append(dict(zip(header, fields)))
            last_whole = True
        if cut and last_whole:                          # the last row has no line end: torn
            rows.pop()
            torn += 1
    return rows, torn


@contextlib.contextmanager
def _csv_lock(path, exclusive):
    """Hold an flock on the CSV itself (exclusive for a write, shared for a read); a write creates it empty if
    missing, a read of a missing file raises FileNotFoundError.

    A rewrite replaces the file (os.replace), so a writer that waited on the old file's lock finds another file at
    `path` once it gets the lock: it then locks the new one instead. An empty file this call created is removed
    again when the write fails. No locking where fcntl is missing (Windows)."""
    try:
        import fcntl
    except ImportError:                                            # pragma: no cover - not POSIX
        yield
        return
    while True:
        created = False
        try:
            if not exclusive:
                raise FileExistsError                              # a read never creates the file
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, _mode_of(path))
            created = True
        except FileExistsError:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                if not exclusive:
                    raise                                          # reading a missing file
                continue                                           # removed meanwhile: try again
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            mine = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
                continue                                           # replaced while we waited: lock the new file
            try:
                yield
            except BaseException:
                if created and os.fstat(fd).st_size == 0:
                    with contextlib.suppress(OSError):
                        if os.stat(path).st_ino == mine.st_ino:
                            os.unlink(path)
                raise
            return
        finally:
            os.close(fd)


def _header(path):
    """The CSV's column names, or None when the file is missing or empty."""
    if not os.path.exists(path):
        return None
    with open(path, newline="", encoding="utf-8") as f:
        return next(csv.reader(f), None) or None


def _ends_with_newline(path):
    """True when the file ends with a line end (an empty file counts as ending with one)."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return True
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


# ---- JSONL rows ---------------------------------------------------------------------------------------------
def read_utf8(path, what="file"):
    """The whole file as text; a missing file, a folder or bytes that are not UTF-8 are a ValueError naming `what`
    (the flag or the kind of file), the file and, for bad bytes, the line."""
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path}: {'no such file' if not os.path.exists(path) else 'not a file'}")
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"{what} {path}:{line}: not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start}); "
                         "save the file as UTF-8") from None


def read_jsonl(path, what="file", fields=(), torn_last="raise", blank_text=True):
    """The rows of a JSONL file (the lab's one JSONL reader): every non-blank line one JSON object with the keys
    `fields` ("text", if named, a string; blank_text=False: not an empty one). Anything else is a ValueError naming
    `what`, the file and the line (path:line): a line that is not JSON (a torn last line, from an interrupted write,
    says so), a missing field, a file that is not UTF-8 or not there. torn_last="skip": an append-only log a resumed
    run adds to, whose torn last line is left out (that row is made again; open_log cuts it off before appending)."""
    lines = read_utf8(path, what).split("\n")
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if n == last and torn_last == "skip":
                break
            torn = "; a torn last line? finish it or delete it" if n == last else ""
            raise ValueError(f"{what} {path}:{n}: not valid JSON ({e.msg}){torn}") from None
        missing = [k for k in fields if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{what} {path}:{n}: no {', '.join(repr(k) for k in missing)} field (each line must be a "
                             f"JSON object with {', '.join(repr(k) for k in fields)})")
        if "text" in fields and not isinstance(row["text"], str):
            raise ValueError(f"{what} {path}:{n}: 'text' is {type(row['text']).__name__}, not a string")
        if "text" in fields and not (blank_text or row["text"].strip()):
            raise ValueError(f"{what} {path}:{n}: 'text' is empty; each line needs a non-empty string 'text' field")
        rows.append(row)
    return rows


def open_log(path):
    """An append-only JSONL log opened for appending (text, UTF-8), its torn last line (a write interrupted before
    its newline) cut off first, so that the next row starts a line of its own. The folder is created."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if os.path.exists(path):
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    return open(path, "a", encoding="utf-8")


def read_json(path):
    """The JSON in `path`, or None where there is no such file (a record not made yet)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def sha256_file(path):
    """The hex sha256 of a file's bytes (read in 1 MiB pieces), as the cards list their files."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            h.update(piece)
    return h.hexdigest()


def save_torch(obj, path):
    """torch.save through write_bytes: an interrupted save leaves the previous file intact."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return write_bytes(path, buf.getbuffer())


def load_torch(path, what="file"):
    """torch.load with weights_only=True: tensors, containers, numbers and strings only. A pickle that asks for
    anything else (a class whose __reduce__ runs code: a crafted --checkpoint or cache) is refused, without running
    it, as a ValueError naming `what` and the file."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{what} {path}: refused to load: it holds more than tensors, numbers, strings and "
                         f"containers ({first}); delete it if you did not make it with this lab") from None


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


def command_today(command):
    """A recorded command as it is typed today: the lab's commands were `python -m mtp_triton ...` until they moved
    out of the package into mtp_lab (commit 8433a68); rows and records made before keep the old words."""
    return command.replace("python -m mtp_triton", "python -m mtp_lab")


def md_table(header, rows, cell=str, indent=""):
    """A markdown table (lines joined by newlines, no trailing one, each after `indent`): the header (an empty title
    is written `| |`), the |---| rule, one line per row with every cell through `cell`. The one table writer of the
    reports, the README renderer and the cards."""
    lines = ["|" + "|".join(f" {h} " if h else " " for h in header) + "|", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(indent + line for line in lines)


def percents(xs):
    """Fractions as whole percents joined by ' / ' (a per-depth acceptance: '64 / 29 / 9')."""
    return " / ".join(f"{100 * x:.0f}" for x in xs)
