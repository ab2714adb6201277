"""Printable text out of a growing token list (pi-run's output, the server's streamed deltas, the terminal chat)."""

from __future__ import annotations


class TextStream:
    """Turns a growing token list into printable text deltas: a token may end inside a multi-byte character, so
    text ending in U+FFFD is held back until the character completes.

    Each push decodes a short window, not the whole list: the tokens from the start of the last delta's window on.
    Decoding everything each time made a token's cost grow with the answer (0.23 ms at 2,000 tokens, SmolLM2's
    tokenizer; per client, on pi-serve's model thread). The window starts where an earlier delta ended on a whole
    character, and spans the tokens that delta came from as context: what a decoder does at the start of a text
    (SentencePiece strips one leading space) it does to both decodes compared, and a separator a decoder puts between
    two tokens falls inside the window. So the deltas join to the whole list's decode, as decoding it all each time
    gave (tests/test_text_stream.py)."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.sent = tokenizer, [], 0
        self._start = 0  # the window: ids[_start:] (a character boundary), of which ids[_start:_done] made _seen
        self._done = 0
        self._seen = ""

    def push(self, tok: int) -> str:
        self.ids.append(tok)
        text = self.tok.decode(self.ids[self._start:], skip_special=True)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self._seen):]
        self._start, self._done = self._done, len(self.ids)
        self._seen = self.tok.decode(self.ids[self._start:], skip_special=True)
        self.sent += len(delta)
        return delta

    @property
    def text(self) -> str:
        return self.tok.decode(self.ids, skip_special=True)
