"""Text out of Model.generate for the server and the terminal chat: printable deltas (a token may end inside a
character), stop strings matched across tokens, a cancel flag checked between tokens, and what an API response
reports at the end (finish reason, token counts).

    g = TextGeneration(m, ids, stop=["\\n\\n"], max_tokens=64, temperature=0.0, reuse_prefix=True)
    for delta in g: print(delta, end="")
    g.finish_reason, g.usage    # "stop" | "length" | "cancelled", {"prompt_tokens": ...}
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from pinfer_llm.runtime.generation.stop_strings import StopStrings
from pinfer_llm.runtime.generation.stream import TextStream


class TextGeneration:
    def __init__(self, m, ids: Sequence[int], stop: Sequence[str] = (), cancel: threading.Event | None = None,
                 **generate_kw):
        self.m, self.ids, self.stop, self.cancel = m, list(ids), list(stop), cancel
        # checks the prompt now (Model.generate does), so a bad one fails before anything is streamed
        self._tokens = m.generate(self.ids, **generate_kw)
        self.finish_reason: str | None = None
        self.stop_string: str | None = None  # the stop string that ended the text, if one did
        self.tokens: list[int] = []  # the generated token ids, those of a stop string too
        self.completion_tokens = 0
        self.cached_tokens = 0

    def __iter__(self) -> Iterator[str]:
        text, stops = TextStream(self.m.tokenizer), StopStrings(self.stop)
        try:
            for tok in self._tokens:
                self.completion_tokens += 1
                self.tokens.append(tok)
                out = stops.push(text.push(tok))
                if out:
                    yield out
                if stops.stopped:
                    self.finish_reason, self.stop_string = "stop", stops.matched
                    return
                if self.cancel is not None and self.cancel.is_set():
                    self.finish_reason = "cancelled"
                    return
            # an end-of-turn token is "stop"; max_tokens and a full context are both "length", as in OpenAI's API
            self.finish_reason = "stop" if self.m.stats.stop_reason == "stop" else "length"
            # the whole answer goes out, a character left incomplete by the last token too
            out = stops.push(text.text[text.sent:])
            if stops.stopped:
                self.finish_reason, self.stop_string = "stop", stops.matched
            else:
                out += stops.flush()
            if out:
                yield out
        finally:
            self._tokens.close()
            if self.completion_tokens:  # else the generator never started and the stats are the last call's
                self.cached_tokens = self.m.stats.reused_tokens

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": len(self.ids), "completion_tokens": self.completion_tokens,
                "total_tokens": len(self.ids) + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
