"""The one way every `python -m mtp_lab <command>` ends on bad input: one `error:` line and exit status 2.

Every command line of the lab (the `python -m mtp_lab` commands, the kernel benchmarks, scripts/*.py,
data/*/make_*.py) is made by `command_parser`, and the flags several commands share (--model, --out, --kernels,
--dtype, --threads, --heads, --drafter, --seed, --device, ...) are defined once, in `_common`, and added by
`add_common` with the command's own default. `Resumable` ends a command whose rows are appended as they finish.

A command's main(argv) validates what it can before any compute and raises ValueError / TypeError / OSError with a
message that names the file, flag or field and what is wrong. `run` turns such an exception, wherever it comes
from, into a single line on stderr (never a traceback) and exit status 2; Ctrl-C becomes exit status 130 with one
line. Set MTP_TRITON_TRACEBACK=1 to see the traceback instead (for debugging the project itself).
"""
import argparse
import math
import os
import struct
import sys

# what bad input raises: argument checks (ValueError, TypeError), files (OSError, UnicodeError is a ValueError),
# torch refusing a device or dtype (RuntimeError), truncated binary files (struct.error)
INPUT_ERRORS = (ValueError, TypeError, OSError, RuntimeError, struct.error)


def one_line(message):
    """The message on one line (newlines and runs of spaces folded), or the exception's type when it is empty."""
    text = " ".join(str(message).split())
    return text or type(message).__name__


def error(message, code=2):
    """Print `error: <message>` as one line on stderr; return the exit status."""
    print("error: " + one_line(message), file=sys.stderr)
    return code


