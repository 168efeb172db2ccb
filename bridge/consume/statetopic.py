"""The compacted kv-state topic on Kafka: the syncer behind `kvbridge state-sync`, and the loader.

``kvbridge state-sync`` consumes kv-events (read_committed) and keeps kv-state, a compacted
single-partition topic, equal to the cache state those events build (see
:mod:`bridge.consume.statesync` for the records). Block records and, last, the offsets record of
the kv-events they reflect are written in one Kafka transaction, so a read_committed reader
that stops after an offsets record has whole transactions only. A consumer bootstraps with
:func:`bootstrap_state` and then tails kv-events from the returned offsets
(docs/state-topic.md).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, ConfigResource

from bridge.consume.reader import Undecodable, records_of
from bridge.consume.state import CacheState
from bridge.consume.statesync import OFFSETS_KEY, Change, PartitionWatch, Pending, StateSync, load
from bridge.log.records import Record, RecordCodec, RecordError
from bridge.log.sink import ensure_topic
from bridge.ops.logsetup import librdkafka_logger

log = logging.getLogger(__name__)

DEFAULT_STATE_TOPIC = "kv-state"
STATE_TOPIC_CONFIG = {
    "cleanup.policy": "compact",
    # Tombstones stay long enough for a slow loader to see them.
    "delete.retention.ms": str(24 * 3600 * 1000),
}


def _consumer(bootstrap: str, overrides: dict[str, Any] | None, purpose: str) -> Consumer:
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "group.id": f"kvbridge-{purpose}-{uuid.uuid4().hex[:12]}",
        "enable.auto.commit": False,
        "enable.partition.eof": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
    }
    conf.update(overrides or {})
    conf.setdefault("logger", librdkafka_logger())
    return Consumer(conf)


def ensure_state_topic(bootstrap: str, topic: str, overrides: dict[str, Any] | None = None) -> bool:
    """Create the compacted state topic (one partition) if missing; True if created.

    One partition: a reader that stops at the end it saw then holds whole transactions
    only (the commit markers of a multi-partition transaction land at different times)."""
    created = ensure_topic(
        bootstrap, topic, partitions=1, overrides=overrides, config=STATE_TOPIC_CONFIG
    )
    admin = AdminClient(
        {"bootstrap.servers": bootstrap, "logger": librdkafka_logger(), **(overrides or {})}
    )
    md = admin.list_topics(topic, timeout=10).topics[topic]
    if len(md.partitions) != 1:
        raise RuntimeError(
            f"state topic {topic!r} has {len(md.partitions)} partitions; it needs exactly 1 "
            "(atomic snapshots). Delete it or give another --state-topic"
        )
    try:
        res = ConfigResource(ConfigResource.Type.TOPIC, topic)
        configs = admin.describe_configs([res])[res].result(timeout=10)
        policy = configs["cleanup.policy"].value
        if "compact" not in policy:
            log.warning(
                "state topic %s has cleanup.policy=%s: without compaction it grows forever; "
                "set cleanup.policy=compact",
                topic,
                policy,
            )
    except (KafkaException, KeyError) as exc:
        log.debug("could not check cleanup.policy of %s: %s", topic, exc)
    return created


def read_state_records(
    bootstrap: str,
    state_topic: str,
    overrides: dict[str, Any] | None = None,
    timeout: float = 120.0,
    idle_polls: int = 2,
    offsets: list[int] | None = None,
) -> list[Change]:
    """The state topic's committed records, in log order, up to a transaction boundary.

    Reads (read_committed) at least to the end seen when it starts and stops right after an
    offsets record, which state-sync writes last in every transaction: never inside one,
    even when a fetch delivers a transaction in parts. When the position cannot reach the
    end (transaction markers, an open transaction of a state-sync that crashed mid-commit),
    it stops at the last boundary after ``idle_polls`` polls without records. ``offsets``:
    filled with each record's offset (in the same order)."""
    consumer = _consumer(bootstrap, overrides, "state-load")
    out: list[Change] = []
    try:
        md = consumer.list_topics(state_topic, timeout=10).topics.get(state_topic)
        if md is None or md.error is not None or not md.partitions:
            return out
        if len(md.partitions) != 1:
            raise RuntimeError(
                f"state topic {state_topic!r} has {len(md.partitions)} partitions; kvbridge "
                "state-sync writes exactly one"
            )
        tp = TopicPartition(state_topic, 0)
        lo, end = consumer.get_watermark_offsets(tp, timeout=10)
        if end <= lo:
            return out
        consumer.assign([TopicPartition(state_topic, 0, lo)])
        deadline = time.monotonic() + timeout
        at_boundary = False  # the last record read was an offsets record
        whole = 0  # records up to the last offsets record (whole transactions)
        idle = 0
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"reading state topic {state_topic!r} took over {timeout:.0f}s without "
                    "reaching a transaction boundary; is the broker healthy, and is the topic "
                    "written by kvbridge state-sync?"
                )
            msgs = consumer.consume(5000, timeout=0.5)
            for msg in records_of(msgs):
                out.append((msg.key(), msg.value()))
                if offsets is not None:
                    offsets.append(msg.offset())
                at_boundary = msg.key() == OFFSETS_KEY
                if at_boundary:
                    whole = len(out)
            idle = 0 if msgs else idle + 1
            if not at_boundary:
                (pos,) = consumer.position([tp])
                if pos.offset < end:
                    continue  # inside a transaction: its rest is committed and on its way
                # Every transaction before the end is decided and state-sync ends each with an
                # offsets record: records after the last one were written by someone else.
                if len(out) > whole:
                    log.warning(
                        "state topic %s: %d records after the last state-sync transaction (offsets "
                        "%s..%d) were not written by kvbridge state-sync; ignored",
                        state_topic,
                        len(out) - whole,
                        offsets[whole] if offsets is not None else "?",
                        end - 1,
                    )
                del out[whole:]
                if offsets is not None:
                    del offsets[whole:]
                break
            (pos,) = consumer.position([tp])
            if pos.offset >= end:
                break
            if idle >= idle_polls:
                # Only transaction markers, aborted records or an open transaction are left
                # before the end: what was read is still whole transactions.
                log.debug(
                    "state topic %s: stopped at offset %d of %d", state_topic, pos.offset, end
                )
                break
    finally:
        consumer.close()
    return out


