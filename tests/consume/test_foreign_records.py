"""Records the bridge did not write, in its topics: every reader skips, counts and goes on.

A tombstone (null value), another producer's bytes, an unknown schema fingerprint, a
truncated Avro body and a Confluent-framed value without a registry are produced with a
plain confluent_kafka Producer into a real kv-events topic among the bridge's records. Each
reader (TopicReader, `kvbridge consume`, `replay`, `check`, `state-sync`, `state --serve`,
the kv-state bootstrap) must end with exactly what it gives for the same topic without them,
and name where the skipped records are.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest
from confluent_kafka import Producer
from e2e_util import run_cli, wait_for

from bridge.consume.reader import TopicReader
from bridge.consume.state import CacheState
from bridge.consume.stateserve import LiveState, StateServer
from bridge.consume.statetopic import bootstrap_state
from bridge.log.markers import StreamStarted
from bridge.log.records import Envelope, Record, RecordCodec
from bridge.vllm.events import BlockRemoved, BlockStored

pytestmark = pytest.mark.kafka

CODEC = RecordCodec()
H = [bytes([0xB0 + i]) * 8 for i in range(8)]
PODS = {"pod-a": 0, "pod-b": 1}  # pod -> partition


def bridge_records() -> list[tuple[str, Record]]:
    """(pod, record) as the bridge writes them: a stream start, stores, a removal."""
    out = []
    for pod in PODS:
        seq = 0
        out.append((pod, Record(Envelope(pod, "m", 0, 5, 0, -1, 1.0), StreamStarted(0, "tcp://x"))))
        for i in range(0, 6, 2):
            ev = BlockStored(H[i : i + 2], None, [1, 2], 16, medium="GPU")
            out.append((pod, Record(Envelope(pod, "m", 0, 5, seq, 0, 2.0 + seq), ev)))
            seq += 1
        ev = BlockRemoved([H[0]], medium="GPU")
        out.append((pod, Record(Envelope(pod, "m", 0, 5, seq, 0, 9.0), ev)))
    return out


def foreign_values() -> list[tuple[bytes | None, str]]:
    """(value, words its skip reason contains) of records kvbridge never writes."""
    real = CODEC.encode(Envelope("pod-a", "m", 0, 5, 99, 0, 1.0), BlockRemoved([H[7]]))
    return [
        (None, "tombstone"),
        (b"hello from another producer", "neither Avro single-object"),
        (b"\xc3\x01" + b"\x11" * 8 + real[10:], "unknown schema"),
        (real[: len(real) // 2], "truncated"),
        (b"\x00\x00\x00\x00\x07" + real[10:], "no schema registry"),
    ]


class TopicWriter:
    """Produces into one topic with explicit partitions; remembers where each record went."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.topic = topic
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})

    def send(self, partition: int, key: bytes | None, value: bytes | None) -> tuple[int, int]:
        where: list[tuple[int, int]] = []

        def delivered(err: Any, msg: Any) -> None:
            assert err is None, err
            where.append((msg.partition(), msg.offset()))

        self.producer.produce(self.topic, value, key, partition, on_delivery=delivered)
        assert self.producer.flush(30) == 0
        return where[0]


def write_topics(bootstrap: str, clean: str, mixed: str) -> list[tuple[int, int, str]]:
    """The bridge's records into both topics; into ``mixed`` also a foreign record after
    every other one. Returns (partition, offset, reason words) of the foreign records."""
    cw, mw = TopicWriter(bootstrap, clean), TopicWriter(bootstrap, mixed)
    foreign = foreign_values()
    placed = []
    for i, (pod, rec) in enumerate(bridge_records()):
        value = CODEC.encode(rec.envelope, rec.event)
        cw.send(PODS[pod], pod.encode(), value)
        mw.send(PODS[pod], pod.encode(), value)
        if i % 2 == 0 and foreign:
            bad, why = foreign.pop(0)
            p = 1 - PODS[pod]
            placed.append((*mw.send(p, b"someone-else" if bad else pod.encode(), bad), why))
    assert not foreign
    return placed


