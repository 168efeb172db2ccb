"""The compacted kv-state topic: the pure record mapping, and state-sync end to end.

Unit and property tests drive :mod:`bridge.consume.statesync` without Kafka. The end-to-end test
runs simulated pods (a publisher restart, clears, a lost range) through the real bridge into a real
broker, runs state-sync, stops and resumes it, and checks that a consumer bootstrapping from
kv-state and tailing kv-events from the stored offsets ends with exactly the state of a full
replay and, for every certain stream, the simulator's own cache model.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import Counter

import pytest
from bridge_util import read_all, running_bridge
from confluent_kafka import KafkaException, Producer
from e2e_util import wait_for
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.consume.sentlog import compare_with_sent
from bridge.consume.state import CacheState, StreamState
from bridge.consume.statesync import Pending, StateSync, StateTopicError, load
from bridge.consume.statetopic import (
    EventTail,
    StateSyncer,
    bootstrap_state,
    load_state,
    read_state_records,
)
from bridge.log.markers import EventsLost, PodRemoved, PublisherRestarted, StreamStarted
from bridge.log.records import Envelope, Record, RecordCodec
from bridge.ops.config import PodConfig
from bridge.simulator.model import ModelConfig
from bridge.simulator.pod import PodSpec, SimulatedFleet
from bridge.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, UnknownEvent

H = [bytes([i]) * 8 for i in range(8)]


def rec(event, pod="p", rank=0, seq=0, index=0, epoch=1, model="m"):
    return Record(Envelope(pod, model, rank, epoch, seq, index, 0.0), event)


def decoded(changes):
    return [(tuple(json.loads(k)), None if v is None else json.loads(v)) for k, v in changes]


def blocks_of(changes):
    return [(k, v) for k, v in decoded(changes) if k[0] == "block"]


def comparable(st: StreamState) -> dict:
    """Every field of a stream's state; of the derived key index, the non-empty parts."""
    d = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}
    if "index" in d:
        d["index"] = {m: i for m, i in d["index"].items() if i}
    return d


def assert_same_state(got: CacheState, want: CacheState) -> None:
    """Everything a CacheState holds (models of pods that are still there)."""
    assert got.streams.keys() == want.streams.keys()
    for key, stream in want.streams.items():
        assert comparable(got.streams[key]) == comparable(stream), key
    assert got.applied == want.applied
    assert got.duplicates == want.duplicates
    assert +got.markers == +want.markers
    live = {pod for pod, _ in want.streams}
    assert {p: m for p, m in got.models.items() if p in live} == {
        p: m for p, m in want.models.items() if p in live
    }


# --- the mapping ----------------------------------------------------------------------------