def load_state(
    bootstrap: str,
    state_topic: str,
    events_topic: str,
    overrides: dict[str, Any] | None = None,
    policy: str | None = None,
) -> StateSync:
    """The state and kv-events offsets the state topic holds (empty if it does not exist).
    ``policy``: the state policy (None: the one the state topic was built with)."""
    offsets: list[int] = []
    records = read_state_records(bootstrap, state_topic, overrides, offsets=offsets)
    if not records:
        log.info("state topic %s is empty or missing: the state starts empty", state_topic)
    where = {key: off for (key, _), off in zip(records, offsets, strict=True)}  # the latest
    undecodable = Undecodable(state_topic)
    sync, skipped = load(
        records,
        events_topic,
        lambda key, why: undecodable.add(0, where.get(key, -1), why),
        policy=policy,
    )
    if skipped:
        log.warning(
            "state topic %s: %d records not written by kvbridge state-sync were skipped "
            "(first: %s)",
            state_topic,
            skipped,
            "; ".join(undecodable.samples()),
        )
    return sync


def bootstrap_state(
    bootstrap: str,
    state_topic: str = DEFAULT_STATE_TOPIC,
    events_topic: str = "kv-events",
    overrides: dict[str, Any] | None = None,
    policy: str | None = None,
) -> tuple[CacheState, dict[int, int]]:
    """(state, {partition: next offset}): read the state topic to its end (read_committed);
    continue with kv-events records from exactly those offsets (partitions not in the dict:
    from their beginning) to have the state a full replay would build."""
    sync = load_state(bootstrap, state_topic, events_topic, overrides, policy)
    return sync.state, dict(sync.offsets)


@dataclass(slots=True)
class TailedRecord:
    partition: int
    offset: int
    timestamp_ms: int
    record: Record | None  # None: not a kv-events record (counted, logged, skipped)


