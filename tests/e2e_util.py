"""Helpers for end-to-end tests: real `kvbridge` processes, a real broker, waiting on conditions."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def free_port_block(n: int) -> int:
    """A base port such that base..base+n-1 are all free on 127.0.0.1 right now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no block of free ports found")


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Proc:
    """A `python -m bridge ...` subprocess whose output goes to a file shown on failure."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.p = subprocess.Popen(
            [sys.executable, "-m", "bridge", *args],
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=full_env,
        )

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()
        return self.p.returncode


def run_cli(args: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bridge", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_json(path: Path) -> Any:
    """The JSON document at ``path``, or None while it is missing or still being written."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line still being written
    return out


def metric_totals(url: str) -> dict[str, float]:
    """Prometheus samples summed over all labels, and also per ``outcome``/``kind``/``type``."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    text = urlopen(url, timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
            for label in ("outcome", "kind", "type"):
                if label in sample.labels:
                    key = f'{sample.name}{{{label}="{sample.labels[label]}"}}'
                    out[key] = out.get(key, 0.0) + sample.value
    return out
