"""The calibration corpus shipped with pinfer (*.txt here), and cutting text into profiling windows.

heldout.txt is never profiled: it is kept for perplexity measurements of profiled and sparse models.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.textfile import read_text

CORPUS_DIR = Path(__file__).parent
HELDOUT = CORPUS_DIR / "heldout.txt"  # never profiled: kept for perplexity measurements

def builtin_corpus() -> list[Path]:
    """The calibration texts shipped with the package (prose, dialogue, code, notes); not the held-out text."""
    return sorted(p for p in CORPUS_DIR.glob("*.txt") if p != HELDOUT)


def corpus_windows(tokenizer, files: Sequence[Path], ctx: int, max_tokens: int | None = None
                   ) -> tuple[list[list[int]], str]:
    """Tokenise each file (with the tokenizer's BOS handling) and cut it into windows of at most ctx tokens.

    Files are not concatenated across a window, so every window starts at a document boundary or continues one.
    Returns (windows, description of the corpus for ACT_CORPUS)."""
    if ctx < 2:
        raise PinferError(f"--ctx must be at least 2, got {ctx}")
    windows: list[list[int]] = []
    total, used = 0, []
    for p in files:
        p = Path(p)
        text = read_text(p, "corpus file")  # a FIFO, a device, a binary file: one line each
        ids = tokenizer.encode(text)
        if max_tokens is not None:
            ids = ids[:max(0, max_tokens - total)]
        if not ids:
            continue
        used.append(p.name)
        for s in range(0, len(ids), ctx):
            windows.append(ids[s:s + ctx])
        total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    if total == 0:
        raise PinferError("the corpus is empty; pass text files with --corpus")
    builtin = [p.name for p in builtin_corpus()]
    what = "built-in" if used and all(n in builtin for n in used) else "user"
    return windows, f"{what}: {', '.join(used)} ({total} tokens)"
