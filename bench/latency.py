"""End-to-end latency: vLLM batch timestamp (record field ``ts``) to a consumer receiving it.

The consumer reads only the head of each Avro record (pod, model, dp_rank, epoch, seq,
index, ts: the first fields of ``schemas/kv_event.avsc``), which costs far less than a full
decode, so that measuring disturbs the run as little as possible.
"""

from __future__ import annotations

import math
import struct
import time
import uuid
from collections.abc import Sequence
from typing import NamedTuple

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

__all__ = ["LatencyConsumer", "RecordHead", "percentile", "read_head", "summarize"]

_HEADER = 10  # C3 01 + 8-byte schema fingerprint (Avro single-object encoding)
_DOUBLE = struct.Struct("<d")


class RecordHead(NamedTuple):
    pod: str
    model: str
    dp_rank: int
    epoch: int
    seq: int
    index: int
    ts: float


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """Avro int/long at ``pos``: zigzag varint -> (value, next position)."""
    shift = result = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return (result >> 1) ^ -(result & 1), pos
        shift += 7


def read_head(value: bytes) -> RecordHead:
    """The envelope fields in front of a kv-events record's ``batch_extra`` and event."""
    if value[:2] != b"\xc3\x01":
        raise ValueError("not an Avro single-object encoded value")
    pos = _HEADER
    n, pos = _varint(value, pos)
    pod = value[pos : pos + n].decode()
    pos += n
    n, pos = _varint(value, pos)
    model = value[pos : pos + n].decode()
    pos += n
    dp_rank, pos = _varint(value, pos)
    epoch, pos = _varint(value, pos)
    seq, pos = _varint(value, pos)
    index, pos = _varint(value, pos)
    (ts,) = _DOUBLE.unpack_from(value, pos)
    return RecordHead(pod, model, dp_rank, epoch, seq, index, ts)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of already sorted values."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(round(q * len(sorted_values) / 100, 9)))  # 99.9% of 1000 -> 999
    return sorted_values[min(rank, len(sorted_values)) - 1]


def summarize(latencies: list[float], prefix: str = "") -> dict[str, float | int | None]:
    """Milliseconds: p50, p99, p99.9, max over ``latencies`` (seconds); None when empty."""
    values = sorted(latencies)

    def ms(q: float) -> float | None:
        return round(percentile(values, q) * 1e3, 2) if values else None

    out: dict[str, float | int | None] = {"samples": len(values)} if not prefix else {}
    out.update(
        {
            f"{prefix}p50_ms": ms(50),
            f"{prefix}p99_ms": ms(99),
            f"{prefix}p999_ms": ms(99.9),
            f"{prefix}max_ms": ms(100),
        }
    )
    return out


class LatencyConsumer:
    """Reads a topic from the beginning; ``poll()`` returns, per event record, (receive time,
    Kafka CreateTime in seconds, head). CreateTime is set by the producer when the bridge
    hands the record over, so it splits the latency into bridge and Kafka parts.

    Marker records (index -1) are skipped: they carry the bridge's clock, not vLLM's.
    """

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"kvbridge-bench-latency-{uuid.uuid4().hex[:12]}",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "fetch.wait.max.ms": 50,
            }
        )
        md = self._consumer.list_topics(topic, timeout=10).topics[topic]
        self._consumer.assign(
            [TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(md.partitions)]
        )

    def poll(self, timeout: float = 0.05) -> list[tuple[float, float, RecordHead]]:
        # consume() waits for a full batch or the timeout: wait for one record, then take
        # whatever else is already there without waiting.
        first = self._consumer.poll(timeout)
        if first is None:
            return []
        msgs = [first, *self._consumer.consume(1000, timeout=0)]
        now = time.time()
        out = []
        for msg in msgs:
            if msg.error() is not None:
                continue
            head = read_head(msg.value())
            if head.index >= 0:
                out.append((now, msg.timestamp()[1] / 1000, head))
        return out

    def close(self) -> None:
        self._consumer.close()
