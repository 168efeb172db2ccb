"""The kv-events topics a bridge writes: created and sized before use, pinned, watched.

Each topic is created if missing (``--topic-partitions``, ``--topic-replication``), its record
size limit is given to the sink, and with a schema registry and a topic template each topic
gets its subject. Once the checkpoints are loaded, each topic's *pinned* partition count is
decided (:mod:`bridge.log.partitioning`): pods are spread over that count, so partitions added
while the bridge runs move no pod. A thread compares the topics' current counts with the
pinned ones and warns when they differ (``kvbridge_topic_partitions``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from bridge.log.checkpoints import Checkpoint
from bridge.log.partitioning import TopicPin, decide_pin, recorded_count
from bridge.log.records import schema_dir
from bridge.log.sink import KafkaSink, ensure_topic, topic_max_message_bytes
from bridge.ops.config import BridgeConfig, shared_kafka_properties, topic_base

log = logging.getLogger(__name__)


class Topics:
    """The topics of one bridge. ``on_adopt(pin)`` is called when a topic's pinned count
    changes from the one its checkpoints recorded (``--repartition``)."""

    CHECK_INTERVAL = 60.0  # seconds between checks of the topics' partition counts
    CHECK_TIMEOUT = 2.0  # a metadata request slower than this: checked next time

    def __init__(
        self,
        config: BridgeConfig,
        sink: KafkaSink,
        codec: Any,
        registry: CollectorRegistry,
        on_adopt: Callable[[TopicPin], None],
    ) -> None:
        self.config = config
        self.sink = sink
        self.codec = codec
        self.on_adopt = on_adopt
        self.ready: set[str] = set()
        # Per kv-events topic, the partition count its pods are produced with (pinned).
        self.pins: dict[str, TopicPin] = {}
        self._loaded: list[Checkpoint] | None = None  # the checkpoints at start
        self._warned: dict[str, int] = {}  # topic -> current count warned about
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.partitions = Gauge(
            "kvbridge_topic_partitions",
            "Partitions of each kv-events topic: kind=current (the topic's count) and "
            "kind=pinned (the count pods are spread over; differs after partitions were added, "
            "until a restart with --repartition)",
            ["topic", "kind"],
            registry=registry,
        )

    def ensure(self, topic: str) -> None:
        """Create ``topic`` if missing and learn its limits (once), and pin it once the
        checkpoints are loaded. Blocking (admin requests): callable from any thread."""
        if topic not in self.ready:
            c = self.config
            admin = shared_kafka_properties(c.kafka)
            ensure_topic(
                c.bootstrap_servers,
                topic,
                partitions=c.topic_partitions,
                replication=c.topic_replication,
                overrides=admin,
            )
            limit = topic_max_message_bytes(c.bootstrap_servers, topic, admin)
            self.sink.set_topic_limit(topic, limit)
            self.sink.fit_batches(self.sink.record_limit(topic)[1])
            log.info(
                "topic %s: records up to %d bytes (max.message.bytes %s, producer "
                "message.max.bytes %d); a larger BlockStored is split, anything else larger "
                "is written as EventsLost",
                topic,
                self.sink.record_limit(topic)[0],
                "unknown" if limit is None else limit,
                self.sink.client_limit,
            )
            registry = getattr(self.codec, "registry", None)
            if registry is not None and "{" in c.topic:
                # Each topic a template yields gets its own subject (<topic>-value); the
                # registry gives one id per schema, so the codec's header serves them all.
                schema = json.loads((schema_dir() / "kv_event.avsc").read_text())
                reg = registry.register(topic, schema)  # as writer_codec registered it
                if reg.header != self.codec.header:
                    raise RuntimeError(
                        f"schema registry gave schema id {reg.schema_id} for {reg.subject}, "
                        f"not the id registered for {topic_base(c.topic)}-value; this bridge "
                        "writes one id to every topic: use a registry that ids schemas globally"
                    )
            self.ready.add(topic)
        if topic not in self.pins and self._loaded is not None:
            self.pin(topic)

    def load(self, checkpoints: Iterable[Checkpoint]) -> None:
        """The checkpoints read at start: pin every topic made ready so far."""
        self._loaded = list(checkpoints)
        for topic in sorted(self.ready):
            self.pin(topic)

    def pin_of(self, topic: str) -> TopicPin:
        return self.pins.get(topic) or self.pin(topic)

    def pin(self, topic: str) -> TopicPin:
        """Decide ``topic``'s pinned partition count (recorded in the checkpoints, else the
        topic's current count; the current one with --repartition), log and export it."""
        current = self.sink.partition_count(topic, timeout=10.0)
        if current is None:
            raise RuntimeError(
                f"cannot read the partition count of topic {topic!r} from Kafka; check that "
                "the broker is reachable and the topic exists"
            )
        recorded = recorded_count(self._loaded or [], topic)
        pin = decide_pin(topic, recorded, current, self.config.repartition)
        self.pins[topic] = pin
        self.partitions.labels(topic, "pinned").set(pin.pinned)
        self.partitions.labels(topic, "current").set(pin.current)
        if pin.adopted:
            log.warning(
                "topic %s: %s; pods whose partition changes start a new epoch (StreamStarted) "
                "in their new partition",
                topic,
                pin.adoption(),
            )
            self.on_adopt(pin)
        else:
            log.info(
                "topic %s: pods spread over %d partitions (%s)",
                topic,
                pin.pinned,
                "recorded in the checkpoints" if recorded is not None else "the topic's count",
            )
        self._warn(topic, current)
        return pin

    def _warn(self, topic: str, current: int) -> None:
        """One warning per topic and new partition count that differs from the pinned one."""
        pin = self.pins[topic]
        self.partitions.labels(topic, "current").set(current)
        if current == pin.pinned or self._warned.get(topic) == current:
            return
        self._warned[topic] = current
        log.warning("%s", replace(pin, current=current).warning())

    def start_watch(self) -> None:
        self._watcher = threading.Thread(target=self._watch, name="partition-watch", daemon=True)
        self._watcher.start()

    def stop_watch(self, timeout: float) -> None:
        """Stop the watch thread (before the producer closes: the thread uses it)."""
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join(min(self.CHECK_TIMEOUT + 5, timeout))

    def _watch(self) -> None:
        """Thread: every CHECK_INTERVAL, compare each topic's partition count with the pinned
        one (a metadata request per topic; warns, never moves a pod)."""
        while not self._watch_stop.wait(self.CHECK_INTERVAL):
            for topic in list(self.pins):
                if self._watch_stop.is_set():
                    return
                current = self.sink.partition_count(topic, self.CHECK_TIMEOUT)
                if current is not None:
                    self._warn(topic, current)
