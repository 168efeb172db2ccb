"""Property: the hand-written encoder (bridge.log.avro, via RecordCodec.encode and
encode_batch) writes exactly fastavro's bytes for generated events of every type, edge values
included: 0, negatives where allowed, +-2**63 bounds, long token lists, ids past 2**27 (the
lane path's range) and past 2**32, lists with 0 ids, empty lists, None optionals, split parts."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.log.markers import EmptyBatch, EventsLost, PodRemoved, PublisherRestarted, StreamStarted
from bridge.log.records import Envelope, RecordCodec
from bridge.log.split import split_stored
from bridge.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, UnknownEvent

CODEC = RecordCodec()
LONG_MIN, LONG_MAX = -(1 << 63), (1 << 63) - 1
EDGE_IDS = [0, 1, 63, 64, 8191, 8192, (1 << 20) - 1, 1 << 20, (1 << 27) - 1, 1 << 27]
EDGE_IDS += [(1 << 32) - 1, 1 << 32, LONG_MAX, -1, -64, -65, LONG_MIN]

longs = st.one_of(
    st.sampled_from([0, 1, -1, 63, 64, -65, LONG_MIN, LONG_MAX]), st.integers(LONG_MIN, LONG_MAX)
)
opt_long = st.none() | longs
text = st.text(max_size=70)
opt_text = st.none() | st.sampled_from(["GPU", "cpu", ""]) | text
raw = st.binary(max_size=70)
token_id = st.one_of(
    st.integers(0, 150_000), st.sampled_from(EDGE_IDS), st.integers(LONG_MIN, LONG_MAX)
)
token_ids = st.one_of(
    st.lists(st.integers(0, 150_000), max_size=600),  # vocabulary ids: the lane path
    st.lists(st.sampled_from([0, 0, 5, 64, 150_000]), max_size=80),  # 0s among them
    st.lists(token_id, max_size=100),
)
hashes = st.one_of(
    st.lists(st.binary(min_size=8, max_size=8), max_size=40),
    st.lists(st.binary(min_size=32, max_size=32), max_size=40),
    st.lists(raw, max_size=5),
)
extra = st.dictionaries(text, raw, max_size=4)
extra_keys = st.none() | st.lists(
    st.none() | st.integers(-5, 2**64 - 1) | st.text(max_size=5) | st.lists(st.integers(0, 9)),
    max_size=40,
)


@st.composite
def stored(draw: Any) -> BlockStored:
    return BlockStored(
        block_hashes=draw(hashes),
        parent_block_hash=draw(st.none() | raw),
        token_ids=draw(token_ids),
        block_size=draw(st.sampled_from([16, 1, 0]) | longs),
        lora_id=draw(opt_long),
        medium=draw(opt_text),
        lora_name=draw(opt_text),
        extra_keys=draw(extra_keys),
        group_idx=draw(st.none() | st.sampled_from([0, 1]) | longs),
        kv_cache_spec_kind=draw(opt_text),
        kv_cache_spec_sliding_window=draw(opt_long),
        locality=draw(opt_text),
        ownership=draw(opt_text),
        session_id=draw(opt_text),
        lookahead_token_ids=draw(st.none() | st.lists(token_ids, max_size=3)),
        extra=draw(extra),
    )


removed = st.builds(
    BlockRemoved,
    hashes,
    medium=opt_text,
    group_idx=st.none() | st.sampled_from([0, 1]) | longs,
    locality=opt_text,
    ownership=opt_text,
    extra=extra,
)
events = st.one_of(
    stored(),
    removed,
    st.builds(AllBlocksCleared, extra=extra),
    st.builds(UnknownEvent, text, raw),
    st.builds(StreamStarted, longs, text),
    st.builds(PublisherRestarted, longs, opt_long, longs),
    st.builds(EventsLost, longs, longs, text),
    st.builds(PodRemoved, text),
    st.just(EmptyBatch()),
)
envelopes = st.builds(
    Envelope,
    pod=text,
    model=text,
    dp_rank=st.integers(-(1 << 31), (1 << 31) - 1),
    epoch=longs,
    seq=longs,
    index=st.integers(-1, 5000),
    ts=st.floats(allow_nan=False),
    batch_extra=extra,
)


@settings(max_examples=400, deadline=None)
@given(envelopes, events)
def test_encode_is_fastavros_bytes(env: Envelope, event: Any) -> None:
    assert CODEC.encode(env, event) == CODEC.encode_reference(env, event)


@settings(max_examples=200, deadline=None)
@given(envelopes, st.lists(st.one_of(stored(), removed, events), max_size=12))
def test_encode_batch_is_fastavros_bytes(env: Envelope, batch: list[Any]) -> None:
    values = CODEC.encode_batch(
        env.pod, env.model, env.dp_rank, env.epoch, env.seq, env.ts, env.batch_extra, batch
    )
    assert len(values) == len(batch)
    for i, (value, event) in enumerate(zip(values, batch, strict=True)):
        e = Envelope(
            env.pod, env.model, env.dp_rank, env.epoch, env.seq, i, env.ts, env.batch_extra
        )
        assert value == CODEC.encode_reference(e, event)


@settings(max_examples=100, deadline=None)
@given(envelopes, stored(), st.integers(2, 5))
def test_split_parts_encode_like_fastavro(env: Envelope, event: BlockStored, n: int) -> None:
    if len(event.block_hashes) < n:
        return
    parts = split_stored(event, n)
    assert len(parts) == n
    for k, part in enumerate(parts):
        e = Envelope(env.pod, env.model, env.dp_rank, env.epoch, env.seq, env.index, env.ts)
        e.part, e.parts = k, n
        assert CODEC.encode(e, part) == CODEC.encode_reference(e, part)


def test_token_id_edges_one_by_one() -> None:
    """Every edge id alone, in pairs, and around 0s, against fastavro."""
    env = Envelope("p", "m", 0, 1, 2, 0, 1.0)
    lists = [[v] for v in EDGE_IDS] + [[a, b] for a in EDGE_IDS for b in EDGE_IDS]
    lists += [[0] * 3, [0, 5, 0], [5, 0], [0, 5], [7] * 1000 + [0] + [8] * 1000, []]
    lists += [list(range(70_000)), list(range(1 << 27, (1 << 27) + 50))]
    for ids in lists:
        event = BlockStored([b"\x01" * 8], None, ids, 16)
        assert CODEC.encode(env, event) == CODEC.encode_reference(env, event), ids[:4]
