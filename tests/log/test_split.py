"""The pure splitting of an oversized BlockStored into parts, and joining them back."""

from __future__ import annotations

import random

import pytest

from bridge.consume.state import CacheState
from bridge.log.records import Envelope, Record, RecordCodec
from bridge.log.split import PartJoiner, fit_parts, join_parts, split_stored
from bridge.vllm.events import BlockStored, hash_from_int


def _stored(n_blocks: int, bs: int = 16, **kw) -> BlockStored:
    rng = random.Random(n_blocks)
    return BlockStored(
        block_hashes=[hash_from_int(1000 + i) for i in range(n_blocks)],
        parent_block_hash=hash_from_int(999),
        token_ids=[rng.randrange(200_000) for _ in range(n_blocks * bs)],
        block_size=bs,
        medium="GPU",
        group_idx=0,
        **kw,
    )


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10])
def test_split_keeps_chain_tokens_and_fields(n: int) -> None:
    ev = _stored(10, extra_keys=[[i] for i in range(10)], extra={"x": b"\x01"})
    parts = split_stored(ev, n)
    assert len(parts) == n
    assert [h for p in parts for h in p.block_hashes] == ev.block_hashes
    parent = ev.parent_block_hash
    for p in parts:
        assert p.block_hashes  # no empty part
        assert p.parent_block_hash == parent  # the chain goes on across parts
        parent = p.block_hashes[-1]
        assert len(p.token_ids) == len(p.block_hashes) * ev.block_size
        assert p.extra_keys is not None and len(p.extra_keys) == len(p.block_hashes)
        assert (p.medium, p.group_idx, p.extra) == (ev.medium, ev.group_idx, ev.extra)
    assert join_parts(parts) == ev


def test_irregular_token_count_and_lists_survive_a_round_trip() -> None:
    ev = _stored(6, bs=4)
    ev.token_ids = ev.token_ids[:-3]  # vLLM may send fewer tokens than blocks * block_size
    ev.lookahead_token_ids = [[1, 2]]  # not one per block: kept whole in the first part
    parts = split_stored(ev, 4)
    assert parts[0].lookahead_token_ids == [[1, 2]]
    assert all(p.lookahead_token_ids is None for p in parts[1:])
    assert join_parts(parts) == ev


def test_split_refuses_more_parts_than_blocks() -> None:
    with pytest.raises(ValueError):
        split_stored(_stored(3), 4)


def _size(codec: RecordCodec):
    env = Envelope("pod-a", "m", 0, 1, 5, 0, 1.0)
    return lambda ev: len(codec.encode(env, ev))


def test_fit_parts_uses_the_fewest_parts_under_the_limit() -> None:
    codec = RecordCodec()
    size_of = _size(codec)
    ev = _stored(300, bs=16)
    whole = size_of(ev)
    limit = whole // 3
    parts = fit_parts(ev, size_of, limit)
    assert parts is not None and 3 < len(parts) <= 5
    assert all(size_of(p) <= limit for p in parts)
    assert join_parts(parts) == ev
    assert fit_parts(ev, size_of, whole) == [ev]  # fits: not split


def test_fit_parts_gives_up_on_one_block_too_large() -> None:
    size_of = _size(RecordCodec())
    ev = _stored(4, bs=5000)  # each block's tokens alone are ~15 KB
    assert fit_parts(ev, size_of, 8000) is None
    assert fit_parts(_stored(1, bs=5000), size_of, 8000) is None
    assert fit_parts(BlockStored([], None, list(range(9000)), 0), size_of, 8000) is None


def _records(ev: BlockStored, n: int, seq: int = 5) -> list[Record]:
    parts = split_stored(ev, n)
    return [
        Record(Envelope("pod-a", "m", 0, 1, seq, 0, 1.0, part=i, parts=n), p)
        for i, p in enumerate(parts)
    ]


def test_parts_round_trip_through_avro_and_join() -> None:
    codec = RecordCodec()
    ev = _stored(9)
    recs = [codec.decode(codec.encode(r.envelope, r.event)) for r in _records(ev, 3)]
    assert [(r.envelope.part, r.envelope.parts) for r in recs] == [(0, 3), (1, 3), (2, 3)]
    joiner = PartJoiner()
    out = [joiner.add(r) for r in recs]
    assert out[:2] == [None, None]
    assert out[2] is not None and out[2].event == ev
    assert (out[2].envelope.part, out[2].envelope.parts) == (0, 1)


def test_joiner_hands_back_parts_that_do_not_continue_an_event() -> None:
    ev = _stored(4)
    recs = _records(ev, 2)
    joiner = PartJoiner()
    assert joiner.add(recs[1]) is recs[1]  # no part 0 before it (read from an offset)
    assert joiner.add(recs[0]) is None
    assert joiner.add(recs[0]) is None  # part 0 again (a duplicate): starts over
    joined = joiner.add(recs[1])
    assert joined is not None and joined.event == ev
    assert joiner.add(recs[1]) is recs[1]  # a duplicate last part


def test_cache_state_applies_parts_as_one_event_and_skips_duplicate_parts() -> None:
    ev = _stored(8)
    whole, split = CacheState(), CacheState()
    whole.apply(Record(Envelope("pod-a", "m", 0, 1, 5, 0, 1.0), ev))
    recs = _records(ev, 4)
    for r in recs + recs:  # at-least-once: the batch written twice
        split.apply(r)
    assert split.resident("pod-a", 0) == whole.resident("pod-a", 0)
    assert split.duplicates == 4
    assert split.applied == 4
