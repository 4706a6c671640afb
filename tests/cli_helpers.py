"""Run `python -m mtp_lab ...` as a user would, and check how it refuses bad input."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "data", "tiny-stdlib-llama")


def hang_guard(seconds):
    """A child process's time limit, there to stop a hang, never to judge speed: `seconds` (enough on a quiet 2-core
    machine) times MTP_TEST_TIME_SCALE (default 4), since a machine shared with other work, or a slower laptop, runs
    the suite several times slower and must not see a test fail for it."""
    return seconds * float(os.environ.get("MTP_TEST_TIME_SCALE", "4"))


def run_cli(*args, timeout=300, cwd=ROOT, env=None):
    """CompletedProcess (text) of `python -m mtp_lab *args`, without the interpreter flag of the test run."""
    env = dict({k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MTP_TRITON_TRACEBACK")},
               **(env or {}))
    return subprocess.run([sys.executable, "-m", "mtp_lab", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, errors="replace", timeout=hang_guard(timeout), env=env)


def assert_refused(r, *words):
    """Exit status 2, exactly one `error:` line on stderr naming each of `words` (case-insensitive), no traceback."""
    lines = [line for line in r.stderr.splitlines() if "error:" in line]
    assert r.returncode == 2, f"rc {r.returncode}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(lines) == 1, f"{len(lines)} error lines:\n{r.stderr[-3000:]}"
    for w in words:
        assert w.lower() in lines[0].lower(), f"{w!r} not in {lines[0]!r}"
    return lines[0]
