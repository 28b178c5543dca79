"""Per-sequence text output: incremental detokenization plus stop strings.

Text that could still turn out to be the start of a stop string is held back until it
can be decided, so a client never receives text that is later retracted.
"""

from __future__ import annotations

from typing import Sequence


class TextStream:
    def __init__(self, detokenizer, stop: Sequence[str] = ()) -> None:
        self._detok = detokenizer
        self._stop = tuple(stop)
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""  # decoded, not yet emitted
        self.text = ""  # emitted so far (the final text once finished)
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        """Feed new tokens; return the text that became final. Sets ``stopped`` when a
        stop string appears (the stop string and everything after it are dropped)."""
        if self.stopped:
            return ""
        return self._emit(self._pending + self._detok.push(token_ids), final=False)

    def finish(self) -> str:
        """End of generation: emit whatever is left."""
        if self.stopped:
            return ""
        return self._emit(self._pending + self._detok.flush(), final=True)

    def _emit(self, candidate: str, final: bool) -> str:
        if self._stop:
            # search from where a stop string could start (it may straddle the boundary)
            start = max(0, len(self.text) - self._max_hold)
            window = self.text[start:] + candidate
            cut = min(
                (i for i in (window.find(s) for s in self._stop) if i >= 0), default=-1
            )
            if cut >= 0:
                keep = start + cut - len(self.text)  # chars of candidate before the stop
                out = candidate[: max(keep, 0)]
                self.text += out
                self._pending = ""
                self.stopped = True
                return out
            if not final:
                hold = self._held_suffix(candidate)
                self._pending = candidate[len(candidate) - hold :] if hold else ""
                candidate = candidate[: len(candidate) - hold]
        else:
            self._pending = ""
        self.text += candidate
        return candidate

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
