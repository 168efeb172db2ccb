"""Smoke tests of the benchmark suite (bench/): tiny sizes, structure only, no speed asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from bench import e2e, report
from bench.ceiling import run_ceiling
from bench.e2e import RunContext, drain_run, latency_run
from bench.feeder import stamp
from bench.latency import percentile, read_head, summarize
from bench.workload import WorkloadConfig, describe, generate, pod_payloads
from bridge.log.markers import StreamStarted
from bridge.log.records import Envelope, RecordCodec
from bridge.simulator import PodSpec, SimulatedFleet
from bridge.vllm.decoder import decode_batch
from bridge.vllm.events import BlockStored
from bridge.vllm.jsonview import event_to_json

REPO = Path(__file__).resolve().parents[2]
TINY = WorkloadConfig(pods=2, batches_per_pod=80, seed=3)


def test_workload_is_deterministic_by_seed():
    assert generate(TINY) == generate(TINY)
    assert generate(TINY) != generate(replace(TINY, seed=4))


def test_workload_has_the_promised_mix():
    d = describe(generate(replace(TINY, clear_prob=0.05)))
    assert d["batches"] == 160
    assert set(d["by_type"]) == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert d["event_forms"]["map"] > 0 and d["event_forms"]["array"] > 0  # 0.33.0 and 0.23.0
    assert d["stored_blocks_min"] >= 1 and d["stored_blocks_max"] <= 32
    assert d["tokens_per_block"] == [16]  # token ids included, 16 per block
    assert d["hashes_per_removed"] == [1]
    assert d["hash_kinds"] == {"int": d["hash_kinds"]["int"]}
    bytes_mode = describe(generate(replace(TINY, hash_mode="bytes")))
    assert set(bytes_mode["hash_kinds"]) == {"32-byte"}


def test_workload_equals_what_the_simulator_sends():
    """The ceiling's payloads are the simulated pods' payloads (apart from the timestamp)."""
    config = replace(TINY, batches_per_pod=30)
    specs = [
        PodSpec(
            name=name,
            model=config.model,
            release=config.release_of(i),
            rate=0,
            batches=config.batches_per_pod,
            seed=config.seed,
            cache=config.model_config(),
        )
        for i, name in enumerate(config.pod_names())
    ]
    with SimulatedFleet(*specs) as fleet:
        fleet.wait_done(timeout=20)
        for i, name in enumerate(config.pod_names()):
            sent = [payload for _, payload in fleet[name].publisher(0).buffer]
            mine = list(pod_payloads(config, i))
            assert [stamp(p, 0.0) for p in sent] == [stamp(p, 0.0) for p in mine]
            logged = [r["events"] for r in fleet.sent(name)]
            decoded = [[event_to_json(e) for e in decode_batch(p).events] for p in mine]
            assert logged == decoded


def test_stamp_replaces_only_the_timestamp():
    payload = generate(TINY)[0]
    stamped = stamp(payload, 1234.5)
    assert decode_batch(stamped).ts == 1234.5
    assert decode_batch(stamped).events == decode_batch(payload).events
    assert len(stamped) == len(payload)


def test_read_head_matches_the_record_codec():
    codec = RecordCodec()
    cases = [
        (
            Envelope("pod-ü", "m", 0, 1_767_225_600_000, 0, 0, 1767225600.25),
            BlockStored([], None, [], 16),
        ),
        (Envelope("p", "", 7, 1, 2**40, 12, 0.0), BlockStored([b"\x01" * 8], None, [1] * 16, 16)),
        (Envelope("x" * 300, "model", 3, 5, 9, -1, 1e9), StreamStarted(0, "tcp://h:1")),
    ]
    for env, event in cases:
        head = read_head(codec.encode(env, event))
        assert head == (env.pod, env.model, env.dp_rank, env.epoch, env.seq, env.index, env.ts)
    with pytest.raises(ValueError):
        read_head(b"\x00" * 20)


def test_percentiles_use_nearest_rank():
    values = [float(i) for i in range(1, 1001)]
    assert percentile(values, 50) == 500.0
    assert percentile(values, 99) == 990.0
    assert percentile(values, 99.9) == 999.0
    s = summarize([0.001, 0.002, 0.003])
    assert s["samples"] == 3 and s["p50_ms"] == 2.0 and s["max_ms"] == 3.0


def test_ceiling_counts_every_event_of_the_payloads():
    payloads = generate(TINY)
    d = describe(payloads)
    r = run_ceiling(payloads, "tiny")
    assert r["events"] == d["events"] and r["batches"] == d["batches"]
    assert r["payload_bytes"] == d["payload_bytes"]
    assert r["avro_bytes"] > r["events"] * 10  # every event became a record
    for key in report.CEILING_KEYS:
        assert key in r
    assert r["cpu_us_per_event"] > 0 and r["events_per_s"] > 0


def test_ceiling_only_cli_run_writes_a_valid_report(tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--only", "ceiling", "--quick", "--batches", "160"]
        + ["--ceiling-batches", "60", "--results-dir", str(tmp_path), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    doc = json.loads(out.read_text())
    assert report.validate(doc) == []
    assert [c["same_payloads_as_e2e"] for c in doc["ceiling"]] == [True, False, False, False]
    assert doc["ceiling"][0]["events"] == doc["workload"]["events"]
    assert "skipped" in doc["naive"] and doc["bridge"] == {"scaling": [], "latency": []}
    saved = [p for p in tmp_path.glob("*.json") if p != out]
    assert len(saved) == 1 and json.loads(saved[0].read_text()) == doc
    assert "ceiling: e2e mix, 16 pods" in proc.stdout


def test_validate_names_what_is_missing():
    doc = {"bench": {"schema_version": 1}, "ceiling": [{"label": "x"}], "bridge": {}}
    problems = report.validate(doc)
    assert "missing top-level key 'naive'" in problems
    assert any(p.startswith("ceiling[0]: missing 'events'") for p in problems)
    assert any(p.startswith("bridge: expected") for p in problems)


def test_ratios_come_from_the_same_document():
    doc = {
        "ceiling": [{"label": "c", "same_payloads_as_e2e": True, "events_per_s": 100.0}]
        + [{"label": "d", "same_payloads_as_e2e": False, "events_per_s": 1.0}],
        "naive": {"pods": 2, "events_per_s": 40.0, "cpu_us_per_event": 10.0},
        "bridge": {"scaling": [{"pods": 2, "events_per_s": 50.0, "cpu_us_per_event": 20.0}]},
    }
    doc["ceiling"][0]["cpu_us_per_event"] = 5.0
    ratios = {r["name"]: r["value"] for r in report.compute_ratios(doc, ref_pods=2)}
    assert ratios == {
        "bridge/ceiling events/s": 0.5,
        "bridge/ceiling CPU per event": 4.0,
        "bridge/naive events/s": 1.25,
        "bridge/naive CPU per event": 2.0,
    }


def test_tiny_end_to_end_drain_and_latency(kafka_bootstrap, tmp_path, monkeypatch):
    """The real protocol on a real broker: pause, backlog, resume, count; then a latency run."""
    monkeypatch.setattr(e2e, "START_DELAY", 1.5)
    ctx = RunContext(kafka_bootstrap, None, tmp_path, TINY, print)
    r = drain_run(ctx, "bridge", pods=2, batches_per_pod=40, tag="smoke")
    for key in report.DRAIN_KEYS:
        assert key in r
    assert r["complete"] and r["workload_matches_simulator"]
    assert r["events"] == r["events_sent"] == r["bridge_metrics"]["kvbridge_events_in_total"]
    assert r["records"] == r["events"] + 2  # one StreamStarted per stream
    assert r["records_before_resume"] == 0
    lat = latency_run(ctx, 2, 0.5, 2000.0, 6.7, seconds=1.5, warmup=0.3, tag="smoke-lat")
    for key in report.LATENCY_KEYS:
        assert key in lat
    assert lat["complete"] and lat["samples"] > 0
    assert lat["p50_ms"] <= lat["p99_ms"] <= lat["p999_ms"]


@pytest.mark.kafka
def test_tiny_drain_with_two_workers(kafka_bootstrap, tmp_path, monkeypatch):
    """`--workers 2`: both workers resumed, measured and counted; every event once."""
    monkeypatch.setattr(e2e, "START_DELAY", 1.5)
    ctx = RunContext(kafka_bootstrap, None, tmp_path, TINY, print)
    r = drain_run(ctx, "bridge", pods=4, batches_per_pod=30, tag="smoke-w", workers=2)
    assert r["workers"] == 2
    assert r["complete"] and r["workload_matches_simulator"]
    assert r["events"] == r["events_sent"] == r["bridge_metrics"]["kvbridge_events_in_total"]
    assert r["records"] == r["events"] + 4  # one StreamStarted per stream, across both workers
