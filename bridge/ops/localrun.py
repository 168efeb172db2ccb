"""Running kvbridge pieces as local child processes: free ports, waiting, child processes.

Shared by the test suite (``tests/e2e_util.py``) and the benchmarks (``bench/procs.py``),
which both start simulated pods, bridges and brokers on 127.0.0.1.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ChildProc", "WaitTimeout", "free_port", "free_port_block", "wait_until"]

PORT_RANGE = (10_000, 20_000)


class WaitTimeout(TimeoutError, AssertionError):
    """A condition did not hold in time (an AssertionError too, so tests report it as one)."""


def free_port() -> int:
    """A port free on 127.0.0.1 right now (chosen by the kernel)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port_block(n: int) -> int:
    """A base port such that base .. base+n-1 are free on 127.0.0.1 right now.

    Taken from 10000-20000: below the kernel's ephemeral range (where outgoing connections,
    e.g. to Kafka, get their local ports, so a port found free cannot be taken by one a
    moment later) and below the simulator's own automatic ports.
    """
    lo, hi = PORT_RANGE
    hi = min(hi, _ephemeral_low()) - n
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(lo, max(lo + 1, hi))
        ok = True
        for port in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"found no block of {n} free ports on 127.0.0.1")


def wait_until(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``cond`` until it returns something truthy, and return that; :class:`WaitTimeout`
    naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


class ChildProc:
    """A child process whose output (stdout and stderr) goes to ``log_path``."""

    def __init__(
        self,
        argv: list[str],
        log_path: Path,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        stdin: int | None = None,
    ) -> None:
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.p = subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL if stdin is None else stdin,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
        )
        self.pid = self.p.pid
        self._paused = False

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def alive(self) -> bool:
        return self.p.poll() is None

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self._paused = False

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (resuming a paused process first), SIGKILL after ``timeout``; the exit code."""
        if self.p.poll() is None:
            if self._paused:
                self.resume()
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        if not self._log.closed:
            self._log.close()
        return self.p.returncode
