"""A progress line on a terminal: one line of stderr rewritten in place, for the commands that
read for a while (`spanguard replay`, `spanguard backtest`)."""

from __future__ import annotations

import time
from typing import TextIO

__all__ = ["ProgressLine"]


class ProgressLine:
    """One line rewritten in place, at most once every `every` seconds; silent unless `enabled`
    (the caller says whether the stream is a terminal worth drawing on)."""

    def __init__(self, stream: TextIO, enabled: bool, every: float) -> None:
        self.stream, self.enabled, self.every = stream, enabled, every
        self._last_draw = 0.0

    def due(self) -> bool:
        """Whether to draw now (enabled, and `every` seconds since the last draw); a True
        counts as a draw."""
        now = time.monotonic()
        if not self.enabled or now - self._last_draw < self.every:
            return False
        self._last_draw = now
        return True

    def draw(self, text: str) -> None:
        self.stream.write("\r" + text)
        self.stream.flush()

    def clear(self) -> None:
        """Wipe the line, so a message written next starts on a clean line."""
        if self.enabled and self._last_draw:
            self.stream.write("\r" + " " * 79 + "\r")
            self.stream.flush()

    def close(self) -> None:
        self.clear()
