"""User-facing errors.

Anything a user can cause (a bad path, a bad file, a bad option) raises PinferError with a one-line message that says
what is wrong and what to do. The CLIs print it without a traceback (unless --verbose) and exit non-zero.
"""

import sys
import traceback

_CONTROL = {c: f"\\x{c:02x}" for c in range(32)} | {10: "\\n", 13: "\\r", 127: "\\x7f"}


class PinferError(Exception):
    """A problem with the user's input, reported as one line (control characters from a file's bytes, such as a
    newline in a corrupt tensor name, are escaped)."""

    def __init__(self, message: object = "", *args):
        super().__init__(str(message).translate(_CONTROL), *args)


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an exception while a file is being written so that it cleans up as Ctrl-C does."""


def report(exc: BaseException, verbose: bool = False, prog: str = "pinfer") -> int:
    """Print a user-facing error and return the exit code a CLI should use."""
    if verbose:
        traceback.print_exception(exc)
    if isinstance(exc, PinferError):
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    if isinstance(exc, Terminated):
        print(f"{prog}: terminated", file=sys.stderr)
        return 143
    if isinstance(exc, KeyboardInterrupt):
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    if isinstance(exc, MemoryError):
        print(f"{prog}: error: out of memory; try a smaller --ctx-size or a smaller model", file=sys.stderr)
        return 1
    print(f"{prog}: internal error: {type(exc).__name__}: {exc} (rerun with --verbose for a traceback)",
          file=sys.stderr)
    return 2
