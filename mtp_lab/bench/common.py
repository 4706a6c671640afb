"""Shared benchmark plumbing: the kernel benchmarks' command line, device and size grid, timing, measured copy
bandwidth and figures. The environment stamp, CSV rows and atomic writes live in mtp_lab.records (re-exported
here)."""
import io
import os
import sys
import time

import torch

from ..cli import command_parser, int_at_least  # noqa: F401  (int_at_least: re-exported for bench code)
from ..records import (KeptRows, append_rows, ensure_writable_dir, env_info, git_commit, output_lock,  # noqa: F401
                       read_rows, resume_rows, write_bytes, write_text)


# ---- command lines ------------------------------------------------------------------------------------------
def kernel_parser(doc, default_csv, png_next_to_csv=False, module=None):
    """The parser of a kernel benchmark `module` (python -m <module>): doc's first line, --out (the CSV the rows are
    appended to) and --plot (a PNG of this run's rows)."""
    ap = command_parser(f"python -m {module}" if module else None, doc.splitlines()[0], "out",
                        out=dict(default=default_csv, help="CSV to append rows to"))
    ap.add_argument("--plot", default=None, help="PNG path for the plot of this run's rows (default: " +
                    ("next to --out)" if png_next_to_csv else "no plot)"))
    return ap


def kernel_args(ap, argv, module=None, no_gpu=None):
    """Parse argv; without CUDA, print `no_gpu` and, for a benchmark `module` that launches Triton kernels, switch on
    Triton's interpreter (mtp_triton.use_interpreter), the only way Triton runs kernels without a GPU.

    If a kernel module was already built without it (use_interpreter raises RuntimeError), the command is run again
    as `python -m <module> <argv>` in a fresh process with TRITON_INTERPRET=1 (os.execve: nothing after this call
    runs in the old process). A command-line helper: only main() functions call it."""
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        if module:
            from mtp_triton.kernels import use_interpreter
            try:
                use_interpreter()
            except RuntimeError:
                argv = list(sys.argv[1:] if argv is None else argv)
                os.execve(sys.executable, [sys.executable, "-m", module, *argv], dict(os.environ, TRITON_INTERPRET="1"))
        if no_gpu:
            print(no_gpu)
    return args


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


def save_figure(fig, path, close=False, **savefig_kw):
    """tight_layout, save at 80 dpi through write_bytes (an interrupted save leaves the old image whole; the folder
    is created); the format follows the file's extension (png without one). close=True for pyplot figures the
    caller is done with."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=os.path.splitext(str(path))[1][1:].lower() or "png", dpi=80, **savefig_kw)
    write_bytes(path, buf.getvalue())
    if close:
        import matplotlib.pyplot as plt
        plt.close(fig)
    return path


# ---- devices and sizes --------------------------------------------------------------------------------------
def bench_device(device=None):
    """(device, on_gpu): `device` if given, else "cuda" where CUDA is available, else "cpu"."""
    on_gpu = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
    return device or ("cuda" if on_gpu else "cpu"), on_gpu


def sweep(defaults, **given):
    """The sizes a benchmark sweeps: its `defaults` (a dict: the full grid on a GPU, a tiny one on a CPU), each
    replaced by the value given for it, unless that is None or empty."""
    return {k: given.get(k) or v for k, v in defaults.items()}


# ---- timing: the lab's one timer and its one copy-bandwidth probe ---------------------------------------------
def _on_gpu(device):
    return torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))


def stopwatch(fn, device=None):
    """(fn()'s value, the wall seconds it took), a CUDA device synchronised before and after (its work is
    asynchronous). The lab's one clock: time_fn repeats it, the transformers baseline times its generate calls with
    it."""
    sync = (lambda: torch.cuda.synchronize(device)) if _on_gpu(device) else (lambda: None)
    sync()
    t0 = time.perf_counter()
    value = fn()
    sync()
    return value, time.perf_counter() - t0


def time_fn(fn, warmup=1, rep=5, device=None, best=False):
    """Median seconds per call (best=True: the least). GPU: triton.testing.do_bench (ms -> s); CPU or Triton's
    interpreter (do_bench needs a GPU): `stopwatch` over `rep` calls after `warmup` untimed ones."""
    if _on_gpu(device) and os.environ.get("TRITON_INTERPRET", "0") != "1":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="min" if best else "median") * 1e-3
    for _ in range(warmup):
        fn()
    times = sorted(stopwatch(fn, device)[1] for _ in range(rep))
    return times[0] if best else times[len(times) // 2]


_COPY = {}


def copy_bandwidth(device=None, nbytes=None, best=False):
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted), once per process, device, size and
    statistic. Its two uses record two meanings:
      * the kernel benchmarks' ceiling (copy_gbps, lm_head_frac_of_copy, kv_append's ceiling): the median time_fn
        of copying `nbytes` (default: 1 GiB on a GPU, 64 MiB on a CPU);
      * the roofline of the speed rows (copy_gb_s, floor_step_ms, floor_fraction): best=True, 256 MiB
        (roofline.ROOFLINE_BYTES), the least of 5 copies: what the machine sustains at its best moment."""
    on_gpu = _on_gpu(device)
    dev = (str(device) if device is not None else "cuda") if on_gpu else "cpu"
    n = nbytes or (1 << 30 if on_gpu else 1 << 26)
    key = (dev, n, best)
    if key not in _COPY:
        src = torch.empty(n, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        _COPY[key] = 2 * n / time_fn(lambda: dst.copy_(src), device=dev, best=best)
        del src, dst
    return _COPY[key]
