"""Avro records of the kv-events topic: typed events <-> self-identifying Avro bytes.

Values use the Avro single-object encoding: ``C3 01``, the writer schema's
CRC-64-AVRO fingerprint (8 bytes, little-endian), then the Avro binary body.
Any Avro library can tell from the header which schema wrote a record.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import msgpack
from fastavro import schemaless_reader, schemaless_writer
from fastavro.schema import parse_schema, to_parsing_canonical_form

from bridge.log import avro
from bridge.log.markers import (
    EmptyBatch,
    EventsLost,
    Marker,
    PodRemoved,
    PublisherRestarted,
    StreamStarted,
)
from bridge.vllm.events import (
    REMAINING_COPY_COUNTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    UnknownEvent,
    VllmEvent,
    parse_copy_counts,
)

SCHEMA_NAMESPACE = "io.kvbridge.v1"
SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = b"\x00"  # Confluent wire format: then the schema id, 4 bytes big-endian


class RecordError(ValueError):
    """A Kafka value that is not a kv-events record this bridge can read."""


def schema_dir() -> Path:
    """`schemas/` at the repository root (also copied beside the package in images)."""
    here = Path(__file__).resolve().parent.parent  # bridge/
    for candidate in (here.parent / "schemas", here / "schemas"):
        if (candidate / "kv_event.avsc").is_file():
            return candidate
    raise FileNotFoundError(f"kv_event.avsc not found next to {here}; reinstall kvbridge")


@cache
def previous_schemas() -> tuple[Any, ...]:
    """Earlier versions of the record schema (``schemas/history/``), parsed: records they
    wrote are read with the current schema (new fields take their defaults)."""
    history = schema_dir() / "history"
    paths = sorted(history.glob("kv_event.v*.avsc")) if history.is_dir() else []
    return tuple(parse_schema(json.loads(p.read_text())) for p in paths)


_EMPTY = 0xC15D213AA4D7A795


@cache
def _fp_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (_EMPTY & -(fp & 1))
        table.append(fp & 0xFFFFFFFFFFFFFFFF)
    return tuple(table)


def crc64_avro(data: bytes) -> int:
    """The Avro spec's 64-bit Rabin fingerprint (CRC-64-AVRO) of ``data``."""
    table = _fp_table()
    fp = _EMPTY
    for b in data:
        fp = (fp >> 8) ^ table[(fp ^ b) & 0xFF]
    return fp


@dataclass(slots=True)
class Envelope:
    """Where a record belongs: identifies a vLLM event exactly (markers use index -1)."""

    pod: str
    model: str
    dp_rank: int
    epoch: int
    seq: int
    index: int
    ts: float
    batch_extra: dict[str, bytes] = field(default_factory=dict)
    # A BlockStored split over several records (bridge/log/split.py): this record's part, of parts.
    part: int = 0
    parts: int = 1


@dataclass(slots=True)
class Record:
    envelope: Envelope
    event: VllmEvent | Marker


def _full(name: str) -> str:
    return f"{SCHEMA_NAMESPACE}.{name}"


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def event_to_avro(event: VllmEvent | Marker) -> tuple[str, dict[str, Any]]:
    """The union branch (full name, datum) for one event or marker."""
    if isinstance(event, BlockStored):
        d = {
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
            "extra_keys": None
            if event.extra_keys is None
            else [None if k is None else _pack(k) for k in event.extra_keys],
            "group_idx": event.group_idx,
            "kv_cache_spec_kind": event.kv_cache_spec_kind,
            "kv_cache_spec_sliding_window": event.kv_cache_spec_sliding_window,
            "locality": event.locality,
            "ownership": event.ownership,
            "session_id": event.session_id,
            "lookahead_token_ids": event.lookahead_token_ids,
            "extra": event.extra,
        }
        return _full("BlockStored"), d
    if isinstance(event, BlockRemoved):
        d = {
            "block_hashes": event.block_hashes,
            "medium": event.medium,
            "group_idx": event.group_idx,
            "locality": event.locality,
            "ownership": event.ownership,
            "extra": removed_extra(event),
        }
        return _full("BlockRemoved"), d
    if isinstance(event, AllBlocksCleared):
        return _full("AllBlocksCleared"), {"extra": event.extra}
    if isinstance(event, UnknownEvent):
        return _full("UnknownEvent"), {"tag": event.tag, "raw": event.raw}
    if isinstance(event, StreamStarted):
        return _full("StreamStarted"), {"next_seq": event.next_seq, "endpoint": event.endpoint}
    if isinstance(event, PublisherRestarted):
        d = {"old_epoch": event.old_epoch, "last_seq": event.last_seq, "first_seq": event.first_seq}
        return _full("PublisherRestarted"), d
    if isinstance(event, EventsLost):
        d = {"from_seq": event.from_seq, "to_seq": event.to_seq, "reason": event.reason}
        return _full("EventsLost"), d
    if isinstance(event, PodRemoved):
        return _full("PodRemoved"), {"reason": event.reason}
    if isinstance(event, EmptyBatch):
        return _full("EmptyBatch"), {}
    raise TypeError(f"not an event or marker: {type(event).__name__}")


