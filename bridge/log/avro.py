"""A hand-written Avro binary encoder for the kv-events schema (``schemas/kv_event.avsc``).

Avro binary is a plain concatenation of the fields in schema order, so a record is built by
joining byte strings: ``long``/``int`` -> zigzag varint, ``double`` -> 8 bytes little-endian,
``string``/``bytes`` -> varint length + raw, union -> branch index + value, array/map -> one
block (count, items) then ``0``. This produces exactly the bytes fastavro's
``schemaless_writer`` does for the same datum (``tests/log/test_encoding_fast.py`` checks that on
randomized events of every type, ``tests/log/test_encoding_property.py`` on generated ones), at a
fraction of the cost: no per-record dict; the envelope fields that are constant within a vLLM
batch (pod, model, dp_rank, epoch, seq, then ts and batch_extra) are encoded once per batch
(:func:`batch_prefix`, :func:`envelope_tail`) and only ``index`` and the event vary per
record (:func:`encode_records`); token ids are encoded all at once by bigint arithmetic
(:func:`_lanes`); repeated runs of fields are encoded once per distinct value.

Written for one schema: :data:`SCHEMA_FINGERPRINT` is the CRC-64-AVRO fingerprint of the
schema these functions implement; :class:`bridge.log.records.RecordCodec` uses them only when the
schema it loaded has that fingerprint, and fastavro otherwise.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from bridge.log.markers import EmptyBatch, EventsLost, PodRemoved, PublisherRestarted, StreamStarted
from bridge.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, UnknownEvent

__all__ = [
    "INDEX",
    "batch_prefix",
    "encode_records",
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
    if 64 <= n < 8192:
        return bytes(((n << 1) & 0x7F | 0x80, n >> 6))
    if n < _LONG_MIN or n > _LONG_MAX:
        raise OverflowError(f"{n} does not fit an Avro long (64-bit signed)")
    return _varint((n << 1) ^ (n >> 63))


# Records' `index` field: precomputed for the indexes a batch has.
INDEX = tuple(write_long(i) for i in range(1024))


def index_bytes(index: int) -> bytes:
    return INDEX[index] if 0 <= index < 1024 else write_long(index)


# Token ids (the bulk of the bytes) are encoded all at once with arithmetic on one Python int
# that holds the ids in 32-bit lanes ("SIMD within a register"): ``array`` reads the ids into
# C integers, ``int.from_bytes`` turns them into one int, and a dozen bigint operations, each
# a C loop over all lanes, turn every lane into that id's varint (7-bit groups, continuation
# bits), padded with zero bytes, which a ``translate`` deletes. ~25 ns per id where a lookup
# table of per-id ``bytes`` objects took ~120-240 ns (random reads into ~12 MB, cache misses).
# A lane holds ids 0 <= v < 2**27 (varints of up to 4 bytes); anything else, and lists with
# id 0 (whose one byte is 0, deleted with the padding), take other paths.
_LANE_ID_MAX = (1 << 27) - 1
_MASKS_CACHED = 4096  # lane counts whose masks are kept (each mask is 4 bytes per lane)
_masks: dict[int, tuple[int, ...]] = {}
_ZERO = b"\x00"


def _lane_masks(n: int) -> tuple[int, ...]:
    """The constants of :func:`_lanes` for ``n`` lanes: each 32-bit pattern repeated."""
    m = _masks.get(n)
    if m is None:
        ones = ((1 << (32 * n)) - 1) // 0xFFFFFFFF  # 1 in every lane
        m = tuple(
            ones * k
            for k in (
                0xF8000000,  # ids >= 2**27: not for this path
                0x7FFFFFC0,  # bits 6.. of the id: moved up one (7-bit groups)
                0x7FFFC000,  # then bits 14..
                0x7FC00000,  # then bits 22..
                0x7F7F7F7F,  # added: bit 7 of a byte is set iff the byte is not 0
                0x80808080,
                0x00808080,  # continuation bit of byte 0..2 when byte 1..3 is set
                0x00008080,
                0x00000080,
            )
        )
        if n <= _MASKS_CACHED:
            _masks[n] = m
    return m


def _lanes(ids: array[int]) -> bytes | None:
    """The varints of ``ids`` (zigzag of non-negative v is 2v), concatenated; None when an id
    is 2**27 or more, or 0."""
    n = len(ids)
    high, g1, g2, g3, b7f, b80, c1, c2, c3 = _lane_masks(n)
    x = int.from_bytes(ids, "little")
    if x & high:
        return None
    x += x & g1  # v: groups of 7 bits at bit 0, 7, 14, 21 of each lane...
    x += x & g2
    x += x & g3
    x <<= 1  # ...of zigzag(v) = 2v at bit 0, 8, 16, 24: each group one byte
    nz = (x + b7f) & b80  # bit 7 of every non-zero byte
    cont = ((nz >> 8) & c1) | ((nz >> 16) & c2) | ((nz >> 24) & c3)  # a byte above is set
    out = (x | cont).to_bytes(4 * n, "little").translate(None, _ZERO)
    if len(out) != n + cont.bit_count():  # an id 0: its one byte, 0, went with the padding
        return None
    return out


def _lanes_with_zeros(ids: array[int]) -> bytes | None:
    """:func:`_lanes` of ids that may hold 0s: the runs between them, joined by 0 bytes."""
    n = len(ids)
    runs = []
    start = 0
    while True:
        try:
            stop = ids.index(0, start)
        except ValueError:
            stop = n
        if stop > start:
            run = _lanes(ids[start:stop])
            if run is None:
                return None
            runs.append(run)
        else:
            runs.append(b"")
        if stop == n:
            return _ZERO.join(runs)
        start = stop + 1


def _longs(values: Sequence[int]) -> bytes:
    """Avro ``array<long>``."""
    n = len(values)
    if n == 0:
        return b"\x00"
    try:
        ids = array("I", values)
    except (OverflowError, TypeError):  # negative, >= 2**32, not an int: one by one
        body = None
    else:
        body = _lanes(ids)
        if body is None and ids.count(0) * 8 <= n:  # a few 0s (many: one by one is faster)
            body = _lanes_with_zeros(ids)
    if body is None:  # write_long raises OverflowError for what is not a long, as fastavro
        body = b"".join(map(write_long, values))
    return (_BYTE[n << 1] if n < 64 else write_long(n)) + body + b"\x00"


def prepare(max_value: int = (1 << 18) - 1) -> None:
    """Kept for callers of the former varint table: nothing to build any more (token ids are
    encoded arithmetically); only computes the masks of common list lengths."""
    for n in (16, 32, 64, 128, 256, 512):
        _lane_masks(n)


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


_NO_KEYS: dict[int, bytes] = {}  # extra_keys of n blocks, all null: the common case


def _extra_keys(keys: list[Any] | None) -> bytes:
    if keys is None:
        return b"\x00"
    n = len(keys)
    if not n:
        return b"\x02\x00"
    if keys.count(None) == n:
        b = _NO_KEYS.get(n)
        if b is None:
            b = b"\x02" + write_long(n) + b"\x00" * n + b"\x00"
            if n < 1024:
                _NO_KEYS[n] = b
        return b
    parts = [b"\x02", write_long(n)]
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


# Runs of BlockStored/BlockRemoved fields that repeat from event to event (medium "GPU",
# group 0, the same block size and spec kind, ...), encoded once per distinct value and kept
# (bounded). Keys are taken only of exactly-typed values (int/str/None), so that no equal but
# differently typed value (16.0, True) is ever given another value's bytes.
_RUNS_MAX = 4096
_stored_mid: dict[tuple[Any, ...], bytes] = {}
_stored_spec: dict[tuple[Any, ...], bytes] = {}
_removed_rest: dict[tuple[Any, ...], bytes] = {}
_NoneType = type(None)
_KEY_TYPES = (int, str, _NoneType)


def _keyable(key: tuple[Any, ...]) -> bool:
    return all(type(v) in _KEY_TYPES for v in key)


def _run(cache: dict[tuple[Any, ...], bytes], key: tuple[Any, ...], encode: Any) -> bytes:
    """``encode(*key)``, kept in ``cache`` if the key's values are exactly typed."""
    b = encode(*key)
    if len(cache) < _RUNS_MAX and _keyable(key):
        cache[key] = b
    return b


