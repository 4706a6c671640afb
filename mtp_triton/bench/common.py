"""Shared benchmark plumbing: environment stamp, CSV rows, timing, measured copy bandwidth."""
import csv
import datetime
import os
import platform
import subprocess
import time

import torch


def device_name(device=None):
    if torch.cuda.is_available() and (device is None or str(device).startswith("cuda")):
        return torch.cuda.get_device_name()
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"


def git_commit():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
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


def append_rows(path, rows):
    """Append dict rows to a CSV (header from the union of keys; an existing header is extended)."""
    if not rows:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    old = []
    if os.path.exists(path):
        with open(path, newline="") as f:
            old = list(csv.DictReader(f))
    keys = []
    for r in old + list(rows):
        for k in r:
            if k not in keys:
                keys.append(k)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in old + list(rows):
            w.writerow(r)


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


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