def event_from_avro(name: str, d: dict[str, Any]) -> VllmEvent | Marker:
    short = name.rsplit(".", 1)[-1]
    if short == "BlockStored":
        keys = d["extra_keys"]
        if keys is not None:
            d["extra_keys"] = [None if k is None else _unpack(k) for k in keys]
        return BlockStored(**d)
    cls = _SIMPLE_TYPES.get(short)
    if cls is None:
        raise RecordError(f"unknown event type {name!r} in record")
    if cls is BlockRemoved:
        raw = d["extra"].get(REMAINING_COPY_COUNTS)
        if raw is not None:
            counts = parse_copy_counts(raw, len(d["block_hashes"]))
            if counts is not None:
                del d["extra"][REMAINING_COPY_COUNTS]
                d["remaining_copy_counts"] = counts
    return cls(**d)


def removed_extra(event: BlockRemoved) -> dict[str, bytes]:
    """The Avro ``extra`` of a remove: its unknown fields plus ``remaining_copy_counts``,
    which the schema has no field for (it travels under its vLLM name)."""
    if event.remaining_copy_counts is None:
        return event.extra
    return {**event.extra, REMAINING_COPY_COUNTS: _pack(event.remaining_copy_counts)}


_SIMPLE_TYPES: dict[str, type] = {
    c.__name__: c
    for c in (
        BlockRemoved,
        AllBlocksCleared,
        UnknownEvent,
        StreamStarted,
        PublisherRestarted,
        EventsLost,
        PodRemoved,
        EmptyBatch,
    )
}


