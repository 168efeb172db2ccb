"""Content keys: a block's identity computed by kvbridge from what the block holds (pure).

A router knows a prompt's token ids, not vLLM's block hashes (whose algorithm, NONE_HASH
seed and CBOR layout change between releases and settings). kvbridge therefore names every
stored block by its *content*: a 16-byte BLAKE2b chain over

* a root per (model, LoRA, block size): two pods of different models, adapters or block
  sizes never share a key;
* per block, the parent's content key, the block's token ids (4-byte little-endian each,
  whatever the host) and its *extra* inputs: what vLLM puts in the block's ``extra_keys``
  besides the LoRA name (which the root carries) -- multimodal ``(identifier, offset in the
  block)`` pairs, the cache salt (first block only), prompt-embedding digests -- msgpack
  encoded, empty when there are none.

vLLM computes a block's extra keys as ``lora_name + mm pairs + cache_salt + embeds digests``
(``generate_block_hash_extra_keys`` in ``vllm/v1/core/kv_cache_utils.py``); an mm input
``(identifier, offset, length)`` of the prompt is listed in every block ``[start, end)``
with ``start < offset + length`` and ``end > offset``, as ``(identifier, offset - start)``.
:func:`query_extras` builds the same for a prompt, so keys computed from a query equal the
keys computed from the events of the engine that cached that prompt.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b
from typing import Any

import msgpack

KEY_BYTES = 16
_ROOT_TAG = b"kvbridge-content-v1\0"
_SWAP = sys.byteorder != "little"
MAX_TOKEN_ID = (1 << 32) - 1
KEY_HASH = blake2b(digest_size=KEY_BYTES)  # copied per key: cheaper than a new blake2b(...)


def root_key(model: str, lora: str | int | None, block_size: int) -> bytes:
    """The parent key of a sequence's first block, for one (model, LoRA, block size)."""
    raw = msgpack.packb([model, lora, block_size], use_bin_type=True)
    return blake2b(_ROOT_TAG + raw, digest_size=KEY_BYTES).digest()


def pack_tokens(token_ids: Sequence[int]) -> bytes | None:
    """Token ids as 4-byte little-endian unsigned ints; None if one is outside 0..2**32-1."""
    try:
        a = array("I", token_ids)
    except (OverflowError, TypeError):
        return None
    if a.itemsize != 4:  # pragma: no cover (every platform Python supports has 4-byte I)
        a = array("L", token_ids)
    if _SWAP:  # pragma: no cover (big-endian hosts)
        a.byteswap()
    return a.tobytes()


def lora_of(lora_name: str | None, lora_id: int | None) -> str | int | None:
    """The LoRA part of the root: the adapter's name (0.14+), else its id (older releases)."""
    return lora_name if lora_name is not None else lora_id


def stored_extra(entry: Any, lora_name: str | None) -> bytes:
    """The extra part of one block's key from its ``extra_keys`` entry (as decoded): the
    entry without its leading LoRA name (the root holds the LoRA), msgpack-encoded."""
    if entry is None:
        return b""
    if isinstance(entry, list | tuple):
        items = list(entry)
        if items and lora_name is not None and items[0] == lora_name:
            items = items[1:]
        return msgpack.packb(items, use_bin_type=True) if items else b""
    return msgpack.packb([entry], use_bin_type=True)


def query_extras(
    n_blocks: int,
    block_size: int,
    media: Sequence[tuple[str, int, int]] = (),
    cache_salt: str | None = None,
) -> list[bytes] | None:
    """Per block, the extra part of its key for a prompt with multimodal inputs ``media``
    (``(identifier, offset, length)`` in prompt tokens) and ``cache_salt``; None when every
    block has none (the common case: the caller skips the extras)."""
    if not media and not cache_salt:
        return None
    ordered = sorted(media, key=lambda m: m[1])
    out: list[bytes] = []
    for i in range(n_blocks):
        start, end = i * block_size, (i + 1) * block_size
        items: list[Any] = [
            [ident, off - start]
            for ident, off, length in ordered
            if start < off + length and end > off
        ]
        if i == 0 and cache_salt:
            items.append(cache_salt)
        out.append(msgpack.packb(items, use_bin_type=True) if items else b"")
    return out


def chain(
    parent: bytes, tokens: bytes, block_size: int, n_blocks: int, extras: Sequence[bytes] | None
) -> list[bytes]:
    """The content keys of ``n_blocks`` consecutive blocks after ``parent``, from their packed
    tokens (``4 * block_size`` bytes each)."""
    w = 4 * block_size
    out = []
    k = parent
    new_hash = KEY_HASH.copy  # blake2b(k + tokens + extra), fed in parts: the same digest
    for i in range(n_blocks):
        h = new_hash()
        h.update(k)
        h.update(tokens[i * w : i * w + w])
        if extras is not None:
            h.update(extras[i])
        k = h.digest()
        out.append(k)
    return out


def key_from_hex(text: Any) -> bytes | None:
    """A content key saved as hex (kv-state's ``"ck"``, snapshots); None unless it is exactly
    ``2 * KEY_BYTES`` hex digits."""
    if not isinstance(text, str) or len(text) != 2 * KEY_BYTES:
        return None
    try:
        k = bytes.fromhex(text)
    except ValueError:
        return None
    return k if len(k) == KEY_BYTES else None