def test_each_event_maps_to_its_block_records_and_tombstones():
    s = StateSync("kv-events", policy="set")
    c = s.apply(0, 0, 1000, rec(StreamStarted(0, "tcp://x"), index=-1))
    assert blocks_of(c) == []
    ((key, meta),) = decoded(c)
    assert key == ("stream", "p", 0)
    assert meta["epoch"] == 1 and meta["uncertain"] is False and meta["last_ts_ms"] == 1000
    assert meta["model"] == "m"

    stored = BlockStored([H[0], H[1]], H[7], [], 16, medium="GPU", group_idx=0)
    c = s.apply(0, 1, 1001, rec(stored, seq=0))
    assert blocks_of(c) == [
        (("block", "p", 0, "GPU", 0, H[0].hex()), {"parent": H[7].hex(), "epoch": 1}),
        (("block", "p", 0, "GPU", 0, H[1].hex()), {"parent": H[0].hex(), "epoch": 1}),
    ]
    meta = dict(decoded(c))[("stream", "p", 0)]
    assert meta["last_seq"] == 0 and meta["tiers"] == [["GPU", 0]]

    # The same store again (a new batch): nothing changes, so no block record.
    c = s.apply(0, 2, 1002, rec(stored, seq=1))
    assert blocks_of(c) == []
    # A duplicate record (same seq/index): skipped by the state, nothing written but metadata.
    c = s.apply(0, 3, 1003, rec(stored, seq=1))
    assert blocks_of(c) == [] and s.state.duplicates == 1

    # Remove: a tombstone for the resident hash only (H[5] is unknown, H[0] in another tier).
    c = s.apply(0, 4, 1004, rec(BlockRemoved([H[1], H[5]], medium="GPU", group_idx=0), seq=2))
    assert blocks_of(c) == [(("block", "p", 0, "GPU", 0, H[1].hex()), None)]
    c = s.apply(0, 5, 1005, rec(BlockRemoved([H[0]], medium="CPU"), seq=3))
    assert blocks_of(c) == []

    s.apply(0, 6, 1006, rec(BlockStored([H[2]], None, [], 16, medium="CPU"), seq=4))
    c = s.apply(0, 7, 1007, rec(EventsLost(5, 6, "test"), seq=6, index=-1))
    assert blocks_of(c) == []
    meta = dict(decoded(c))[("stream", "p", 0)]
    assert meta["uncertain"] is True and meta["lost_batches"] == 2

    # A clear tombstones every tier's blocks; the stream record stays.
    c = s.apply(0, 8, 1008, rec(AllBlocksCleared(), seq=7))
    assert sorted(blocks_of(c)) == [
        (("block", "p", 0, "CPU", None, H[2].hex()), None),
        (("block", "p", 0, "GPU", 0, H[0].hex()), None),
    ]
    assert dict(decoded(c))[("stream", "p", 0)]["uncertain"] is False

    # A publisher restart drops the stream's blocks; rank 1 is its own stream.
    s.apply(0, 9, 1009, rec(BlockStored([H[3]], None, [], 16), seq=8))
    s.apply(0, 10, 1010, rec(BlockStored([H[4]], None, [], 16), rank=1))
    c = s.apply(0, 11, 1011, rec(PublisherRestarted(1, 8, 0), epoch=2, index=-1))
    assert blocks_of(c) == [(("block", "p", 0, None, None, H[3].hex()), None)]
    assert dict(decoded(c))[("stream", "p", 0)]["epoch"] == 2
    assert s.state.resident("p", 1) == {(None, None): {H[4]}}

    # PodRemoved: every rank's blocks and stream records become tombstones.
    c = s.apply(0, 12, 1012, rec(PodRemoved("gone"), index=-1, epoch=2))
    assert sorted(decoded(c), key=str) == sorted(
        [
            (("block", "p", 1, None, None, H[4].hex()), None),
            (("stream", "p", 0), None),
            (("stream", "p", 1), None),
        ],
        key=str,
    )
    assert s.state.streams == {} and s.last_ts_ms == {}

    s.apply(1, 99, 1013, rec(StreamStarted(0, "tcp://x"), pod="other", index=-1))
    ((key, value),) = decoded([s.offsets_record()])
    assert key == ("offsets",) and value["topic"] == "kv-events"
    assert set(value["partitions"]) == {"0", "1"}
    assert value["partitions"]["1"]["next_offset"] == 100
    value = value["partitions"]["0"]
    assert value["next_offset"] == 13
    assert value["counts"] == {"applied": 12, "duplicates": 1}
    assert value["markers"] == {
        "EventsLost": 1,
        "PodRemoved": 1,
        "PublisherRestarted": 1,
        "StreamStarted": 1,
    }


def test_pending_coalesces_by_key_and_ends_with_the_offsets():
    s = StateSync("t")
    pending = Pending()
    pending.add(2, s.apply(2, 40, 1, rec(BlockStored([H[0]], None, [], 16))))
    pending.add(2, s.apply(2, 41, 2, rec(BlockRemoved([H[0]]), seq=1)))
    records = decoded(pending.records(s))
    assert records[0] == (("block", "p", 0, None, None, H[0].hex()), None)  # last write wins
    assert [k for k, _ in records].count(("stream", "p", 0)) == 1
    assert records[-1][0] == ("offsets",)  # last: the loader's transaction boundary
    assert records[-1][1]["partitions"] == {
        "2": {"next_offset": 42, "counts": {"applied": 2}, "markers": {}}
    }


def test_load_rejects_another_topic_and_skips_unreadable_records():
    s = StateSync("kv-events")
    changes = s.apply(0, 0, 5, rec(BlockStored([H[0]], None, [], 16)))
    changes.append(s.offsets_record())
    with pytest.raises(StateTopicError, match="reflects events topic 'kv-events'"):
        load(changes, "other")
    loaded, skipped = load([*changes, (b"not json", b"{}"), (b'["block"]', b"1")], "kv-events")
    assert skipped == 2
    assert_same_state(loaded.state, s.state)
    assert loaded.offsets == {0: 1} and loaded.last_ts_ms == {("p", 0): 5}


