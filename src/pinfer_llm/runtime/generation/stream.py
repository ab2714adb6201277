"""Printable text out of a growing token list (pi-run's output, the server's streamed deltas, the terminal chat)."""

from __future__ import annotations


class TextStream:
    """Turns a growing token list into printable text deltas: a token may end inside a multi-byte character, so
    text ending in U+FFFD is held back until the character completes."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.sent = tokenizer, [], 0

    def push(self, tok: int) -> str:
        self.ids.append(tok)
        text = self.tok.decode(self.ids, skip_special=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta

    @property
    def text(self) -> str:
        return self.tok.decode(self.ids, skip_special=True)
