"""A hand-written Avro binary encoder for the kv-events schema (``schemas/kv_event.avsc``).

Avro binary is a plain concatenation of the fields in schema order, so a record is built by
joining byte strings: ``long``/``int`` -> zigzag varint, ``double`` -> 8 bytes little-endian,
``string``/``bytes`` -> varint length + raw, union -> branch index + value, array/map -> one
block (count, items) then ``0``. This produces exactly the bytes fastavro's
``schemaless_writer`` does for the same datum (``tests/test_encoding_fast.py`` checks that on
randomized events of every type), at a fraction of the cost: no per-record dict, and the
envelope fields that are constant within a vLLM batch (pod, model, dp_rank, epoch, seq, then
ts and batch_extra) are encoded once per batch; only ``index`` and the event vary per record.

Written for one schema: :data:`SCHEMA_FINGERPRINT` is the CRC-64-AVRO fingerprint of the
schema these functions implement; :class:`bridge.records.RecordCodec` uses them only when the
schema it loaded has that fingerprint, and fastavro otherwise.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from bridge.events import AllBlocksCleared, BlockRemoved, BlockStored, UnknownEvent
from bridge.markers import EmptyBatch, EventsLost, PodRemoved, PublisherRestarted, StreamStarted

__all__ = [
    "INDEX",
    "SCHEMA_FINGERPRINT",
    "prepare",
    "encode_event",
    "envelope_head",
    "envelope_tail",
    "index_bytes",
    "write_long",
    "WHOLE",
    "part_bytes",
]

# CRC-64-AVRO of the parsing canonical form of schemas/kv_event.avsc as of this encoder
# (v2: the part/parts fields and the EmptyBatch marker; schemas/history/kv_event.v1.avsc had
# 0x9C83AD1185576AC8).
SCHEMA_FINGERPRINT = 0xC013B2B0F155537B

_LONG_MIN = -(1 << 63)
_LONG_MAX = (1 << 63) - 1

# Single-byte varints: zigzag values 0..127.
_BYTE = tuple(bytes((z,)) for z in range(128))
_pack_double = struct.Struct("<d").pack


def _varint(z: int) -> bytes:
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def write_long(n: int) -> bytes:
    """Avro ``long`` (and ``int``): zigzag varint; OverflowError outside 64 bits, as fastavro."""
    if 0 <= n < 64:
        return _BYTE[n << 1]
    if n < _LONG_MIN or n > _LONG_MAX:
        raise OverflowError(f"{n} does not fit an Avro long (64-bit signed)")
    return _varint((n << 1) ^ (n >> 63))


# Records' `index` field: precomputed for the indexes a batch has.
INDEX = tuple(write_long(i) for i in range(1024))


def index_bytes(index: int) -> bytes:
    return INDEX[index] if 0 <= index < 1024 else write_long(index)


# Non-negative longs 0..len-1 as varints, grown on demand up to _TABLE_CAP (token ids: the bulk
# of the bytes; one C-level join over table lookups instead of a Python loop per id).
_TABLE_CAP = 1 << 21
_table: list[bytes] = [write_long(i) for i in range(64)]


def _grow_table(upto: int) -> None:
    """Extend the table to cover ``upto`` (at least doubling): ~0.1 µs per entry."""
    n = len(_table)
    end = min(max(upto + 1, n * 2), _TABLE_CAP)
    # zigzag(v) = 2v for v >= 0; 2v < 2**14 -> 2 bytes, < 2**21 -> 3 bytes, < 2**28 -> 4 bytes.
    a = max(n, 64)
    b = min(end, 1 << 13)
    _table.extend(bytes(((v << 1) & 0x7F | 0x80, v >> 6)) for v in range(a, b))
    a = max(n, 1 << 13)
    b = min(end, 1 << 20)
    _table.extend(
        bytes(((v << 1) & 0x7F | 0x80, (v >> 6) & 0x7F | 0x80, v >> 13)) for v in range(a, b)
    )
    a = max(n, 1 << 20)
    _table.extend(_varint(v << 1) for v in range(a, end))


def prepare(max_value: int = (1 << 18) - 1) -> None:
    """Build the varint table up to ``max_value`` now (the bridge does at start: ~50 ms and
    ~12 MB for 2**18 entries, which covers vocabularies up to 262,144 tokens) rather than on
    the first token ids that need it."""
    if max_value >= len(_table):
        _grow_table(min(max_value, _TABLE_CAP - 1))


def _longs(values: Sequence[int]) -> bytes:
    """Avro ``array<long>``."""
    n = len(values)
    if n == 0:
        return b"\x00"
    try:
        negative = min(values) < 0
    except TypeError:  # not all ints: let the slow path raise the error fastavro would
        negative = True
    body = None
    if not negative:
        try:
            body = b"".join(map(_table.__getitem__, values))
        except IndexError:  # an id past the table: grow it (up to its cap) and retry
            hi = max(values)
            if hi < _TABLE_CAP:
                _grow_table(hi)
                body = b"".join(map(_table.__getitem__, values))
    if body is None:
        body = b"".join(map(write_long, values))
    return write_long(n) + body + b"\x00"


def _bytes(b: bytes) -> bytes:
    n = len(b)
    return (_BYTE[n << 1] if n < 64 else write_long(n)) + b


def _string(s: str) -> bytes:
    return _bytes(s.encode())


# Optional strings repeat (medium "GPU", locality, ...): cache their encoding, bounded.
_OPT_STR: dict[str | None, bytes] = {None: b"\x00"}
_OPT_STR_MAX = 4096


def _opt_string(s: str | None) -> bytes:
    b = _OPT_STR.get(s)
    if b is None:
        b = b"\x02" + _string(s)  # type: ignore[arg-type]
        if len(_OPT_STR) < _OPT_STR_MAX and len(b) <= 256:
            _OPT_STR[s] = b
    return b


def _opt_long(v: int | None) -> bytes:
    return b"\x00" if v is None else b"\x02" + write_long(v)


def _opt_bytes(v: bytes | None) -> bytes:
    return b"\x00" if v is None else b"\x02" + _bytes(v)


def _hashes(hashes: Sequence[bytes]) -> bytes:
    """Avro ``array<bytes>``; block hashes usually all have one length (8 or 32)."""
    n = len(hashes)
    if n == 1:
        return b"\x02" + _bytes(hashes[0]) + b"\x00"
    if n == 0:
        return b"\x00"
    lengths = set(map(len, hashes))
    if len(lengths) == 1:
        size = lengths.pop()
        if size < 64:
            sep = _BYTE[size << 1]
            return write_long(n) + sep + sep.join(hashes) + b"\x00"
    return write_long(n) + b"".join(map(_bytes, hashes)) + b"\x00"


def _map(d: dict[str, bytes]) -> bytes:
    """Avro ``map<bytes>``."""
    if not d:
        return b"\x00"
    parts = [write_long(len(d))]
    for k, v in d.items():
        parts.append(_string(k))
        parts.append(_bytes(v))
    parts.append(b"\x00")
    return b"".join(parts)


def _extra_keys(keys: list[Any] | None) -> bytes:
    if keys is None:
        return b"\x00"
    if not keys:
        return b"\x02\x00"
    parts = [b"\x02", write_long(len(keys))]
    for k in keys:
        parts.append(
            b"\x00" if k is None else b"\x02" + _bytes(msgpack.packb(k, use_bin_type=True))
        )
    parts.append(b"\x00")
    return b"".join(parts)


def _lookahead(v: list[list[int]] | None) -> bytes:
    if v is None:
        return b"\x00"
    if not v:
        return b"\x02\x00"
    return b"\x02" + write_long(len(v)) + b"".join(map(_longs, v)) + b"\x00"


# Union branch indexes of the `event` field, in schema order.
def _stored(e: BlockStored) -> bytes:
    return b"".join(
        (
            b"\x00",
            _hashes(e.block_hashes),
            _opt_bytes(e.parent_block_hash),
            _longs(e.token_ids),
            write_long(e.block_size),
            _opt_long(e.lora_id),
            _opt_string(e.medium),
            _opt_string(e.lora_name),
            _extra_keys(e.extra_keys),
            _opt_long(e.group_idx),
            _opt_string(e.kv_cache_spec_kind),
            _opt_long(e.kv_cache_spec_sliding_window),
            _opt_string(e.locality),
            _opt_string(e.ownership),
            _opt_string(e.session_id),
            _lookahead(e.lookahead_token_ids),
            _map(e.extra),
        )
    )


def _removed(e: BlockRemoved) -> bytes:
    return (
        b"\x02"
        + _hashes(e.block_hashes)
        + _opt_string(e.medium)
        + _opt_long(e.group_idx)
        + _opt_string(e.locality)
        + _opt_string(e.ownership)
        + _map(e.extra if e.remaining_copy_counts is None else _removed_extra(e))
    )


def _removed_extra(e: BlockRemoved) -> dict[str, bytes]:
    from bridge.records import removed_extra  # records imports this module

    return removed_extra(e)


def _cleared(e: AllBlocksCleared) -> bytes:
    return b"\x04" + _map(e.extra)


def _unknown(e: UnknownEvent) -> bytes:
    return b"\x06" + _string(e.tag) + _bytes(e.raw)


def _started(e: StreamStarted) -> bytes:
    return b"\x08" + write_long(e.next_seq) + _string(e.endpoint)


def _restarted(e: PublisherRestarted) -> bytes:
    return b"\x0a" + write_long(e.old_epoch) + _opt_long(e.last_seq) + write_long(e.first_seq)


def _lost(e: EventsLost) -> bytes:
    return b"\x0c" + write_long(e.from_seq) + write_long(e.to_seq) + _string(e.reason)


def _removed_pod(e: PodRemoved) -> bytes:
    return b"\x0e" + _string(e.reason)


def _empty(e: EmptyBatch) -> bytes:
    return b"\x10"


EVENT_ENCODERS: dict[type, Callable[[Any], bytes]] = {
    BlockStored: _stored,
    BlockRemoved: _removed,
    AllBlocksCleared: _cleared,
    UnknownEvent: _unknown,
    StreamStarted: _started,
    PublisherRestarted: _restarted,
    EventsLost: _lost,
    PodRemoved: _removed_pod,
    EmptyBatch: _empty,
}


def encode_event(event: Any) -> bytes:
    """The ``event`` union (branch index + record) of one event or marker."""
    enc = EVENT_ENCODERS.get(type(event))
    if enc is None:
        for cls, fn in EVENT_ENCODERS.items():
            if isinstance(event, cls):
                return fn(event)
        raise TypeError(f"not an event or marker: {type(event).__name__}")
    return enc(event)


def envelope_head(pod: str, model: str, dp_rank: int, epoch: int, seq: int) -> bytes:
    """The fields before ``index``: pod, model, dp_rank, epoch, seq."""
    return _string(pod) + _string(model) + write_long(dp_rank) + write_long(epoch) + write_long(seq)


# The ``part`` and ``parts`` fields after ``event``: a record that holds a whole event.
WHOLE = b"\x00\x02"


def part_bytes(part: int, parts: int) -> bytes:
    """The ``part`` and ``parts`` fields (a BlockStored split over several records)."""
    if part == 0 and parts == 1:
        return WHOLE
    return write_long(part) + write_long(parts)


def envelope_tail(ts: float, batch_extra: dict[str, bytes]) -> bytes:
    """The fields between ``index`` and ``event``: ts, batch_extra."""
    return _pack_double(ts) + _map(batch_extra)
