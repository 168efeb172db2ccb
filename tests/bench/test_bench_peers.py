"""The bench's peers part (bench/peers.py): payload files, the skip without Go, its tables.

No Go build here (the first one takes minutes); `python -m bench --only peers` runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report
from bench.peers import MAGIC, PRIMARY, _python_side, _summary, read_payloads, write_payloads
from bench.workload import WorkloadConfig, describe, generate

REPO = Path(__file__).resolve().parents[2]


def test_payload_file_round_trips(tmp_path):
    payloads = generate(WorkloadConfig(pods=2, batches_per_pod=40, seed=1)) + [b"", b"\x90"]
    path = tmp_path / "p.bin"
    write_payloads(path, payloads)
    data = path.read_bytes()
    assert data[:8] == MAGIC and int.from_bytes(data[8:12], "little") == len(payloads)
    assert len(data) == 12 + sum(4 + len(p) for p in payloads)
    assert read_payloads(path) == payloads


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda d: b"KVBPAYL2" + d[8:], "bad magic"),
        (lambda d: d[:-1], "truncated in payload 2 of 3"),
        (lambda d: d[:-4], "truncated at payload 2 of 3"),
        (lambda d: d + b"x", "1 bytes after the last payload"),
    ],
)
def test_a_bad_payload_file_is_refused(tmp_path, mangle, message):
    path = tmp_path / "p.bin"
    write_payloads(path, [b"abc", b"defg", b"hi"])
    path.write_bytes(mangle(path.read_bytes()))
    with pytest.raises(ValueError, match=message):
        read_payloads(path)


def test_python_side_counts_every_event():
    payloads = generate(WorkloadConfig(pods=2, batches_per_pod=60, seed=2))
    events = describe(payloads)["events"]
    side = _python_side(payloads)
    assert set(side) == {"kvbridge_decode", "kvbridge_decode_encode", "python_unpackb"}
    for r in side.values():
        assert r["events"] == events and r["batches"] == len(payloads)
        assert r["cpu_seconds"] > 0 and r["wall_seconds"] > 0


def test_without_go_the_part_is_skipped_with_a_note(tmp_path):
    out = tmp_path / "out.json"
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--only", "peers", "--quick", "--batches", "160"]
        + ["--ceiling-batches", "60", "--results-dir", str(tmp_path), "--out", str(out)],
        cwd=REPO,
        env={**os.environ, "PATH": str(empty)},  # no `go` to be found
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    doc = json.loads(out.read_text())
    assert report.validate(doc) == []
    assert "no `go` command on PATH" in doc["peers"]["skipped"]
    assert any(n.startswith("peers skipped: no `go` command") for n in doc["notes"])
    assert "Peers: no `go` command on PATH" in proc.stdout
    assert doc["ceiling"] == [] and doc["ratios"] == []  # nothing else ran


def _result(decoder: str, workload: str, cpu_us: float | None, failed: int = 0) -> dict:
    runs = [
        {
            "batches": 10,
            "ok_batches": 10 - failed,
            "failed_batches": failed,
            "events": 0 if failed == 10 else 70,
            "cpu_seconds": (cpu_us or 1.0) * 70 / 1e6 * k,
            "wall_seconds": 0.001,
            **({"first_error": "event 0: expected msgpack array"} if failed else {}),
        }
        for k in (1.0, 1.5, 0.9)  # three rounds: the median is the first
    ]
    return {"workload": workload, "decoder": decoder, "name": decoder} | _summary(runs, 70)


def test_peer_tables_and_ratios_come_from_the_document():
    maps = "0.33.0 map, int hashes"
    results = [
        _result("aibrix", PRIMARY, 2.0),
        _result("aibrix", maps, None, failed=10),
        _result("kvbridge_decode", PRIMARY, 4.0),
        _result("kvbridge_decode", maps, 5.0),
    ]
    peers = {
        "rounds": 3,
        "pinned_cpu": 1,
        "primary": PRIMARY,
        "go": {"version": "go1.26.8", "gomaxprocs": 1, "modules": {}},
        "workloads": [
            {"label": PRIMARY, "batches": 10, "events": 70},
            {"label": maps, "batches": 10, "events": 70},
        ],
        "results": results,
    }
    assert results[0]["cpu_us_per_event"] == 2.0  # the median of 2.0, 3.0, 1.8
    assert results[0]["cpu_us_per_event_min"] == 1.8 and results[0]["accepts_all"]
    rejected = results[1]
    assert not rejected["accepts_all"] and not rejected["events_agree"]
    assert "cpu_us_per_event" not in rejected  # per event only when every batch decoded
    doc = {"peers": peers}
    ratios = report.compute_ratios(doc, ref_pods=16)
    assert [(r["name"], r["value"]) for r in ratios] == [
        ("kvbridge decode / AIBrix speed per core (target >= 1.0)", 0.5)
    ]
    text = "\n".join(report._render_peers(peers))
    assert "rejects 10/10" in text and "aibrix on 0.33.0 map, int hashes: event 0" in text
    assert report._render_peers({"skipped": "not selected"}) == []
