"""User-facing errors.

Anything a user can cause (a bad path, a bad file, a bad option) raises PinferError with a one-line message that says
what is wrong and what to do. The CLIs print it without a traceback (unless --verbose) and exit non-zero.
"""

import reprlib
import sys
import traceback

_CONTROL = {c: f"\\x{c:02x}" for c in range(32)} | {10: "\\n", 13: "\\r", 127: "\\x7f"}
QUOTE_LIMIT = 64  # characters of a string from a file that a message shows (ggml's tensor names are shorter)
MESSAGE_LIMIT = 1000  # a message longer than this is cut: it is one line on a terminal, not a dump of the file


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """A string from a file (a name, a key, a value), quoted for a message and cut to `limit` characters: a corrupt
    length field can make a "name" swallow the rest of the file (a 199 MB error line on SmolLM2)."""
    s = value if isinstance(value, str) else reprlib.repr(value)  # reprlib: a 256k-token list is not printed
    if len(s) <= limit:
        return f"'{s}'"
    return f"'{s[:limit]}...' ({len(s)} characters)"


class PinferError(Exception):
    """A problem with the user's input, reported as one line (control characters from a file's bytes, such as a
    newline in a corrupt tensor name, are escaped)."""

    def __init__(self, message: object = "", *args):
        text = str(message)
        if len(text) > MESSAGE_LIMIT:  # cut before escaping: escaping 200 MB takes seconds
            text = f"{text[:MESSAGE_LIMIT]}... ({len(text) - MESSAGE_LIMIT} more characters)"
        super().__init__(text.translate(_CONTROL), *args)


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
