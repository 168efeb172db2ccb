"""Per-stream checkpoints in a compacted Kafka topic (like Kafka Connect's source offsets).

Key: JSON ``[pod, dp_rank]``; value: JSON ``{"epoch", "seq", "digest", "ts"}``: the last batch of
that stream Kafka holds (acknowledged, or committed in exactly-once mode), with a fingerprint of
its payload so a restarted bridge can tell whether the publisher is still the same incarnation.
Optional fields: ``uid`` (the pod's incarnation), ``topic`` and ``partitions`` (the kv-events
topic of the stream and the partition count its records were produced with: the pinned count,
see :mod:`bridge.log.partitioning`). Checkpoints without them, written by older bridges, still load.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from bridge.ops.logsetup import librdkafka_logger

log = logging.getLogger(__name__)

StreamKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    epoch: int
    seq: int
    digest: bytes | None  # payload_digest() of batch `seq`; None when `seq` was a loss marker
    uid: str | None = None  # the pod's incarnation (Kubernetes UID), when known
    topic: str | None = None  # the kv-events topic the stream is produced to
    partitions: int | None = None  # the partition count it was produced with (pinned)
    ts: float | None = field(default=None, compare=False)  # when written (decoded ones only)

    def encode(self) -> bytes:
        d: dict[str, Any] = {"epoch": self.epoch, "seq": self.seq, "ts": time.time()}
        d["digest"] = None if self.digest is None else self.digest.hex()
        if self.uid is not None:
            d["uid"] = self.uid
        if self.topic is not None:
            d["topic"] = self.topic
        if self.partitions is not None:
            d["partitions"] = self.partitions
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, value: bytes) -> Checkpoint:
        d = json.loads(value)
        digest = d.get("digest")
        uid = d.get("uid")
        topic = d.get("topic")
        partitions = d.get("partitions")
        ts = d.get("ts")
        if partitions is not None and (type(partitions) is not int or partitions < 1):
            raise ValueError(f"partitions {partitions!r} is not a count >= 1")
        return cls(
            int(d["epoch"]),
            int(d["seq"]),
            None if digest is None else bytes.fromhex(digest),
            None if uid is None else str(uid),
            None if topic is None else str(topic),
            partitions,
            None if ts is None else float(ts),
        )


def checkpoint_key(pod: str, rank: int) -> bytes:
    return json.dumps([pod, rank], separators=(",", ":")).encode()


def load_checkpoints(
    bootstrap: str, topic: str, overrides: dict[str, Any] | None = None, timeout: float = 30.0
) -> dict[StreamKey, Checkpoint]:
    """The latest committed checkpoint of every stream in ``topic`` (empty if it is new)."""
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "group.id": f"kvbridge-checkpoints-{uuid.uuid4().hex[:12]}",
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        **(overrides or {}),
    }
    conf.setdefault("logger", librdkafka_logger())
    consumer = Consumer(conf)
    out: dict[StreamKey, Checkpoint] = {}
    try:
        md = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
        if md is None or md.error is not None:
            return out
        ends = {}
        for p in md.partitions:
            lo, hi = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)
            if hi > lo:
                ends[p] = hi
        if not ends:
            return out
        consumer.assign([TopicPartition(topic, p, 0) for p in ends])
        deadline = time.monotonic() + timeout
        remaining = set(ends)
        while remaining:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"reading checkpoints from {topic!r} took over {timeout:.0f}s; is the broker "
                    "healthy?"
                )
            for msg in consumer.consume(1000, timeout=0.5):
                if msg.error():
                    if msg.error().fatal():
                        raise KafkaException(msg.error())
                    continue
                try:
                    pod, rank = json.loads(msg.key())
                    key = (str(pod), int(rank))
                    if msg.value() is None:
                        out.pop(key, None)
                    else:
                        out[key] = Checkpoint.decode(msg.value())
                except (ValueError, TypeError, KeyError) as exc:
                    log.warning(
                        "checkpoint at offset %d unreadable (%s); ignored", msg.offset(), exc
                    )
                if msg.offset() + 1 >= ends[msg.partition()]:
                    remaining.discard(msg.partition())
            # read_committed may stop short of the high watermark (aborted/open transactions)
            for tp in consumer.position([TopicPartition(topic, p) for p in list(remaining)]):
                if tp.offset >= ends[tp.partition]:
                    remaining.discard(tp.partition)
            if remaining and not consumer.assignment():
                break
    finally:
        consumer.close()
    return out
