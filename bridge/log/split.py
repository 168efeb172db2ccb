"""Splitting a BlockStored too large for one Kafka record into parts, and joining them (pure).

A part is a BlockStored of its own over contiguous blocks ``a..b-1`` of the event: its
``parent_block_hash`` is block ``a-1`` (the event's parent for the first part), its token ids
are those of its blocks (``block_size`` per block; the last part takes any remainder, so the
parts' token ids concatenate to the event's even when vLLM sent an irregular count), and its
per-block lists (``extra_keys``, ``lookahead_token_ids``) are sliced alike when they have one
entry per block (otherwise the first part carries them whole). Every other field is copied.
So a consumer that applies parts one by one, as independent BlockStored events, ends with the
same state as one applying the event, and :func:`join_parts` gives the event back exactly.

Records of parts share the event's (pod, dp_rank, epoch, seq, index) and carry ``part`` and
``parts`` in their envelope (:class:`bridge.log.records.Envelope`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from bridge.log.records import Record
from bridge.vllm.events import BlockStored

__all__ = ["PartJoiner", "fit_parts", "join_parts", "split_stored"]


def _bounds(n_blocks: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous, non-empty block ranges covering ``0..n_blocks-1``, sizes within one."""
    q, r = divmod(n_blocks, n)
    out, a = [], 0
    for i in range(n):
        b = a + q + (1 if i < r else 0)
        out.append((a, b))
        a = b
    return out


def _per_block(values: list[Any] | None, n_blocks: int, a: int, b: int, first: bool) -> Any:
    if values is None:
        return None
    if len(values) == n_blocks:
        return values[a:b]
    return values if first else None  # not one per block: kept whole, in the first part


def split_stored(event: BlockStored, n: int) -> list[BlockStored]:
    """``event`` as ``n`` parts (1 <= n <= number of blocks) of contiguous blocks."""
    hashes = event.block_hashes
    if not 1 <= n <= max(1, len(hashes)):
        raise ValueError(f"cannot split {len(hashes)} blocks into {n} parts")
    if n == 1:
        return [event]
    bs, tokens = event.block_size, event.token_ids
    bounds = _bounds(len(hashes), n)
    parts = []
    for i, (a, b) in enumerate(bounds):
        first, last = i == 0, i == n - 1
        lo = min(a * bs, len(tokens))
        hi = len(tokens) if last else min(b * bs, len(tokens))
        parts.append(
            replace(
                event,
                block_hashes=hashes[a:b],
                parent_block_hash=event.parent_block_hash if first else hashes[a - 1],
                token_ids=tokens[lo:hi],
                extra_keys=_per_block(event.extra_keys, len(hashes), a, b, first),
                lookahead_token_ids=_per_block(event.lookahead_token_ids, len(hashes), a, b, first),
            )
        )
    return parts


def fit_parts(
    event: BlockStored, size_of: Callable[[BlockStored], int], limit: int
) -> list[BlockStored] | None:
    """The fewest even parts of ``event`` whose ``size_of`` (encoded record size) is at most
    ``limit`` each, or None when even one block alone is over it (cannot be split)."""
    total = size_of(event)
    if total <= limit:
        return [event]
    n_blocks = len(event.block_hashes)
    if n_blocks < 2:
        return None
    n = min(n_blocks, -(-total // limit))  # a lower bound: the parts repeat the fixed fields
    while True:
        parts = split_stored(event, n)
        sizes = [size_of(p) for p in parts]
        worst = max(sizes)
        if worst <= limit:
            return parts
        if n == n_blocks:
            return None
        n = min(n_blocks, max(n + 1, -(-n * worst // limit)))


def _concat(values: Sequence[list[Any] | None]) -> list[Any] | None:
    if all(v is None for v in values):
        return None
    out: list[Any] = []
    for v in values:
        if v is not None:
            out.extend(v)
    return out


def join_parts(parts: Sequence[BlockStored]) -> BlockStored:
    """The event the parts were split from (:func:`split_stored` undone)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return replace(
        first,
        block_hashes=[h for p in parts for h in p.block_hashes],
        token_ids=[t for p in parts for t in p.token_ids],
        extra_keys=_concat([p.extra_keys for p in parts]),
        lookahead_token_ids=_concat([p.lookahead_token_ids for p in parts]),
    )


class PartJoiner:
    """Feed records in topic order; get each record back, a split event once, whole.

    :meth:`add` returns the record itself when it is not a part, None for a part that is not
    the last of its event, and for the last part a record of the joined event (envelope
    ``part=0, parts=1``). A part that does not continue the event being joined (a duplicate,
    or parts missing) is returned as it is, and ends any unfinished event of its stream.
    """

    def __init__(self) -> None:
        # (pod, dp_rank) -> ((epoch, seq, index), parts so far)
        self._open: dict[tuple[str, int], tuple[tuple[int, int, int], list[Record]]] = {}

    def add(self, record: Record) -> Record | None:
        env = record.envelope
        if env.parts <= 1:
            return record
        stream = (env.pod, env.dp_rank)
        ident = (env.epoch, env.seq, env.index)
        held = self._open.get(stream)
        if env.part == 0:
            self._open[stream] = (ident, [record])
            return None
        if held is None or held[0] != ident or len(held[1]) != env.part:
            self._open.pop(stream, None)
            return record
        got = held[1]
        got.append(record)
        if len(got) < env.parts:
            return None
        del self._open[stream]
        events = [r.event for r in got]
        if not all(isinstance(e, BlockStored) for e in events):
            return record
        whole = join_parts(events)  # type: ignore[arg-type]
        return Record(replace(got[0].envelope, part=0, parts=1), whole)
