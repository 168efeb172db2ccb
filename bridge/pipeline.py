"""From a delivered vLLM batch (or a sequencer marker) to Avro records in Kafka."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bridge.events import UnknownEvent
from bridge.markers import EventsLost, Marker
from bridge.metrics import BridgeMetrics, LagRecorder, StreamStats
from bridge.ratelimit import RateLimitedLog
from bridge.records import Envelope, RecordCodec
from bridge.sink import KafkaSink
from bridge.vllm.decoder import DecodeError, decode_batch

log = logging.getLogger(__name__)


Position = tuple[int, int, bytes | None]


@dataclass(slots=True)
class StreamInfo:
    """Identity of one (pod, dp_rank) stream, with its counts for the metrics."""

    pod: str
    model: str
    dp_rank: int
    endpoint: str
    topic: str | None = None  # None: the sink's default topic
    uid: str | None = None  # the pod's incarnation (Kubernetes UID), when discovery knows it
    partition: int = -1  # the pod's pinned partition (-1: librdkafka's partitioner decides)
    key: bytes = b""
    counters: dict[str, Any] = field(default_factory=dict)
    stats: StreamStats | None = None  # plain-number counts (Pipeline.stats)
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
        self.lag = LagRecorder(metrics)
        self._stats: dict[tuple[str, int], StreamStats] = {}
        # Exactly-once: (stats, events by type, records, batch ts) of the open transaction,
        # counted as written when it commits (:meth:`committed`), dropped if it aborts.
        self._uncommitted: list[tuple[StreamStats, dict[type, int], int, float | None]] = []
        self._default_cb = sink.delivery_callback()

    def stats(self, stream: StreamInfo) -> StreamStats:
        """The stream's plain-number counts (one per (pod, dp_rank), kept across reconnects)."""
        st = stream.stats
        if st is None:
            ident = (stream.pod, stream.dp_rank)
            st = self._stats.get(ident)
            if st is None:
                st = self._stats[ident] = StreamStats(self.metrics, stream.pod, stream.dp_rank)
            stream.stats = st
        return st

    def flush_metrics(self) -> None:
        """Move the counts of every stream, and the lag samples, into Prometheus."""
        for st in self._stats.values():
            st.flush()
        self.lag.flush()

    def committed(self) -> None:
        """Exactly-once: the open transaction committed; count what it held as written."""
        now = time.time()
        pending = self.lag.pending
        for st, by_type, records, ts in self._uncommitted:
            st.add_out(by_type, records)
            if ts is not None:
                pending.append(max(0.0, now - ts))
        self._uncommitted.clear()

    def aborted(self) -> None:
        """Exactly-once: the open transaction aborted; nothing it held was written."""
        self._uncommitted.clear()

    def deliver(
        self, stream: StreamInfo, epoch: int, seq: int, payload: bytes, replayed: bool
    ) -> None:
        st = stream.stats or self.stats(stream)
        if replayed:
            st.batches_replay += 1
        else:
            st.batches_live += 1
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            self.metrics.decode_errors.labels(stream.pod, "payload").inc()
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
            self.metrics.dp_mismatch.labels(stream.pod).inc()
            self.bad_input.warning(
                stream.pod,
                "dp_rank",
                "batch seq %d says data_parallel_rank %d but arrived on "
                "the stream of rank %d (check the pod's dp and ports)",
                seq,
                batch.dp_rank,
                stream.dp_rank,
            )
        events = batch.events
        position = (epoch, seq, payload)
        if events:
            values = self.codec.encode_batch(
                stream.pod, stream.model, stream.dp_rank, epoch, seq, batch.ts, batch.extra, events
            )
            by_type: dict[type, int] = {}
            for t in map(type, events):
                by_type[t] = by_type.get(t, 0) + 1
            if UnknownEvent in by_type:
                for event in events:
                    if type(event) is UnknownEvent:
                        self.metrics.unknown_events.labels(stream.pod, event.tag[:64]).inc()
            counts = st.events_in
            for t, n in by_type.items():
                counts[t] = counts.get(t, 0) + n
            n = len(values)
            if self.track_acks:
                cb = self._batch_callback(stream, position, batch.ts, by_type, n)
                self.sink.produce_batch(
                    stream.key, values, cb, stream.topic, partition=stream.partition
                )
            else:
                self._uncommitted.append((st, by_type, n, batch.ts))
                self.sink.produce_batch(
                    stream.key,
                    values,
                    self._on_failed_only,
                    stream.topic,
                    every=False,
                    partition=stream.partition,
                )
            self.produced += n
        stream.delivered = position
        st.last_seq = seq

    def _on_failed_only(self, err: Any, msg: Any) -> None:
        """Exactly-once: the last record of a batch failed (the commit fails too): report it."""
        if err is not None:
            self._default_cb(err, msg)

    def _batch_callback(
        self,
        stream: StreamInfo,
        position: Position | None,
        batch_ts: float | None,
        by_type: dict[type, int],
        records: int,
    ) -> Callable[..., None]:
        """One delivery callback shared by a batch's records (at-least-once).

        Once every record is reported: counts the acknowledged ones (a refused one is handed
        to the sink's failure path, which writes the batch as lost) and, if the last one was
        acknowledged (the records share a partition and are written in order), moves the
        stream's checkpoint to ``position`` and observes the end-to-end lag (vLLM batch
        timestamp -> acknowledgement).
        """
        default = self._default_cb
        observe = self.metrics.e2e_lag.observe  # per batch, not per event: no stall at flush
        st = stream.stats or self.stats(stream)
        left = records
        failed: list[bytes] = []

        def delivered(err: Any, msg: Any) -> None:
            nonlocal left
            left -= 1
            if err is not None:
                default(err, msg)
                failed.append(msg.value() or b"")
            if left:
                return
            if failed:
                st.add_out(self._minus_failed(by_type, failed), records - len(failed))
            else:
                st.add_out(by_type, records)
            if err is None:
                if position is not None:
                    stream.acked = position
                if batch_ts is not None:
                    observe(max(0.0, time.time() - batch_ts))

        return delivered

    def _minus_failed(self, by_type: dict[type, int], failed: list[bytes]) -> dict[type, int]:
        """``by_type`` without the events of the refused records (rare: decoded to know)."""
        out = dict(by_type)
        for value in failed:
            try:
                t = type(self.codec.decode(value).event)
            except Exception:  # not decodable: cannot say which type; count it out of none
                continue
            if out.get(t):
                out[t] -= 1
        return out

    def marker(self, stream: StreamInfo, epoch: int, seq: int, marker: Marker) -> None:
        env = Envelope(stream.pod, stream.model, stream.dp_rank, epoch, seq, -1, time.time())
        self.metrics.markers_out.labels(stream.pod, type(marker).__name__).inc()
        if isinstance(marker, EventsLost) and marker.open_ended:
            # Not a count of batches: the end of an epoch whose later batches, if the old
            # incarnation published any, are unknown (a restart or a seq jump follows).
            log.info(
                "pod %s rank %d epoch %d ends after seq %d: anything it published later is "
                "unknown (%s)",
                stream.pod,
                stream.dp_rank,
                epoch,
                marker.from_seq - 1,
                marker.reason,
            )
        elif isinstance(marker, EventsLost):
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
        st = stream.stats or self.stats(stream)
        if isinstance(marker, EventsLost):
            position: Position | None = (epoch, marker.to_seq, None)
            stream.delivered = position
        else:
            position = None
        if not self.track_acks:
            self._uncommitted.append((st, {}, 1, None))
            self.sink.produce_batch(
                stream.key,
                [value],
                self._on_failed_only,
                stream.topic,
                every=False,
                partition=stream.partition,
            )
            return
        cb = self._batch_callback(stream, position, None, {}, 1)
        self.sink.produce_batch(stream.key, [value], cb, stream.topic, partition=stream.partition)
