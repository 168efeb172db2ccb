"""Kafka producer side: idempotent, acks=all, key = pod, murmur2 partitioning."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

log = logging.getLogger(__name__)

# The bridge's defaults; anything here can be overridden by passing librdkafka properties.
PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    # Java clients and kvbridge agree on key -> partition.
    "partitioner": "murmur2_random",
    # A broker outage delays records instead of expiring them in the local queue (0 = no limit).
    "message.timeout.ms": 0,
    "linger.ms": 5,
    "compression.type": "lz4",
    "queue.buffering.max.messages": 200_000,
    "queue.buffering.max.kbytes": 256 * 1024,
}

DeliveryFailed = Callable[[bytes | None, bytes | None, KafkaError], None]


class KafkaSink:
    """Produces records; full local queue -> blocks (serving callbacks) instead of dropping."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        overrides: dict[str, Any] | None = None,
        on_failure: DeliveryFailed | None = None,
        on_success: Callable[[bytes], None] | None = None,
    ) -> None:
        conf = dict(PRODUCER_DEFAULTS)
        conf.update(overrides or {})
        conf["bootstrap.servers"] = bootstrap_servers
        conf.setdefault("error_cb", self._on_client_error)
        self.topic = topic
        self._producer = Producer(conf)
        self._on_failure = on_failure
        self._on_success = on_success
        self.delivered = 0
        self.failed = 0

    def _on_client_error(self, err: KafkaError) -> None:
        if err.fatal():
            log.error("kafka producer fatal error: %s", err)
        else:
            log.warning("kafka: %s", err)

    def _on_delivery(self, err: KafkaError | None, msg: Any) -> None:
        if err is None:
            self.delivered += 1
            if self._on_success is not None:
                self._on_success(msg.key())
            return
        self.failed += 1
        log.error("kafka delivery failed for key %r: %s", msg.key(), err)
        if self._on_failure is not None:
            self._on_failure(msg.key(), msg.value(), err)

    def produce(
        self, key: bytes, value: bytes, on_delivery: Callable[..., None] | None = None
    ) -> None:
        """Queue one record; if the local queue is full, wait (backpressure) until it is not."""
        cb = on_delivery or self._on_delivery
        while True:
            try:
                self._producer.produce(self.topic, value, key, on_delivery=cb)
                return
            except BufferError:
                self._producer.poll(0.05)

    def delivery_callback(self) -> Callable[[KafkaError | None, Any], None]:
        return self._on_delivery

    def poll(self, timeout: float = 0.0) -> int:
        return self._producer.poll(timeout)

    def pending(self) -> int:
        return len(self._producer)

    def flush(self, timeout: float) -> int:
        """Wait for outstanding records; returns how many are still not acknowledged."""
        return self._producer.flush(timeout)


def ensure_topic(
    bootstrap_servers: str,
    topic: str,
    partitions: int = 6,
    replication: int = 1,
    timeout: float = 30.0,
    overrides: dict[str, Any] | None = None,
) -> bool:
    """Create ``topic`` if it does not exist; True if created. Waits until it has leaders."""
    conf = {"bootstrap.servers": bootstrap_servers, **(overrides or {})}
    admin = AdminClient(conf)
    deadline = time.monotonic() + timeout
    created = False
    try:
        md = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise RuntimeError(
            f"cannot reach Kafka at {bootstrap_servers}: {exc}. Check --bootstrap-servers and that "
            "the broker is up"
        ) from exc
    if topic not in md.topics:
        fut = admin.create_topics([NewTopic(topic, partitions, replication)])[topic]
        try:
            fut.result(timeout=timeout)
            created = True
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise RuntimeError(
                    f"Kafka refused to create topic {topic!r} ({partitions} partitions, "
                    f"replication {replication}): {exc.args[0].str()}"
                ) from exc
    while time.monotonic() < deadline:
        t = admin.list_topics(topic, timeout=5).topics.get(topic)
        if (
            t
            and t.error is None
            and t.partitions
            and all(p.leader >= 0 for p in t.partitions.values())
        ):
            return created
        time.sleep(0.1)
    raise RuntimeError(f"topic {topic!r} has no leader for every partition after {timeout}s")