class RecordCodec:
    """Encodes and decodes kv-events values (single-object encoding)."""

    def __init__(self, schema_path: Path | None = None, header: bytes | None = None) -> None:
        """``header``: the value prefix to write instead of the single-object header (the
        Confluent wire format's magic byte and schema id, when a registry is configured)."""
        path = schema_path or schema_dir() / "kv_event.avsc"
        raw = json.loads(path.read_text())
        self.schema = parse_schema(raw)
        self.canonical = to_parsing_canonical_form(self.schema)
        self.fingerprint = crc64_avro(self.canonical.encode())
        self.header = SINGLE_OBJECT_MAGIC + self.fingerprint.to_bytes(8, "little")
        if header is not None:
            self.header = header
        self._readers: dict[bytes, Any] = {self.fingerprint.to_bytes(8, "little"): self.schema}
        for old in previous_schemas():  # records written by earlier versions of the schema
            fp = crc64_avro(to_parsing_canonical_form(old).encode()).to_bytes(8, "little")
            self._readers.setdefault(fp, old)

    @cached_property
    def _fast(self) -> bool:
        """Whether the loaded schema is the one :mod:`bridge.log.avro` was written for."""
        return self.fingerprint == avro.SCHEMA_FINGERPRINT

    def encode(self, envelope: Envelope, event: VllmEvent | Marker) -> bytes:
        """One record value: ``self.header`` then the Avro body."""
        if not self._fast:
            return self.encode_reference(envelope, event)
        return b"".join(
            (
                self.header,
                avro.envelope_head(
                    envelope.pod, envelope.model, envelope.dp_rank, envelope.epoch, envelope.seq
                ),
                avro.index_bytes(envelope.index),
                avro.envelope_tail(envelope.ts, envelope.batch_extra),
                avro.encode_event(event),
                avro.part_bytes(envelope.part, envelope.parts),
            )
        )

    def encode_batch(
        self,
        pod: str,
        model: str,
        dp_rank: int,
        epoch: int,
        seq: int,
        ts: float,
        batch_extra: dict[str, bytes],
        events: Sequence[VllmEvent],
    ) -> list[bytes]:
        """The values of a vLLM batch's records (``index`` = position in ``events``), equal to
        ``encode`` of each; the envelope is encoded once for the whole batch."""
        if not self._fast:
            return [
                self.encode_reference(
                    Envelope(pod, model, dp_rank, epoch, seq, i, ts, batch_extra), event
                )
                for i, event in enumerate(events)
            ]
        return avro.encode_records(
            avro.batch_prefix(self.header, pod, model, dp_rank, epoch, seq),
            avro.envelope_tail(ts, batch_extra),
            events,
        )

    def encode_reference(self, envelope: Envelope, event: VllmEvent | Marker) -> bytes:
        """``encode`` through fastavro's generic writer: the reference the fast path matches,
        and the path taken for any schema other than the one it was written for."""
        datum = {
            "pod": envelope.pod,
            "model": envelope.model,
            "dp_rank": envelope.dp_rank,
            "epoch": envelope.epoch,
            "seq": envelope.seq,
            "index": envelope.index,
            "ts": envelope.ts,
            "batch_extra": envelope.batch_extra,
            "event": event_to_avro(event),
            "part": envelope.part,
            "parts": envelope.parts,
        }
        buf = io.BytesIO()
        buf.write(self.header)
        schemaless_writer(buf, self.schema, datum)
        return buf.getvalue()

    # Where Confluent wire-format schema ids are looked up (bridge.log.registry.SchemaRegistry):
    # anything with ``writer_schema(schema_id) -> parsed schema`` raising RecordError.
    registry: Any = None

    def _confluent_writer(self, schema_id: int) -> Any:
        """The writer schema of a Confluent wire-format value (magic byte 0 + schema id)."""
        if self.registry is not None:
            return self.registry.writer_schema(schema_id)
        if self.header == CONFLUENT_MAGIC + schema_id.to_bytes(4, "big"):
            return self.schema  # our own records: the id we were given when registering
        raise RecordError(
            f"value is in the Confluent wire format (schema id {schema_id}) and no schema "
            "registry is configured to look the id up: pass --schema-registry-url "
            "(or set KVBRIDGE_SCHEMA_REGISTRY_URL)"
        )

    def decode(self, value: bytes | None) -> Record:
        """A record from either framing: Avro single-object encoding (``C3 01`` + fingerprint)
        or the Confluent wire format (``00`` + 4-byte big-endian schema id).

        Raises RecordError, and only that, for anything else: a null value (a tombstone),
        bytes another producer wrote, an unknown schema, a truncated or corrupt body."""
        if value is None:
            raise RecordError("null value (a tombstone): kvbridge never writes one")
        if not isinstance(value, bytes | bytearray | memoryview):
            raise RecordError(f"value is {type(value).__name__}, not bytes")
        value = bytes(value)
        if len(value) >= 10 and value[:2] == SINGLE_OBJECT_MAGIC:
            writer = self._readers.get(value[2:10])
            if writer is None:
                raise RecordError(
                    f"value written with an unknown schema (fingerprint {value[2:10][::-1].hex()});"
                    " upgrade kvbridge to read it"
                )
            body = value[10:]
        elif len(value) >= 5 and value[:1] == CONFLUENT_MAGIC:
            writer = self._confluent_writer(int.from_bytes(value[1:5], "big"))
            body = value[5:]
        else:
            raise RecordError(
                "value is neither Avro single-object encoded (C3 01 marker) nor in the Confluent "
                "wire format (magic byte 0 + schema id); is this topic written by kvbridge?"
            )
        try:
            d = schemaless_reader(io.BytesIO(body), writer, self.schema, return_record_name=True)
        except Exception as exc:  # fastavro raises many types on corrupt input
            why = str(exc) or type(exc).__name__  # EOFError of a truncated body says nothing
            raise RecordError(f"corrupt or truncated Avro body: {why}") from exc
        try:
            name, ev = d.pop("event")
            return Record(Envelope(**d), event_from_avro(name, ev))
        except RecordError:
            raise
        except (TypeError, ValueError, KeyError) as exc:  # a body that is not a kv-event
            raise RecordError(f"not a kv-events record: {exc}") from exc
