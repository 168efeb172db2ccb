"""Which partition a pod's records go to, and when that may change (pure: no I/O).

Kafka's default partitioner for keyed records (Java's ``DefaultPartitioner``/``BuiltInPartitioner``
and librdkafka's ``murmur2_random``) is ``(murmur2(key) & 0x7fffffff) % partitions``. The bridge
computes it itself, once per stream, with a *pinned* partition count instead of the topic's
current one: adding partitions to the topic then moves no pod (which would break the per-(pod,
rank) order consumers rely on) until the operator asks for it (``--repartition``).

The pinned count of a topic is recorded in the stream checkpoints (``Checkpoint.partitions``):
at start it is the count of the newest checkpoint of that topic that records one, else the
topic's current count (checkpoints written before the field existed, or a new topic).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's 32-bit murmur2 of ``data`` as an unsigned int (Java's ``Utils.murmur2`` & 2^32-1)."""
    n = len(data)
    h = (_SEED ^ n) & _MASK
    end = n - (n & 3)
    for i in range(0, end, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    rest = n & 3
    if rest:
        if rest == 3:
            h ^= data[end + 2] << 16
        if rest >= 2:
            h ^= data[end + 1] << 8
        h ^= data[end]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


def murmur2_signed(data: bytes) -> int:
    """:func:`murmur2` as Java's signed 32-bit int (the values Kafka's own tests list)."""
    h = murmur2(data)
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives ``key`` among ``partitions``."""
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, not {partitions}")
    return (murmur2(key) & 0x7FFFFFFF) % partitions


class _Recorded(Protocol):
    """What :func:`recorded_count` needs of a checkpoint."""

    topic: str | None
    partitions: int | None
    ts: float | None


def recorded_count(checkpoints: Iterable[_Recorded], topic: str) -> int | None:
    """The pinned count recorded for ``topic``: that of its newest checkpoint recording one
    (None: no checkpoint of that topic records a count)."""
    best: tuple[float, int] | None = None
    for cp in checkpoints:
        if cp.topic != topic or cp.partitions is None:
            continue
        ts = cp.ts or 0.0
        if best is None or ts >= best[0]:
            best = (ts, cp.partitions)
    return None if best is None else best[1]


@dataclass(frozen=True, slots=True)
class TopicPin:
    """The partition count a topic's streams are produced with, and where it came from."""

    topic: str
    pinned: int
    current: int
    recorded: int | None  # what the checkpoints said (None: nothing recorded)

    @property
    def differs(self) -> bool:
        """The topic's partition count is not the pinned one (partitions were added)."""
        return self.current != self.pinned

    @property
    def adopted(self) -> bool:
        """This start replaced the recorded count (--repartition, or a shrunken topic)."""
        return self.recorded is not None and self.pinned != self.recorded

    def adoption(self) -> str:
        """Why the recorded count was replaced (for the log)."""
        if self.recorded is not None and self.recorded > self.pinned:
            return (
                f"the topic has {self.pinned} partitions, fewer than the {self.recorded} "
                "recorded in the checkpoints (was it deleted and recreated?): adopting "
                f"{self.pinned}"
            )
        return (
            f"--repartition: adopting the topic's {self.pinned} partitions (pinned was "
            f"{self.recorded})"
        )

    def previous(self, recorded_for_stream: int | None) -> int:
        """The count a stream was produced with before this start: its checkpoint's, else the
        topic's recorded count, else (nothing recorded anywhere) the pinned count."""
        if recorded_for_stream is not None:
            return recorded_for_stream
        return self.recorded if self.recorded is not None else self.pinned

    def moves(self, key: bytes, recorded_for_stream: int | None) -> bool:
        """Whether a stream keyed ``key`` now goes to another partition than before."""
        before = self.previous(recorded_for_stream)
        return partition_for(key, before) != partition_for(key, self.pinned)

    def warning(self) -> str | None:
        """The operator's warning when the counts differ (None when they agree)."""
        if not self.differs:
            return None
        return (
            f"topic {self.topic} has {self.current} partitions but the bridge spreads pods over "
            f"the pinned {self.pinned}: every pod stays in the partition it had, so consumers "
            "keep each pod's order; nothing to do if that is fine. To spread the pods over all "
            f"{self.current} partitions, restart the bridge with --repartition "
            "(KVBRIDGE_REPARTITION=true): each pod whose partition changes then starts a new "
            "epoch (StreamStarted) in its new partition, and a consumer that is behind may read "
            "a moved pod's new records before its old ones (docs/operations.md, 'Adding "
            "partitions to kv-events')"
        )


def decide_pin(topic: str, recorded: int | None, current: int, repartition: bool) -> TopicPin:
    """The pinned count at start: the recorded one; the topic's current count when nothing is
    recorded, with ``repartition``, or when the topic has fewer partitions than recorded
    (records cannot go to partitions that do not exist)."""
    if current < 1:
        raise ValueError(f"topic {topic} reports {current} partitions")
    if recorded is None or repartition or recorded > current:
        return TopicPin(topic, current, current, recorded)
    return TopicPin(topic, recorded, current, recorded)


__all__ = [
    "TopicPin",
    "decide_pin",
    "murmur2",
    "murmur2_signed",
    "partition_for",
    "recorded_count",
]
