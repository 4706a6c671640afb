"""Shared benchmark plumbing: paths, environment stamp, CSV rows that survive interrupts, output checks, trees by
name, command-line pieces, figures, timing and measured copy bandwidth."""
import argparse
import contextlib
import csv
import datetime
import io
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))     # the repository
EMBEDDED = os.path.join(ROOT, "data", "tiny-stdlib-llama")                               # the embedded model
PROMPTS = os.path.join(ROOT, "data", "prompts", "thirdparty_code.jsonl")                 # held-out code prompts


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


def write_text(path, text):
    """Write a whole text file so that a failed write leaves the old file as it was (temporary file + rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _replace(path, text.encode("utf-8"))
    return path


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


# ---- trees by name ------------------------------------------------------------------------------------------
def tree_by_name(name, num_heads=None, heads_dir=None, acc=None):
    """The tree a name stands for:

        None, 'tuned'  tuned to heads_dir/accuracy.json (with the budget stored there); without it the preset
        'tuned-N'      the N-node tree for the accuracies `acc` [H, K] (or those in heads_dir/accuracy.json)
        a preset       'medusa-16', 'chain-4', ... (mtp_triton.tree.PRESETS)
        'chain-N'      N drafts in a line (any N)
        'width-K'      the candidate-count sweep: K candidates (top-K ranks) of every head, hanging off the
                       top-1 chain, so num_heads * K nodes besides the root; needs top-K drafts of each head
    num_heads: the heads there are (a deeper tree is a ValueError; 'width-K' needs it).
    """
    from ..tree import PRESETS, Tree, get_tree
    if name in (None, "tuned"):
        if heads_dir is None:
            return get_tree(None, num_heads)
        from ..demo import default_tree
        return default_tree(heads_dir, num_heads)
    if name.startswith("tuned-"):
        if acc is None:
            if heads_dir is None or not os.path.exists(os.path.join(heads_dir, "accuracy.json")):
                raise ValueError(f"tree {name!r} needs the heads' accuracies (an accuracy.json beside the heads)")
            from ..demo import read_accuracy
            acc = read_accuracy(heads_dir, num_heads)[0]
        return get_tree(Tree.from_accuracies(acc, int(name.split("-", 1)[1])), num_heads)
    if name.startswith("chain-") and name not in PRESETS:
        return get_tree(Tree.chain(int(name.split("-")[1])), num_heads)
    if name.startswith("width-"):
        if num_heads is None:
            raise ValueError(f"tree {name!r} needs num_heads")
        k = int(name.split("-")[1])
        return Tree.from_choices([(0,) * d + (r,) for d in range(num_heads) for r in range(k)])
    return get_tree(name, num_heads)


# ---- command lines ------------------------------------------------------------------------------------------
def int_at_least(low):
    """argparse type: an int >= low, refused with a message that says so."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def add_output_args(ap, default_csv, png_next_to_csv=False):
    """--out (the CSV rows are appended to) and --plot (a PNG of this run's rows)."""
    ap.add_argument("--out", default=default_csv, help="CSV to append rows to")
    ap.add_argument("--plot", default=None, help="PNG path for the plot of this run's rows (default: " +
                    ("next to --out)" if png_next_to_csv else "no plot)"))


def save_rows(rows, csv_path, plot=None, png=None, line=None):
    """The end of a benchmark: print line(row) for each row (if given), append the rows to the CSV, draw them
    with plot(rows, png) if png, and say where they went."""
    for r in rows if line else ():
        print(line(r))
    append_rows(csv_path, rows)
    if png:
        plot(rows, png)
    print(f"appended {len(rows)} rows to {csv_path}" + (f"; plot {png}" if png else ""))


def png_next_to(csv_path):
    return os.path.splitext(csv_path)[0] + ".png"


def interpreter_unless_cuda(module, argv):
    """Without CUDA, Triton runs kernels only in its interpreter: switch it on (mtp_triton.use_interpreter).

    If a kernel module was already built without it (use_interpreter raises RuntimeError), this command is run
    again as `python -m <module> <argv>` in a fresh process with TRITON_INTERPRET=1 (os.execve: nothing after
    this call runs in the old process). A command-line helper: only main() functions call it."""
    if torch.cuda.is_available():
        return
    from ..kernels import use_interpreter
    try:
        use_interpreter()
    except RuntimeError:
        args = list(sys.argv[1:] if argv is None else argv)
        os.execve(sys.executable, [sys.executable, "-m", module, *args], dict(os.environ, TRITON_INTERPRET="1"))


def save_figure(fig, path, close=False, **savefig_kw):
    """tight_layout, create the folder, save at 80 dpi; close=True for pyplot figures the caller is done with."""
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80, **savefig_kw)
    if close:
        import matplotlib.pyplot as plt
        plt.close(fig)
    return path


# ---- timing -------------------------------------------------------------------------------------------------
def time_fn(fn, warmup=1, rep=5, device=None):
    """Median seconds per call. GPU: triton.testing.do_bench (ms -> s). CPU: perf_counter (do_bench needs a GPU)."""
    on_gpu = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
    if on_gpu and os.environ.get("TRITON_INTERPRET", "0") != "1":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(device=None, nbytes=1 << 30):
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted), the roofline's ceiling."""
    on_gpu = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
    dev = "cuda" if on_gpu else "cpu"
    n = nbytes if on_gpu else min(nbytes, 1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device=dev)
    return 2 * n / t
