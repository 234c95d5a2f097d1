"""Stop strings: cut generated text at the first stop string, even when it spans tokens."""

from __future__ import annotations


class StopMatcher:
    """Feed text as it is generated; emits only text that can no longer become part of a stop string.

    The stop string itself is never emitted. Work per `feed` is bounded by the longest stop
    string, not by the length of the output.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.stopped: str | None = None

    def feed(self, text: str) -> str:
        """Returns the text that is now safe to emit; sets `stopped` when a stop string matched."""
        if self.stopped is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        # Generation halts where a stop string is first complete, so the match that ends
        # first wins (the longest one on a tie), whatever the chunking was.
        first = None
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0 and (first is None or (i + len(stop), i) < (first[0] + len(first[1]), first[0])):
                first = (i, stop)
        if first is not None:
            self._held = ""
            self.stopped = first[1]
            return buf[: first[0]]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def finish(self) -> str:
        """The end of generation: whatever was held back is plain text after all."""
        held, self._held = self._held, ""
        return "" if self.stopped is not None else held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
