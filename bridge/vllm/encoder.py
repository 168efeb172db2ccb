"""Encode typed events exactly as a given vLLM release's msgspec encoder would (spec §4, §11).

Used by the simulator and the tests. Rules reproduced from msgspec:

* the batch envelope is always an array: ``[ts, events]`` (0.9.0) or
  ``[ts, events, data_parallel_rank]`` (0.9.1 →);
* events are arrays with every field of the release (nil for None) up to
  0.23.0, and maps from 0.24.0: ``"type"`` first, then the fields in
  declaration order, fields with a default left out when None;
* a map header's kind follows the struct's total field count including the tag
  (fixmap up to 15, else map16), while the count written is the number of pairs
  actually written (so 0.33.0's BlockStored is ``de 00 0b``, 11 pairs);
* floats are float64, ints use the smallest encoding, bytes are ``bin``.

``extra`` entries (msgpack bytes) are written back verbatim, so that
``decode_batch(encode_batch(b, r))`` equals ``b`` with hashes in normal form.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Literal

import msgpack

from bridge.vllm.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
    VllmEvent,
)
from bridge.vllm.releases import (
    BLOCK_REMOVED_FIELDS,
    BLOCK_STORED_FIELDS,
    Release,
    WireField,
    as_release,
)

__all__ = ["HashMode", "encode_batch", "normal_hash", "wire_hash"]

HashMode = Literal["int", "signed", "bytes"]
_HASH_MODES = ("int", "signed", "bytes")
_HASH_FIELDS = frozenset({"block_hashes", "parent_block_hash"})
_POS_RE = re.compile(r"#(0|[1-9][0-9]*)")


def wire_hash(h: bytes, mode: HashMode = "int") -> int | bytes:
    """What vLLM sends for the digest ``h`` in ``mode``.

    ``"int"``: the last 8 bytes as unsigned 64-bit int (vLLM's default integer mode);
    ``"signed"``: the same 64 bits as a signed int64 (0.9.x builtin ``hash()`` style);
    ``"bytes"``: ``h`` unchanged (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, 0.10.2 →).
    """
    if mode == "bytes":
        return h
    value = int.from_bytes(h[-8:], "big")
    if mode == "int":
        return value
    if mode == "signed":
        return value - (1 << 64) if value >= 1 << 63 else value
    raise ValueError(f"unknown hash mode {mode!r}: expected one of {_HASH_MODES}")


def normal_hash(h: bytes, mode: HashMode = "int") -> bytes:
    """What ``decode_batch`` yields for ``wire_hash(h, mode)``."""
    if mode == "bytes":
        return h
    wire_hash(h, mode)  # validates the mode
    return int.from_bytes(h[-8:], "big").to_bytes(8, "big")


def _packb(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _array_header(n: int) -> bytes:
    if n <= 15:
        return bytes((0x90 | n,))
    if n <= 0xFFFF:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _map_header(pairs: int, struct_fields: int) -> bytes:
    """msgspec picks the header kind from the struct's field count (tag included)."""
    size = max(pairs, struct_fields)
    if size <= 15:
        return bytes((0x80 | pairs,))
    if size <= 0xFFFF:
        return b"\xde" + pairs.to_bytes(2, "big")
    return b"\xdf" + pairs.to_bytes(4, "big")


class _Layout:
    """One event type as one release writes it."""

    __slots__ = ("tag", "fields", "absent", "map_form", "packed_keys", "bridge_len", "known")

    def __init__(self, tag: str, all_fields: tuple[WireField, ...], release: Release) -> None:
        self.tag = tag
        self.fields = tuple(f for f in all_fields if f.since <= release)
        self.absent = tuple(f for f in all_fields if f.since > release)
        self.map_form = release.map_events
        self.packed_keys = tuple(_packb(f.name) for f in self.fields)
        self.bridge_len = 1 + len(all_fields)  # array positions the decoder knows
        self.known = frozenset(f.name for f in all_fields) | {"type"}


@lru_cache(maxsize=64)
def _layouts(release: Release) -> dict[type, _Layout]:
    return {
        BlockStored: _Layout("BlockStored", BLOCK_STORED_FIELDS, release),
        BlockRemoved: _Layout("BlockRemoved", BLOCK_REMOVED_FIELDS, release),
        AllBlocksCleared: _Layout("AllBlocksCleared", (), release),
    }


def _check_msgpack(raw: bytes, what: str) -> None:
    try:
        msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ValueError(f"{what} is not one msgpack value: {exc}") from None


def _positional_extra(extra: dict[str, bytes], first: int, what: str) -> list[bytes]:
    """Values of ``"#<pos>"`` extras, which must be positions first, first+1, ..."""
    positions = {}
    for name, raw in extra.items():
        m = _POS_RE.fullmatch(name) if isinstance(name, str) else None
        if m is None:
            raise ValueError(
                f"{what}: extra {name!r} cannot be written in array form "
                f"(array extras are named '#<position>')"
            )
        _check_msgpack(raw, f"{what}: extra {name!r}")
        positions[int(m[1])] = raw
    expected = list(range(first, first + len(positions)))
    if sorted(positions) != expected:
        raise ValueError(
            f"{what}: array extras must be contiguous positions starting at #{first}, "
            f"got {sorted(extra)}"
        )
    return [positions[p] for p in expected]


def _encode_event(
    ev: VllmEvent, release: Release, layouts: dict[type, _Layout], mode: HashMode, what: str
) -> bytes:
    if type(ev) is UnknownEvent:
        _check_msgpack(ev.raw, f"{what}: raw")
        return ev.raw
    layout = layouts.get(type(ev))
    if layout is None:
        raise TypeError(f"{what}: not a vLLM event: {type(ev).__name__}")
    what = f"{what} ({layout.tag})"
    for f in layout.absent:
        if getattr(ev, f.name) is not None:
            raise ValueError(
                f"{what}: field {f.name!r} is not sent by vLLM {release} "
                f"(first in {f.since}); it must be None"
            )
    values: list[Any] = []
    for f in layout.fields:
        v = getattr(ev, f.name)
        if f.name in _HASH_FIELDS and v is not None:
            if f.name == "block_hashes":
                v = [wire_hash(_as_hash(h, what), mode) for h in v]
            else:
                v = wire_hash(_as_hash(v, what), mode)
        values.append(v)
    try:
        if layout.map_form:
            return _map_event(layout, values, ev.extra, what)
        return _array_event(layout, values, ev.extra, what)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"{what}: cannot encode: {exc}") from None


