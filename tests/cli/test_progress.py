"""The progress printer of `kvbridge replay` and `kvbridge check`."""

from __future__ import annotations

import io
import logging

import pytest

from bridge.cli.progress import Progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_is_a_bar_on_a_terminal_and_log_lines_otherwise():
    tty, pipe = Tty(), io.StringIO()
    bar = Progress(lambda: (250, 1000), stream=tty)
    log_mode = Progress(lambda: (250, 1000), stream=pipe)
    assert (bar.mode, log_mode.mode) == ("bar", "log")
    bar.n = log_mode.n = 250
    bar.done()
    log_mode.done()
    assert tty.getvalue().startswith("\r[#######-----") and " 25.0%  250 records" in tty.getvalue()
    assert tty.getvalue().endswith("\n")
    assert pipe.getvalue() == ""  # log mode writes through logging, never raw bar output


def test_tick_draws_every_256_records_once_the_interval_is_past(caplog):
    stream = io.StringIO()
    p = Progress(lambda: (10, None), mode="log", stream=stream, label="replay")
    p.interval = 0.0
    with caplog.at_level(logging.INFO, logger="kvbridge"):
        for _ in range(255):
            p.tick()
        assert caplog.messages == []
        p.tick()
    assert caplog.messages[0].startswith("replay: 256 records  ")  # unbounded: no percentage
    assert stream.getvalue() == ""


def test_update_feeds_running_totals_and_clear_erases_the_bar():
    tty = Tty()
    p = Progress(mode="bar", stream=tty, label="check")
    p.interval = 0.0
    p.update(500, (500, 2000))
    assert "[#######-----" in tty.getvalue() and " 25.0%  500 records" in tty.getvalue()
    p.clear()
    assert tty.getvalue().endswith("\r\x1b[K")
    p.update(2000, (2000, 2000))
    p.done()
    last = tty.getvalue().rsplit("\r", 1)[-1]
    assert last.startswith("[" + "#" * 30 + "] 100.0%  2,000 records  ")
    assert last.endswith(" rec/s\x1b[K\n")


def test_off_writes_nothing(caplog):
    tty = Tty()
    p = Progress(lambda: (1, 1), mode="off", stream=tty)
    p.interval = 0.0
    with caplog.at_level(logging.INFO, logger="kvbridge"):
        for _ in range(1024):
            p.tick()
        p.update(2000, (2000, 2000))
        p.clear()
        p.done()
    assert tty.getvalue() == "" and caplog.messages == []


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="expected one of auto, bar, log, off"):
        Progress(mode="sometimes")
