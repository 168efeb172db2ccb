"""Decode a vLLM ``KVEventBatch`` msgpack payload into typed events (spec §4, §5).

Version-agnostic. The plain forms vLLM sends take a typed fast path
(:mod:`bridge.vllm.typed_decode`, one msgspec decode per payload); anything else, and
every malformed payload, takes the general path here: one schema-less
``msgpack.unpackb``, then cheap type checks. Both give the same result. Accepts
every release 0.9.0–0.34.0: a 2- or 3-element (or map) envelope, events as
positional arrays of any length or as maps. Integer hashes become their 8-byte
normal form, byte hashes stay as they are. Anything this bridge does not know is
kept as msgpack bytes (``extra``, ``UnknownEvent``).
Every malformed payload raises :class:`DecodeError`, and nothing else.

Values are checked against their domains here, so that every decoded batch can be
written as Avro (``schemas/kv_event.avsc``): an integer hash is a signed or unsigned
64-bit int, a byte hash is not empty; token ids, ``lora_id``, ``group_idx`` and
``kv_cache_spec_sliding_window`` are in ``0..2**63-1`` (Avro ``long``); ``block_size``
is in ``1..2**63-1``, or 0 for an offloading placeholder (no ``token_ids``, spec §8);
``data_parallel_rank`` is in ``0..2**31-1`` (Avro ``int``); ``ts`` is finite; every
``extra_keys`` entry can be re-encoded as msgpack. A value outside its domain is a
DecodeError that names the field and the value (``value out of range: ...``).
"""

from __future__ import annotations

from collections.abc import Callable
from math import isfinite
from typing import Any

import msgpack

from bridge.vllm.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
    VllmEvent,
)
from bridge.vllm.releases import BLOCK_REMOVED_FIELDS, BLOCK_STORED_FIELDS
from bridge.vllm.typed_decode import decode_typed

__all__ = ["DecodeError", "decode_batch", "decode_event"]

_MASK64 = (1 << 64) - 1
_HASH_MIN = -(1 << 63)  # int hashes: signed int64 (0.9.x builtin hash) or uint64
_LONG_MAX = (1 << 63) - 1  # Avro long
_INT_MAX = (1 << 31) - 1  # Avro int


class DecodeError(ValueError):
    """A payload that is not a valid vLLM KV-event batch; the message says what and where."""


class _Invalid(Exception):
    """Internal: a value with the wrong shape; the caller adds where it was."""


_KIND = {
    type(None): "nil",
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    bytes: "bin",
    list: "array",
    dict: "map",
}


def _kind(value: Any) -> str:
    t = type(value)
    return _KIND.get(t, t.__name__)