# --- property: kv-state (with restarts of state-sync) always reloads to the same state -------

ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["store", "store", "store", "remove", "remove", "clear", "lost", "restart", "dup"]
            + ["started", "podremoved", "unknown"]
        ),
        st.sampled_from(["p", "q"]),
        st.integers(0, 1),  # rank
        st.sampled_from([("GPU", 0), ("CPU", None), ("GPU", 1)]),
        st.lists(st.sampled_from(H), min_size=1, max_size=3),
        st.booleans(),  # state-sync restarts after this record
    ),
    max_size=80,
)


def records_for(sequence) -> list[tuple[int, Record]]:
    """(partition, record) in topic order; partition by pod, as the bridge keys records."""
    pos: dict[tuple[str, int], list[int]] = {}  # [epoch, next seq]
    out: list[tuple[int, Record]] = []
    last: dict[tuple[str, int], Record] = {}
    for op, pod, rank, (medium, group), hashes, _ in sequence:
        key = (pod, rank)
        epoch, seq = pos.setdefault(key, [1, 0])
        part = 0 if pod == "p" else 1
        if op == "dup":
            if key in last:
                out.append((part, last[key]))
            continue
        if op in ("restart", "started"):
            marker = PublisherRestarted(epoch, seq - 1, 0) if op == "restart" else None
            pos[key] = [epoch + 1, 0]
            r = rec(marker or StreamStarted(0, "x"), pod, rank, 0, -1, epoch + 1)
        elif op == "podremoved":
            r = rec(PodRemoved("test"), pod, rank, seq, -1, epoch)
            for k in [k for k in pos if k[0] == pod]:
                pos[k] = [pos[k][0] + 1, 0]
        elif op == "lost":
            r = rec(EventsLost(seq, seq, "test"), pod, rank, seq, -1, epoch)
            pos[key][1] += 1
        else:
            if op == "store":
                ev = BlockStored(hashes, H[7], [], 16, medium=medium, group_idx=group)
            elif op == "remove":
                ev = BlockRemoved(hashes, medium=medium, group_idx=group)
            elif op == "unknown":
                ev = UnknownEvent("FutureEvent", b"\x90")
            else:
                ev = AllBlocksCleared()
            r = rec(ev, pod, rank, seq, 0, epoch)
            pos[key][1] += 1
            last[key] = r
        out.append((part, r))
    return out


@settings(max_examples=150, deadline=None)
@given(ops)
def test_kv_state_reloads_to_the_replayed_state_across_restarts(sequence):
    records = records_for(sequence)
    restarts = [r[-1] for r in sequence]
    reference = CacheState()
    log: list[tuple[bytes, bytes | None]] = []  # the state topic, uncompacted
    sync = StateSync("ev")
    pending = Pending()
    offsets = Counter()
    for i, (part, r) in enumerate(records):
        reference.apply(r)
        pending.add(part, sync.apply(part, offsets[part], 1000 + i, r))
        offsets[part] += 1
        if restarts[i % len(restarts)]:
            # commit, "crash", and resume from the topic, as state-sync does
            log += pending.records(sync)
            pending.clear()
            sync, skipped = load(log, "ev")
            assert skipped == 0
            assert sync.offsets == {p: n for p, n in offsets.items()}
    log += pending.records(sync)
    assert_same_state(sync.state, reference)
    loaded, _ = load(log, "ev")
    assert_same_state(loaded.state, reference)
    assert loaded.last_ts_ms == sync.last_ts_ms
    # Compaction keeps the last value per key and may drop tombstones: same state.
    compacted = {k: v for k, v in log}
    loaded, _ = load([(k, v) for k, v in compacted.items() if v is not None], "ev")
    assert_same_state(loaded.state, reference)


# --- end to end -----------------------------------------------------------------------------


def pod_config(pod) -> PodConfig:
    return PodConfig(pod.name, pod.model, pod.pub, pod.replay, pod.dp_size)


def read_into(
    state: CacheState, bootstrap: str, topic: str, start: dict[int, int], ends: dict[int, int]
) -> CacheState:
    """Apply kv-events records from ``start`` (default: the beginning) up to ``ends``."""
    tail = EventTail(bootstrap, topic, start)
    tail.ends = dict(ends)
    try:
        while not tail.caught_up():
            for tr in tail.poll(0.5):
                assert tr.record is not None
                if tr.offset < ends[tr.partition]:
                    state.apply(tr.record)
    finally:
        tail.close()
    return state


