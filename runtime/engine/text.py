"""Output text assembly: incremental detokenisation plus stop-string matching.

Stop strings are matched on text, not tokens: a stop string may end in the middle of a
token or span several. Text that could be the beginning of a stop string is held back
until the next token decides, so a streamed response never shows part of a stop string
it later has to take back.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..tokenizer import IncrementalDetokenizer


def _held_suffix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class TextStream:
    """Feeds tokens through a detokenizer; returns text safe to emit and whether to stop."""

    def __init__(
        self, detokenizer: IncrementalDetokenizer, stops: Sequence[str] = (), include_stop: bool = False
    ) -> None:
        self._detok = detokenizer
        self._stops = tuple(stops)
        self._include_stop = include_stop
        self._pending = ""
        self.stopped_on: str | None = None

    def push(self, token_id: int, *, emit_text: bool = True, match_stops: bool = True) -> tuple[str, bool]:
        """Add one token; return ``(text to emit now, stop string matched)``.

        ``emit_text=False`` consumes the token without showing its text (a stop token).
        ``match_stops=False`` matches no stop string ending in this token's text (vLLM's
        ``min_tokens``), but still holds back what a later token may complete into one.
        A match always ends in the new token's text: one inside the held-back text was
        refused when it was new.
        """
        new = self._detok.push(token_id)
        if not emit_text:
            return "", False
        held_before = len(self._pending)
        buf = self._pending + new
        if not self._stops:
            self._pending = ""
            return buf, False
        hit_pos, hit = -1, None
        for stop in self._stops if match_stops and new else ():
            pos = buf.find(stop, max(held_before - len(stop) + 1, 0))
            if pos != -1 and (hit_pos == -1 or pos < hit_pos):
                hit_pos, hit = pos, stop
        if hit is not None:
            self._pending = ""
            self.stopped_on = hit
            end = hit_pos + len(hit) if self._include_stop else hit_pos
            return buf[:end], True
        held = _held_suffix_len(buf, self._stops)
        self._pending = buf[len(buf) - held :] if held else ""
        return buf[: len(buf) - held], False

    def finish(self) -> str:
        """At the end (not on a stop string): everything still held back."""
        if self.stopped_on is not None:
            return ""
        tail = self._pending + self._detok.flush()
        self._pending = ""
        return tail
