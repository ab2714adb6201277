"""Text out of token generation, shared by pi-run and pi-serve: printable deltas (stream.py), stop strings,
chat templates (chat.py) and TextGeneration (textgen.py)."""
