"""kv-events partitions added while state-sync runs.

The pure parts (:class:`PartitionWatch`, :meth:`StateSync.add_partitions`) without Kafka; then
against the real broker: partitions are added with the AdminClient while state-sync runs, records
keyed (as the bridge keys them, murmur2) into the new partitions, and kv-state must come to
reflect them: the offsets record names every partition, and the loaded state equals a replay
of kv-events from scratch. A consumer stitching from a snapshot that predates the new
partitions reads them from their beginning.
"""

from __future__ import annotations

import json
import logging
import threading

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewPartitions
from e2e_util import wait_for
from kafka_broker import KafkaBroker, create_topic, topic_name
from test_statesync import (
    H,
    SyncThread,
    assert_same_state,
    end_offsets,
    nonempty,
    rec,
    replay_all,
    stitch,
)

from bridge.consume.statesync import PartitionWatch, Pending, StateSync, load
from bridge.consume.statetopic import StateSyncer, bootstrap_state, load_state, read_state_records
from bridge.log.records import Envelope, RecordCodec
from bridge.vllm.events import BlockRemoved, BlockStored

# --- pure logic -----------------------------------------------------------------------------


def test_partition_watch_reports_added_partitions_once_and_retries_without_metadata():
    w = PartitionWatch(interval=30.0, known={0, 1}, next_check=100.0)
    assert not w.due(99.9) and w.due(100.0)
    assert w.checked(100.0, {0, 1}) == []
    assert w.next_check == 130.0 and not w.due(129.9)
    # Two partitions added: reported once, sorted, then known.
    assert w.checked(130.0, {3, 0, 2, 1}) == [2, 3]
    assert w.known == {0, 1, 2, 3}
    assert w.checked(160.0, {0, 1, 2, 3}) == []
    # Metadata unavailable: nothing changes but the failure count; the next check retries.
    assert w.checked(190.0, None) == [] and w.failures == 1 and w.next_check == 220.0
    assert w.checked(220.0, None) == [] and w.failures == 2
    assert w.checked(250.0, {0, 1, 2, 3, 4}) == [4] and w.failures == 0
    # Fewer partitions (stale metadata; Kafka never removes any): nothing is forgotten.
    assert w.checked(280.0, {0, 1}) == [] and w.known == {0, 1, 2, 3, 4}


def test_added_partitions_enter_the_offsets_record_at_zero_and_reload():
    s = StateSync("ev")
    pending = Pending()
    pending.add(0, s.apply(0, 7, 1, rec(BlockStored([H[0]], None, [], 16))))
    assert s.add_partitions([2, 0, 1]) == [1, 2]  # partition 0 keeps its offset
    for p in (1, 2):
        pending.add(p, ())
    records = pending.records(s)
    key, value = records[-1]
    assert json.loads(key) == ["offsets"]
    parts = json.loads(value)["partitions"]
    assert {p: v["next_offset"] for p, v in parts.items()} == {"0": 8, "1": 0, "2": 0}
    assert parts["1"] == {"next_offset": 0, "counts": {}, "markers": {}}
    # The new partition's records then advance it like any other.
    pending.add(2, s.apply(2, 0, 2, rec(BlockStored([H[1]], None, [], 16), pod="q")))
    loaded, skipped = load(pending.records(s), "ev")
    assert skipped == 0
    assert loaded.offsets == {0: 8, 1: 0, 2: 1}
    assert_same_state(loaded.state, s.state)
    assert s.add_partitions([1, 2]) == []


def test_cli_takes_the_check_interval_as_a_duration_and_refuses_zero(capsys):
    from bridge.cli.commands import build_parser, main

    args = build_parser().parse_args(["state-sync", "--partition-check-interval", "1m30s"])
    assert args.partition_check_interval == 90.0
    assert build_parser().parse_args(["state-sync"]).partition_check_interval == 30.0
    argv = ["state-sync", "--bootstrap-servers", "127.0.0.1:1", "--partition-check-interval", "0"]
    assert main(argv) == 2
    assert "--partition-check-interval must be > 0" in capsys.readouterr().err


# --- against the broker ---------------------------------------------------------------------


