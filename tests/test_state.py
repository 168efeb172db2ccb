"""Cache-state rebuild: idempotent stores, tolerant removes, clears and markers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.events import AllBlocksCleared, BlockRemoved, BlockStored
from bridge.markers import EventsLost, PodRemoved, PublisherRestarted, StreamStarted
from bridge.records import Envelope, Record
from bridge.state import CacheState


def rec(event, pod="p", rank=0, seq=0, index=0, epoch=1):
    return Record(Envelope(pod, "m", rank, epoch, seq, index, 0.0), event)


H = [bytes([i]) * 8 for i in range(6)]


def test_store_remove_clear_and_markers():
    s = CacheState()
    s.apply(rec(StreamStarted(0, "tcp://x"), index=-1))
    s.apply(rec(BlockStored([H[0], H[1]], None, [], 16, medium="GPU", group_idx=0)))
    s.apply(rec(BlockStored([H[1]], H[0], [], 16, medium="GPU", group_idx=0)))  # duplicate store
    s.apply(rec(BlockStored([H[2]], None, [], 16, medium="CPU")))
    s.apply(rec(BlockRemoved([H[5]], medium="GPU", group_idx=0)))  # unknown hash: no-op
    assert s.resident("p", 0) == {("GPU", 0): {H[0], H[1]}, ("CPU", None): {H[2]}}
    assert s.streams[("p", 0)].tiers[("GPU", 0)][H[1]] == H[0]
    s.apply(rec(BlockRemoved([H[0]], medium="CPU")))  # other tier: no-op
    assert s.resident("p", 0)[("GPU", 0)] == {H[0], H[1]}
    s.apply(rec(EventsLost(3, 5, "test"), index=-1))
    assert s.summary()["streams"][0]["uncertain"] is True
    s.apply(rec(AllBlocksCleared()))
    assert s.resident("p", 0) == {}
    s.apply(rec(BlockStored([H[3]], None, [], 16), rank=1))
    s.apply(rec(PublisherRestarted(1, 9, 0), rank=1, index=-1, epoch=2))
    assert s.resident("p", 1) == {}
    s.apply(rec(BlockStored([H[3]], None, [], 16), rank=1, epoch=2))
    s.apply(rec(PodRemoved("gone"), index=-1))
    assert s.streams == {}


ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "clear", "restart"]),
        st.integers(0, 1),  # rank
        st.sampled_from(["GPU", "CPU"]),
        st.lists(st.sampled_from(H), min_size=1, max_size=3),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_matches_brute_force_sets(sequence):
    s = CacheState()
    ref: dict[tuple[int, str], set[bytes]] = {}
    for op, rank, medium, hs in sequence:
        if op == "store":
            s.apply(rec(BlockStored(hs, None, [], 16, medium=medium), rank=rank))
            ref.setdefault((rank, medium), set()).update(hs)
        elif op == "remove":
            s.apply(rec(BlockRemoved(hs, medium=medium), rank=rank))
            ref.setdefault((rank, medium), set()).difference_update(hs)
        elif op == "clear":
            s.apply(rec(AllBlocksCleared(), rank=rank))
            for k in ref:
                if k[0] == rank:
                    ref[k] = set()
        else:
            s.apply(rec(PublisherRestarted(1, 3, 0), rank=rank, index=-1))
            for k in ref:
                if k[0] == rank:
                    ref[k] = set()
    for rank in (0, 1):
        want = {(m, None): v for (r, m), v in ref.items() if r == rank and v}
        assert s.resident("p", rank) == want


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(range(6)), max_size=6),
    st.lists(st.sampled_from(range(6)), max_size=8),
)
def test_prefix_match_is_the_longest_resident_prefix(stored, query):
    s = CacheState()
    digests = [bytes(24) + bytes([i]) * 8 for i in range(6)]  # 32-byte digests
    s.apply(rec(BlockStored([digests[i] for i in stored], None, [], 16, medium="GPU")))
    s.apply(rec(BlockStored([H[5]], None, [], 16, medium="CPU"), rank=1))
    keys = [int.from_bytes(bytes([i]) * 8, "big") for i in query]
    want = 0
    for i in query:
        if i not in stored:
            break
        want += 1
    got = s.prefix_match(keys)
    assert got[("p", 0)] == want
    assert s.prefix_match(keys, medium="CPU")[("p", 0)] == 0


def test_query_parsing_accepts_vllm_keys_and_digests():
    from bridge.cli import parse_query
    from bridge.config import ConfigError

    digest = "0x" + "ab" * 24 + "0102030405060708"
    assert parse_query(f"5, 0x10, {digest}, -1") == [5, 16, 0x0102030405060708, 2**64 - 1]
    with pytest.raises(ConfigError, match="not a block hash"):
        parse_query("5,zz")