def replay_all(bootstrap: str, topic: str, ends: dict[int, int]) -> CacheState:
    return read_into(CacheState(), bootstrap, topic, {}, ends)


def stitch(bootstrap: str, state_topic: str, events_topic: str, ends: dict[int, int]):
    """What a new consumer does: load kv-state, then tail kv-events from its offsets."""
    state, offsets = bootstrap_state(bootstrap, state_topic, events_topic)
    return read_into(state, bootstrap, events_topic, offsets, ends)


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    tail = EventTail(bootstrap, topic)
    try:
        return dict(tail.ends)
    finally:
        tail.close()


class SyncThread:
    def __init__(self, syncer: StateSyncer) -> None:
        self.syncer = syncer
        self.stop = threading.Event()
        self.error: BaseException | None = None
        syncer.open()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.syncer.run(self.stop)
        except BaseException as exc:
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def committed(self) -> bool:
        self.check()
        return self.syncer.commits >= 1 and self.syncer.consumed > 0

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        self.syncer.close()
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error


@pytest.mark.kafka
def test_state_sync_resumes_and_consumers_stitch_exactly(kafka_bootstrap, make_topic):
    events = make_topic(partitions=3)
    state_topic = f"{events}-state"
    specs = [
        # a publisher restart mid-run
        PodSpec(name="restarts", release="0.26.0", rate=40, batches=120, seed=1,
                restart_at_batches=frozenset({50}), wait_for_subscriber=True),
        # frequent clears, two DP ranks, a CPU tier
        PodSpec(name="clears", release="0.33.0", rate=40, batches=120, seed=2, dp_size=2,
                cache=ModelConfig(
                    clear_prob=0.05, cpu_offload_prob=0.3, repeat_prob=0.3, offload_chunk_blocks=3
                ),
                wait_for_subscriber=True),
        # a range lost for good (never sent, never buffered): uncertain
        PodSpec(name="lossy", release="0.23.0", rate=40, batches=120, seed=3,
                lose_seqs=frozenset({30, 31}), wait_for_subscriber=True),
    ]  # fmt: skip
    with SimulatedFleet(*specs) as fleet:
        pods = [pod_config(p) for p in fleet.pods]
        with running_bridge(kafka_bootstrap, events, pods, exactly_once=True):
            fleet.wait_sent(20, timeout=30)
            first = SyncThread(StateSyncer(kafka_bootstrap, events, state_topic))
            # Stop state-sync midway, once it has committed some of the stream.
            wait_for(first.committed, 30, "state-sync to commit")
            first.close()
            mid = load_state(kafka_bootstrap, state_topic, events)
            assert mid.offsets and sum(mid.offsets.values()) > 0
            # A consumer stitching at this mid point already agrees with a full replay.
            ends = end_offsets(kafka_bootstrap, events)
            assert_same_state(
                stitch(kafka_bootstrap, state_topic, events, ends),
                replay_all(kafka_bootstrap, events, ends),
            )

            second = SyncThread(StateSyncer(kafka_bootstrap, events, state_topic))
            assert second.syncer.resumed_from == mid.offsets  # resumed, not restarted
            fleet.wait_done(timeout=60)

            def topic_complete() -> bool:
                return not compare_with_sent(read_all(kafka_bootstrap, events), fleet.sent())

            wait_for(topic_complete, 60, "kv-events to hold every batch", interval=0.5)
        # The bridge has stopped: kv-events is final. Wait for state-sync to reflect all of it.
        ends = end_offsets(kafka_bootstrap, events)

        def synced() -> bool:
            second.check()
            got = second.syncer.synced  # written by the syncer's thread
            return all(got.get(p, 0) >= end for p, end in ends.items())

        wait_for(synced, 60, "state-sync to catch up")
        second.close()
        # The second one resumed where the first stopped, and had work left to do.
        # (offsets also count the bridge's transaction markers, hence <=)
        resumed = sum(second.syncer.sync.offsets.values()) - sum(mid.offsets.values())
        assert 0 < second.syncer.consumed <= resumed

        final = load_state(kafka_bootstrap, state_topic, events)
        replayed = replay_all(kafka_bootstrap, events, ends)
        assert_same_state(final.state, replayed)  # kv-state alone is the whole state now
        stitched = stitch(kafka_bootstrap, state_topic, events, ends)
        assert_same_state(stitched, replayed)

        # ... and equals the simulator's own cache model for every certain stream.
        assert replayed.markers["PublisherRestarted"] == 1
        assert replayed.markers["EventsLost"] >= 1
        uncertain = {k for k, s in stitched.streams.items() if s.uncertain}
        assert ("lossy", 0) in uncertain
        certain = [(p.name, r) for p in fleet.pods for r in range(p.dp_size)]
        certain = [k for k in certain if k not in uncertain]
        assert len(certain) == 3
        for pod, rank in certain:
            assert stitched.resident(pod, rank) == {
                t: b for t, b in fleet.resident(pod, rank).items() if b
            }, f"{pod}/{rank}"
        assert any(stitched.resident(pod, rank) for pod, rank in certain)

    # The stored topic holds one live record per resident block, and ends with the offsets
    # record of every partition with records (the end of the last transaction).
    records = read_state_records(kafka_bootstrap, state_topic)
    assert json.loads(records[-1][0]) == ["offsets"]
    latest = {k: v for k, v in records}
    blocks = [k for k, v in latest.items() if v is not None and json.loads(k)[0] == "block"]
    assert len(blocks) == sum(s.blocks() for s in replayed.streams.values())
    offsets = json.loads(records[-1][1])["partitions"]
    assert {int(p): v["next_offset"] for p, v in offsets.items()} == final.offsets
    assert set(final.offsets) == {p for p, n in ends.items() if n}


