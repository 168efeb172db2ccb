"""Pods never move partition unless the operator says so (bridge/log/partitioning.py).

Pure parts: Kafka's murmur2 partitioner (Kafka's own test values, and the real broker's
librdkafka ``murmur2_random`` for a few hundred keys), the pinned-count decision, checkpoints
with and without the new fields. Then real simulated pods, a real bridge and the session's
broker: partitions added while the bridge runs, a restart without and one with
``--repartition``.
"""

from __future__ import annotations

import heapq
import json
import logging
import time
from collections import defaultdict

import pytest
from bridge_util import metric, running_bridge
from confluent_kafka import Producer
from confluent_kafka.admin import NewPartitions
from e2e_util import wait_for

from bridge.consume.checker import TopicChecker
from bridge.consume.reader import ConsumedRecord, TopicReader
from bridge.consume.sentlog import compare_with_sent
from bridge.consume.state import CacheState
from bridge.ingest.topics import Topics
from bridge.log.checkpoints import Checkpoint, checkpoint_key, load_checkpoints
from bridge.log.markers import StreamStarted
from bridge.log.partitioning import (
    TopicPin,
    decide_pin,
    murmur2,
    murmur2_signed,
    partition_for,
    recorded_count,
)
from bridge.log.sink import ensure_topic
from bridge.ops.config import PodConfig
from bridge.simulator.model import ModelConfig
from bridge.simulator.pod import PodSpec, SimulatedFleet

# -- murmur2 and the decision (pure) ---------------------------------------------------------

# Kafka's UtilsTest.testMurmur2 (Java's signed 32-bit results).
KAFKA_MURMUR2 = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


def test_murmur2_matches_kafkas_known_values():
    for key, want in KAFKA_MURMUR2.items():
        assert murmur2_signed(key) == want, key
        assert murmur2(key) == want & 0xFFFFFFFF


def test_partition_for_is_the_positive_hash_modulo_the_count():
    for key in KAFKA_MURMUR2:
        for n in (1, 2, 3, 6, 8, 64):
            assert partition_for(key, n) == (murmur2_signed(key) & 0x7FFFFFFF) % n
    assert partition_for(b"21", 1) == 0
    with pytest.raises(ValueError, match="at least one partition"):
        partition_for(b"x", 0)


def cp(topic: str | None, partitions: int | None, ts: float | None) -> Checkpoint:
    return Checkpoint(1, 2, None, None, topic, partitions, ts)


def test_recorded_count_is_the_newest_of_that_topic():
    cps = [
        cp("kv", 2, 100.0),
        cp("kv", 4, 200.0),  # newest of kv: a bridge started with --repartition wrote it
        cp("kv", 2, 150.0),
        cp("other", 8, 300.0),
        cp(None, None, 400.0),  # an older bridge's checkpoint: records nothing
        cp("kv", None, 500.0),
    ]
    assert recorded_count(cps, "kv") == 4
    assert recorded_count(cps, "other") == 8
    assert recorded_count(cps, "none") is None
    assert recorded_count([cp(None, None, 1.0)], "kv") is None


def test_decide_pin():
    # Nothing recorded (new topic, or only old checkpoints): the current count.
    assert decide_pin("kv", None, 4, False) == TopicPin("kv", 4, 4, None)
    # Recorded 2, the topic grew to 4: stays 2 and warns; --repartition adopts 4.
    kept = decide_pin("kv", 2, 4, False)
    assert (kept.pinned, kept.differs, kept.adopted) == (2, True, False)
    text = kept.warning()
    assert text is not None
    assert "kv has 4 partitions" in text and "pinned 2" in text and "--repartition" in text
    adopted = decide_pin("kv", 2, 4, True)
    assert (adopted.pinned, adopted.differs, adopted.adopted) == (4, False, True)
    assert adopted.warning() is None and "--repartition" in adopted.adoption()
    # Fewer partitions than recorded (topic recreated): records cannot go there; adopt.
    shrunk = decide_pin("kv", 8, 4, False)
    assert (shrunk.pinned, shrunk.adopted) == (4, True) and "fewer" in shrunk.adoption()
    assert decide_pin("kv", 4, 4, True) == TopicPin("kv", 4, 4, 4)
    with pytest.raises(ValueError):
        decide_pin("kv", None, 0, False)


