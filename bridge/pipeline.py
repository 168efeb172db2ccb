"""From a delivered vLLM batch (or a sequencer marker) to Avro records in Kafka."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bridge.events import UnknownEvent
from bridge.markers import EventsLost, Marker
from bridge.metrics import BridgeMetrics
from bridge.ratelimit import RateLimitedLog
from bridge.records import Envelope, RecordCodec
from bridge.sink import KafkaSink
from bridge.vllm.decoder import DecodeError, decode_batch

log = logging.getLogger(__name__)


Position = tuple[int, int, bytes | None]


@dataclass(slots=True)
class StreamInfo:
    """Identity of one (pod, dp_rank) stream, with its metric children cached."""

    pod: str
    model: str
    dp_rank: int
    endpoint: str
    topic: str | None = None  # None: the sink's default topic
    uid: str | None = None  # the pod's incarnation (Kubernetes UID), when discovery knows it
    key: bytes = b""
    counters: dict[str, Any] = field(default_factory=dict)
    # Positions (epoch, seq, payload or None for a loss marker) for checkpoints: the last batch
    # handed to the producer, the last one Kafka acknowledged, the last one checkpointed.
    delivered: Position | None = None
    acked: Position | None = None
    written: Position | None = None

    def __post_init__(self) -> None:
        self.key = self.pod.encode()


class Pipeline:
    def __init__(
        self,
        codec: RecordCodec,
        sink: KafkaSink,
        metrics: BridgeMetrics,
        track_acks: bool = True,
    ) -> None:
        self.codec = codec
        self.sink = sink
        self.metrics = metrics
        # At-least-once: checkpoints follow acknowledgements. Exactly-once: the transaction
        # commits records and checkpoints together, so `delivered` is enough.
        self.track_acks = track_acks
        self.produced = 0  # records handed to the producer (commit pacing)
        self.bad_input = RateLimitedLog(log)
        self._type_counters: dict[tuple[str, str], Any] = {}

    def _count_event(self, pod: str, type_name: str) -> None:
        c = self._type_counters.get((pod, type_name))
        if c is None:
            c = self._type_counters[(pod, type_name)] = self.metrics.events_in.labels(
                pod, type_name
            )
        c.inc()

    def deliver(
        self, stream: StreamInfo, epoch: int, seq: int, payload: bytes, replayed: bool
    ) -> None:
        m = self.metrics
        c = stream.counters
        if not c:  # metric children resolved once per stream, not per batch
            c["live"] = m.batches_in.labels(stream.pod, "live")
            c["replay"] = m.batches_in.labels(stream.pod, "replay")
            c["last_seq"] = m.last_seq.labels(stream.pod, str(stream.dp_rank))
        c["replay" if replayed else "live"].inc()
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            m.decode_errors.labels(stream.pod, "payload").inc()
            self.bad_input.warning(
                stream.pod,
                "payload",
                "rank %d seq %d: undecodable batch (%s); written as EventsLost",
                stream.dp_rank,
                seq,
                exc,
            )
            reason = f"undecodable batch: {exc}"[:500]
            self.marker(stream, epoch, seq, EventsLost(seq, seq, reason))
            return
        if batch.dp_rank is not None and batch.dp_rank != stream.dp_rank:
            m.dp_mismatch.labels(stream.pod).inc()
            self.bad_input.warning(
                stream.pod,
                "dp_rank",
                "batch seq %d says data_parallel_rank %d but arrived on "
                "the stream of rank %d (check the pod's dp and ports)",
                seq,
                batch.dp_rank,
                stream.dp_rank,
            )
        encode = self.codec.encode
        produce = self.sink.produce
        key = stream.key
        topic = stream.topic
        events = batch.events
        position = (epoch, seq, payload)
        last = len(events) - 1
        for index, event in enumerate(events):
            env = Envelope(
                stream.pod, stream.model, stream.dp_rank, epoch, seq, index, batch.ts, batch.extra
            )
            if isinstance(event, UnknownEvent):
                m.unknown_events.labels(stream.pod, event.tag[:64]).inc()
            self._count_event(stream.pod, type(event).__name__)
            if index == last and self.track_acks:
                produce(key, encode(env, event), self._on_acked(stream, position, batch.ts), topic)
            else:
                produce(key, encode(env, event), None, topic)
        self.produced += len(events)
        stream.delivered = position
        c["last_seq"].set(seq)

    def _on_acked(
        self, stream: StreamInfo, position: Position, batch_ts: float | None = None
    ) -> Callable[..., None]:
        """Delivery callback of a batch's last record: moves the stream's checkpoint and
        observes the end-to-end lag (vLLM batch timestamp -> Kafka acknowledgement)."""
        default = self.sink.delivery_callback()
        lag = self.metrics.e2e_lag

        def acked(err: Any, msg: Any) -> None:
            default(err, msg)
            if err is None:
                stream.acked = position
                if batch_ts is not None:
                    lag.observe(max(0.0, time.time() - batch_ts))

        return acked

    def marker(self, stream: StreamInfo, epoch: int, seq: int, marker: Marker) -> None:
        env = Envelope(stream.pod, stream.model, stream.dp_rank, epoch, seq, -1, time.time())
        self.metrics.markers_out.labels(stream.pod, type(marker).__name__).inc()
        if isinstance(marker, EventsLost):
            reason = marker.reason.split(":", 1)[0]
            self.metrics.batches_lost.labels(stream.pod, reason).inc(
                marker.to_seq - marker.from_seq + 1
            )
            log.warning(
                "pod %s rank %d epoch %d: batches %d..%d lost: %s",
                stream.pod,
                stream.dp_rank,
                epoch,
                marker.from_seq,
                marker.to_seq,
                marker.reason,
            )
        else:
            log.info("pod %s rank %d epoch %d: %s", stream.pod, stream.dp_rank, epoch, marker)
        value = self.codec.encode(env, marker)
        self.produced += 1
        if isinstance(marker, EventsLost):
            position = (epoch, marker.to_seq, None)
            stream.delivered = position
            if self.track_acks:
                self.sink.produce(stream.key, value, self._on_acked(stream, position), stream.topic)
                return
        self.sink.produce(stream.key, value, None, stream.topic)