class EventTail:
    """kv-events (read_committed) from given offsets per partition, with progress against
    the end offsets seen at the start."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        offsets: dict[int, int] | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        self.topic = topic
        self.consumer = _consumer(bootstrap, overrides, "state-tail")
        self.codec = RecordCodec()
        self.undecodable = Undecodable(topic)
        md = self.consumer.list_topics(topic, timeout=10).topics.get(topic)
        if md is None or md.error is not None or not md.partitions:
            self.consumer.close()
            raise RuntimeError(
                f"topic {topic!r} not found on the broker; check --topic and "
                "--bootstrap-servers (kvbridge run creates it)"
            )
        self.partitions = sorted(md.partitions)
        offsets = dict(offsets or {})
        unknown = set(offsets) - set(self.partitions)
        if unknown:
            self.consumer.close()
            raise RuntimeError(
                f"the state reflects partitions {sorted(unknown)} that topic {topic!r} does not "
                "have; is it the state topic of another events topic?"
            )
        self.ends: dict[int, int] = {}
        self.next: dict[int, int] = {}
        assign = []
        for p in self.partitions:
            lo, hi = self.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            self.ends[p] = hi
            start = offsets.get(p)
            if start is None:
                start = lo
            elif start > hi:
                log.error(
                    "%s partition %d: the state reflects offsets up to %d but the partition ends "
                    "at %d; was the topic recreated? Rebuild the state topic",
                    topic,
                    p,
                    start,
                    hi,
                )
            elif start < lo:
                log.error(
                    "%s partition %d: offsets %d..%d were deleted (retention) before they were "
                    "applied; the state misses them",
                    topic,
                    p,
                    start,
                    lo - 1,
                )
                start = lo
            self.next[p] = start
            assign.append(TopicPartition(topic, p, start if start >= 0 else OFFSET_BEGINNING))
        self.consumer.assign(assign)

    def poll(self, timeout: float = 0.1, max_records: int = 2000) -> list[TailedRecord]:
        out = []
        for msg in records_of(self.consumer.consume(max_records, timeout=timeout)):
            p, off = msg.partition(), msg.offset()
            self.next[p] = off + 1
            try:
                rec: Record | None = self.codec.decode(msg.value())
            except RecordError as exc:
                self.undecodable.add(p, off, str(exc))
                rec = None
            out.append(TailedRecord(p, off, msg.timestamp()[1], rec))
        return out

    @property
    def skipped(self) -> int:
        """Records skipped because they could not be decoded (``undecodable`` has where)."""
        return self.undecodable.count

    def partition_ids(self, timeout: float = 5.0) -> set[int] | None:
        """The topic's partitions per fresh metadata from the broker; None if that is not
        available right now (broker unreachable, topic briefly unknown)."""
        try:
            md = self.consumer.list_topics(self.topic, timeout=timeout).topics.get(self.topic)
        except KafkaException as exc:
            log.debug("metadata of %s unavailable: %s", self.topic, exc)
            return None
        if md is None or md.error is not None or not md.partitions:
            log.debug("metadata of %s unavailable: %s", self.topic, md and md.error)
            return None
        return set(md.partitions)

    def add_partitions(self, partitions: list[int]) -> list[int]:
        """Also read these partitions (added to the topic after the start), from their
        beginning; their end seen at the start counts as 0. Returns those not read before."""
        new = sorted({p for p in partitions if p not in self.next})
        if not new:
            return []
        self.consumer.incremental_assign(
            [TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in new]
        )
        for p in new:
            self.ends[p] = 0
            self.next[p] = 0
        self.partitions = sorted(self.next)
        return new

    def positions(self) -> dict[int, int]:
        """Per partition, the offset of the next record to read (past transaction markers,
        which take offsets but are never returned). Call from the consuming thread."""
        pos = dict(self.next)
        for tp in self.consumer.position([TopicPartition(self.topic, p) for p in self.partitions]):
            if tp.offset >= 0:
                pos[tp.partition] = max(pos[tp.partition], tp.offset)
        return pos

    def lag(self) -> dict[int, int]:
        """Per partition, how far behind the end seen at the start (0 = caught up)."""
        pos = self.positions()
        return {p: max(0, self.ends[p] - pos[p]) for p in self.partitions}

    def caught_up(self) -> bool:
        return not any(self.lag().values())

    def close(self) -> None:
        self.consumer.close()


class StateSyncer:
    """Keeps the state topic in step with kv-events, one transaction per commit interval."""

    def __init__(
        self,
        bootstrap: str,
        events_topic: str = "kv-events",
        state_topic: str = DEFAULT_STATE_TOPIC,
        transactional_id: str | None = None,
        overrides: dict[str, Any] | None = None,
        commit_interval: float = 0.2,
        commit_max: int = 50_000,
        partition_check_interval: float = 30.0,
        policy: str | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.events_topic = events_topic
        self.state_topic = state_topic
        self.policy = policy
        self.transactional_id = transactional_id or f"kvbridge-state-sync-{state_topic}"
        self.overrides = dict(overrides or {})
        self.commit_interval = commit_interval
        self.commit_max = commit_max
        # How often kv-events' partition count is checked (partitions added while running).
        self.partition_check_interval = partition_check_interval
        self.metadata_timeout = 5.0  # seconds a check waits for metadata
        self.watch = PartitionWatch(partition_check_interval, set())
        self.producer: Producer | None = None
        self.tail: EventTail | None = None
        self.undecodable: Undecodable | None = None  # the tail's: kv-events records skipped
        self.sync = StateSync(events_topic, policy=policy)
        self.pending = Pending()
        self.consumed = 0
        self.commits = 0
        self.resumed_from: dict[int, int] = {}
        # kv-events positions whose records are all in the state topic (set by run()).
        self.synced: dict[int, int] = {}

    def open(self) -> None:
        """Fence any older instance, load the state topic, position kv-events after it."""
        ensure_state_topic(self.bootstrap, self.state_topic, self.overrides)
        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap,
            "transactional.id": self.transactional_id,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "compression.type": "lz4",
        }
        conf.update(self.overrides)
        conf.setdefault("logger", librdkafka_logger())
        self.producer = Producer(conf)
        try:
            # Aborts a crashed predecessor's open transaction, so the load below sees the end.
            self.producer.init_transactions(60)
        except KafkaException as exc:
            raise RuntimeError(
                f"could not start transactions (id {self.transactional_id!r}): "
                f"{exc.args[0].str()}. The broker needs the transaction state log"
            ) from exc
        self.sync = load_state(
            self.bootstrap, self.state_topic, self.events_topic, self.overrides, self.policy
        )
        self.resumed_from = dict(self.sync.offsets)
        self.tail = EventTail(self.bootstrap, self.events_topic, self.sync.offsets, self.overrides)
        self.undecodable = self.tail.undecodable
        self.watch = PartitionWatch(
            self.partition_check_interval,
            set(self.tail.partitions),
            time.monotonic() + self.partition_check_interval,
        )
        log.info(
            "state-sync: %s -> %s, %d streams loaded, resuming at %s",
            self.events_topic,
            self.state_topic,
            len(self.sync.state.streams),
            self.resumed_from or "the beginning",
        )

    def step(self, timeout: float = 0.1) -> int:
        """Consume what is there and apply it (no commit); returns the records consumed."""
        assert self.tail is not None, "open() first"
        got = self.tail.poll(timeout)
        for tr in got:
            if tr.record is None:
                self.sync.offsets[tr.partition] = tr.offset + 1
                self.pending.add(tr.partition, ())
            else:
                changes = self.sync.apply(tr.partition, tr.offset, tr.timestamp_ms, tr.record)
                self.pending.add(tr.partition, changes)
        self.consumed += len(got)
        return len(got)

    def check_partitions(self, now: float | None = None) -> list[int]:
        """Pick up kv-events partitions added since open(): read them from their beginning
        and name them (at offset 0 until their records are applied) in the offsets record
        of the next transaction. Returns the new partitions. Without metadata it changes
        nothing; the next check retries."""
        assert self.tail is not None, "open() first"
        ids = self.tail.partition_ids(self.metadata_timeout)
        new = self.watch.checked(time.monotonic() if now is None else now, ids)
        if ids is None and self.watch.failures == 1:
            log.warning(
                "state-sync: could not get the partitions of %s; retrying in %.0fs",
                self.events_topic,
                self.watch.interval,
            )
        new = self.tail.add_partitions(new)
        if not new:
            return []
        for p in self.sync.add_partitions(new):
            self.pending.add(p, ())
        log.info(
            "state-sync: %s has new partitions %s; reading them from their beginning",
            self.events_topic,
            new,
        )
        return new

    def commit(self) -> bool:
        """Write the pending changes and offsets in one transaction; False if it was aborted
        (the changes stay pending and go into the next one)."""
        p = self.producer
        assert p is not None, "open() first"
        if not self.pending.partitions:
            return True
        records = self.pending.records(self.sync)
        try:
            p.begin_transaction()
            for key, value in records:
                self._produce(key, value)
            p.commit_transaction(60)
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            if err.fatal():
                raise RuntimeError(
                    f"state-sync: cannot write {self.state_topic!r}: {err.str()} (fenced by "
                    "another state-sync with the same --transactional-id?)"
                ) from exc
            log.warning("state-sync: transaction failed (%s); aborting, will retry", err.str())
            try:
                p.abort_transaction(60)
            except KafkaException as exc2:
                raise RuntimeError(
                    f"state-sync: could not abort a failed transaction: {exc2.args[0].str()}"
                ) from exc2
            return False
        self.pending.clear()
        self.commits += 1
        return True

    def _produce(self, key: bytes, value: bytes | None) -> None:
        assert self.producer is not None
        while True:
            try:
                self.producer.produce(self.state_topic, value, key)
                return
            except BufferError:
                self.producer.poll(0.05)

    def run(self, stop: threading.Event, until_caught_up: bool = False) -> None:
        """Consume and commit until ``stop`` (or, with ``until_caught_up``, until kv-events'
        end seen at open() is reflected in the state topic); commits what is pending."""
        assert self.tail is not None, "open() first"
        next_commit = time.monotonic() + self.commit_interval
        while not stop.is_set():
            self.step(0.1)
            now = time.monotonic()
            if self.watch.due(now):
                self.check_partitions(now)
            if now >= next_commit or len(self.pending) >= self.commit_max:
                self.commit()
                next_commit = now + self.commit_interval
            if not self.pending.partitions:
                self.synced = self.tail.positions()
                if until_caught_up and all(
                    self.synced[p] >= end for p, end in self.tail.ends.items()
                ):
                    return
        while not self.commit():
            time.sleep(0.2)

    def close(self) -> None:
        if self.tail is not None:
            self.tail.close()
            self.tail = None
        if self.producer is not None:
            self.producer.flush(10)
            self.producer = None
