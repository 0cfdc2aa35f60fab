"""Live progress inside a step's long phases on rank 0's console, at most a line every ``interval_s``."""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO


class PhaseProgress:
    def __init__(self, stream: Optional[TextIO] = None, interval_s: float = 10.0, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.enabled = enabled
        self.clock = clock
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._label = ""
        self._unit = ""
        self._total = 0
        self._t0 = self._last = 0.0
        self._done = 0
        self._counters: dict[str, float] = {}
        self._shown = False
        self.context = ""  # e.g. "step 3", set by the run's owner

    def start(self, label: str, total: int, unit: str) -> None:
        self._label, self._total, self._unit = label, total, unit
        self._t0 = self._last = self.clock()
        self._done, self._counters, self._shown = 0, {}, False

    def update(self, done: int, **counters: float) -> None:
        """``done`` units of ``total`` finished; counters are running totals (e.g. tokens=...)."""
        self._done = done
        self._counters.update(counters)
        now = self.clock()
        if self.enabled and now - self._last >= self.interval_s:
            self._last = now
            self._write(self.line(now))

    def finish(self) -> None:
        if self._shown and self._tty:
            self.stream.write("\n")
            self.stream.flush()
        self._shown = False

    def line(self, now: Optional[float] = None) -> str:
        elapsed = (self.clock() if now is None else now) - self._t0
        label = f"{self.context} {self._label}" if self.context else self._label
        parts = [f"{label}: {self._done}/{self._total} {self._unit}"]
        for name, value in self._counters.items():
            rate = f" ({value / elapsed:,.0f}/s)" if elapsed > 0 else ""
            parts.append(f"{int(value):,} {name}{rate}")
        parts.append(f"{elapsed:.0f} s")
        return ", ".join(parts)

    def _write(self, text: str) -> None:
        self._shown = True
        if self._tty:
            self.stream.write("\r\x1b[2K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