def _pack(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. nested too deeply
        raise _Invalid(f"cannot re-encode value: {exc}") from None


# --- field converters: return the typed value or raise _Invalid -------------------------


def _hash(v: Any) -> bytes:
    t = type(v)
    if t is int:
        if _HASH_MIN <= v <= _MASK64:
            return (v & _MASK64).to_bytes(8, "big")
        raise _Invalid(
            f"value out of range: hash {v} (an int hash is a signed or unsigned 64-bit int)"
        )
    if t is bytes and v:
        return v
    if t is bytes:
        raise _Invalid("value out of range: empty bin hash (a digest has at least one byte)")
    raise _Invalid(f"expected int or bin hash, got {_kind(v)}")


def _opt_hash(v: Any) -> bytes | None:
    return None if v is None else _hash(v)


def _hash_list(v: Any) -> list[bytes]:
    if type(v) is not list:
        raise _Invalid(f"expected array of hashes, got {_kind(v)}")
    try:
        return [_hash(h) for h in v]
    except _Invalid:
        for i, h in enumerate(v):
            try:
                _hash(h)
            except _Invalid as exc:
                raise _Invalid(f"element {i}: {exc}") from None
        raise  # unreachable: _hash is deterministic


def _out_of_range(v: int, low: int, high: int) -> _Invalid:
    if v < low:
        bound = f">= {low}"
    else:
        bound = "<= 2**31-1, an Avro int" if high == _INT_MAX else "<= 2**63-1, an Avro long"
    return _Invalid(f"value out of range: {v} (must be {bound})")


def _block_size(v: Any) -> int:
    """``1..2**63-1``; 0 passes here, :func:`_check_stored` allows it for placeholders only."""
    if type(v) is not int:
        raise _Invalid(f"expected int, got {_kind(v)}")
    if 0 <= v <= _LONG_MAX:
        return v
    raise _out_of_range(v, 1, _LONG_MAX)


def _opt_count(v: Any) -> int | None:
    """An optional id, index or size: nil or ``0..2**63-1``."""
    if v is None:
        return v
    if type(v) is not int:
        raise _Invalid(f"expected int or nil, got {_kind(v)}")
    if 0 <= v <= _LONG_MAX:
        return v
    raise _out_of_range(v, 0, _LONG_MAX)


def _opt_str(v: Any) -> str | None:
    if v is None or type(v) is str:
        return v
    raise _Invalid(f"expected str or nil, got {_kind(v)}")


def _check_tokens(v: list[Any]) -> None:
    """Every element an int in ``0..2**63-1``: one type pass, then min/max (C loops)."""
    if v and (list(map(type, v)).count(int) != len(v) or min(v) < 0 or max(v) > _LONG_MAX):
        for i, x in enumerate(v):
            if type(x) is not int:
                raise _Invalid(f"element {i}: expected int, got {_kind(x)}")
            if not 0 <= x <= _LONG_MAX:
                raise _Invalid(f"element {i}: {_out_of_range(x, 0, _LONG_MAX)}")


def _int_list(v: Any) -> list[int]:
    if type(v) is not list:
        raise _Invalid(f"expected array of int, got {_kind(v)}")
    _check_tokens(v)
    return v


def _extra_keys(v: Any) -> list[Any] | None:
    """Nil or an array of per-block values, each kept as msgpack: they must re-encode."""
    if v is None:
        return v
    if type(v) is not list:
        raise _Invalid(f"expected array or nil, got {_kind(v)}")
    if v.count(None) != len(v):  # GPU events without extra keys send [nil, ...]
        for i, k in enumerate(v):
            if k is not None:
                try:
                    _pack(k)
                except _Invalid as exc:
                    raise _Invalid(f"element {i}: {exc}") from None
    return v


def _opt_int_lists(v: Any) -> list[list[int]] | None:
    if v is None:
        return None
    if type(v) is not list:
        raise _Invalid(f"expected array of arrays of int, or nil, got {_kind(v)}")
    for i, inner in enumerate(v):
        try:
            _int_list(inner)
        except _Invalid as exc:
            raise _Invalid(f"element {i}: {exc}") from None
    return v


_Converter = Callable[[Any], Any]

_CONVERTERS: dict[str, _Converter] = {
    "block_hashes": _hash_list,
    "parent_block_hash": _opt_hash,
    "token_ids": _int_list,
    "block_size": _block_size,
    "lora_id": _opt_count,
    "medium": _opt_str,
    "lora_name": _opt_str,
    "extra_keys": _extra_keys,
    "group_idx": _opt_count,
    "kv_cache_spec_kind": _opt_str,
    "kv_cache_spec_sliding_window": _opt_count,
    "locality": _opt_str,
    "ownership": _opt_str,
    "session_id": _opt_str,
    "lookahead_token_ids": _opt_int_lists,
}


def _check_stored(ev: BlockStored) -> None:
    """``block_size`` 0 only for an offloading placeholder: one without token ids (spec §8)."""
    if ev.block_size == 0 and ev.token_ids:
        raise _Invalid(
            f"field 'block_size': value out of range: 0 with {len(ev.token_ids)} token_ids "
            "(must be >= 1; 0 only for an offloading placeholder, without token_ids)"
        )


class _Shape:
    """How to decode one known event type: field names/converters in array order."""

    __slots__ = (
        "cls",
        "names",
        "converters",
        "pairs",
        "required",
        "required_names",
        "known",
        "check",
    )

    def __init__(
        self,
        cls: type,
        names: tuple[str, ...],
        required: int,
        check: Callable[[Any], None] | None = None,
    ) -> None:
        self.cls = cls
        self.names = names
        self.converters = tuple(_CONVERTERS[n] for n in names)
        self.pairs = tuple(zip(names, self.converters, strict=True))
        self.required = required  # the first `required` fields must be present
        self.required_names = names[:required]
        self.known = frozenset(names) | {"type"}
        self.check = check  # constraints across fields, on the built event


_SHAPES: dict[str, _Shape] = {
    # Fields were only ever appended, so one positional table serves every release.
    "BlockStored": _Shape(
        BlockStored, tuple(f.name for f in BLOCK_STORED_FIELDS), 4, _check_stored
    ),
    "BlockRemoved": _Shape(BlockRemoved, tuple(f.name for f in BLOCK_REMOVED_FIELDS), 1),
    "AllBlocksCleared": _Shape(AllBlocksCleared, (), 0),
}


def _from_array(shape: _Shape, ev: list[Any]) -> VllmEvent:
    """Fast path: no unknown trailing elements and every value valid (else the exact error)."""
    if shape.required < len(ev) <= len(shape.names) + 1:
        try:
            values = [conv(v) for conv, v in zip(shape.converters, ev[1:], strict=False)]
        except _Invalid:
            pass
        else:
            return shape.cls(*values)
    return _from_array_checked(shape, ev)


def _from_array_checked(shape: _Shape, ev: list[Any]) -> VllmEvent:
    names = shape.names
    n = len(ev)
    if n - 1 < shape.required:
        raise _Invalid(f"missing required field {names[n - 1]!r} (array of {n} elements)")
    values = []
    for k in range(min(n - 1, len(names))):
        try:
            values.append(shape.converters[k](ev[k + 1]))
        except _Invalid as exc:
            raise _Invalid(f"field {names[k]!r}: {exc}") from None
    extra: dict[str, bytes] = {}
    for pos in range(len(names) + 1, n):
        try:
            extra[f"#{pos}"] = _pack(ev[pos])
        except _Invalid as exc:
            raise _Invalid(f"element {pos}: {exc}") from None
    return shape.cls(*values, extra=extra)


def _from_map(shape: _Shape, ev: dict[Any, Any]) -> VllmEvent:
    """Fast path: only known keys and every value valid (else the exact error)."""
    if ev.keys() <= shape.known:
        get = ev.get
        try:
            values = [conv(get(name)) for name, conv in shape.pairs]
        except _Invalid:
            pass
        else:
            for name in shape.required_names:
                if name not in ev:
                    raise _Invalid(f"missing required field {name!r}")
            return shape.cls(*values)
    return _from_map_checked(shape, ev)


def _from_map_checked(shape: _Shape, ev: dict[Any, Any]) -> VllmEvent:
    kwargs: dict[str, Any] = {}
    for k, (name, conv) in enumerate(zip(shape.names, shape.converters, strict=True)):
        if name in ev:
            try:
                kwargs[name] = conv(ev[name])
            except _Invalid as exc:
                raise _Invalid(f"field {name!r}: {exc}") from None
        elif k < shape.required:
            raise _Invalid(f"missing required field {name!r}")
    extra: dict[str, bytes] = {}
    if len(ev) > len(kwargs) + 1:
        for key, value in ev.items():
            if key in shape.known and type(key) is str:
                continue
            if type(key) is not str:
                raise _Invalid(f"map key must be str, got {_kind(key)}")
            try:
                extra[key] = _pack(value)
            except _Invalid as exc:
                raise _Invalid(f"field {key!r}: {exc}") from None
    return shape.cls(**kwargs, extra=extra)


def _tag_of(ev: Any) -> str | None:
    if type(ev) is list:
        tag = ev[0] if ev else None
    elif type(ev) is dict:
        tag = ev.get("type")
    else:
        return None
    return tag if type(tag) is str else None


def _event(ev: Any) -> VllmEvent:
    t = type(ev)
    if t is list:
        if not ev:
            raise _Invalid("empty array, expected a tagged event")
        tag = ev[0]
        if type(tag) is not str:
            raise _Invalid(f"event tag (element 0) must be str, got {_kind(tag)}")
        shape = _SHAPES.get(tag)
        if shape is None:
            return UnknownEvent(tag, _pack(ev))
        out = _from_array(shape, ev)
        if shape.check is not None:
            shape.check(out)
        return out
    if t is dict:
        if "type" not in ev:
            raise _Invalid("event map has no 'type' key")
        tag = ev["type"]
        if type(tag) is not str:
            raise _Invalid(f"event tag ('type') must be str, got {_kind(tag)}")
        shape = _SHAPES.get(tag)
        if shape is None:
            return UnknownEvent(tag, _pack(ev))
        out = _from_map(shape, ev)
        if shape.check is not None:
            shape.check(out)
        return out
    raise _Invalid(f"expected an event array or map, got {_kind(ev)}")


def decode_event(obj: Any) -> VllmEvent:
    """Typed event from one already-unpacked msgpack event (array or map form)."""
    try:
        return _event(obj)
    except _Invalid as exc:
        tag = _tag_of(obj)
        raise DecodeError(f"{tag}: {exc}" if tag else str(exc)) from None


def _ts(v: Any) -> float:
    t = type(v)
    if t is float:
        if isfinite(v):
            return v
        raise DecodeError(f"envelope: field 'ts': value out of range: {v} (must be finite)")
    if t is int:
        return float(v)  # msgpack ints (< 2**64) are finite floats
    raise DecodeError(f"envelope: field 'ts': expected a number, got {_kind(v)}")


def _dp_rank(v: Any) -> int | None:
    if v is None:
        return v
    if type(v) is not int:
        raise DecodeError(
            f"envelope: field 'data_parallel_rank': expected int or nil, got {_kind(v)}"
        )
    if 0 <= v <= _INT_MAX:
        return v
    raise DecodeError(f"envelope: field 'data_parallel_rank': {_out_of_range(v, 0, _INT_MAX)}")


def _envelope_extra(name: str, value: Any) -> bytes:
    try:
        return _pack(value)
    except _Invalid as exc:
        raise DecodeError(f"envelope: {name}: {exc}") from None


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one PUB/replay payload; raises DecodeError (only) if it is malformed."""
    batch = decode_typed(payload)  # the plain forms, typed (None: anything else)
    if batch is not None:
        return batch
    return _decode_general(payload)


def _decode_general(payload: bytes) -> EventBatch:
    """Every form, the exact error: one schema-less unpack, then the checks below."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises ValueError subclasses, TypeError, ...
        detail = str(exc) or type(exc).__name__
        raise DecodeError(f"not a single valid msgpack value: {detail}") from None

    extra: dict[str, bytes] = {}
    t = type(obj)
    if t is list:
        n = len(obj)
        if n < 2:
            raise DecodeError(
                f"envelope: expected an array [ts, events, data_parallel_rank], got {n} element(s)"
            )
        ts, events = obj[0], obj[1]
        dp_rank = _dp_rank(obj[2]) if n > 2 else None
        for i in range(3, n):
            extra[f"#{i}"] = _envelope_extra(f"element {i}", obj[i])
    elif t is dict:
        if "ts" not in obj or "events" not in obj:
            raise DecodeError("envelope: map without 'ts' and 'events'")
        ts, events = obj["ts"], obj["events"]
        dp_rank = _dp_rank(obj.get("data_parallel_rank"))
        for key, value in obj.items():
            if type(key) is not str:
                raise DecodeError(f"envelope: map key must be str, got {_kind(key)}")
            if key not in ("ts", "events", "data_parallel_rank"):
                extra[key] = _envelope_extra(f"field {key!r}", value)
    else:
        raise DecodeError(f"envelope: expected an array [ts, events, ...], got {_kind(obj)}")

    ts = _ts(ts)
    if type(events) is not list:
        raise DecodeError(f"envelope: field 'events': expected array, got {_kind(events)}")
    try:
        out = [_event(ev) for ev in events]
    except _Invalid:
        for i, ev in enumerate(events):  # find which event, for the message
            try:
                _event(ev)
            except _Invalid as exc:
                tag = _tag_of(ev)
                where = f"event {i} ({tag})" if tag else f"event {i}"
                raise DecodeError(f"{where}: {exc}") from None
        raise  # unreachable: decoding is deterministic
    return EventBatch(ts=ts, events=out, dp_rank=dp_rank, extra=extra)