def nonempty(offsets: dict[int, int]) -> dict[int, int]:
    return {p: o for p, o in offsets.items() if o}


def write_records(bootstrap: str, topic: str, pod: str, seqs: range, epoch: int = 1) -> None:
    codec = RecordCodec()
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for seq in seqs:
        env = Envelope(pod, "m", 0, epoch, seq, 0, 0.0)
        ev = BlockStored([seq.to_bytes(8, "big")], None, [], 16, medium="GPU", group_idx=0)
        if seq % 3 == 2:
            ev = BlockRemoved([(seq - 1).to_bytes(8, "big")], medium="GPU", group_idx=0)
        producer.produce(topic, codec.encode(env, ev), pod.encode())
    assert producer.flush(30) == 0


@pytest.mark.kafka
def test_a_crash_mid_transaction_is_invisible_and_the_next_state_sync_fences_it(
    kafka_bootstrap, make_topic
):
    events = make_topic(partitions=2)
    state_topic = f"{events}-state"
    for pod in ("a", "b"):
        write_records(kafka_bootstrap, events, pod, range(0, 30))
    first = StateSyncer(kafka_bootstrap, events, state_topic)
    first.open()
    first.run(threading.Event(), until_caught_up=True)
    committed = load_state(kafka_bootstrap, state_topic, events)
    assert committed.offsets == nonempty(end_offsets(kafka_bootstrap, events))

    # More events; the first state-sync applies them and "crashes" inside its transaction:
    # the records are in the state topic's log, the commit never happens.
    for pod in ("a", "b"):
        write_records(kafka_bootstrap, events, pod, range(30, 60))
    ends = nonempty(end_offsets(kafka_bootstrap, events))
    wait_for(lambda: first.step(0.2) >= 0 and first.sync.offsets == ends, 30, "the new records")
    records = first.pending.records(first.sync)
    first.producer.begin_transaction()
    for key, value in records:
        first.producer.produce(state_topic, value, key)
    assert first.producer.flush(30) == 0
    first.tail.close()

    # A reader sees the last committed snapshot only: blocks and offsets agree.
    during = load_state(kafka_bootstrap, state_topic, events)
    assert during.offsets == committed.offsets
    assert_same_state(during.state, committed.state)

    second = StateSyncer(kafka_bootstrap, events, state_topic)
    second.open()  # fences the first and aborts its transaction
    try:
        assert second.resumed_from == committed.offsets
        second.run(threading.Event(), until_caught_up=True)
    finally:
        second.close()
    with pytest.raises(KafkaException):
        first.producer.commit_transaction(10)
    final = load_state(kafka_bootstrap, state_topic, events)
    assert final.offsets == ends
    assert_same_state(
        final.state, replay_all(kafka_bootstrap, events, end_offsets(kafka_bootstrap, events))
    )
    assert final.state.resident("a", 0) == {
        ("GPU", 0): {s.to_bytes(8, "big") for s in range(60) if s % 3 == 0}
    }
