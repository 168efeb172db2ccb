"""Reading the kv-events topic back: typed records with their Kafka coordinates."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaException, TopicPartition

from bridge.records import Record, RecordCodec, RecordError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ConsumedRecord:
    partition: int
    offset: int
    timestamp_ms: int
    record: Record


@dataclass(frozen=True, slots=True)
class StartAt:
    """Where to start: "beginning", "end", an offset (of ``partition``) or a timestamp (ms)."""

    kind: str = "beginning"
    offset: int | None = None
    partition: int | None = None
    timestamp_ms: int | None = None


class TopicReader:
    def __init__(
        self, bootstrap_servers: str, topic: str, overrides: dict[str, Any] | None = None
    ) -> None:
        conf: dict[str, Any] = {
            "bootstrap.servers": bootstrap_servers,
            "group.id": f"kvbridge-reader-{uuid.uuid4().hex[:12]}",
            "enable.auto.commit": False,
            "enable.partition.eof": False,
            "auto.offset.reset": "earliest",
            # Only committed records: in exactly-once mode, aborted ones never show.
            "isolation.level": "read_committed",
        }
        conf.update(overrides or {})
        self.topic = topic
        self.consumer = Consumer(conf)
        self.codec = RecordCodec()
        self.skipped = 0

    def close(self) -> None:
        self.consumer.close()

    def __enter__(self) -> TopicReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def partitions(self, timeout: float = 10.0) -> list[int]:
        md = self.consumer.list_topics(self.topic, timeout=timeout)
        t = md.topics.get(self.topic)
        if t is None or t.error is not None or not t.partitions:
            raise RuntimeError(
                f"topic {self.topic!r} not found on the broker; check --topic and "
                "--bootstrap-servers (kvbridge run creates it)"
            )
        return sorted(t.partitions)

    def _start_offsets(self, start: StartAt, parts: list[int]) -> dict[int, int]:
        if start.kind == "beginning":
            return {p: OFFSET_BEGINNING for p in parts}
        if start.kind == "end":
            return {p: OFFSET_END for p in parts}
        if start.kind == "offset":
            if start.partition is None or start.offset is None:
                raise ValueError("--from-offset needs --partition")
            if start.partition not in parts:
                raise ValueError(
                    f"partition {start.partition} does not exist; topic {self.topic!r} has "
                    f"partitions {parts}"
                )
            return {start.partition: start.offset}
        if start.kind == "timestamp":
            tps = [TopicPartition(self.topic, p, start.timestamp_ms) for p in parts]
            found = self.consumer.offsets_for_times(tps, timeout=10)
            # -1: no record at or after that time in this partition -> start at its end.
            return {tp.partition: (tp.offset if tp.offset >= 0 else OFFSET_END) for tp in found}
        raise ValueError(f"unknown start kind {start.kind!r}")

    def read(
        self,
        start: StartAt | None = None,
        follow: bool = False,
        to_offset: int | None = None,
        idle_timeout: float = 1.0,
    ) -> Iterator[ConsumedRecord]:
        """Records from ``start``; without ``follow``, stops at the end seen when it began."""
        start = start or StartAt()
        parts = self.partitions()
        offsets = self._start_offsets(start, parts)
        ends: dict[int, int] = {}
        for p in offsets:
            lo, hi = self.consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=10)
            ends[p] = hi if to_offset is None else min(hi, to_offset + 1)
            if offsets[p] == OFFSET_END:
                offsets[p] = hi
            elif offsets[p] == OFFSET_BEGINNING:
                offsets[p] = lo
        remaining = {p for p in offsets if follow or offsets[p] < ends[p]}
        self.consumer.assign([TopicPartition(self.topic, p, o) for p, o in offsets.items()])
        idle = 0
        while remaining:
            msgs = self.consumer.consume(500, timeout=idle_timeout)
            for msg in msgs:
                err = msg.error()
                if err is not None:
                    if err.fatal():
                        raise KafkaException(err)
                    log.warning("kafka: %s", err)
                    continue
                p, off = msg.partition(), msg.offset()
                if not follow and off >= ends[p]:
                    remaining.discard(p)
                    continue
                try:
                    rec = self.codec.decode(msg.value())
                except RecordError as exc:
                    self.skipped += 1
                    log.warning("partition %d offset %d: skipped: %s", p, off, exc)
                else:
                    yield ConsumedRecord(p, off, msg.timestamp()[1], rec)
                if not follow and off + 1 >= ends[p]:
                    remaining.discard(p)
            if not follow and remaining:
                # Transaction markers take offsets but are never returned, and read_committed
                # stops at the last stable offset: the position says when a partition is done.
                idle = 0 if msgs else idle + 1
                positions = self.consumer.position(
                    [TopicPartition(self.topic, p) for p in remaining]
                )
                for tp in positions:
                    if tp.offset >= ends[tp.partition]:
                        remaining.discard(tp.partition)
                if idle >= 3 and remaining:
                    log.warning(
                        "partitions %s: no more committed records before the end seen at the "
                        "start (an open transaction?); stopping there",
                        sorted(remaining),
                    )
                    return