@pytest.fixture
def topics(make_topic, kafka_bootstrap):
    clean, mixed = make_topic(partitions=2), make_topic(partitions=2)
    return clean, mixed, write_topics(kafka_bootstrap, clean, mixed)


def read(bootstrap: str, topic: str) -> tuple[list[Record], TopicReader]:
    with TopicReader(bootstrap, topic) as reader:
        return [cr.record for cr in reader.read()], reader


def state_json(records: list[Record]) -> dict[str, Any]:
    state = CacheState()
    for r in records:
        state.apply(r)
    return state.to_json()


def test_topic_reader_skips_counts_and_names_foreign_records(topics, kafka_bootstrap):
    clean, mixed, foreign = topics
    want, _ = read(kafka_bootstrap, clean)
    got, reader = read(kafka_bootstrap, mixed)
    assert sorted(map(repr, got)) == sorted(map(repr, want))
    assert reader.skipped == len(foreign) == 5
    assert reader.records_read == len(want) + 5
    # In read order, which interleaves the partitions: compare as sets.
    skipped = {(p, o): reason for p, o, reason in reader.undecodable.first}
    assert set(skipped) == {(p, o) for p, o, _ in foreign}
    for p, o, words in foreign:
        assert words in skipped[(p, o)], skipped[(p, o)]


def strip_position(lines: str) -> list[dict[str, Any]]:
    out = []
    for line in lines.splitlines():
        doc = json.loads(line)
        for k in ("partition", "offset", "timestamp"):
            doc.pop(k)
        out.append(doc)
    return sorted(out, key=json.dumps)


def test_consume_replay_and_check_go_on_and_check_reports_them(topics, kafka_bootstrap):
    clean, mixed, foreign = topics
    kafka = ["--bootstrap-servers", kafka_bootstrap, "--topic"]
    where = [f"{p}:{o}" for p, o, _ in foreign]

    runs = {t: run_cli(["consume", *kafka, t, "--from-beginning"]) for t in (clean, mixed)}
    assert runs[mixed].returncode == 0, runs[mixed].stderr
    assert strip_position(runs[mixed].stdout) == strip_position(runs[clean].stdout)
    assert "5 records of" in runs[mixed].stderr
    assert all(w in runs[mixed].stderr for w in where), runs[mixed].stderr

    runs = {t: run_cli(["replay", *kafka, t, "--json"]) for t in (clean, mixed)}
    assert runs[mixed].returncode == 0, runs[mixed].stderr
    assert json.loads(runs[mixed].stdout) == json.loads(runs[clean].stdout)
    runs = {t: run_cli(["replay", *kafka, t]) for t in (clean, mixed)}
    assert "undecodable skipped: 5" in runs[mixed].stdout, runs[mixed].stdout

    ok = run_cli(["check", *kafka, clean])
    bad = run_cli(["check", *kafka, mixed])
    assert ok.returncode == 0 and ok.stdout.startswith("OK: "), ok.stdout + ok.stderr
    assert bad.returncode == 1, bad.stdout + bad.stderr
    verdict, *listed = bad.stdout.splitlines()
    summary = ok.stdout.splitlines()[0].removeprefix("OK: ")
    assert verdict == f"FAIL: 5 undecodable records ({summary})"
    assert listed[0] == "  5 records could not be decoded (skipped)"
    shown = {line.split(": ")[0].removeprefix("  undecodable at "): line for line in listed[1:]}
    assert set(shown) == set(where), listed
    for p, o, words in foreign:
        assert words in shown[f"{p}:{o}"]


