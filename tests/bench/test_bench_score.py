"""Smoke test of bench/score.py (tiny sizes, structure only; no speed asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_score_bench_runs_and_writes_its_json(tmp_path):
    args = ["--pods", "8", "--queries", "30", "--prompt-tokens", "2048", "--memory-pods", "4",
            "--ingest-batches", "40", "--repeats", "1"]  # fmt: skip
    got = subprocess.run(
        [sys.executable, "-m", "bench.score", *args, "--results-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert got.returncode == 0, got.stderr
    (path,) = tmp_path.glob("score-*.json")
    r = json.loads(path.read_text())
    assert r["fleet"]["indexed_blocks"] > 0 and not r["fleet"]["skipped"]
    q = r["queries"]
    assert [q[k]["queries"] for k in ("turn", "new", "cold", "all")] == [10, 10, 10, 30]
    assert q["turn"]["best_tokens_mean"] > 0 and q["new"]["best_tokens_mean"] > 0
    assert q["cold"]["best_tokens_mean"] == 0 and q["cold"]["rows_mean"] == 0
    assert q["new"]["rows_mean"] == 8  # every pod holds the system prompts
    assert q["limit"] == 8
    for tag in ("before", "limit"):  # the A/B and the limited answer, timed alongside
        assert q["all"][tag]["lib_p99_us"] >= q["all"][tag]["lib_p50_us"] > 0
        assert q["all"][tag]["server_p99_us"] >= q["all"][tag]["server_p50_us"] > 0
    assert len(r["load_average"]) == 3
    assert "p99 <= 1 ms" in got.stdout and "before the p99 round" in got.stdout
    assert r["memory"]["with_index"] > r["memory"]["without_index"] > 0
    assert set(r["ingest"]["apply_per_s"]) == {"with_index", "without_index"}
    assert "lib p99 us" in got.stdout
