"""Typed KV-cache events, shared by the decoder, the simulator, Avro and the consumers.

Block hashes are always ``bytes`` here, in the bridge's lossless normal form:
an integer hash ``h`` from the wire becomes ``(h % 2**64).to_bytes(8, "big")``,
a digest stays its raw bytes. ``key64(h)`` then equals the integer vLLM itself
sends in its default integer-hash mode.

``extra`` holds fields this bridge does not know (keys of a newer vLLM, or array
elements past the last known position, named ``"#<position>"``), each value
msgpack-encoded, so nothing vLLM sends is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack


def hash_from_int(value: int) -> bytes:
    """Normal form of an integer hash (signed int64 or uint64): 8 bytes, unsigned BE."""
    return (value % (1 << 64)).to_bytes(8, "big")


def hash_text(block_hash: bytes) -> str:
    """The one textual form of a hash, printed everywhere one is shown: ``0x`` and the
    lowercase hex of its normal form (16 digits for vLLM's integer hashes)."""
    return "0x" + block_hash.hex()


def parse_hash_text(text: str) -> int:
    """A hash as text -> vLLM's 64-bit key: :func:`hash_text`'s form (``0x`` and the hex of a
    key or of a digest, whose key is its last 8 bytes), or a decimal key (signed or unsigned,
    as vLLM sends them). ValueError with what to write instead."""
    t = text.strip()
    if t[:2].lower() == "0x":
        digits = t[2:]
        if not digits or len(digits) > 128:
            raise ValueError(f"{text!r} is not a block hash")
        raw = bytes.fromhex(
            digits.rjust(16, "0")
            if len(digits) <= 16
            else digits.rjust(len(digits) + len(digits) % 2, "0")
        )
        return int.from_bytes(raw[-8:], "big")
    try:
        n = int(t, 10)
    except ValueError:
        hint = ""
        if t and all(c in "0123456789abcdefABCDEF" for c in t):
            hint = f" (hex is written with 0x: 0x{t})"
        raise ValueError(f"{text!r} is not a block hash{hint}") from None
    if not -(1 << 63) <= n < (1 << 64):
        raise ValueError(f"{text!r} is out of the 64-bit range")
    return n % (1 << 64)


def key64(block_hash: bytes) -> int:
    """The 64-bit key vLLM sends in integer mode: the last 8 bytes, unsigned big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # One entry per block: that block's extra hash inputs (a msgpack value) or None.
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None
    extra: dict[str, bytes] = field(default_factory=dict)


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    # Per hash, the copies of it the engine still holds after this remove (vllm#48933, an
    # open PR: no release sends it yet). Not a field of the Avro schema: it travels in
    # ``extra`` under its vLLM name, as any field unknown to the schema, and
    # :mod:`bridge.log.records` lifts it here when the value is a list of ints.
    remaining_copy_counts: list[int] | None = None
    extra: dict[str, bytes] = field(default_factory=dict)


REMAINING_COPY_COUNTS = "remaining_copy_counts"


def copy_counts(event: BlockRemoved) -> list[int] | None:
    """``remaining_copy_counts`` of a remove: the typed field, else the preserved unknown
    field of that name (msgpack), if it is a list of non-negative ints, one per hash."""
    if event.remaining_copy_counts is not None:
        return event.remaining_copy_counts
    raw = event.extra.get(REMAINING_COPY_COUNTS)
    return None if raw is None else parse_copy_counts(raw, len(event.block_hashes))


def parse_copy_counts(raw: bytes, n_hashes: int) -> list[int] | None:
    """The msgpack ``remaining_copy_counts`` value, or None if it is not one count per hash."""
    try:
        value = msgpack.unpackb(raw)
    except Exception:  # malformed msgpack: leave it an unknown field
        return None
    if (
        isinstance(value, list)
        and len(value) == n_hashes
        and all(type(v) is int and v >= 0 for v in value)
    ):
        return value
    return None


@dataclass(slots=True)
class AllBlocksCleared:
    extra: dict[str, bytes] = field(default_factory=dict)


@dataclass(slots=True)
class UnknownEvent:
    """An event whose tag this bridge does not know; kept whole as msgpack bytes."""

    tag: str
    raw: bytes


VllmEvent = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


@dataclass(slots=True)
class EventBatch:
    """One vLLM ``KVEventBatch``: what one PUB message carries."""

    ts: float
    events: list[VllmEvent]
    dp_rank: int | None = None  # absent in vLLM 0.9.0 (2-element envelope)
    extra: dict[str, bytes] = field(default_factory=dict)