def _as_hash(h: Any, what: str) -> bytes:
    if not isinstance(h, bytes):
        raise ValueError(f"{what}: hashes must be bytes (normal form), got {type(h).__name__}")
    return h


def _array_event(layout: _Layout, values: list[Any], extra: dict[str, bytes], what: str) -> bytes:
    if not extra:
        return _packb([layout.tag, *values])
    tail = _positional_extra(extra, layout.bridge_len, what)
    pad = layout.bridge_len - 1 - len(values)  # fields newer than the release, as nil
    parts = [_array_header(layout.bridge_len + len(tail)), _packb(layout.tag)]
    parts.extend(_packb(v) for v in values)
    parts.append(b"\xc0" * pad)
    parts.extend(tail)
    return b"".join(parts)


def _map_event(layout: _Layout, values: list[Any], extra: dict[str, bytes], what: str) -> bytes:
    body = [b"\xa4type", _packb(layout.tag)]
    pairs = 1
    for f, key, v in zip(layout.fields, layout.packed_keys, values, strict=True):
        if v is None and f.has_default:
            continue
        body.append(key)
        body.append(_packb(v))
        pairs += 1
    for name, raw in extra.items():
        if not isinstance(name, str) or name in layout.known:
            raise ValueError(
                f"{what}: extra {name!r} must be a str and not clash with a known field name"
            )
        _check_msgpack(raw, f"{what}: extra {name!r}")
        body.append(_packb(name))
        body.append(raw)
        pairs += 1
    return _map_header(pairs, 1 + len(layout.fields)) + b"".join(body)


def encode_batch(batch: EventBatch, release: Release | str, hash_mode: HashMode = "int") -> bytes:
    """The payload ``release``'s publisher would send for ``batch`` (hashes in ``hash_mode``).

    ValueError if the batch cannot come from that release: a field the release
    does not have is set, byte hashes before 0.10.2, a dp_rank in 0.9.0, or
    ``extra`` entries that cannot be written back in that release's form.
    """
    rel = as_release(release)
    if hash_mode not in _HASH_MODES:
        raise ValueError(f"unknown hash mode {hash_mode!r}: expected one of {_HASH_MODES}")
    if hash_mode == "bytes" and not rel.supports_bytes_hashes:
        raise ValueError(
            f"vLLM {rel} cannot send byte hashes (first in 0.10.2); use hash_mode 'int' or 'signed'"
        )
    layouts = _layouts(rel)

    parts: list[bytes] = []
    if rel.has_dp_rank:
        tail = _positional_extra(batch.extra, 3, "envelope") if batch.extra else []
        parts.append(_array_header(3 + len(tail)))
    else:
        if batch.dp_rank is not None:
            raise ValueError(f"vLLM {rel} sends no data_parallel_rank (first in 0.9.1)")
        if batch.extra:
            raise ValueError(f"vLLM {rel} has a 2-element envelope: no room for envelope extras")
        tail = []
        parts.append(b"\x92")
    parts.append(_packb(float(batch.ts)))
    parts.append(_array_header(len(batch.events)))
    for i, ev in enumerate(batch.events):
        parts.append(_encode_event(ev, rel, layouts, hash_mode, f"event {i}"))
    if rel.has_dp_rank:
        dp_rank = 0 if batch.dp_rank is None else batch.dp_rank
        if type(dp_rank) is not int or not -(1 << 63) <= dp_rank < 1 << 64:
            raise ValueError(f"envelope: dp_rank must be a 64-bit int or None, got {dp_rank!r}")
        parts.append(_packb(dp_rank))
        parts.extend(tail)
    return b"".join(parts)
