"""The one way every `python -m mtp_lab <command>` ends on bad input: one `error:` line and exit status 2.

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
