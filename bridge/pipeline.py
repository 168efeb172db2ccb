"""From a delivered vLLM batch (or a sequencer marker) to Avro records in Kafka."""

from __future__ import annotations

import logging
import time
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


@dataclass(slots=True)
class StreamInfo:
    """Identity of one (pod, dp_rank) stream, with its metric children cached."""

    pod: str
    model: str
    dp_rank: int
    endpoint: str
    key: bytes = b""
    counters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.key = self.pod.encode()


class Pipeline:
    def __init__(self, codec: RecordCodec, sink: KafkaSink, metrics: BridgeMetrics) -> None:
        self.codec = codec
        self.sink = sink
        self.metrics = metrics
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
        m.batches_in.labels(stream.pod, "replay" if replayed else "live").inc()
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
        for index, event in enumerate(batch.events):
            env = Envelope(
                stream.pod, stream.model, stream.dp_rank, epoch, seq, index, batch.ts, batch.extra
            )
            if isinstance(event, UnknownEvent):
                m.unknown_events.labels(stream.pod, event.tag[:64]).inc()
            self._count_event(stream.pod, type(event).__name__)
            produce(key, encode(env, event))
        m.last_seq.labels(stream.pod, str(stream.dp_rank)).set(seq)

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
        self.sink.produce(stream.key, self.codec.encode(env, marker))
