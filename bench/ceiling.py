"""The ceiling: the bridge's per-event work alone, in one process, no sockets, no Kafka.

For every payload: ``decode_batch`` (msgpack -> typed events), then
``RecordCodec.encode_batch`` of its events (typed events -> Avro single-object bytes), exactly
the calls the bridge's pipeline makes per batch. Nothing else: no ZeroMQ, no sequencing, no
producer. An end-to-end run can approach this number but not pass it (on the same machine and
payloads).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from bridge.log import avro as avro_encode
from bridge.log.records import RecordCodec
from bridge.vllm.decoder import decode_batch

__all__ = ["run_ceiling"]

_POD = "pod-0"
_MODEL = "bench-model"
_EPOCH = 1_767_225_600_000


def _decode_all(payloads: Sequence[bytes]) -> int:
    n = 0
    for payload in payloads:
        n += len(decode_batch(payload).events)
    return n


def _decode_and_encode_all(payloads: Sequence[bytes], codec: RecordCodec) -> tuple[int, int]:
    """(events, Avro bytes): what the bridge's pipeline does per batch, minus the producer."""
    encode = codec.encode_batch
    events = avro_bytes = 0
    for seq, payload in enumerate(payloads):
        batch = decode_batch(payload)
        values = encode(_POD, _MODEL, 0, _EPOCH, seq, batch.ts, batch.extra, batch.events)
        avro_bytes += sum(map(len, values))
        events += len(values)
    return events, avro_bytes


def _encode_only(payloads: Sequence[bytes], codec: RecordCodec) -> float:
    """CPU seconds of ``encode_batch`` alone, each batch timed right after its (untimed)
    decode, as in the pipeline (its objects still in cache); includes two clock reads per
    batch (~0.1 µs)."""
    encode = codec.encode_batch
    clock = time.process_time
    cpu = 0.0
    for seq, payload in enumerate(payloads):
        batch = decode_batch(payload)
        t0 = clock()
        encode(_POD, _MODEL, 0, _EPOCH, seq, batch.ts, batch.extra, batch.events)
        cpu += clock() - t0
    return cpu


def run_ceiling(payloads: Sequence[bytes], label: str, description: str = "") -> dict[str, Any]:
    """Time decode + encode of every event of ``payloads`` (and decode alone, and encode
    alone, for the split)."""
    if not payloads:
        raise ValueError("the ceiling needs at least one payload")
    codec = RecordCodec()
    avro_encode.prepare()  # as the bridge's pipeline does when it starts
    _decode_and_encode_all(payloads[: min(len(payloads), 200)], codec)  # warm caches

    cpu0 = time.process_time()
    decoded = _decode_all(payloads)
    decode_cpu = time.process_time() - cpu0

    t0, cpu0 = time.perf_counter(), time.process_time()
    events, avro_bytes = _decode_and_encode_all(payloads, codec)
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    if events != decoded:
        raise AssertionError(f"decoded {decoded} events once and {events} the second time")

    encode_cpu = _encode_only(payloads, codec)

    payload_bytes = sum(len(p) for p in payloads)
    return {
        "label": label,
        "description": description,
        "batches": len(payloads),
        "events": events,
        "payload_bytes": payload_bytes,
        "avro_bytes": avro_bytes,
        "seconds": round(seconds, 4),
        "cpu_seconds": round(cpu, 4),
        "events_per_s": round(events / seconds, 1),
        "mb_per_s": round(payload_bytes / seconds / 1e6, 3),
        "cpu_us_per_event": round(cpu / events * 1e6, 2),
        "decode_cpu_us_per_event": round(decode_cpu / events * 1e6, 2),
        "encode_cpu_us_per_event": round(max(0.0, cpu - decode_cpu) / events * 1e6, 2),
        "encode_only_cpu_us_per_event": round(encode_cpu / events * 1e6, 2),
    }