def _mid(block_size: int, lora_id: int | None, medium: str | None, lora_name: str | None) -> bytes:
    return (
        write_long(block_size) + _opt_long(lora_id) + _opt_string(medium) + _opt_string(lora_name)
    )


def _spec(
    group_idx: int | None,
    kind: str | None,
    window: int | None,
    locality: str | None,
    ownership: str | None,
) -> bytes:
    return (
        _opt_long(group_idx)
        + _opt_string(kind)
        + _opt_long(window)
        + _opt_string(locality)
        + _opt_string(ownership)
    )


def _is_long(v: Any) -> bool:
    """An exact int (not a bool, float, ...), or None: a value whose encoding may be cached."""
    return v is None or type(v) is int


# Union branch indexes of the `event` field, in schema order.
def _stored(e: BlockStored) -> bytes:
    key = (e.block_size, e.lora_id, e.medium, e.lora_name)
    mid = _stored_mid.get(key) if type(key[0]) is int and _is_long(key[1]) else None
    if mid is None:
        mid = _run(_stored_mid, key, _mid)
    key = (
        e.group_idx,
        e.kv_cache_spec_kind,
        e.kv_cache_spec_sliding_window,
        e.locality,
        e.ownership,
    )
    spec = _stored_spec.get(key) if _is_long(key[0]) and _is_long(key[2]) else None
    if spec is None:
        spec = _run(_stored_spec, key, _spec)
    look = e.lookahead_token_ids
    extra = e.extra
    return b"".join(
        (
            b"\x00",
            _hashes(e.block_hashes),
            _opt_bytes(e.parent_block_hash),
            _longs(e.token_ids),
            mid,
            _extra_keys(e.extra_keys),
            spec,
            _opt_string(e.session_id),
            b"\x00\x00" if look is None and not extra else _lookahead(look) + _map(extra),
        )
    )