def murmur2_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner (and kvbridge's murmur2_random) picks."""
    m, h = 0x5BD1E995, (0x9747B28C ^ len(key)) & 0xFFFFFFFF
    whole = len(key) & ~3
    for i in range(0, whole, 4):
        k = int.from_bytes(key[i : i + 4], "little") * m & 0xFFFFFFFF
        k = (k ^ (k >> 24)) * m & 0xFFFFFFFF
        h = (h * m & 0xFFFFFFFF) ^ k
    rest = key[whole:]
    if len(rest) == 3:
        h ^= rest[2] << 16
    if len(rest) >= 2:
        h ^= rest[1] << 8
    if rest:
        h = (h ^ rest[0]) * m & 0xFFFFFFFF
    h = (h ^ (h >> 13)) * m & 0xFFFFFFFF
    h ^= h >> 15
    return (h & 0x7FFFFFFF) % partitions


def pod_in(partition: int, partitions: int, before: int | None = None) -> str:
    """A pod name whose key lands in ``partition`` of ``partitions`` (and, with ``before``,
    in the same partition when the topic had ``before`` partitions: it does not move)."""
    for i in range(10_000):
        name = f"pod-{i}"
        if murmur2_partition(name.encode(), partitions) != partition:
            continue
        if before is None or murmur2_partition(name.encode(), before) == partition:
            return name
    raise AssertionError("no such pod name")


def produce(bootstrap: str, topic: str, pod: str, seqs: range) -> set[int]:
    """Records of one pod's stream, keyed by pod as the bridge does; the partitions they
    were delivered to."""
    codec = RecordCodec()
    delivered: set[int] = set()
    errors: list[object] = []

    def on_delivery(err, msg) -> None:
        if err is not None:
            errors.append(err)
        else:
            delivered.add(msg.partition())

    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "partitioner": "murmur2_random",
        }
    )
    for seq in seqs:
        env = Envelope(pod, "m", 0, 1, seq, 0, 0.0)
        ev = BlockStored([seq.to_bytes(8, "big")], None, [], 16, medium="GPU", group_idx=0)
        if seq % 3 == 2:
            ev = BlockRemoved([(seq - 1).to_bytes(8, "big")], medium="GPU", group_idx=0)
        producer.produce(topic, codec.encode(env, ev), pod.encode(), on_delivery=on_delivery)
    assert producer.flush(30) == 0 and not errors
    return delivered


def add_partitions(admin: AdminClient, topic: str, total: int) -> None:
    admin.create_partitions([NewPartitions(topic, total)])[topic].result(30)

    def visible() -> bool:
        t = admin.list_topics(topic, timeout=10).topics[topic]
        return len(t.partitions) == total and all(p.leader >= 0 for p in t.partitions.values())

    wait_for(visible, 30, f"{topic} to have {total} partitions with leaders")


def stored_offsets(bootstrap: str, state_topic: str) -> dict[int, int]:
    """The partitions and next offsets of kv-state's last offsets record ({} if none)."""
    records = read_state_records(bootstrap, state_topic)
    last = [v for k, v in records if json.loads(k) == ["offsets"]]
    if not last:
        return {}
    return {int(p): d["next_offset"] for p, d in json.loads(last[-1])["partitions"].items()}


@pytest.mark.kafka
def test_partitions_added_while_running_are_read_from_their_beginning(
    kafka_bootstrap, kafka_admin, make_topic, caplog
):
    caplog.set_level(logging.INFO, logger="bridge.consume.statetopic")
    events = make_topic(partitions=2)
    state_topic = f"{events}-state"
    # Pods that stay in their partition when the topic grows from 2 to 4 partitions.
    a, b = pod_in(0, 4, before=2), pod_in(1, 4, before=2)
    assert produce(kafka_bootstrap, events, a, range(0, 20)) == {0}
    assert produce(kafka_bootstrap, events, b, range(0, 20)) == {1}

    # No partition check (1 h) until the new partition holds records, so that they were
    # written before state-sync found the partition; then a check every 0.2 s.
    syncer = StateSyncer(kafka_bootstrap, events, state_topic, partition_check_interval=3600)
    sync = SyncThread(syncer)
    try:
        before = nonempty(end_offsets(kafka_bootstrap, events))
        wait_for(lambda: stored_offsets(kafka_bootstrap, state_topic) == before, 30, "kv-state")

        add_partitions(kafka_admin, events, 4)
        # Records in a new partition (and more in an old one); partition 3 stays empty.
        c = pod_in(2, 4)
        assert produce(kafka_bootstrap, events, c, range(0, 25)) == {2}
        assert produce(kafka_bootstrap, events, a, range(20, 30)) == {0}
        ends = end_offsets(kafka_bootstrap, events)
        assert set(ends) == {0, 1, 2, 3} and ends[2] > 0 and ends[3] == 0
        assert syncer.tail.partitions == [0, 1]  # not found yet
        syncer.watch.interval = 0.2
        syncer.watch.next_check = 0.0  # due now (read by the syncer's thread)

        # The next transactions name the new partitions: 2 with its records, 3 at offset 0.
        wait_for(
            lambda: sync.check() or stored_offsets(kafka_bootstrap, state_topic) == ends,
            30,
            "kv-state to reflect the new partitions",
        )
        # A partition added without records still makes a transaction that names it.
        add_partitions(kafka_admin, events, 5)
        wait_for(
            lambda: sync.check() or stored_offsets(kafka_bootstrap, state_topic) == {**ends, 4: 0},
            30,
            "kv-state to name partition 4",
        )
    finally:
        sync.close()

    ends[4] = 0
    assert end_offsets(kafka_bootstrap, events) == ends
    state, offsets = bootstrap_state(kafka_bootstrap, state_topic, events)
    assert offsets == ends
    replayed = replay_all(kafka_bootstrap, events, ends)
    assert_same_state(state, replayed)
    assert state.resident(c, 0) == {
        ("GPU", 0): {s.to_bytes(8, "big") for s in range(25) if s % 3 == 0}
    }
    assert_same_state(stitch(kafka_bootstrap, state_topic, events, ends), replayed)
    found = [r.getMessage() for r in caplog.records if "new partitions" in r.getMessage()]
    assert found == [
        f"state-sync: {events} has new partitions {new}; reading them from their beginning"
        for new in ([2, 3], [4])
    ]

    # A restart resumes from the stored offsets of all four partitions.
    again = StateSyncer(kafka_bootstrap, events, state_topic)
    again.open()
    try:
        assert again.resumed_from == ends
        assert again.tail.partitions == [0, 1, 2, 3, 4]
    finally:
        again.close()


