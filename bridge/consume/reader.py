"""Reading the kv-events topic back: typed records with their Kafka coordinates.

A small library for anything that consumes the topic (``kvbridge consume``/``replay``,
``kvbridge check``, routers, analytics)::

    from bridge.consume.reader import StartAt, StopAt, TopicReader
    from bridge.consume.state import CacheState

    state = CacheState()
    with TopicReader("localhost:9092", "kv-events") as reader:
        for cr in reader.read(StartAt.at_timestamp(1764700000000), stop=StopAt.at_end()):
            state.apply(cr.record)  # cr.partition, cr.offset, cr.timestamp_ms: where it was
        print(reader.next_offsets)  # where to continue from next time

Where to start (:class:`StartAt`): the beginning, the end, offsets per partition, a timestamp
(the first record at or after it, via ``offsets_for_times``), or a consumer group's committed
offsets (``TopicReader(..., group_id=...)``, then :meth:`TopicReader.commit`). Where to stop
(:class:`StopAt`): the end seen when reading began (the default), offsets per partition, a
timestamp, or never (``follow=True``). Reads are ``read_committed``: records of aborted
transactions never show.

:meth:`TopicReader.read` assigns the partitions itself; :meth:`TopicReader.read_group` joins
the consumer group instead, so that its members share the partitions (and rebalance when
members come and go) while following the topic.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    OFFSET_INVALID,
    Consumer,
    KafkaException,
    TopicPartition,
)

from bridge.log.records import Record, RecordCodec, RecordError
from bridge.ops.logsetup import librdkafka_logger

log = logging.getLogger(__name__)

__all__ = ["ConsumedRecord", "ReaderError", "StartAt", "StopAt", "TopicReader", "Undecodable"]


class ReaderError(RuntimeError):
    """Reading cannot start as asked (missing topic, unknown partition, no group...)."""


@dataclass(slots=True)
class ConsumedRecord:
    partition: int
    offset: int
    timestamp_ms: int
    record: Record


@dataclass(frozen=True, slots=True)
class StartAt:
    """Where to start reading.

    ``kind``: "beginning", "end", "offset" (``offset`` of ``partition`` only), "offsets"
    (``offsets``: {partition: offset}; only those partitions are read), "timestamp"
    (``timestamp_ms``: the first record at or after it, in every partition) or "committed"
    (the reader's consumer group's committed offsets; partitions without one start at the
    beginning).
    """

    kind: str = "beginning"
    offset: int | None = None
    partition: int | None = None
    timestamp_ms: int | None = None
    offsets: dict[int, int] | None = field(default=None, hash=False)

    @classmethod
    def beginning(cls) -> StartAt:
        return cls("beginning")

    @classmethod
    def end(cls) -> StartAt:
        return cls("end")

    @classmethod
    def at_offsets(cls, offsets: dict[int, int]) -> StartAt:
        return cls("offsets", offsets=dict(offsets))

    @classmethod
    def at_timestamp(cls, timestamp_ms: int) -> StartAt:
        return cls("timestamp", timestamp_ms=timestamp_ms)

    @classmethod
    def committed(cls) -> StartAt:
        return cls("committed")


@dataclass(frozen=True, slots=True)
class StopAt:
    """Where to stop. ``offsets``: {partition: last offset to read (inclusive)}; partitions
    not named are read to the end. ``offset``: the last offset to read in every partition.
    ``timestamp_ms``: the last record read is the last at or before it (in each partition).
    Several conditions: the first one reached. With ``follow``, a partition without a bound
    is read forever."""

    offsets: dict[int, int] | None = field(default=None, hash=False)
    timestamp_ms: int | None = None
    offset: int | None = None

    @classmethod
    def at_end(cls) -> StopAt:
        return cls()

    @classmethod
    def at_offsets(cls, offsets: dict[int, int]) -> StopAt:
        return cls(offsets=dict(offsets))

    @classmethod
    def at_timestamp(cls, timestamp_ms: int) -> StopAt:
        return cls(timestamp_ms=timestamp_ms)


class Undecodable:
    """Records a reader skipped because it cannot decode them (a null value, bytes another
    producer wrote, an unknown schema, a truncated body): how many, where the first few are
    and why, and a warning for each, rate-limited to one per ``interval`` seconds (with the
    count of those not logged in between)."""

    KEEP = 5  # (partition, offset, reason) kept for reports

    def __init__(self, topic: str, interval: float = 10.0) -> None:
        self.topic = topic
        self.count = 0
        self.first: list[tuple[int, int, str]] = []
        self._interval = interval
        self._logged_at: float | None = None
        self._not_logged = 0

    def add(self, partition: int, offset: int, reason: str) -> None:
        self.count += 1
        if len(self.first) < self.KEEP:
            self.first.append((partition, offset, reason))
        now = time.monotonic()
        if self._logged_at is not None and now - self._logged_at < self._interval:
            self._not_logged += 1
            return
        self._logged_at = now
        more = f"; {self._not_logged} more since the last warning" if self._not_logged else ""
        self._not_logged = 0
        log.warning(
            "%s partition %d offset %d: skipped, not a kv-events record this reader can decode "
            "(%s); %d skipped so far%s",
            self.topic,
            partition,
            offset,
            reason,
            self.count,
            more,
        )

    def samples(self) -> list[str]:
        """``partition:offset: reason`` of the first few skipped records."""
        return [f"{p}:{o}: {why}" for p, o, why in self.first]


def records_of(msgs: list[Any]) -> Iterator[Any]:
    """The messages of a ``consume()`` that carry records: a fatal client error raises,
    others (a broker briefly away, ...) are logged and skipped."""
    for msg in msgs:
        err = msg.error()
        if err is None:
            yield msg
        elif err.fatal():
            raise KafkaException(err)
        else:
            log.warning("kafka: %s", err)


class TopicReader:
    """Reads one topic: :meth:`read` with manually assigned partitions (no rebalancing), or
    :meth:`read_group` as a member of a consumer group that shares the partitions.

    ``group_id``: a consumer group whose committed offsets :meth:`read` can start from
    (``StartAt.committed()``) and :meth:`commit` advances; without it, a throwaway group
    that commits nothing. ``overrides``: any librdkafka consumer properties.

    After (or during) a read: ``next_offsets`` {partition: the offset after the last
    record read}, ``start_offsets`` and ``end_offsets`` (where each partition started and
    where it stops; None while following without a bound), ``records_read``, ``skipped``
    (records that could not be decoded; ``undecodable`` says where and why).
    In :meth:`read_group` these cover the partitions the member owns now (``assigned``).
    ``before_commit``: called before every commit (e.g. to flush output the commit vouches
    for).
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        overrides: dict[str, Any] | None = None,
        group_id: str | None = None,
        codec: RecordCodec | None = None,
    ) -> None:
        """``codec``: how values are decoded (default: both framings, no schema registry)."""
        conf: dict[str, Any] = {
            "bootstrap.servers": bootstrap_servers,
            "group.id": group_id or f"kvbridge-reader-{uuid.uuid4().hex[:12]}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": False,
            "auto.offset.reset": "earliest",
            # Only committed records: in exactly-once mode, aborted ones never show.
            "isolation.level": "read_committed",
        }
        conf.update(overrides or {})
        self.topic = topic
        self.group_id = group_id
        conf.setdefault("logger", librdkafka_logger())
        self.consumer = Consumer(conf)
        self.codec = codec or RecordCodec()
        self.undecodable = Undecodable(topic)
        self.records_read = 0
        self.next_offsets: dict[int, int] = {}
        self.start_offsets: dict[int, int] = {}
        self.end_offsets: dict[int, int | None] = {}
        self.assigned: frozenset[int] = frozenset()
        self.before_commit: Callable[[], None] | None = None
        self._cooperative = "cooperative" in str(conf.get("partition.assignment.strategy", ""))
        self._fallback = "beginning"
        self._stopping = threading.Event()

    @property
    def skipped(self) -> int:
        """Records skipped because they could not be decoded (``undecodable`` has where)."""
        return self.undecodable.count

    def close(self) -> None:
        self.consumer.close()

    def stop(self) -> None:
        """Make :meth:`read`/:meth:`read_group` return at their next poll (within
        ``idle_timeout``), for good; safe to call from another thread."""
        self._stopping.set()

    def __enter__(self) -> TopicReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def partitions(self, timeout: float = 10.0) -> list[int]:
        md = self.consumer.list_topics(self.topic, timeout=timeout)
        t = md.topics.get(self.topic)
        if t is None or t.error is not None or not t.partitions:
            raise ReaderError(
                f"topic {self.topic!r} not found on the broker; check --topic and "
                "--bootstrap-servers (kvbridge run creates it)"
            )
        return sorted(t.partitions)

    def _check_partitions(self, wanted: dict[int, int], parts: list[int], what: str) -> None:
        unknown = sorted(set(wanted) - set(parts))
        if unknown:
            raise ReaderError(
                f"{what}: partition {unknown[0]} does not exist; topic {self.topic!r} has "
                f"partitions {parts[0]}..{parts[-1]}"
            )

    def _offsets_for_time(self, parts: list[int], timestamp_ms: int) -> dict[int, int]:
        """Per partition, the first offset whose timestamp is >= ``timestamp_ms`` (-1: none)."""
        tps = [TopicPartition(self.topic, p, timestamp_ms) for p in parts]
        found = self.consumer.offsets_for_times(tps, timeout=10)
        return {tp.partition: tp.offset for tp in found}

    def _start_offsets(self, start: StartAt, parts: list[int]) -> dict[int, int]:
        if start.kind == "beginning":
            return {p: OFFSET_BEGINNING for p in parts}
        if start.kind == "end":
            return {p: OFFSET_END for p in parts}
        if start.kind == "offset":
            if start.partition is None or start.offset is None:
                raise ReaderError("--from-offset N needs --partition P (offsets are per partition)")
            wanted = {start.partition: start.offset}
            self._check_partitions(wanted, parts, "start offset")
            return wanted
        if start.kind == "offsets":
            wanted = dict(start.offsets or {})
            if not wanted:
                raise ReaderError("start offsets: give at least one partition:offset")
            self._check_partitions(wanted, parts, "start offset")
            return wanted
        if start.kind == "timestamp":
            if start.timestamp_ms is None:
                raise ReaderError("start at a timestamp needs timestamp_ms")
            found = self._offsets_for_time(parts, start.timestamp_ms)
            # -1: no record at or after that time in this partition -> start at its end.
            return {p: (o if o >= 0 else OFFSET_END) for p, o in found.items()}
        if start.kind == "committed":
            if self.group_id is None:
                raise ReaderError(
                    "starting at committed offsets needs a consumer group: give --group ID"
                )
            got = self.consumer.committed([TopicPartition(self.topic, p) for p in parts], 10)
            return {tp.partition: (tp.offset if tp.offset >= 0 else OFFSET_BEGINNING) for tp in got}
        raise ReaderError(f"unknown start kind {start.kind!r}")

    def _stop_offsets(
        self, stop: StopAt | None, to_offset: int | None, parts: list[int]
    ) -> dict[int, int]:
        """Exclusive end offsets per partition from the stop conditions (absent: no bound)."""
        ends: dict[int, int] = {}
        for last in (to_offset, stop.offset if stop is not None else None):
            if last is not None:
                ends = {p: min(ends.get(p, last + 1), last + 1) for p in parts}
        if stop is not None and stop.offsets:
            self._check_partitions(stop.offsets, parts, "stop offset")
            for p, o in stop.offsets.items():
                ends[p] = min(ends.get(p, o + 1), o + 1)
        if stop is not None and stop.timestamp_ms is not None:
            for p, o in self._offsets_for_time(parts, stop.timestamp_ms + 1).items():
                if o >= 0:
                    ends[p] = min(ends.get(p, o), o)
        return ends

    def watermarks(self, partition: int) -> tuple[int, int]:
        return self.consumer.get_watermark_offsets(
            TopicPartition(self.topic, partition), timeout=10, cached=False
        )

    def _resolve(self, p: int, offset: int) -> tuple[int, int]:
        """(the real offset to start ``p`` at, its end now): OFFSET_BEGINNING/OFFSET_END
        resolved, an offset gone by retention or past the end clamped (with a warning)."""
        lo, hi = self.watermarks(p)
        if offset == OFFSET_END:
            return hi, hi
        if offset == OFFSET_BEGINNING or offset < lo:
            if offset != OFFSET_BEGINNING:
                log.warning(
                    "partition %d: offset %d is gone (retention); starting at %d", p, offset, lo
                )
            return lo, hi
        if offset > hi:
            holds = "is empty" if lo == hi else f"holds offsets {lo}..{hi - 1}"
            log.warning(
                "partition %d %s: offset %d is past its end; starting at the end (offset %d), "
                "with the records written from now on",
                p,
                holds,
                offset,
                hi,
            )
            return hi, hi
        return offset, hi

    def read(
        self,
        start: StartAt | None = None,
        follow: bool = False,
        to_offset: int | None = None,
        idle_timeout: float = 1.0,
        stop: StopAt | None = None,
        tick: Callable[[], None] | None = None,
    ) -> Iterator[ConsumedRecord]:
        """Records from ``start`` up to ``stop`` (and ``to_offset``, inclusive, in every
        partition). Without ``follow``, a partition without a bound stops at the end it had
        when reading began; with it, such a partition is read until the caller stops (or
        :meth:`stop`). ``tick``: called before every poll (at least every ``idle_timeout``
        seconds, also while no records come), when every record yielded so far is handled."""
        start = start or StartAt()
        self.start_offsets, self.end_offsets, self.next_offsets = {}, {}, {}
        parts = self.partitions()
        offsets = self._start_offsets(start, parts)
        bounds = self._stop_offsets(stop, to_offset, parts)
        ends: dict[int, int | None] = {}
        for p in offsets:
            offsets[p], hi = self._resolve(p, offsets[p])
            bound = bounds.get(p)
            ends[p] = bound if follow else min(hi, bound if bound is not None else hi)
        self.start_offsets = dict(offsets)
        self.end_offsets = dict(ends)
        self.next_offsets = dict(offsets)
        remaining = {p for p in offsets if ends[p] is None or offsets[p] < ends[p]}
        self.consumer.assign([TopicPartition(self.topic, p, o) for p, o in offsets.items()])
        idle = 0
        while remaining and not self._stopping.is_set():
            if tick is not None:
                tick()
            msgs = self.consumer.consume(500, timeout=idle_timeout)
            for msg in records_of(msgs):
                p, off = msg.partition(), msg.offset()
                end = ends.get(p)
                if p not in remaining or (end is not None and off >= end):
                    remaining.discard(p)
                    continue
                cr = self._take(msg, p, off)
                if cr is not None:
                    yield cr
                if end is not None and off + 1 >= end:
                    remaining.discard(p)
            bounded = {p for p in remaining if ends[p] is not None}
            if bounded:
                # Transaction markers take offsets but are never returned, and read_committed
                # stops at the last stable offset: the position says when a partition is done.
                idle = 0 if msgs else idle + 1
                positions = self.consumer.position([TopicPartition(self.topic, p) for p in bounded])
                for tp in positions:
                    end = ends[tp.partition]
                    if tp.offset >= 0 and end is not None and tp.offset >= end:
                        remaining.discard(tp.partition)
                        self.next_offsets[tp.partition] = max(
                            self.next_offsets[tp.partition], min(tp.offset, end)
                        )
                if not follow and idle >= 3 and remaining:
                    log.warning(
                        "partitions %s: no more committed records before the end seen at the "
                        "start (an open transaction?); stopping there",
                        sorted(remaining),
                    )
                    return

    def read_group(
        self,
        fallback: StartAt | None = None,
        idle_timeout: float = 1.0,
        tick: Callable[[], None] | None = None,
    ) -> Iterator[ConsumedRecord]:
        """Follow the topic as a member of the consumer group (``subscribe()``): the members
        share the partitions, and the group rebalances when members join or leave. Never
        ends by itself: the caller breaks out (or calls :meth:`stop`), then :meth:`commit`.

        Each partition assigned to this member starts at the group's committed offset, or,
        where none is committed, at ``fallback``: ``StartAt.beginning()`` (the default;
        ``StartAt.committed()`` means the same) or ``StartAt.end()``. Before partitions are
        taken away, the offsets after the records yielded from them are committed
        synchronously, so the next owner continues exactly there. Every record yielded is
        taken as handled once the caller asks for the next one. ``tick``: as in :meth:`read`.
        """
        if self.group_id is None:
            raise ReaderError("sharing partitions needs a consumer group: give --group ID")
        kind = (fallback or StartAt.beginning()).kind
        if kind not in ("beginning", "end", "committed"):
            raise ReaderError(
                "a group member starts each partition at the group's committed offset; where "
                "none is committed, it can only fall back to the beginning or the end "
                f"(not {kind!r})"
            )
        self._fallback = "end" if kind == "end" else "beginning"
        self.start_offsets, self.end_offsets, self.next_offsets = {}, {}, {}
        self.assigned = frozenset()
        self.partitions()  # a clear error for a missing topic
        self.consumer.subscribe(
            [self.topic],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        while not self._stopping.is_set():
            if tick is not None:
                tick()
            msgs = self.consumer.consume(500, timeout=idle_timeout)
            for msg in records_of(msgs):
                p, off = msg.partition(), msg.offset()
                nxt = self.next_offsets.get(p)
                if nxt is None or off < nxt:
                    # Not ours any more (fetched before a rebalance), or already read.
                    log.debug(
                        "partition %d offset %d: not read (owned: %s)", p, off, nxt is not None
                    )
                    continue
                cr = self._take(msg, p, off)
                if cr is not None:
                    yield cr

    def _take(self, msg: Any, p: int, off: int) -> ConsumedRecord | None:
        """Count the record at ``p``/``off`` as read and decode it; None (counted in
        ``undecodable``, logged rate-limited) if it cannot be decoded."""
        self.next_offsets[p] = off + 1
        self.records_read += 1
        try:
            rec = self.codec.decode(msg.value())
        except RecordError as exc:
            self.undecodable.add(p, off, str(exc))
            return None
        return ConsumedRecord(p, off, msg.timestamp()[1], rec)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Start each newly assigned partition at its committed offset (else the fallback)."""
        parts = sorted(tp.partition for tp in partitions)
        if not parts:
            return
        try:
            got = consumer.committed([TopicPartition(self.topic, p) for p in parts], timeout=10)
        except KafkaException as exc:
            raise ReaderError(
                f"group {self.group_id!r}: cannot read its committed offsets ({exc}); is the "
                "broker reachable?"
            ) from None
        fallback = OFFSET_END if self._fallback == "end" else OFFSET_BEGINNING
        tps = []
        for tp in got:
            start, _ = self._resolve(tp.partition, tp.offset if tp.offset >= 0 else fallback)
            self.start_offsets[tp.partition] = start
            self.next_offsets[tp.partition] = start
            self.end_offsets[tp.partition] = None
            tps.append(TopicPartition(self.topic, tp.partition, start))
        self.assigned = self.assigned | frozenset(parts)
        if self._cooperative:
            consumer.incremental_assign(tps)
        else:
            consumer.assign(tps)
        log.info(
            "group %s: assigned partitions %s (starting at %s); owns %s",
            self.group_id,
            ",".join(map(str, parts)),
            ",".join(f"{tp.partition}:{tp.offset}" for tp in tps),
            ",".join(map(str, sorted(self.assigned))) or "none",
        )

    def _forget(self, parts: list[int]) -> None:
        for p in parts:
            self.next_offsets.pop(p, None)
            self.start_offsets.pop(p, None)
            self.end_offsets.pop(p, None)
        self.assigned = self.assigned - frozenset(parts)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Commit where the revoked partitions stand, before giving them up."""
        parts = sorted(tp.partition for tp in partitions if tp.partition in self.next_offsets)
        if parts:
            try:
                done = self.commit(partitions=parts)
            except KafkaException as exc:
                log.warning(
                    "group %s: could not commit partitions %s before giving them up (%s); "
                    "their next owner starts at their previous commit",
                    self.group_id,
                    ",".join(map(str, parts)),
                    exc,
                )
            else:
                log.info(
                    "group %s: revoked partitions %s (committed %s)",
                    self.group_id,
                    ",".join(map(str, parts)),
                    ",".join(f"{p}:{o}" for p, o in sorted(done.items())),
                )
        self._forget([tp.partition for tp in partitions])

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Partitions lost (e.g. the session timed out): nothing can be committed for them."""
        parts = sorted(tp.partition for tp in partitions)
        log.warning(
            "group %s: lost partitions %s without committing (session timed out?); their next "
            "owner starts at their last commit",
            self.group_id,
            ",".join(map(str, parts)),
        )
        self._forget(parts)

    def progress(self) -> tuple[int, int | None]:
        """(offsets read so far, offsets to read in all; None when unbounded) over the
        partitions of the current :meth:`read`."""
        done = sum(self.next_offsets[p] - self.start_offsets[p] for p in self.start_offsets)
        if any(e is None for e in self.end_offsets.values()):
            return done, None
        total = sum(max(0, (e or 0) - self.start_offsets[p]) for p, e in self.end_offsets.items())
        return done, total

    def commit(
        self, asynchronous: bool = False, partitions: list[int] | None = None
    ) -> dict[int, int]:
        """Commit ``next_offsets`` (of ``partitions`` only, if given) as the consumer group's
        position (needs ``group_id``); returns what was committed. Records before those
        offsets count as processed: call it after handling them."""
        if self.group_id is None:
            raise ReaderError("commit needs a consumer group: TopicReader(..., group_id=...)")
        todo = {p: o for p, o in self.next_offsets.items() if partitions is None or p in partitions}
        if not todo:
            return {}
        if self.before_commit is not None:
            self.before_commit()
        tps = [TopicPartition(self.topic, p, o) for p, o in sorted(todo.items())]
        self.consumer.commit(offsets=tps, asynchronous=asynchronous)
        return todo

    def committed(self) -> dict[int, int]:
        """The consumer group's committed offsets (partitions without one left out)."""
        parts = self.partitions()
        got = self.consumer.committed([TopicPartition(self.topic, p) for p in parts], 10)
        return {tp.partition: tp.offset for tp in got if tp.offset not in (OFFSET_INVALID, -1)}
