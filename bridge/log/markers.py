"""Marker records: what the bridge writes into the log about the streams themselves.

Consumers act on them: StreamStarted and PublisherRestarted -> drop the state held
for (pod, dp_rank); EventsLost -> that state is uncertain; PodRemoved -> forget the pod.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class StreamStarted:
    next_seq: int
    endpoint: str


@dataclass(slots=True, frozen=True)
class PublisherRestarted:
    old_epoch: int
    last_seq: int | None
    first_seq: int


# EventsLost reason prefix for a batch some of whose records Kafka refused for good: its other
# records may be in the log, so this marker may cover a partly delivered batch.
KAFKA_REFUSED = "kafka refused a record"
# EventsLost reason prefix for a batch with a record larger than the topic accepts that cannot
# be split (anything but a BlockStored of several blocks); none of its records is written.
RECORD_TOO_LARGE = "record too large for the topic"


# to_seq of an EventsLost whose range has no known end: the tail of an epoch closed by a
# publisher restart (or a seq jump). Whatever the old incarnation published from from_seq on,
# if anything, is unknown; the next marker opens a new epoch, so consumers reset anyway.
TAIL_END = 2**63 - 1


@dataclass(slots=True, frozen=True)
class EventsLost:
    from_seq: int
    to_seq: int
    reason: str

    @property
    def open_ended(self) -> bool:
        """The range is an epoch's unknown tail (``to_seq == TAIL_END``): not a count."""
        return self.to_seq == TAIL_END


@dataclass(slots=True, frozen=True)
class PodRemoved:
    reason: str


@dataclass(slots=True, frozen=True)
class EmptyBatch:
    """Batch ``seq`` (the envelope's) held no events: written so that the seq is accounted."""


Marker = StreamStarted | PublisherRestarted | EventsLost | PodRemoved | EmptyBatch
MARKER_TYPES = (StreamStarted, PublisherRestarted, EventsLost, PodRemoved, EmptyBatch)
