"""Helpers for end-to-end tests: real `kvbridge` processes, a real broker, waiting on conditions."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bridge.ops import localrun

REPO = Path(__file__).resolve().parent.parent


def free_port_block(n: int) -> int:
    """A base port such that base..base+n-1 are all free on 127.0.0.1 right now."""
    return localrun.free_port_block(n)


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``cond`` until truthy; an AssertionError naming ``what`` after ``timeout`` s."""
    return localrun.wait_until(cond, timeout, what, interval)


class Proc(localrun.ChildProc):
    """A `python -m bridge ...` subprocess whose output goes to a file shown on failure."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        super().__init__([sys.executable, "-m", "bridge", *args], log_path, cwd=REPO, env=env)


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
