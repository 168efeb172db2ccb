"""Kafka producer side: idempotent, acks=all, key = pod, murmur2 partitioning.

The bridge gives each record an explicit partition, Kafka's murmur2 of the pod with the topic's
*pinned* partition count (:mod:`bridge.log.partitioning`), so adding partitions moves no pod;
``partition=-1`` (librdkafka's ``murmur2_random`` over the current count) is only the default
of :meth:`KafkaSink.produce` for callers that do not care.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from bridge.ops.config import KafkaUnreachable
from bridge.ops.logsetup import librdkafka_logger

log = logging.getLogger(__name__)

# The bridge's defaults; anything here can be overridden by passing librdkafka properties.
PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    # Java clients and kvbridge agree on key -> partition (kv-events records carry an explicit
    # partition computed with the same function over the pinned count).
    "partitioner": "murmur2_random",
    # A broker outage delays records instead of expiring them in the local queue (0 = no limit).
    "message.timeout.ms": 0,
    "linger.ms": 5,
    "compression.type": "lz4",
    # The producer's share of the memory bound: beyond it the bridge stops reading its sockets.
    "queue.buffering.max.messages": 100_000,
    "queue.buffering.max.kbytes": 64 * 1024,
}

_FENCED_CODES = {
    getattr(KafkaError, name)
    for name in ("_FENCED", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH")
    if hasattr(KafkaError, name)
}

_PURGED_CODES = {KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT}

DeliveryFailed = Callable[[bytes | None, bytes | None, KafkaError], None]

# librdkafka's message.max.bytes default, and the broker's max.message.bytes default.
CLIENT_MAX_MESSAGE_BYTES = 1_000_000
BROKER_MAX_MESSAGE_BYTES = 1_048_588


class _Unsent:
    """What a delivery callback is given for a record produce() refused outright (e.g.
    MSG_SIZE_TOO_LARGE): the record, as a delivery report's message would give it."""

    __slots__ = ("_key", "_partition", "_topic", "_value")

    def __init__(self, topic: str, key: bytes, value: bytes | None, partition: int) -> None:
        self._topic, self._key, self._value, self._partition = topic, key, value, partition

    def topic(self) -> str:
        return self._topic

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return -1


class Fenced(RuntimeError):
    """Another bridge with the same transactional id took over; this one must stop."""