def test_which_streams_move():
    pin = decide_pin("kv", 2, 4, True)
    for i in range(50):
        key = f"pod-{i}".encode()
        moves = partition_for(key, 2) != partition_for(key, 4)
        assert pin.moves(key, 2) is moves  # the stream's own checkpoint says 2
        assert pin.moves(key, None) is moves  # an old checkpoint: the topic's recorded 2
        assert pin.moves(key, 4) is False  # already written with 4 (an earlier repartition)
    unpinned = decide_pin("kv", None, 4, True)
    assert not any(unpinned.moves(f"pod-{i}".encode(), None) for i in range(50))


def test_checkpoint_json_old_and_new():
    old = json.dumps({"epoch": 7, "seq": 41, "digest": "abcd", "ts": 1.5}).encode()
    c = Checkpoint.decode(old)
    assert (c.epoch, c.seq, c.digest, c.uid, c.topic, c.partitions) == (
        7,
        41,
        b"\xab\xcd",
        None,
        None,
        None,
    )
    new = Checkpoint(7, 41, None, "uid-1", "kv-events", 6)
    back = Checkpoint.decode(new.encode())
    assert back == new and back.ts is not None
    assert json.loads(new.encode())["partitions"] == 6
    assert "partitions" not in json.loads(Checkpoint(1, 2, None).encode())
    for bad in (0, -1, "6", 2.5, True):
        with pytest.raises(ValueError):
            Checkpoint.decode(json.dumps({"epoch": 1, "seq": 2, "partitions": bad}).encode())


# -- the real broker ------------------------------------------------------------------------


@pytest.mark.kafka
def test_murmur2_matches_the_brokers_partitioner(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=8)
    keys = [f"pod-{i}".encode() for i in range(200)]
    keys += [bytes([i % 256]) * (1 + i % 13) for i in range(60)]  # every tail length, high bytes
    keys += [f"vllm-{i}.ns.svc.cluster.local".encode() for i in range(40)]
    got: dict[bytes, int] = {}

    def delivered(err, msg) -> None:
        assert err is None, err
        got[msg.key()] = msg.partition()

    p = Producer({"bootstrap.servers": kafka_bootstrap, "partitioner": "murmur2_random"})
    for key in keys:
        p.produce(topic, b"v", key, -1, delivered)
    assert p.flush(30) == 0
    assert len(got) == len(set(keys)) >= 290
    assert {k: partition_for(k, 8) for k in got} == got
    assert len(set(got.values())) == 8


@pytest.mark.kafka
def test_checkpoints_without_the_new_fields_still_load(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=1)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    legacy = {"epoch": 5, "seq": 9, "digest": None, "ts": time.time()}
    p.produce(topic, json.dumps(legacy).encode(), checkpoint_key("old-pod", 0))
    p.produce(topic, Checkpoint(6, 3, b"\x01", None, "kv", 4).encode(), checkpoint_key("new", 1))
    assert p.flush(30) == 0
    loaded = load_checkpoints(kafka_bootstrap, topic)
    assert loaded[("old-pod", 0)] == Checkpoint(5, 9, None)
    assert loaded[("new", 1)] == Checkpoint(6, 3, b"\x01", None, "kv", 4)
    assert recorded_count(loaded.values(), "kv") == 4


# -- a bridge, simulated pods, partitions added ------------------------------------------------

CACHE = ModelConfig(capacity=40, clear_prob=0.01)
# pin-0 and pin-3 keep their partition from 2 to 4 partitions; pin-1 (two ranks), pin-2 and
# pin-4 move (checked below). ~15 s of publishing at 100 batches/s.
SPECS = [
    PodSpec(
        name=f"pin-{i}",
        rate=100,
        batches=1500,
        seed=i,
        dp_size=2 if i == 1 else 1,
        drop_rate=0.03,
        cache=CACHE,
        wait_for_subscriber=True,
    )
    for i in range(5)
]
STAY = {"pin-0", "pin-3"}
# librdkafka refreshes topic metadata every 300 ms: without pinning, pods would move at once.
KAFKA = {"topic.metadata.refresh.interval.ms": "300"}


def read(bootstrap: str, topic: str) -> list[ConsumedRecord]:
    with TopicReader(bootstrap, topic) as r:
        return list(r.read())


