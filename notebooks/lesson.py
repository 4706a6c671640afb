"""What every lesson needs besides its idea: one setup line, an exercise check, committed rows, a benchmark plot.

    import lesson
    L = lesson.setup()              # before any kernel module is imported: picks the interpreter on a CPU
    L.FULL, L.DEVICE, L.ROOT        # GPU present?  "cuda" | "cpu"  the repository root (a pathlib.Path)

    fn = lesson.exercise("1: the tile top-k", mine, solution, check)
    rows = lesson.gpu_rows("run2/kernels/tree_attention.csv", kernel="tree_attention")
    lesson.bench_plot(ax, x, {"triton": [...], "sdpa": [...]}, floor=[...], ...)

Drawing of kernels' index math lives in figures.py; this file holds no lesson's idea.
"""
import html
import os
import pathlib
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU_RESULTS = ROOT / "results" / "nvidia-h200"


def setup(dpi=75, seed=0):
    """Choose the device (GPU: compiled kernels, full sizes; CPU: Triton's interpreter, small sizes), seed torch, size
    the figures, and print one line of versions plus the code stamp. Call it before importing any kernel module:
    the interpreter must be switched on before `@triton.jit` runs."""
    import torch

    import mtp_triton
    full = torch.cuda.is_available()
    if not full:
        mtp_triton.use_interpreter()
    import matplotlib

    from mtp_lab.provenance import stamp
    matplotlib.rcParams["figure.dpi"] = dpi
    torch.manual_seed(seed)
    device = "cuda" if full else "cpu"
    print(f"device {device} | Triton interpreter: {os.environ.get('TRITON_INTERPRET') == '1'} | "
          f"{torch.get_num_threads()} torch thread(s)")
    print(stamp())                                                   # which code made these outputs
    return types.SimpleNamespace(FULL=full, DEVICE=device, ROOT=ROOT)


def _box(ok, text):
    """A green (passed) or red (not yet) line, as HTML in Jupyter and as plain text in a terminal."""
    from IPython.display import HTML, display
    color, mark = ("#1a7f37", "✓") if ok else ("#cf222e", "✗")
    display(HTML(f'<div style="background:{color};color:white;padding:4px 8px;border-radius:3px;'
                 f'font-family:monospace">{mark} {html.escape(text)}</div>'))


def exercise(title, mine, solution, check):
    """Check the learner's answer `mine` (None = not written yet) with `check(fn)`, which raises on a wrong answer.

    The shipped `solution` is checked first and must pass (CI runs it: a broken solution stops the notebook). Then
    `mine` shows a red box until it passes, without stopping the notebook. Returns `mine` if it passed, else the
    solution, for the cells that go on with it."""
    check(solution)
    if mine is None:
        _box(False, f"exercise {title}: not written yet — the shipped solution stands in for it")
        return solution
    try:
        check(mine)
    except Exception as e:                          # noqa: BLE001 -- any failure of the learner's code is a red box
        _box(False, f"exercise {title}: {type(e).__name__}: {e} — the shipped solution stands in for it")
        return solution
    _box(True, f"exercise {title}: your answer passes")
    return mine


def gpu_rows(relpath, **where):
    """Rows of a committed GPU CSV under results/nvidia-h200/ (numbers as floats), filtered by column == value."""
    from mtp_lab.records import read_rows

    out = []
    for row in read_rows(GPU_RESULTS / relpath):
        if all(str(row.get(k)) == str(v) for k, v in where.items()):
            out.append({k: _number(v) for k, v in row.items()})
    return out


def _number(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def bench_plot(ax, x, series, xlabel, ylabel, title, floor=None, floor_label="copy bandwidth", logx=True,
               source=None):
    """A `triton.testing.perf_report`-style plot: one line per provider over one swept shape.

    series: {label: [y per x]}; floor: [y per x] drawn dashed (the bandwidth or copy line); source: where the rows
    come from (a GPU CSV shown on a CPU says so in the title)."""
    for label, ys in series.items():
        ax.plot(x, ys, marker="o", label=label)
    if floor is not None:
        ax.plot(x, floor, "k--", lw=1, label=floor_label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xticks(x)
    ax.set_xticklabels([str(int(v)) if float(v).is_integer() else str(v) for v in x])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title + (f"\n({source})" if source else ""), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax
