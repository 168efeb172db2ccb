"""Rate-limited logging for per-pod bad input: one line per key per interval, with a count."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._log = logger
        self._interval = interval
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def warning(self, pod: str, kind: str, msg: str, *args: object) -> None:
        key = (pod, kind)
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        skipped = self._suppressed.pop(key, 0)
        suffix = f" ({skipped} more like this suppressed)" if skipped else ""
        self._log.warning("pod %s: " + msg + suffix, pod, *args)
