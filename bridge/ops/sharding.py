"""Splitting one fleet across bridge replicas by rendezvous (highest-random-weight) hashing.

Every replica scores each (pod, shard) pair with the same hash and keeps the pods whose best
shard is its own: no coordination, no overlap, every pod owned exactly once. Growing the count
from n to n+1 moves only the pods whose new best shard is n: about 1/(n+1) of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def _score(pod: str, shard: int) -> int:
    h = hashlib.blake2b(f"{shard}\x00{pod}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def shard_of(pod: str, count: int) -> int:
    """The shard (0..count-1) that owns ``pod``."""
    if count < 1:
        raise ValueError(f"shard count must be >= 1, got {count}")
    if count == 1:
        return 0
    return max(range(count), key=lambda s: _score(pod, s))


def owned(pods: Iterable[str], index: int, count: int) -> list[str]:
    """The names among ``pods`` that shard ``index`` of ``count`` owns."""
    return [p for p in pods if shard_of(p, count) == index]
