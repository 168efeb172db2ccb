"""Logging: human-readable lines by default, one JSON object per line with --log-format json.

The bridge logs one line per state change of a stream (connected, disconnected, replay, lost
batches, publisher restart, pod added or removed), never one per event at INFO; bad input is
logged at WARNING, rate-limited per pod.
"""

from __future__ import annotations

import json
import logging
import sys
import time

# Attributes every LogRecord has; anything else was passed with ``extra=`` and is emitted too.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra fields, "exc"}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Send every logger's records to stderr, as text or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


# librdkafka facilities whose messages are transient and retried by librdkafka itself, or
# reported by the bridge in its own words: DEBUG, not the WARNING/ERROR librdkafka gives them.
# GETPID: "Coordinator load in progress" on a fresh broker; FAIL/ERROR: "Connect to ... failed"
# (the error callback and the commands' "cannot reach Kafka" line say it once).
_LIBRDKAFKA_TRANSIENT = frozenset({"GETPID", "FAIL", "ERROR", "COORDERR", "FINDCOORD"})
_LIBRDKAFKA = "kvbridge.librdkafka"


class _Demote(logging.Filter):
    """Lowers librdkafka's transient messages to DEBUG (dropped unless DEBUG is on)."""

    def filter(self, record: logging.LogRecord) -> bool:
        facility = record.args[0] if isinstance(record.args, tuple) and record.args else None
        if facility in _LIBRDKAFKA_TRANSIENT and record.levelno > logging.DEBUG:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(_LIBRDKAFKA).isEnabledFor(logging.DEBUG)
        return True


def librdkafka_logger() -> logging.Logger:
    """The logger given to every librdkafka client (``"logger"`` in its config): its lines
    go through the bridge's logging at librdkafka's level instead of raw ``%4|...`` to stderr."""
    logger = logging.getLogger(_LIBRDKAFKA)
    if not any(isinstance(f, _Demote) for f in logger.filters):
        logger.addFilter(_Demote())
    return logger