@pytest.mark.kafka
def test_a_snapshot_without_the_new_partitions_stitches_and_resumes_exactly(
    kafka_bootstrap, kafka_admin, make_topic
):
    events = make_topic(partitions=1)
    state_topic = f"{events}-state"
    a = pod_in(0, 3, before=1)
    produce(kafka_bootstrap, events, a, range(0, 15))
    first = StateSyncer(kafka_bootstrap, events, state_topic)
    first.open()
    try:
        first.run(threading.Event(), until_caught_up=True)
    finally:
        first.close()
    snapshot = load_state(kafka_bootstrap, state_topic, events)
    assert snapshot.offsets == {0: 15}

    # Partitions added (and written) while no state-sync runs: the snapshot does not name them.
    add_partitions(kafka_admin, events, 3)
    b, c = pod_in(1, 3), pod_in(2, 3)
    assert produce(kafka_bootstrap, events, b, range(0, 12)) == {1}
    assert produce(kafka_bootstrap, events, c, range(0, 9)) == {2}
    assert produce(kafka_bootstrap, events, a, range(15, 20)) == {0}
    ends = end_offsets(kafka_bootstrap, events)
    replayed = replay_all(kafka_bootstrap, events, ends)

    # A consumer bootstrapping now reads partitions 1 and 2 from their beginning.
    _, offsets = bootstrap_state(kafka_bootstrap, state_topic, events)
    assert offsets == {0: 15}
    stitched = stitch(kafka_bootstrap, state_topic, events, ends)
    assert_same_state(stitched, replayed)
    assert stitched.resident(b, 0) and stitched.resident(c, 0)

    # state-sync started now reads them from their beginning too.
    second = StateSyncer(kafka_bootstrap, events, state_topic, partition_check_interval=0.2)
    second.open()
    try:
        assert second.resumed_from == {0: 15}
        second.run(threading.Event(), until_caught_up=True)
    finally:
        second.close()
    final = load_state(kafka_bootstrap, state_topic, events)
    assert final.offsets == ends
    assert_same_state(final.state, replayed)


@pytest.mark.kafka
def test_a_check_without_metadata_changes_nothing_and_the_next_one_retries(caplog):
    caplog.set_level(logging.INFO, logger="bridge.consume.statetopic")
    with KafkaBroker() as broker:  # its own: paused below
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        events = create_topic(admin, topic_name("outage"), 1, None)
        state_topic = f"{events}-state"
        a = pod_in(0, 2, before=1)
        assert produce(broker.bootstrap, events, a, range(0, 10)) == {0}
        syncer = StateSyncer(broker.bootstrap, events, state_topic, partition_check_interval=0.2)
        syncer.metadata_timeout = 1.0
        sync = SyncThread(syncer)
        try:
            wait_for(lambda: sync.check() or syncer.synced.get(0) == 10, 30, "state-sync")
            broker.pause()
            try:
                wait_for(lambda: syncer.watch.failures >= 2, 30, "checks without metadata")
            finally:
                broker.resume()
            sync.check()  # still running
            add_partitions(admin, events, 2)
            b = pod_in(1, 2)
            assert produce(broker.bootstrap, events, b, range(0, 7)) == {1}
            wait_for(
                lambda: (
                    sync.check() or stored_offsets(broker.bootstrap, state_topic) == {0: 10, 1: 7}
                ),
                30,
                "kv-state to reflect partition 1",
            )
            assert syncer.watch.failures == 0
        finally:
            sync.close()
        warnings = [r for r in caplog.records if "could not get the partitions" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        state, offsets = bootstrap_state(broker.bootstrap, state_topic, events)
        assert_same_state(state, replay_all(broker.bootstrap, events, offsets))
