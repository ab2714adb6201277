"""The pi-* commands: thin typer CLIs over the library (pi-run, pi-profile, pi-plan, pi-serve), their shared
options (options.py) and the terminal chat. Nothing outside this package imports it."""

import os
import signal
import sys

from pinfer_llm.cli.threads import default_wait_policy

default_wait_policy()  # before anything imports torch (libgomp reads its environment once, at load)


def _interrupted_early(signum, frame):
    # Ctrl-C while Python is still importing the command (torch takes seconds): a KeyboardInterrupt there would end
    # in Python's own traceback, since no command has its handler yet. One line and 130, as the commands give.
    os.write(2, f"{os.path.basename(sys.argv[0]) or 'pinfer'}: interrupted\n".encode())
    os._exit(130)


def _is_a_command() -> bool:
    """Run as pi-run / pi-plan / ... (or python -m pinfer_llm.cli.X), not imported by a test or a script."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return os.path.basename(sys.argv[0] if sys.argv else "").startswith("pi-") or (
        spec is not None and spec.name.startswith("pinfer_llm.cli."))


def interrupts_raise() -> None:
    """From here on Ctrl-C raises KeyboardInterrupt, which each command turns into one line (formats.errors.report):
    called first thing inside each command's own error handling, so that until then (imports, typer building and
    parsing the command line) the early handler answers: typer turned a KeyboardInterrupt while it parsed into a
    silent exit 130, and one while it built the command into a traceback."""
    if signal.getsignal(signal.SIGINT) is _interrupted_early:
        signal.signal(signal.SIGINT, signal.default_int_handler)


if _is_a_command() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    try:
        signal.signal(signal.SIGINT, _interrupted_early)
    except ValueError:  # not the main thread: nothing to do
        pass
