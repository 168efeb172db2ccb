"""What a running bridge answers to ``/healthz`` and ``/readyz`` (:mod:`bridge.ops.health`).

Called from the HTTP server's threads: they read the bridge's state, never change it, and
ask Kafka at most once every ``KAFKA_PROBE_CACHE`` seconds.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from confluent_kafka import KafkaException

if TYPE_CHECKING:
    from bridge.ingest.runner import Bridge


class BridgeProbes:
    """``liveness()`` and ``readiness()`` of one bridge, as ``(ok, details)``."""

    LIVENESS_TIMEOUT = 30.0  # the event loop must have turned this recently
    KAFKA_PROBE_TIMEOUT = 2.0  # a metadata request slower than this: Kafka unreachable
    KAFKA_PROBE_CACHE = 2.0  # seconds a probe result is reused

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge
        self._lock = threading.Lock()
        self._result: tuple[float, bool, str] | None = None

    def liveness(self) -> tuple[bool, dict[str, object]]:
        """Alive while the event loop turns (and while starting, before it runs)."""
        last = getattr(self.bridge, "last_turn", None)
        if last is None:
            return True, {"state": "starting"}
        age = time.monotonic() - last
        state = "stopping" if self.bridge.stop.is_set() else "running"
        details: dict[str, object] = {"state": state, "loop_turned_seconds_ago": round(age, 3)}
        if age >= self.LIVENESS_TIMEOUT:
            details["reason"] = f"the event loop has not turned for {age:.0f}s"
            return False, details
        return True, details

    def readiness(self) -> tuple[bool, dict[str, object]]:
        """Ready when the loop runs, the producer is usable and Kafka answers a metadata
        request for the checkpoint topic (cached for a few seconds)."""
        reasons: list[str] = []
        alive, live = self.liveness()
        if live["state"] == "starting":
            reasons.append("starting: the bridge has not finished opening (topics, checkpoints)")
        elif not alive:
            reasons.append(str(live["reason"]))
        if self.bridge.sink.fatal is not None:
            reasons.append(f"the Kafka producer failed fatally: {self.bridge.sink.fatal.str()}")
        if self.bridge.stop.is_set():  # the producer may be closed already: do not touch it
            reasons.append("stopping")
            kafka = "not checked (stopping)"
        else:
            kafka_ok, kafka = self._kafka_probe()
            if not kafka_ok:
                reasons.append(f"Kafka is not reachable: {kafka}")
        streams = list(self.bridge.streams)
        details: dict[str, object] = {
            "kafka": kafka,
            "streams": len(streams),
            "streams_connected": sum(1 for st in streams if getattr(st, "connected", False)),
        }
        silent = [st for st in streams if getattr(st, "silent", False)]
        if silent:  # not a reason to be unready (an idle engine is fine), but say which
            details["streams_silent"] = [f"{st.info.pod} rank {st.info.dp_rank}" for st in silent]
        if reasons:
            details["reasons"] = reasons
        return not reasons, details

    def _kafka_probe(self) -> tuple[bool, str]:
        with self._lock:
            cached = self._result
            now = time.monotonic()
            if cached is not None and now - cached[0] < self.KAFKA_PROBE_CACHE:
                return cached[1], cached[2]
            topic = self.bridge.checkpoint_topic
            try:
                md = self.bridge.sink._producer.list_topics(topic, timeout=self.KAFKA_PROBE_TIMEOUT)
                t = md.topics.get(topic)
                if t is None or t.error is not None:
                    ok, what = False, f"topic {topic}: {getattr(t, 'error', None) or 'missing'}"
                elif any(p.leader < 0 for p in t.partitions.values()):
                    ok, what = False, f"topic {topic} has a partition without a leader"
                else:
                    ok, what = True, f"reachable ({len(md.brokers)} brokers)"
            except KafkaException as exc:
                err = exc.args[0] if exc.args else exc
                ok, what = False, f"metadata request failed: {getattr(err, 'str', lambda: err)()}"
            self._result = (time.monotonic(), ok, what)
            return ok, what