def test_state_sync_and_the_kv_state_bootstrap_skip_foreign_records(topics, kafka_bootstrap):
    clean, mixed, foreign = topics
    want = state_json(read(kafka_bootstrap, clean)[0])
    state_topic = f"{mixed}.state"
    sync = [
        "state-sync",
        "--bootstrap-servers",
        kafka_bootstrap,
        "--topic",
        mixed,
        "--state-topic",
        state_topic,
        "--until-caught-up",
    ]
    first = run_cli(sync)
    assert first.returncode == 0, first.stderr
    assert "5 undecodable skipped" in first.stderr
    assert all(f"{p}:{o}: " in first.stderr for p, o, _ in foreign), first.stderr
    state, offsets = bootstrap_state(kafka_bootstrap, state_topic, mixed)
    assert state.to_json() == want

    # Foreign records in kv-state itself: among state-sync's transactions and after them.
    kv = TopicWriter(kafka_bootstrap, state_topic)
    kv.send(0, b"\x00\x01binary", b"not json")  # compaction refuses keyless records
    kv.send(0, b'["stream", "pod-x", 0]', b"[1, 2]")  # JSON, but not a stream record
    kv.send(0, b"\xff\xfe", None)  # a tombstone of a key state-sync never wrote
    extra = Record(Envelope("pod-b", "m", 0, 5, 4, 0, 9.5), BlockStored([H[6]], None, [], 16))
    events = TopicWriter(kafka_bootstrap, mixed)
    events.send(PODS["pod-b"], b"pod-b", CODEC.encode(extra.envelope, extra.event))
    second = run_cli(sync)  # resumes from kv-state (foreign records in it), writes one more
    assert second.returncode == 0, second.stderr
    kv.send(0, b'["block"]', b"{}")  # after the last transaction
    want = state_json([*read(kafka_bootstrap, clean)[0], extra])
    state, offsets = bootstrap_state(kafka_bootstrap, state_topic, mixed)
    assert state.to_json() == want
    with TopicReader(kafka_bootstrap, mixed) as reader:
        assert offsets == {p: reader.watermarks(p)[1] for p in reader.partitions()}


def http(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_state_serve_goes_on_past_foreign_records_and_reports_them(topics, kafka_bootstrap):
    clean, mixed, foreign = topics
    live = LiveState(kafka_bootstrap, mixed)
    server = StateServer(live, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    live.start()
    try:
        wait_for(lambda: http(server.port, "/readyz")[0] == 200, 60, "the server to be ready")
        want = state_json(read(kafka_bootstrap, clean)[0])
        with live.lock:
            assert live.state.to_json() == want
        # While serving: another foreign record, then one of the bridge's.
        w = TopicWriter(kafka_bootstrap, mixed)
        w.send(0, b"pod-a", None)
        extra = Record(Envelope("pod-a", "m", 0, 5, 4, 0, 9.5), BlockStored([H[7]], None, [], 16))
        w.send(0, b"pod-a", CODEC.encode(extra.envelope, extra.event))

        def applied() -> bool:
            assert live.error is None and live.alive, live.error
            with live.lock:
                return live.state.summary()["records_applied"] == want["records_applied"] + 1

        wait_for(applied, 30, "the record after the foreign one to be applied")
        status, health = http(server.port, "/healthz")
        assert status == 200 and health["status"] == "ok"
        assert health["undecodable"]["count"] == 6
        first = {x.split(": ")[0] for x in health["undecodable"]["first"]}
        assert first == {f"{p}:{o}" for p, o, _ in foreign}
        assert http(server.port, "/readyz")[1]["records_undecodable"] == 6
    finally:
        server.shutdown()
        server.server_close()
        live.stop()
    assert live.error is None


def test_skip_warnings_are_rate_limited_and_name_topic_partition_offset(caplog):
    from bridge.consume.reader import Undecodable

    u = Undecodable("kv-events", interval=3600)
    with caplog.at_level("WARNING", logger="bridge.consume.reader"):
        for off in range(8):
            u.add(1, off, "null value (a tombstone)")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "kv-events partition 1 offset 0: skipped, not a kv-events record this reader can "
        "decode (null value (a tombstone)); 1 skipped so far"
    ]
    assert u.count == 8 and u.samples()[-1] == "1:4: null value (a tombstone)"
    assert len(u.first) == Undecodable.KEEP
