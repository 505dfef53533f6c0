"""Stop strings over streamed text: stop as soon as one completes, never stream any part of one.

Text arrives in deltas (one per token, from the detokenizer) and a stop string may be split across them. The
checker holds back the longest suffix of the text that is a prefix of some stop string: it may still become a
stop, so it is not streamed yet. When several stops occur, the one that completes first in the text wins (ties:
the one that starts first), which is what a character-by-character reader would see; so the result does not
depend on how the text was cut into deltas. Text after the stop is dropped. ``include_stop_str_in_output``
appends the stop string itself (nothing needs holding back then: every character up to the stop's end is
output anyway). Stop token ids are the engine's business, not this class's.
"""
from __future__ import annotations


class StopChecker:
    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False):
        self.stops = [s for s in dict.fromkeys(stop) if s]  # unique, non-empty, order kept
        self.include = include_stop_str_in_output
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""          # text seen but not emitted (could still start a stop string)
        self._tail = ""          # the last emitted characters a stop string could still straddle
        self.stopped: str | None = None

    def feed(self, new_text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string matched or None). After a stop, always ("", stop)."""
        if self.stopped is not None:
            return "", self.stopped
        if not self.stops:
            return new_text, None
        buf = self._held + new_text
        ctx = self._tail
        full = ctx + buf
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stops:
            # only matches that end inside the new part: anything earlier would have stopped already
            i = full.find(s, max(0, len(ctx) - len(s) + 1))
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            end, start, s = best
            self.stopped = s
            self._held = ""
            return full[len(ctx):end if self.include else start], s
        keep = 0 if self.include else self._partial(buf)
        emit, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self._tail = (ctx + emit)[-(self._longest - 1):] if self._longest > 1 else ""
        return emit, None

    def _partial(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        """At the end of generation (no stop matched): the held-back text, now known not to be a stop."""
        if self.stopped is not None:
            return ""
        out, self._held = self._held, ""
        return out
