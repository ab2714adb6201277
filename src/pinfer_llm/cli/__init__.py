"""The pi-* commands: thin typer CLIs over the library (pi-run, pi-profile, pi-plan, pi-serve), their shared
options (options.py) and the terminal chat. Nothing outside this package imports it."""

from pinfer_llm.cli.threads import default_wait_policy

default_wait_policy()  # before anything imports torch (libgomp reads its environment once, at load)
