"""Helpers shared by the tests that run benchmarks and evaluations in subprocesses."""
import csv
import os
import signal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED = os.path.join(ROOT, "data", "tiny-stdlib-llama")


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def child_env():
    """The environment of a child Python: this checkout first, no bytecode writes (a file-size limit must hit only
    the files under test), one thread, and no inherited TRITON_INTERPRET (the child chooses for itself)."""
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    return env


def default_sigint():
    """preexec_fn of a child the test sends SIGINT: it starts with SIGINT's default disposition. A shell without job
    control starts background jobs with SIGINT ignored (`nohup bash .ci/run &`); the child would inherit that, and
    Python installs its KeyboardInterrupt handler only where SIGINT is not ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
