"""Smoke test of bench/state.py (tiny sizes, structure only; no speed asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_state_bench_runs_and_writes_its_json(kafka_bootstrap, tmp_path):
    args = ["--events", "2000", "--memory-blocks", "2000", "--bootstrap", kafka_bootstrap]
    got = subprocess.run(
        [sys.executable, "-m", "bench.state", *args, "--results-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert got.returncode == 0, got.stderr
    (path,) = tmp_path.glob("state-*.json")
    r = json.loads(path.read_text())
    assert r["topic"]["records"] == r["read_decode"]["records"] == r["replay"]["records"] == 2000
    assert {"records_per_s", "applied_per_s", "resident_blocks"} <= set(r["replay"])
    assert [m["hash_bytes"] for m in r["memory"]] == [8, 32]
    assert all(m["bytes_per_block"] > 0 and m["resident_blocks"] >= 1984 for m in r["memory"])
    assert "memory/block, 8-byte hashes" in got.stdout
