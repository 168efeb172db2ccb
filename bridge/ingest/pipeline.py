"""From a delivered vLLM batch (or a sequencer marker) to Avro records in Kafka."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from bridge.log.markers import RECORD_TOO_LARGE, EmptyBatch, EventsLost, Marker
from bridge.log.records import Envelope, RecordCodec
from bridge.log.sink import KafkaSink
from bridge.log.split import fit_parts
from bridge.ops.metrics import BridgeMetrics, LagRecorder, StreamStats
from bridge.ops.ratelimit import RateLimitedLog
from bridge.vllm.decoder import DecodeError, decode_batch
from bridge.vllm.events import BlockStored, UnknownEvent

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
            try:
                values = self.codec.encode_batch(
                    stream.pod,
                    stream.model,
                    stream.dp_rank,
                    epoch,
                    seq,
                    batch.ts,
                    batch.extra,
                    events,
                )
                budget = self.sink.value_budget(stream.topic, stream.key)
                if max(map(len, values)) > budget:
                    values = self._fit(stream, epoch, seq, batch.ts, batch.extra, events, values)
            except Exception as exc:  # a bug or a value the encoder cannot write: not a hole
                self.metrics.internal_errors.labels(stream.pod).inc()
                log.exception(
                    "pod %s rank %d seq %d: internal error encoding the batch; written as "
                    "EventsLost, continuing",
                    stream.pod,
                    stream.dp_rank,
                    seq,
                )
                reason = f"internal error encoding the batch: {type(exc).__name__}: {exc}"
                self.marker(stream, epoch, seq, EventsLost(seq, seq, reason[:500]))
                return
            if isinstance(values, str):  # a record too large that cannot be split
                self.marker(stream, epoch, seq, EventsLost(seq, seq, values))
                return
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
        else:  # no event record names this seq: a marker accounts it (the checker needs it)
            self.marker(stream, epoch, seq, EmptyBatch(), position)
        stream.delivered = position
        st.last_seq = seq

    def _fit(
        self,
        stream: StreamInfo,
        epoch: int,
        seq: int,
        ts: float,
        batch_extra: dict[str, bytes],
        events: list[Any],
        values: list[bytes],
    ) -> list[bytes] | str:
        """``values`` with each BlockStored too large for one record split into parts
        (:mod:`bridge.log.split`), or, if a record is too large and cannot be split, the reason
        the batch is written as EventsLost."""
        budget = self.sink.value_budget(stream.topic, stream.key)
        out: list[bytes] = []
        for i, (event, value) in enumerate(zip(events, values, strict=True)):
            if len(value) <= budget:
                out.append(value)
                continue
            env = Envelope(
                stream.pod, stream.model, stream.dp_rank, epoch, seq, i, ts, batch_extra, 0, 2
            )
            parts = None
            if type(event) is BlockStored:
                parts = fit_parts(event, self._sizer(env), budget)
            if parts is None:
                return self._too_large(stream, seq, i, event, len(value))
            n = len(parts)
            for k, part in enumerate(parts):
                out.append(self.codec.encode(replace(env, part=k, parts=n), part))
            self.bad_input.warning(
                stream.pod,
                "split",
                "rank %d seq %d: BlockStored %d (%d blocks, %d bytes) over the %d bytes a "
                "record may have: written as %d records",
                stream.dp_rank,
                seq,
                i,
                len(event.block_hashes),
                len(value),
                budget,
                n,
            )
        return out

    def _sizer(self, env: Envelope) -> Callable[[Any], int]:
        encode = self.codec.encode
        return lambda event: len(encode(env, event))

    def _too_large(self, stream: StreamInfo, seq: int, index: int, event: Any, size: int) -> str:
        """Count and log a record that cannot be written; returns the EventsLost reason."""
        limit, topic_max, client_max = self.sink.record_limit(stream.topic)
        topic = stream.topic or self.sink.topic
        if type(event) is BlockStored:
            why = (
                "one of its blocks alone is too large"
                if len(event.block_hashes) > 1
                else "a BlockStored of one block cannot be split"
            )
        else:
            why = f"a {type(event).__name__} cannot be split"
        self.metrics.decode_errors.labels(stream.pod, "oversized_record").inc()
        self.bad_input.warning(
            stream.pod,
            "oversized_record",
            "rank %d seq %d: event %d (%s) is %d bytes, over the %d bytes a record of topic %s "
            "may have (max.message.bytes %d, producer message.max.bytes %d) and %s; the batch "
            "is written as EventsLost. Raise the topic's max.message.bytes (and "
            "--kafka-property message.max.bytes) to keep such events",
            stream.dp_rank,
            seq,
            index,
            type(event).__name__,
            size,
            limit,
            topic,
            topic_max,
            client_max,
            why,
        )
        return (
            f"{RECORD_TOO_LARGE}: event {index} ({type(event).__name__}) is {size} bytes > "
            f"max.message.bytes {limit} of topic {topic}; {why}"
        )[:500]

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

    def marker(
        self,
        stream: StreamInfo,
        epoch: int,
        seq: int,
        marker: Marker,
        position: Position | None = None,
    ) -> None:
        """Write ``marker`` at ``seq``; an EventsLost (or ``position``, the batch an EmptyBatch
        stands for) moves the stream's checkpoint position when acknowledged."""
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
            level = logging.DEBUG if isinstance(marker, EmptyBatch) else logging.INFO
            log.log(level, "pod %s rank %d epoch %d: %s", stream.pod, stream.dp_rank, epoch, marker)
        value = self.codec.encode(env, marker)
        self.produced += 1
        st = stream.stats or self.stats(stream)
        if isinstance(marker, EventsLost):
            position = (epoch, marker.to_seq, None)
        if position is not None:
            stream.delivered = position
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
