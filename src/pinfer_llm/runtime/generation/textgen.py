"""Text out of a generation for the server and the terminal chat: printable deltas (a token may end inside a
character), stop strings matched across tokens, a cancel flag checked between tokens, and what an API response
reports at the end (finish reason, token counts).

    g = TextGeneration(m, ids, stop=["\\n\\n"], max_tokens=64, temperature=0.0, reuse_prefix=True)
    for delta in g: print(delta, end="")
    g.finish_reason, g.usage    # "stop" | "length" | "cancelled", {"prompt_tokens": ...}

TextOut is the same text handling pushed a token at a time, for generations that a batch advances
(serving/worker.py): out.push(tok) -> the delta, out.end(reason) -> what was held back.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from pinfer_llm.runtime.generation.stop_strings import StopStrings
from pinfer_llm.runtime.generation.stream import TextStream


class TextOut:
    """Tokens in, printable text out; `finish_reason` is set once a stop string matched or end() was called."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.text, self.stops = TextStream(tokenizer), StopStrings(stop)
        self.tokens: list[int] = []  # the generated token ids, those of a stop string too
        self.finish_reason: str | None = None
        self.stop_string: str | None = None  # the stop string that ended the text, if one did

    def push(self, tok: int) -> str:
        """The text this token makes printable (held back: a partial character, a possible stop string)."""
        if self.finish_reason is not None:
            return ""
        self.tokens.append(tok)
        out = self.stops.push(self.text.push(tok))
        if self.stops.stopped:
            self.finish_reason, self.stop_string = "stop", self.stops.matched
        return out

    def end(self, reason: str) -> str:
        """The generation ended ("stop": an end-of-turn token; "length": max_tokens or a full context;
        "cancelled"): the text held back, unless a stop string already ended it or it was cancelled."""
        if self.finish_reason is not None:
            return ""
        self.finish_reason = reason
        if reason == "cancelled":
            return ""
        # the whole answer goes out, a character left incomplete by the last token too
        out = self.stops.push(self.text.text[self.text.sent:])
        if self.stops.stopped:
            self.finish_reason, self.stop_string = "stop", self.stops.matched
        else:
            out += self.stops.flush()
        return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class TextGeneration:
    def __init__(self, m, ids: Sequence[int], stop: Sequence[str] = (), cancel: threading.Event | None = None,
                 **generate_kw):
        self.m, self.ids, self.cancel = m, list(ids), cancel
        # checks the prompt now (Model.generate does), so a bad one fails before anything is streamed
        self._tokens = m.generate(self.ids, **generate_kw)
        self.out = TextOut(m.tokenizer, stop)
        self.completion_tokens = 0
        self.cached_tokens = 0

    @property
    def finish_reason(self) -> str | None:
        return self.out.finish_reason

    @property
    def stop_string(self) -> str | None:
        return self.out.stop_string

    @property
    def tokens(self) -> list[int]:
        return self.out.tokens

    def __iter__(self) -> Iterator[str]:
        try:
            for tok in self._tokens:
                self.completion_tokens += 1
                out = self.out.push(tok)
                if out:
                    yield out
                if self.out.finish_reason is not None:
                    return
                if self.cancel is not None and self.cancel.is_set():
                    self.out.end("cancelled")
                    return
            # an end-of-turn token is "stop"; max_tokens and a full context are both "length", as in OpenAI's API
            out = self.out.end("stop" if self.m.stats.stop_reason == "stop" else "length")
            if out:
                yield out
        finally:
            self._tokens.close()
            if self.completion_tokens:  # else the generator never started and the stats are the last call's
                self.cached_tokens = self.m.stats.reused_tokens

    @property
    def usage(self) -> dict:
        return usage(len(self.ids), self.completion_tokens, self.cached_tokens)
