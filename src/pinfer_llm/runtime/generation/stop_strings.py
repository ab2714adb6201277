"""Stop strings matched in the text as it streams, across token boundaries.

Text arrives in deltas (one token may be part of a character, a stop string may span many tokens). StopStrings holds
back the longest tail of what it has seen that could still grow into a stop string, so no part of a stop string is
ever emitted, and emits everything else at once. The stop string that completes first ends the text, so the result
does not depend on how the text was split into tokens.

    stops = StopStrings(["\\nUser:"])
    for delta in deltas:
        out = stops.push(delta)     # text safe to send now
        if stops.stopped: break     # out is the text before the stop string
    out = stops.flush()             # at the end of generation without a stop: what was held back
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.held = ""  # received, not yet emitted: a suffix that is a prefix of some stop string
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, delta: str) -> str:
        if self.stopped:
            return ""
        text = self.held + delta
        # the stop string that completes first ends the text, whichever way the text was split into deltas; of
        # two that complete together, the longer (earlier starting) one
        hits = [(i + len(s), i) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            end, start = min(hits)
            self.stopped, self.held, self.matched = True, "", text[start:end]
            return text[:start]
        keep = self._partial_tail(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
