"""JSON rendering of events, shared by `kvbridge consume`, the simulator's sent-log and tests.

Hashes are ``0x`` and lowercase hex (:func:`bridge.vllm.events.hash_text`, the form every hash
reader accepts); other bytes are lowercase hex strings. Arbitrary msgpack values (the
per-block ``extra_keys``) become JSON with bytes as ``{"$bytes": "<hex>"}``.
Unknown fields (``extra``) stay hex of their msgpack encoding.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from bridge.vllm.events import (
    REMAINING_COPY_COUNTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    UnknownEvent,
    VllmEvent,
    copy_counts,
    hash_text,
)

_HASH_FIELDS = ("block_hashes", "parent_block_hash")


def value_to_json(value: Any) -> Any:
    """Render a decoded msgpack value as JSON-compatible data."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$bytes": bytes(value).hex()}
    if isinstance(value, list | tuple):
        return [value_to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): value_to_json(v) for k, v in value.items()}
    return value


def event_to_json(event: VllmEvent) -> dict[str, Any]:
    """Every field of a typed event, tagged with ``"type"``; hashes as hex."""
    out: dict[str, Any] = {"type": type(event).__name__}
    if isinstance(event, UnknownEvent):
        out["tag"] = event.tag
        out["raw"] = event.raw.hex()
        return out
    counts = copy_counts(event) if isinstance(event, BlockRemoved) else None
    for f in fields(event):
        v = getattr(event, f.name)
        if f.name == "remaining_copy_counts":
            # One form whether it came typed (from Avro) or as vLLM's unknown field.
            out[f.name] = counts
            continue
        if f.name == "extra" and counts is not None and REMAINING_COPY_COUNTS in v:
            v = {k: b for k, b in v.items() if k != REMAINING_COPY_COUNTS}
        if f.name == "block_hashes":
            out[f.name] = [hash_text(h) for h in v]
        elif f.name == "parent_block_hash":
            out[f.name] = None if v is None else hash_text(v)
        elif f.name == "extra":
            out[f.name] = {k: b.hex() for k, b in v.items()}
        elif f.name == "extra_keys":
            out[f.name] = value_to_json(v)
        else:
            out[f.name] = v
    return out


EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