class KafkaSink:
    """Produces records; full local queue -> blocks (serving callbacks) instead of dropping.

    With ``transactional_id`` every record is written inside a transaction, committed by
    :meth:`commit` (exactly-once mode).
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        overrides: dict[str, Any] | None = None,
        on_failure: DeliveryFailed | None = None,
        on_success: Callable[[bytes], None] | None = None,
        transactional_id: str | None = None,
    ) -> None:
        conf = dict(PRODUCER_DEFAULTS)
        conf.update(overrides or {})
        conf["bootstrap.servers"] = bootstrap_servers
        conf.setdefault("error_cb", self._on_client_error)
        if transactional_id:
            conf["transactional.id"] = transactional_id
            conf.pop("message.timeout.ms", None)  # must not exceed transaction.timeout.ms
        self.topic = topic
        self.side_topics: set[str] = set()  # e.g. checkpoints: not counted by on_success
        self.transactional_id = transactional_id
        self.fatal: KafkaError | None = None
        # Until the bridge has started, an unreachable broker is reported by the start-up
        # check in one line (KafkaUnreachable), not by a warning per connection attempt.
        self.started = False
        conf.setdefault("logger", librdkafka_logger())
        self._conf = conf
        self._producer = Producer(conf)
        self._on_failure = on_failure
        self._on_success = on_success
        self.delivered = 0
        self.failed = 0
        # Largest record the producer sends (librdkafka's message.max.bytes), and per topic
        # its max.message.bytes as described at start (:meth:`set_topic_limit`).
        self.client_limit = int(conf.get("message.max.bytes", CLIENT_MAX_MESSAGE_BYTES))
        self.topic_limits: dict[str, int] = {}
        self._budget_base: dict[str | None, int] = {}  # value_budget per topic, less the key
        self.refused_locally = False  # set while on_failure runs for a produce() refusal
        self.purged = 0  # records dropped unacknowledged by close() (not failures: see there)

    def _on_client_error(self, err: KafkaError) -> None:
        if err.fatal():
            self.fatal = err
            log.error("kafka producer fatal error: %s", err)
        elif err.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN):
            level = logging.WARNING if self.started else logging.DEBUG
            log.log(level, "kafka: %s (records wait in the producer queue)", err)
        else:
            log.warning("kafka: %s", err)

    def check_fatal(self) -> None:
        """Raise if the producer hit a fatal error (e.g. fenced by another transactional bridge)."""
        err = self.fatal
        if err is None:
            return
        if self.transactional_id and (err.code() in _FENCED_CODES or "fenced" in err.str().lower()):
            raise Fenced(
                f"fenced: another bridge started with transactional id {self.transactional_id!r} "
                "and took over; this one stops writing and exits"
            )
        if self.transactional_id and err.code() == KafkaError._FATAL:
            # librdkafka does not always say why; for a transactional producer it is nearly
            # always fencing (its own log line above names the cause).
            raise Fenced(
                f"fenced or fatally failed: the transactional producer (id "
                f"{self.transactional_id!r}) can no longer write, most likely because another "
                f"bridge with this id took over ({err.str()}); exiting"
            )
        raise RuntimeError(f"Kafka producer failed fatally: {err.str()}")

    # -- transactions (exactly-once mode) ------------------------------------------------------
    def init_transactions(self, timeout: float = 60.0) -> None:
        """Fence older producers with this id, abort their open transaction, begin ours."""
        try:
            self._producer.init_transactions(timeout)
        except KafkaException as exc:
            raise RuntimeError(
                f"could not start transactions (id {self.transactional_id!r}): "
                f"{exc.args[0].str()}. The broker needs the transaction state log "
                "(transaction.state.log.replication.factor <= brokers)"
            ) from exc
        self._producer.begin_transaction()

    def commit(self, timeout: float = 60.0) -> None:
        """Commit the open transaction and begin the next; raises KafkaException on failure
        (Fenced when another bridge took the transactional id over)."""
        try:
            self._producer.commit_transaction(timeout)
        except KafkaException as exc:
            self._raise_if_fatal(exc)
            raise
        self._producer.begin_transaction()

    def _serve(self, timeout: float, flush: bool = False) -> int:
        """poll()/flush(): callbacks run here, and librdkafka may raise its fatal error here."""
        try:
            if flush:
                return self._producer.flush(timeout)
            return self._producer.poll(timeout)
        except KafkaException as exc:
            self._note_fatal(exc)
            self.check_fatal()
            raise

    def _note_fatal(self, exc: KafkaException) -> None:
        err = exc.args[0] if exc.args else None
        if self.fatal is None and isinstance(err, KafkaError) and err.fatal():
            self.fatal = err

    def _raise_if_fatal(self, exc: KafkaException) -> None:
        """After a failed call: raise Fenced/RuntimeError if the producer is now unusable."""
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError) and (err.fatal() or err.code() == KafkaError._FATAL):
            # error_cb reports the underlying fatal error (e.g. _FENCED) from a poll
            for _ in range(20):
                if self.fatal is not None:
                    break
                self._serve(0.05)
            if self.fatal is None:
                self.fatal = err
        self.check_fatal()

    def abort(self, timeout: float = 60.0) -> None:
        self._producer.abort_transaction(timeout)
        self._producer.begin_transaction()

    def set_topic_limit(self, topic: str, max_message_bytes: int | None) -> None:
        """Record ``topic``'s max.message.bytes (None: not known, the broker default)."""
        self.topic_limits[topic] = max_message_bytes or BROKER_MAX_MESSAGE_BYTES
        self._budget_base.clear()

    def record_limit(self, topic: str | None) -> tuple[int, int, int]:
        """(limit, topic's max.message.bytes, producer's message.max.bytes): a record whose
        key and value exceed ``limit`` bytes cannot be written to ``topic``."""
        t = topic or self.topic
        topic_max = self.topic_limits.get(t, BROKER_MAX_MESSAGE_BYTES)
        return min(topic_max, self.client_limit), topic_max, self.client_limit

    def fit_batches(self, topic_limit: int) -> None:
        """Keep librdkafka's batches (``batch.size``, uncompressed) within ``topic_limit``, the
        smallest max.message.bytes of the topics written: a larger batch of small records is
        refused by the broker as a whole. Rebuilds the producer, so only before the first
        record; later (a topic made for a discovered pod) it can only warn."""
        size = int(self._conf.get("batch.size", CLIENT_MAX_MESSAGE_BYTES))
        wanted = max(1024, topic_limit - 1024 - topic_limit // 250)
        if size <= wanted:
            return
        if self.delivered or self.failed or len(self._producer):
            log.warning(
                "a topic accepts record batches of at most %d bytes but the producer batches "
                "up to batch.size=%d; batches over the limit are refused and written as "
                "EventsLost: set --kafka-property batch.size=%d",
                topic_limit,
                size,
                wanted,
            )
            return
        log.info("producer batch.size %d (a topic accepts at most %d bytes)", wanted, topic_limit)
        self._conf["batch.size"] = wanted
        old, self._producer = self._producer, Producer(self._conf)
        close = getattr(old, "close", None)
        if close is not None:
            close()

    def value_budget(self, topic: str | None, key: bytes) -> int:
        """The largest value (bytes) written with ``key``: :meth:`record_limit` less the key,
        the record and batch framing (~100 bytes) and lz4's worst-case growth (1/255)."""
        base = self._budget_base.get(topic)
        if base is None:
            limit = self.record_limit(topic)[0]
            base = self._budget_base[topic] = limit - 160 - limit // 250
        return base - len(key)

    def _on_delivery(self, err: KafkaError | None, msg: Any) -> None:
        if err is None:
            self.delivered += 1
            if self._on_success is not None and msg.topic() not in self.side_topics:
                self._on_success(msg.key())
            return
        if err.code() in _PURGED_CODES:
            # Dropped by close() after the shutdown timeout: not refused by Kafka, so not
            # written as lost; the checkpoints stay before it and a restart re-reads it.
            self.purged += 1
            return
        self.failed += 1
        if err.code() in _FENCED_CODES and self.transactional_id and self.fatal is None:
            self.fatal = err
        log.error("kafka delivery failed for key %r: %s", msg.key(), err)
        if self._on_failure is not None:
            self._on_failure(msg.key(), msg.value(), err)

    def produce(
        self,
        key: bytes,
        value: bytes | None,
        on_delivery: Callable[..., None] | None = None,
        topic: str | None = None,
        partition: int = -1,
    ) -> None:
        """Queue one record; if the local queue is full, wait (backpressure) until it is not.
        ``partition`` -1: librdkafka's partitioner (murmur2 of the key, current count)."""
        self._produce_slow(
            key, value, on_delivery or self._on_delivery, topic or self.topic, partition
        )

    def produce_batch(
        self,
        key: bytes,
        values: list[bytes],
        on_delivery: Callable[..., None] | None,
        topic: str | None = None,
        every: bool = True,
        partition: int = -1,
    ) -> None:
        """Queue a vLLM batch's records in order, with one delivery callback shared by all of
        them (``every``) or carried by the last one only (``every=False``: inside a transaction,
        where any failure aborts the whole transaction anyway). None: no callback at all.
        ``partition``: the stream's pinned partition (-1: librdkafka's partitioner).

        One shared callback per batch, instead of the sink's generic per-record path, keeps the
        per-record Python work on acknowledgement to a counter decrement.
        """
        produce = self._producer.produce
        t = topic or self.topic
        if every and on_delivery is not None:
            # The common case. Partition and callback are passed by position: a keyword
            # argument costs ~0.18 µs more per record (an explicit partition costs what -1 does).
            for value in values:
                try:
                    produce(t, value, key, partition, on_delivery)
                except (BufferError, KafkaException):
                    self._produce_slow(key, value, on_delivery, t, partition)
            return
        last = len(values) - 1
        for i, value in enumerate(values):
            cb = on_delivery if every or i == last else None
            try:
                if cb is None:
                    produce(t, value, key, partition)
                else:
                    produce(t, value, key, partition, cb)
            except (BufferError, KafkaException):
                self._produce_slow(key, value, cb, t, partition)

    def _produce_slow(
        self,
        key: bytes,
        value: bytes | None,
        cb: Callable[..., None] | None,
        topic: str,
        partition: int = -1,
    ) -> None:
        """Produce one record, waiting out a full queue (backpressure); a fatal error raises."""
        while True:
            try:
                if cb is None:
                    self._producer.produce(topic, value, key, partition)
                else:
                    self._producer.produce(topic, value, key, partition, on_delivery=cb)
                return
            except BufferError:
                self._serve(0.05)
                self.check_fatal()
            except KafkaException as exc:
                self._raise_if_fatal(exc)
                err = exc.args[0] if exc.args else None
                if not isinstance(err, KafkaError):
                    raise
                # Refused outright (e.g. MSG_SIZE_TOO_LARGE): never retried, reported as a
                # failed delivery of this record, so its batch is written as lost.
                self._refused(err, _Unsent(topic, key, value, partition), cb)
                return

    def _refused(self, err: KafkaError, msg: _Unsent, cb: Callable[..., None] | None) -> None:
        self.refused_locally = True
        try:
            (cb or self._on_delivery)(err, msg)
        finally:
            self.refused_locally = False

    def partition_count(self, topic: str, timeout: float = 2.0) -> int | None:
        """``topic``'s current partition count from a metadata request (None: not known now,
        e.g. the broker did not answer within ``timeout``)."""
        try:
            t = self._producer.list_topics(topic, timeout=timeout).topics.get(topic)
        except KafkaException:
            return None
        if t is None or t.error is not None or not t.partitions:
            return None
        return len(t.partitions)

    def delivery_callback(self) -> Callable[[KafkaError | None, Any], None]:
        return self._on_delivery

    def poll(self, timeout: float = 0.0) -> int:
        return self._serve(timeout)

    def pending(self) -> int:
        return len(self._producer)

    def close(self, timeout: float = 1.0) -> int:
        """Release the producer (its threads stop reconnecting); call after the last flush.
        Returns within about ``timeout`` even when Kafka is unreachable, and returns how many
        records were still not acknowledged: those are purged, not delivered.

        confluent-kafka's ``Producer.close()`` waits for every outstanding record and for
        aborting the open transaction without a time limit, so with the broker down it never
        returns. Here the records left are purged first (their delivery reports are served:
        the caller's acknowledged positions and checkpoints stay before them), an open
        transaction is aborted within ``timeout``, and if that fails the producer is released
        without ``close()`` (librdkafka's destroy does not wait; the broker aborts the
        transaction when the next producer with this id starts, or on its timeout).
        """
        producer = self._producer
        left = len(producer)
        if left:
            try:
                producer.purge(True, True, True)
                producer.poll(0)  # the purged records' delivery reports (see _on_delivery)
            except Exception as exc:  # a fenced or failed producer: nothing left to save
                log.debug("purging the producer: %s", exc)
        clean = True
        if self.transactional_id:
            try:
                producer.abort_transaction(max(0.0, timeout))
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                clean = isinstance(err, KafkaError) and err.code() == KafkaError._STATE
                if not clean:
                    log.debug("aborting the open transaction at close: %s", exc)
        close = getattr(producer, "close", None)
        if close is not None and clean:
            try:
                close()
            except Exception as exc:  # a fenced or failed producer: nothing left to save
                log.debug("closing the producer: %s", exc)
        return left

    def flush(self, timeout: float) -> int:
        """Wait for outstanding records; returns how many are still not acknowledged."""
        return self._serve(timeout, flush=True)


def topic_max_message_bytes(
    bootstrap_servers: str,
    topic: str,
    overrides: dict[str, Any] | None = None,
    timeout: float = 10.0,
) -> int | None:
    """``topic``'s effective max.message.bytes (its own or the broker's default), described
    with the AdminClient; None if the broker did not say."""
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, **(overrides or {})})
    res = ConfigResource(ResourceType.TOPIC, topic)
    try:
        configs = admin.describe_configs([res], request_timeout=timeout)[res].result(timeout)
    except KafkaException as exc:
        log.warning(
            "cannot describe topic %s's configuration (%s); assuming max.message.bytes %d",
            topic,
            exc.args[0].str() if exc.args else exc,
            BROKER_MAX_MESSAGE_BYTES,
        )
        return None
    entry = configs.get("max.message.bytes")
    try:
        return int(entry.value) if entry is not None and entry.value is not None else None
    except ValueError:
        return None