def run(main, argv=None):
    """rc of main(argv) (None counts as 0); bad input -> one `error:` line and 2; Ctrl-C -> one line and 130."""
    try:
        rc = main(argv)
    except KeyboardInterrupt:
        if os.environ.get("MTP_TRITON_TRACEBACK"):
            raise
        print("\ninterrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except INPUT_ERRORS as e:
        if os.environ.get("MTP_TRITON_TRACEBACK"):
            raise
        return error(e if str(e).strip() else f"{type(e).__name__} (no message)")
    return rc if isinstance(rc, int) else 0


# ---- argparse types: numbers refused with a message that says what is allowed ---------------------------
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


def float_in(low=None, high=None, low_open=False, high_open=False):
    """argparse type: a finite float in [low, high] (an open end with low_open / high_open; None: unbounded)."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if low is not None and (value < low or (low_open and value == low)):
            raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {low}, got {value}")
        if high is not None and (value > high or (high_open and value == high)):
            raise argparse.ArgumentTypeError(f"must be {'<' if high_open else '<='} {high}, got {value}")
        return value
    return parse


# ---- the command lines: one parser maker, the shared flags defined once ------------------------------------
PROBABILITY = float_in(0.0, 1.0, low_open=True)            # a probability in (0, 1]: --prune-below, --thresholds


def _common(names):
    """{flag name: argparse keywords} of the flags several commands share. The model and kernel names come from the
    package (torch), imported only for a command that takes --model or --kernels."""
    if "model" in names or "kernels" in names:
        from mtp_triton.loading import SHORT_NAMES
        from mtp_triton.ops import KINDS
    else:
        SHORT_NAMES = KINDS = ()
    return {
        "model": dict(help=f"a short name ({', '.join(SHORT_NAMES)}), a checkpoint folder (config.json + "
                      "*.safetensors + tokenizer) or a .gguf file (default %(default)s)"),
        "drafter": dict(default=None, choices=("medusa", "mtp"), help="medusa: MTP heads; mtp: the MTP module (one "
                        "block, a dynamic tree each step); default mtp where the model has one, else medusa"),
        "heads": dict(default=None, help="the drafter's folder (default: the model's shipped heads or module; "
                      "<folder>/heads or <folder>/mtp for a checkpoint folder)"),
        "out": dict(help="output folder (default %(default)s)"),
        "kernels": dict(default="auto", choices=KINDS, help="the ops a step runs: triton (the kernels), torch (their "
                        "eager twins), compiled (the twins, torch.compile'd on a CPU); default %(default)s: triton on "
                        "a CUDA device, torch elsewhere"),
        "dtype": dict(default=None, choices=("bf16", "fp32"), help="the model's dtype (default: for SmolLM2 on a CPU, "
                      "bf16 where the CPU multiplies it natively, the engine's exact mode, else fp32; else the "
                      "checkpoint's)"),
        "device": dict(default=None, help="torch device (default: cuda where there is one, else cpu)"),
        "threads": dict(type=int_at_least(1), default=2, help="torch CPU threads (default %(default)s)"),
        "seed": dict(type=int_at_least(0), default=0, help="random seed (default %(default)s)"),
        "max-new-tokens": dict(type=int_at_least(1), help="new tokens per prompt (>= 1)"),
        "per-category": dict(type=int_at_least(1), default=2, help="prompts per category (>= 1; default "
                             "%(default)s)"),
        "tree": dict(default="stored", help="'stored' (saved with the heads, else tuned), 'auto' (tuned now to this "
                     "machine), 'tuned' (to the heads' accuracies), a preset (medusa-16, chain-4, ...), chain-N or "
                     "width-K"),
        "prune-below": dict(type=PROBABILITY, default=None, metavar="P", help="confidence pruning: verify only "
                            "drafted nodes whose path probability under the heads is >= P (RuntimeConfig.prune_below;"
                            " off by default)"),
        "temperature": dict(type=float_in(), default=0.0, help="0: greedy (default %(default)s)"),
        "top-p": dict(type=float_in(), default=1.0, help="nucleus sampling mass (default %(default)s)"),
        "quick": dict(action="store_true", help="tiny sizes (CI)"),
        "resume": dict(action="store_true", help="skip the work whose rows the output CSV already holds (same "
                       "setup and device)"),
    }


def add_common(ap, *names, **given):
    """Add the shared flags `names` ('model', 'out', 'max-new-tokens', ...) to `ap`, each as _common() defines it.
    given: per flag (by its dest: max_new_tokens=...) the command's default, or a dict of argparse keywords that
    replace the shared ones (help=..., required=True, choices=...). Returns ap."""
    common = _common(names)
    for name in names:
        kw = dict(common[name])
        value = given.get(name.replace("-", "_"), kw.get("default"))
        kw.update(value if isinstance(value, dict) else dict(default=value))
        if kw.get("action"):
            kw.pop("default", None)
        ap.add_argument("--" + name, **kw)
    return ap


def command_parser(prog, description=None, *common, epilog=None, **given):
    """The one ArgumentParser of every command line in the lab, scripts/ and data/: `prog` (how it is run), the
    description as written (a module's __doc__ or a line of it) and the shared flags `common` (add_common)."""
    ap = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_common(ap, *common, **given)


class Resumable:
    """`with Resumable(csv_path, unit) as stop:` around the measuring of a command whose rows are appended to csv_path
    as each `unit` (prompt, request, suite) finishes. Ctrl-C: a line saying where the finished units' rows are and
    that --resume goes on, stop.rc = 130; a failed write (a full disk): one `error:` line saying the same, stop.rc = 2.
    Both end the block quietly; stop.rc stays None when it ran to the end."""

    def __init__(self, csv_path, unit):
        self.csv_path, self.unit, self.rc = csv_path, unit, None

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            print(f"interrupted: the rows of every finished {self.unit} are in {self.csv_path}; run the same command "
                  "with --resume to go on from there", file=sys.stderr)
            self.rc = 130
        elif kind is not None and issubclass(kind, OSError):
            self.rc = error(f"could not write the rows to {self.csv_path!r}: {exc}. The rows of every {self.unit} "
                            "that finished before are there; make room and run the same command with --resume")
        return self.rc is not None