def partitions_of(records: list[ConsumedRecord]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = defaultdict(set)
    for c in records:
        out[c.record.envelope.pod].add(c.partition)
    return out


def events_since(records: list[ConsumedRecord], ts_ms: float) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for c in records:
        if c.record.envelope.index >= 0 and c.timestamp_ms >= ts_ms:
            out[c.record.envelope.pod] += 1
    return out


def in_time_order(records: list[ConsumedRecord]) -> list[ConsumedRecord]:
    """Records merged across partitions by timestamp, each partition kept in offset order:
    what a consumer sees that read a moved pod's old partition up to the move first."""
    parts: dict[int, list[ConsumedRecord]] = defaultdict(list)
    for c in sorted(records, key=lambda c: (c.partition, c.offset)):
        parts[c.partition].append(c)
    return list(heapq.merge(*parts.values(), key=lambda c: c.timestamp_ms))


def model_of(fleet: SimulatedFleet) -> dict[tuple[str, int], dict]:
    return {
        (pod.name, rank): {t: hs for t, hs in fleet.resident(pod.name, rank).items() if hs}
        for pod in fleet.pods
        for rank in range(pod.dp_size)
    }


def state_of(records: list[ConsumedRecord]) -> CacheState:
    state = CacheState()
    for c in in_time_order(records):
        state.apply(c.record)
    return state


def resident(state: CacheState) -> dict[tuple[str, int], dict]:
    return {key: state.resident(*key) for key in state.streams}


@pytest.mark.kafka
@pytest.mark.timeout(150)
def test_added_partitions_move_no_pod_until_repartition(
    kafka_bootstrap, make_topic, kafka_admin, monkeypatch, caplog
):
    moved = {s.name for s in SPECS} - STAY
    assert all(partition_for(n.encode(), 2) == partition_for(n.encode(), 4) for n in STAY)
    assert all(partition_for(n.encode(), 2) != partition_for(n.encode(), 4) for n in moved)
    monkeypatch.setattr(Topics, "CHECK_INTERVAL", 0.2)
    caplog.set_level(logging.INFO, logger="bridge.ingest")
    topic = make_topic(partitions=2)
    # A checkpoint written by an older bridge (no topic/partitions fields) is read and ignored
    # for pinning: the pinned count is then the topic's count at start.
    checkpoints = f"{topic}.checkpoints"
    ensure_topic(kafka_bootstrap, checkpoints, 1, config={"cleanup.policy": "compact"})
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    legacy = {"epoch": 1, "seq": 3, "digest": None, "ts": time.time()}
    p.produce(checkpoints, json.dumps(legacy).encode(), checkpoint_key("gone-pod", 0))
    assert p.flush(30) == 0
    home = {s.name: partition_for(s.name.encode(), 2) for s in SPECS}

    with SimulatedFleet(*SPECS) as fleet:
        pods = [PodConfig(p.name, p.model, p.pub, p.replay, p.dp_size) for p in fleet.pods]

        # 1. Partitions are added while the bridge runs: every pod keeps its partition.
        with running_bridge(kafka_bootstrap, topic, pods, kafka=KAFKA) as bridge:
            assert bridge.topics.pins[topic] == TopicPin(topic, 2, 2, None)
            assert {s.info.partition for s in bridge.streams if s.info.pod == "pin-1"} == {
                home["pin-1"]
            }
            wait_for(
                lambda: len(events_since(read(kafka_bootstrap, topic), 0)) == len(SPECS),
                30,
                "events of every pod",
                interval=0.3,
            )
            kafka_admin.create_partitions([NewPartitions(topic, 4)])[topic].result(30)
            wait_for(
                lambda: (
                    metric(bridge, "kvbridge_topic_partitions", topic=topic, kind="current") == 4
                ),
                30,
                "the bridge to see 4 partitions",
            )
            assert metric(bridge, "kvbridge_topic_partitions", topic=topic, kind="pinned") == 2
            # By now librdkafka refreshed its metadata (every 300 ms): records produced from
            # here on would go to partition murmur2 % 4 with librdkafka's partitioner.
            grown = time.time() * 1000 + 1000
            wait_for(
                lambda: (
                    all(n >= 50 for n in events_since(read(kafka_bootstrap, topic), grown).values())
                    and len(events_since(read(kafka_bootstrap, topic), grown)) == len(SPECS)
                ),
                30,
                "50 events of every pod after the partitions were added",
                interval=0.3,
            )
        warnings = [
            r.getMessage()
            for r in caplog.records
            if r.name == "bridge.ingest.topics"
            and r.levelno == logging.WARNING
            and "--repartition" in r.getMessage()
        ]
        assert len(warnings) == 1, warnings
        assert f"topic {topic} has 4 partitions" in warnings[0] and "pinned 2" in warnings[0]
        records = read(kafka_bootstrap, topic)
        assert partitions_of(records) == {n: {home[n]} for n in home}
        assert all(
            cp.partitions == 2 and cp.topic == topic
            for cp in _pod_checkpoints(kafka_bootstrap, checkpoints)
        )

        # 2. A restart (exactly-once mode) on the grown topic: the pinned count comes from the
        # checkpoints; the pods stay where they were, the bridge warns at start.
        caplog.clear()
        restart = time.time() * 1000
        with running_bridge(kafka_bootstrap, topic, pods, kafka=KAFKA, exactly_once=True) as b2:
            assert b2.topics.pins[topic] == TopicPin(topic, 2, 4, 2)
            wait_for(
                lambda: len(events_since(read(kafka_bootstrap, topic), restart)) == len(SPECS),
                30,
                "events of every pod after the restart",
                interval=0.3,
            )
        assert any(
            r.levelno == logging.WARNING and f"topic {topic} has 4 partitions" in r.getMessage()
            for r in caplog.records
        )
        records = read(kafka_bootstrap, topic)
        assert partitions_of(records) == {n: {home[n]} for n in home}
        starts = [c for c in records if isinstance(c.record.event, StreamStarted)]
        assert len(starts) == 6  # one per stream: the restart resumed every epoch
        assert all(cp.partitions == 2 for cp in _pod_checkpoints(kafka_bootstrap, checkpoints))

        # 3. --repartition: the pinned count becomes 4; pods that move start a new epoch
        # (StreamStarted) in their new partition, the others resume where they were.
        caplog.clear()
        moving = time.time() * 1000
        with running_bridge(kafka_bootstrap, topic, pods, kafka=KAFKA, repartition=True) as b3:
            assert b3.topics.pins[topic] == TopicPin(topic, 4, 4, 2)
            assert metric(b3, "kvbridge_topic_partitions", topic=topic, kind="pinned") == 4
            fleet.wait_done(timeout=60)
            model = model_of(fleet)
            sent = fleet.sent()

            def complete() -> bool:
                # The moved pods' new epochs replay their whole history from seq 0: wait for
                # all of it (the state can equal the model earlier, while old-epoch records
                # still stand in for the new epoch's).
                records = read(kafka_bootstrap, topic)
                return resident(state_of(records)) == model and not compare_with_sent(
                    newest_epochs(records), sent
                )

            wait_for(complete, 60, "the new epochs complete and the state equal to the model")
        assert not any("has 4 partitions" in r.getMessage() for r in caplog.records)
        assert all(cp.partitions == 4 for cp in _pod_checkpoints(kafka_bootstrap, checkpoints))

    records = read(kafka_bootstrap, topic)
    now = {s.name: partition_for(s.name.encode(), 4) for s in SPECS}
    by_pod = partitions_of(records)
    for name in STAY:
        assert by_pod[name] == {home[name]}
    for name in moved:
        assert by_pod[name] == {home[name], now[name]}
        old = [c for c in records if c.record.envelope.pod == name and c.partition == home[name]]
        new = [c for c in records if c.record.envelope.pod == name and c.partition == now[name]]
        assert max(c.timestamp_ms for c in old) < moving <= min(c.timestamp_ms for c in new)
        for rank in range(2 if name == "pin-1" else 1):
            first = next(c.record for c in new if c.record.envelope.dp_rank == rank)
            assert isinstance(first.event, StreamStarted) and first.event.next_seq == 0
            old_epochs = {c.record.envelope.epoch for c in old if c.record.envelope.dp_rank == rank}
            assert first.envelope.epoch > max(old_epochs)
    # Read in time order, the topic keeps the contract and nothing is uncertain.
    checker = TopicChecker(allow_duplicates=True)
    for c in in_time_order(records):
        checker.add(c.record)
    report = checker.report()
    assert report.ok, report.details()
    state = state_of(records)
    assert not any(st.uncertain for st in state.streams.values())
    # Each moved pod's new epoch alone holds its whole history (replayed from seq 0), and the
    # pods that stayed hold theirs in one epoch.
    assert compare_with_sent(newest_epochs(records), fleet.sent()) == []


def newest_epochs(records: list) -> list:
    """The records of the pods that stayed, and of each moved stream's newest epoch."""
    newest: dict = {}
    for c in records:
        key = (c.record.envelope.pod, c.record.envelope.dp_rank)
        newest[key] = max(newest.get(key, 0), c.record.envelope.epoch)
    return [
        c.record
        for c in records
        if c.record.envelope.pod in STAY
        or c.record.envelope.epoch == newest[(c.record.envelope.pod, c.record.envelope.dp_rank)]
    ]


def _pod_checkpoints(bootstrap: str, topic: str) -> list[Checkpoint]:
    """The checkpoints of the test's pods (not the legacy one)."""
    loaded = load_checkpoints(bootstrap, topic)
    assert len(loaded) == 7  # 6 streams and the legacy checkpoint
    return [c for (pod, _), c in loaded.items() if pod.startswith("pin-")]