def _removed_fields(
    medium: str | None, group_idx: int | None, locality: str | None, ownership: str | None
) -> bytes:
    return (
        _opt_string(medium) + _opt_long(group_idx) + _opt_string(locality) + _opt_string(ownership)
    )


def _removed_body(e: BlockRemoved) -> bytes:
    """A BlockRemoved after its hashes, and the ``part``/``parts`` of a whole event."""
    key = (e.medium, e.group_idx, e.locality, e.ownership)
    rest = _removed_rest.get(key) if _is_long(key[1]) else None
    if rest is None:
        rest = _run(_removed_rest, key, _removed_fields)
    if e.extra or e.remaining_copy_counts is not None:
        return (
            rest + _map(e.extra if e.remaining_copy_counts is None else _removed_extra(e)) + WHOLE
        )
    return rest + _EMPTY_MAP_WHOLE


def _removed(e: BlockRemoved) -> bytes:
    return b"\x02" + _hashes(e.block_hashes) + _removed_body(e)[:-2]


def _removed_extra(e: BlockRemoved) -> dict[str, bytes]:
    from bridge.log.records import removed_extra  # records imports this module

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
_EMPTY_MAP_WHOLE = b"\x00" + WHOLE


def part_bytes(part: int, parts: int) -> bytes:
    """The ``part`` and ``parts`` fields (a BlockStored split over several records)."""
    if part == 0 and parts == 1:
        return WHOLE
    return write_long(part) + write_long(parts)


def envelope_tail(ts: float, batch_extra: dict[str, bytes]) -> bytes:
    """The fields between ``index`` and ``event``: ts, batch_extra."""
    return _pack_double(ts) + _map(batch_extra)


# A BlockRemoved's branch index and one hash of each length below 64, up to the hash's bytes.
_ONE_HASH = tuple(b"\x02\x02" + _BYTE[n << 1] for n in range(64))
_prefixes: dict[tuple[Any, ...], bytes] = {}


def batch_prefix(header: bytes, pod: str, model: str, dp_rank: int, epoch: int, seq: int) -> bytes:
    """``header`` and the fields before ``index``; all but seq kept per stream (bounded)."""
    key = (header, pod, model, dp_rank, epoch)
    b = _prefixes.get(key) if type(dp_rank) is int and type(epoch) is int else None
    if b is None:
        b = header + _string(pod) + _string(model) + write_long(dp_rank) + write_long(epoch)
        if len(_prefixes) < _RUNS_MAX and _keyable(key[1:]):
            _prefixes[key] = b
    return b + write_long(seq)


def encode_records(prefix: bytes, tail: bytes, events: Sequence[Any]) -> list[bytes]:
    """The records of a vLLM batch's events: ``prefix`` (:func:`batch_prefix`), ``index`` (the
    position in ``events``), ``tail`` (:func:`envelope_tail`), the event, whole (part 0 of
    1). BlockRemoved, most of the events, is assembled here in one join from cached runs."""
    index = INDEX if len(events) <= len(INDEX) else [index_bytes(i) for i in range(len(events))]
    out: list[bytes] = []
    append = out.append
    join = b"".join
    one_hash = _ONE_HASH
    encoders = EVENT_ENCODERS
    for i, e in zip(index, events, strict=False):
        t = type(e)
        if t is BlockRemoved:
            hashes = e.block_hashes
            if len(hashes) == 1 and len(hashes[0]) < 64:
                h = hashes[0]
                append(join((prefix, i, tail, one_hash[len(h)], h, _ZERO, _removed_body(e))))
            else:
                append(join((prefix, i, tail, b"\x02", _hashes(hashes), _removed_body(e))))
        elif t is BlockStored:
            append(join((prefix, i, tail, _stored(e), WHOLE)))
        else:
            enc = encoders.get(t)
            append(join((prefix, i, tail, enc(e) if enc else encode_event(e), WHOLE)))
    return out