def ensure_topic(
    bootstrap_servers: str,
    topic: str,
    partitions: int = 6,
    replication: int = 1,
    timeout: float = 30.0,
    overrides: dict[str, Any] | None = None,
    config: dict[str, str] | None = None,
) -> bool:
    """Create ``topic`` if it does not exist; True if created. Waits until it has leaders."""
    conf = {
        "bootstrap.servers": bootstrap_servers,
        "logger": librdkafka_logger(),
        **(overrides or {}),
    }
    admin = AdminClient(conf)
    deadline = time.monotonic() + timeout
    created = False
    try:
        md = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        detail = exc.args[0].str() if exc.args else str(exc)
        raise KafkaUnreachable(bootstrap_servers, detail) from exc
    existing = md.topics.get(topic)
    if existing is not None and existing.error is None and len(existing.partitions) < partitions:
        log.warning(
            "topic %s exists with %d partitions, fewer than topic_partitions=%d; not changing "
            "it (partitions added with kafka-topics --alter get no pods until a restart with "
            "--repartition; see docs/operations.md)",
            topic,
            len(existing.partitions),
            partitions,
        )
    if existing is None:
        new = NewTopic(topic, partitions, replication, config=config or {})
        fut = admin.create_topics([new])[topic]
        try:
            fut.result(timeout=timeout)
            created = True
            log.info(
                "created topic %s (%d partitions, replication %s)",
                topic,
                partitions,
                "broker default" if replication == -1 else replication,
            )
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise RuntimeError(
                    f"Kafka refused to create topic {topic!r} with topic_partitions={partitions}, "
                    f"topic_replication={replication}: {exc.args[0].str()}. Set "
                    "--topic-partitions/--topic-replication (replication cannot exceed the number "
                    "of brokers; -1 = the broker's default), or create the topic yourself"
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
