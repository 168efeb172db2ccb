"""The decoder's fast path: one typed msgspec decode of a whole batch (spec §4, §5).

:func:`decode_typed` returns the :class:`EventBatch` that the general decoder
(:mod:`bridge.vllm.decoder`) would return, or None when the payload is anything but
the plain forms vLLM sends: an envelope ``[ts, events]`` or ``[ts, events, rank]``
whose events are all arrays (≤ 0.23) or all maps (≥ 0.24) of known types, with no
unknown field, every value in its domain. None means "ask the general decoder", which
then gives the result or the exact error; so the fast path never decides an error
itself, it only accepts what the general path accepts, with the same result
(``tests/vllm/test_decoder_fast_path.py`` checks this on generated and hostile batches).

The domains are the general decoder's, written as msgspec constraints: int hashes are
any msgpack int (exactly the signed/unsigned 64-bit range), byte hashes are not empty,
token ids and counts are ``0..2**63-1``, ``data_parallel_rank`` is ``0..2**31-1``;
bools never pass as ints. What cannot be said as a type (a finite ``ts``, block size 0
only without token ids) is checked on the result, and also falls back.
``extra_keys`` entries are accepted here only as nil or an array of scalars (what
re-encodes as msgpack as it is); anything else takes the general path.
"""

from __future__ import annotations

from math import isfinite
from typing import Annotated

import msgspec

from bridge.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, VllmEvent

__all__ = ["decode_typed"]

_MASK64 = (1 << 64) - 1

Hash = int | Annotated[bytes, msgspec.Meta(min_length=1)]
Long = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]
ExtraKey = list[None | bool | int | float | str] | None


# The fields of each event in vLLM's order (the array forms are positional; a release that
# sends fewer trailing fields gets their defaults), shared by both forms.
_STORED_FIELDS = [
    ("block_hashes", list[Hash]),
    ("parent_block_hash", Hash | None),
    ("token_ids", list[Long]),
    ("block_size", Long),
    ("lora_id", Long | None, None),
    ("medium", str | None, None),
    ("lora_name", str | None, None),
    ("extra_keys", list[ExtraKey] | None, None),
    ("group_idx", Long | None, None),
    ("kv_cache_spec_kind", str | None, None),
    ("kv_cache_spec_sliding_window", Long | None, None),
    ("locality", str | None, None),
    ("ownership", str | None, None),
    ("session_id", str | None, None),
    ("lookahead_token_ids", list[list[Long]] | None, None),
]
_REMOVED_FIELDS = [
    ("block_hashes", list[Hash]),
    ("medium", str | None, None),
    ("group_idx", Long | None, None),
    ("locality", str | None, None),
    ("ownership", str | None, None),
]


def _batch_type(form: str, **options: object) -> tuple[type, type, type]:
    """The batch Struct of one form (its events tagged by ``options``), and its stored and
    removed event types. gc=False: these hold no cycles and live only until converted;
    untracked, they do not count towards the collector's thresholds."""
    common = {"forbid_unknown_fields": True, "gc": False, "module": __name__}
    stored = msgspec.defstruct(
        f"_Stored{form}", _STORED_FIELDS, tag="BlockStored", **options, **common
    )
    removed = msgspec.defstruct(
        f"_Removed{form}", _REMOVED_FIELDS, tag="BlockRemoved", **options, **common
    )
    cleared = msgspec.defstruct(f"_Cleared{form}", [], tag="AllBlocksCleared", **options, **common)
    batch = msgspec.defstruct(
        f"_{form}Batch",
        [
            ("ts", float),
            ("events", list[stored | removed | cleared]),
            ("dp_rank", Rank | None, None),
        ],
        array_like=True,
        **common,
    )
    return batch, stored, removed


# vLLM <= 0.23: events are arrays, the tag is element 0; >= 0.24: maps, the tag under "type".
_ArrayBatch, _StoredA, _RemovedA = _batch_type("Array", array_like=True)
_MapBatch, _StoredM, _RemovedM = _batch_type("Map", tag_field="type")

_decode_arrays = msgspec.msgpack.Decoder(_ArrayBatch).decode
_decode_maps = msgspec.msgpack.Decoder(_MapBatch).decode
_STORED = (_StoredA, _StoredM)
_REMOVED = (_RemovedA, _RemovedM)


def _hashes(hashes: list[int | bytes]) -> list[bytes]:
    return [(h & _MASK64).to_bytes(8, "big") if type(h) is int else h for h in hashes]


def _events(typed: list[msgspec.Struct]) -> list[VllmEvent] | None:
    out: list[VllmEvent] = []
    append = out.append
    for ev in typed:
        if type(ev) in _REMOVED:
            hashes = ev.block_hashes
            if len(hashes) == 1 and type(h := hashes[0]) is int:
                hashes = [(h & _MASK64).to_bytes(8, "big")]
            else:
                hashes = _hashes(hashes)
            append(BlockRemoved(hashes, ev.medium, ev.group_idx, ev.locality, ev.ownership))
        elif type(ev) in _STORED:
            if ev.block_size == 0 and ev.token_ids:
                return None  # the general path says why
            parent = ev.parent_block_hash
            if type(parent) is int:
                parent = (parent & _MASK64).to_bytes(8, "big")
            append(
                BlockStored(
                    _hashes(ev.block_hashes),
                    parent,
                    ev.token_ids,
                    ev.block_size,
                    ev.lora_id,
                    ev.medium,
                    ev.lora_name,
                    ev.extra_keys,
                    ev.group_idx,
                    ev.kv_cache_spec_kind,
                    ev.kv_cache_spec_sliding_window,
                    ev.locality,
                    ev.ownership,
                    ev.session_id,
                    ev.lookahead_token_ids,
                )
            )
        else:
            append(AllBlocksCleared())
    return out


def _first_event_is_map(payload: bytes) -> bool:
    """Whether the first event of ``[float64 ts, events, ...]`` is a map (a cheap guess)."""
    # fixarray envelope, 0xcb float64 ts (what vLLM sends), then the events array header
    if len(payload) > 12 and payload[1] == 0xCB:
        head = payload[10]
        pos = 11 if head & 0xF0 == 0x90 else 13 if head == 0xDC else 15
        if pos < len(payload):
            first = payload[pos]
            return first & 0xF0 == 0x80 or first == 0xDE or first == 0xDF
    return False


def decode_typed(payload: bytes) -> EventBatch | None:
    """The batch, if ``payload`` is in a plain vLLM form; None: use the general decoder."""
    if _first_event_is_map(payload):
        first, second = _decode_maps, _decode_arrays
    else:
        first, second = _decode_arrays, _decode_maps
    try:
        batch = first(payload)
    except Exception:  # msgspec.ValidationError/DecodeError; TypeError for a non-buffer
        try:
            batch = second(payload)
        except Exception:
            return None
    ts = batch.ts
    if not isfinite(ts):
        return None
    events = _events(batch.events)
    if events is None:
        return None
    return EventBatch(ts, events, batch.dp_rank)
