"""Progress of a long read (`replay`, `check`) on stderr: a redrawn bar on a terminal, a
log line every 10 s otherwise, or nothing."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

log = logging.getLogger("kvbridge")

# (offsets read so far, offsets to read in all; None when unbounded): TopicReader.progress()
Offsets = tuple[int, "int | None"]

MODES = ("auto", "bar", "log", "off")


def add_progress_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--progress",
        choices=MODES,
        default="auto",
        help="progress on stderr: a bar on a terminal, a log line every 10 s otherwise (auto)",
    )


class Progress:
    """Records read, records/s and % of the offsets to read.

    Fed one record at a time with :meth:`tick` (it asks ``offsets()`` only when it draws), or
    with running totals with :meth:`update`. ``mode`` "auto" is "bar" when ``stream`` is a
    terminal, else "log"; ``label`` starts each log line.
    """

    def __init__(
        self,
        offsets: Callable[[], Offsets] | None = None,
        mode: str = "auto",
        stream: TextIO | None = None,
        label: str = "replay",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r}: expected one of {', '.join(MODES)}")
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "log"
        self.mode = mode
        self.label = label
        self.interval = 0.2 if mode == "bar" else 10.0
        self.started = time.monotonic()
        self.last = self.started
        self.n = 0
        self.drawn = False
        self._offsets = offsets
        self._seen: Offsets = (0, None)

    def tick(self) -> None:
        """One more record (the clock is read once every 256)."""
        self.n += 1
        if self.mode != "off" and not self.n & 255:
            self._show_if_due()

    def update(self, n: int, offsets: Offsets) -> None:
        """``n`` records read so far, at ``offsets``."""
        self.n, self._seen = n, offsets
        if self.mode != "off":
            self._show_if_due()

    def _show_if_due(self) -> None:
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self.show(now)

    def offsets(self) -> Offsets:
        return self._offsets() if self._offsets is not None else self._seen

    def line(self, now: float) -> str:
        rate = self.n / max(now - self.started, 1e-9)
        done, total = self.offsets()
        if total:
            pct = min(100.0, 100.0 * done / total)
            width = 30
            fill = int(width * pct / 100)
            bar = "#" * fill + "-" * (width - fill)
            return f"[{bar}] {pct:5.1f}%  {self.n:,} records  {rate:,.0f} rec/s"
        return f"{self.n:,} records  {rate:,.0f} rec/s"

    def show(self, now: float) -> None:
        if self.mode == "bar":
            self.stream.write("\r" + self.line(now) + "\x1b[K")
            self.stream.flush()
            self.drawn = True
        elif self.mode == "log":
            log.info("%s: %s", self.label, self.line(now))

    def clear(self) -> None:
        """Erase the bar's line (before other output on the terminal); it is redrawn later."""
        if self.mode == "bar" and self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def done(self) -> None:
        """The last figures: the bar's final state and a newline (nothing in log mode)."""
        if self.mode == "bar" and (self.drawn or self.n):
            self.show(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
