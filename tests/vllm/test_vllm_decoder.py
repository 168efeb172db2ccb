"""bridge.vllm.decoder: every release's payload shape, errors, and robustness on any bytes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.vllm.decoder import DecodeError, decode_batch, decode_event
from bridge.vllm.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
    hash_from_int,
)

GOLDEN = {
    k: bytes.fromhex(v["hex"])
    for k, v in json.loads(
        (Path(__file__).parent.parent / "fixtures" / "vllm_golden.json").read_text()
    ).items()
    if not k.startswith("_")
}
D1 = hashlib.sha256(b"example-block-1").digest()
D2 = hashlib.sha256(b"example-block-2").digest()
TS = 1767225600.5
TOKENS = [9707, 11, 1879, 0]


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def stored_array(n: int) -> list[Any]:
    """A BlockStored array of n elements (tag included), values distinct per position."""
    values = [
        [1, -1, b"\x00" * 32],
        2**64 - 1,
        [5, 6, 7, 8],
        4,
        7,
        "GPU",
        "my-lora",
        [None, ["lora", 3]],
        1,
        "sliding_window",
        128,
        "REMOTE",
        "kvcr",
        "session-9",
        [[1, 2], [3]],
    ]
    return ["BlockStored", *values[: n - 1]]


# --- the spec's example payloads ------------------------------------------------------


def test_golden_0_9_0_signed_int_hashes() -> None:
    batch = decode_batch(GOLDEN["v0_9_0_signed"])
    assert batch == EventBatch(
        ts=TS,
        events=[
            BlockStored([D2[-8:]], D1[-8:], TOKENS, 4, lora_id=None),
            BlockRemoved([D1[-8:]]),
        ],
        dp_rank=None,
    )


@pytest.mark.parametrize("name", ["v0_23_0_uint", "v0_33_0_map"])
def test_golden_0_23_array_and_0_33_map_decode_identically(name: str) -> None:
    batch = decode_batch(GOLDEN[name])
    assert batch == EventBatch(
        ts=TS,
        events=[
            BlockStored(
                [D2[-8:]],
                D1[-8:],
                TOKENS,
                4,
                medium="GPU",
                extra_keys=[None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            BlockRemoved([D1[-8:]], medium="GPU", group_idx=0),
        ],
        dp_rank=0,
    )


def test_golden_0_33_byte_hashes_and_clear() -> None:
    batch = decode_batch(GOLDEN["v0_33_0_bytes"])
    assert batch.events == [
        BlockStored(
            [D2],
            None,
            TOKENS,
            4,
            medium="GPU",
            extra_keys=[None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        AllBlocksCleared(),
    ]
    assert batch.dp_rank == 0 and batch.extra == {}
    # zero-copy ZeroMQ frames hand over buffers, not bytes
    assert decode_batch(memoryview(GOLDEN["v0_33_0_bytes"])) == batch
    assert decode_batch(bytearray(GOLDEN["v0_33_0_bytes"])) == batch


# --- shapes of every release ----------------------------------------------------------


@pytest.mark.parametrize("n", [5, 6, 7, 8, 9, 10, 12, 16])
def test_block_stored_array_of_every_length(n: int) -> None:
    ev = decode_event(stored_array(n))
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [hash_from_int(1), b"\xff" * 8, b"\x00" * 32]
    assert ev.parent_block_hash == b"\xff" * 8
    assert ev.token_ids == [5, 6, 7, 8] and ev.block_size == 4
    full = decode_event(stored_array(16))
    names = [
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
    ]
    for pos, name in enumerate(names, start=5):
        expected = getattr(full, name) if pos < n else None
        assert getattr(ev, name) == expected, name
    assert full.lookahead_token_ids == [[1, 2], [3]]
    assert full.extra_keys == [None, ["lora", 3]]
    assert ev.extra == {}


def test_map_event_equals_array_event() -> None:
    names = [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
    ]
    arr = stored_array(16)
    as_map = {"type": "BlockStored", **dict(zip(names, arr[1:], strict=True))}
    assert decode_event(as_map) == decode_event(arr)
    # absent optional keys are None; key order does not matter
    small = {"token_ids": [1], "type": "BlockStored", "block_size": 1}
    small |= {"parent_block_hash": None, "block_hashes": [3]}
    assert decode_event(small) == BlockStored([hash_from_int(3)], None, [1], 1)


@pytest.mark.parametrize(
    "ev, expected",
    [
        (["BlockRemoved", [2**63]], BlockRemoved([hash_from_int(2**63)])),
        (["BlockRemoved", [5], "CPU"], BlockRemoved([hash_from_int(5)], medium="CPU")),
        (["BlockRemoved", [5], "GPU", 3], BlockRemoved([hash_from_int(5)], "GPU", 3)),
        (
            ["BlockRemoved", [5], "STORAGE", None, "LOCAL", "kvcr"],
            BlockRemoved([hash_from_int(5)], "STORAGE", None, "LOCAL", "kvcr"),
        ),
        (
            {"type": "BlockRemoved", "block_hashes": [b"ab"], "medium": None, "ownership": "o"},
            BlockRemoved([b"ab"], ownership="o"),
        ),
        (["AllBlocksCleared"], AllBlocksCleared()),
        ({"type": "AllBlocksCleared"}, AllBlocksCleared()),
    ],
)
def test_removed_and_cleared(ev: Any, expected: Any) -> None:
    assert decode_event(ev) == expected


@pytest.mark.parametrize(
    "value",
    [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
    + [-1, -32, -33, -128, -129, -(2**15), -(2**31) - 1, -(2**63)],
)
def test_int_hash_of_every_msgpack_width(value: int) -> None:
    payload = pack([TS, [["BlockRemoved", [value]]], 0])
    (ev,) = decode_batch(payload).events
    assert ev.block_hashes == [(value % 2**64).to_bytes(8, "big")]


def test_envelope_forms() -> None:
    events = [["AllBlocksCleared"]]
    assert decode_batch(pack([TS, events])).dp_rank is None
    assert decode_batch(pack([TS, events, None])).dp_rank is None
    assert decode_batch(pack([TS, events, 3])).dp_rank == 3
    assert decode_batch(pack([17, []])).ts == 17.0  # an int ts is a number too
    float32 = b"\x93\xca\x3f\xc0\x00\x00\x90\x00"  # [1.5 as float32, [], 0]
    assert decode_batch(float32) == EventBatch(1.5, [], 0)
    as_map = {"ts": TS, "events": events, "data_parallel_rank": 2, "future": [1, "x"]}
    batch = decode_batch(pack(as_map))
    assert batch == EventBatch(TS, [AllBlocksCleared()], 2, {"future": pack([1, "x"])})
    assert decode_batch(pack({"events": [], "ts": 1.0})).dp_rank is None


def test_extras_are_kept_as_msgpack() -> None:
    payload = pack(
        [
            TS,
            [
                [*stored_array(16), {"new": 1}, None],
                ["BlockRemoved", [1], "GPU", 0, None, None, "x"],
                ["AllBlocksCleared", 7],
                {"type": "BlockRemoved", "block_hashes": [], "medium": "GPU", "zz": b"\x01"},
                {"type": "AllBlocksCleared", "reason": "reset"},
            ],
            0,
            "four",
            [5],
        ]
    )
    batch = decode_batch(payload)
    assert batch.extra == {"#3": pack("four"), "#4": pack([5])}
    stored, removed, cleared, removed_map, cleared_map = batch.events
    assert stored.extra == {"#16": pack({"new": 1}), "#17": pack(None)}
    assert removed.extra == {"#6": pack("x")}
    assert cleared.extra == {"#1": pack(7)}
    assert removed_map.extra == {"zz": pack(b"\x01")}
    assert cleared_map.extra == {"reason": pack("reset")}


def test_unknown_tags_are_kept_whole() -> None:
    arr = ["BlockInactive", [1, 2], {"k": b"v"}]
    mp = {"type": "SomethingNew", "x": 1.5}
    batch = decode_batch(pack([TS, [arr, ["AllBlocksCleared"], mp], 0]))
    assert batch.events == [
        UnknownEvent("BlockInactive", pack(arr)),
        AllBlocksCleared(),
        UnknownEvent("SomethingNew", pack(mp)),
    ]


# --- errors ---------------------------------------------------------------------------

GOOD = stored_array(6)


def with_field(pos: int, value: Any) -> list[Any]:
    ev = list(GOOD)
    ev[pos] = value
    return ev


@pytest.mark.parametrize(
    "events, message",
    [
        ([with_field(4, "4")], "event 0 (BlockStored): field 'block_size': expected int, got str"),
        ([["AllBlocksCleared"], with_field(4, True)], "event 1 (BlockStored): field 'block_size'"),
        ([with_field(1, [1, "x"])], "field 'block_hashes': element 1: expected int or bin hash"),
        ([with_field(1, [True])], "field 'block_hashes': element 0"),
        ([with_field(1, 5)], "field 'block_hashes': expected array"),
        ([with_field(2, 1.5)], "field 'parent_block_hash': expected int or bin hash, got float"),
        ([with_field(3, [1, 2, None])], "field 'token_ids': element 2: expected int, got nil"),
        ([with_field(3, [False])], "field 'token_ids': element 0: expected int, got bool"),
        ([with_field(3, {"a": 1})], "field 'token_ids': expected array of int, got map"),
        ([with_field(5, "7")], "field 'lora_id': expected int or nil, got str"),
        ([[*GOOD, 5]], "field 'medium': expected str or nil, got int"),
        ([[*GOOD, "GPU", b"x"]], "field 'lora_name': expected str or nil, got bin"),
        ([[*GOOD, "GPU", None, "x"]], "field 'extra_keys': expected array or nil"),
        ([stored_array(16)[:-1] + [[[1], "x"]]], "field 'lookahead_token_ids': element 1"),
        ([stored_array(16)[:-1] + [[[1, 2.0]]]], "lookahead_token_ids': element 0: element 1"),
        ([GOOD[:4]], "event 0 (BlockStored): missing required field 'block_size'"),
        ([GOOD[:2]], "missing required field 'parent_block_hash'"),
        ([["BlockRemoved"]], "event 0 (BlockRemoved): missing required field 'block_hashes'"),
        (
            [{"type": "BlockStored", "block_hashes": [], "token_ids": [], "block_size": 1}],
            "'parent_block_hash'",
        ),
        ([{"type": "BlockRemoved"}], "missing required field 'block_hashes'"),
        ([{"type": "BlockRemoved", "block_hashes": [], 3: 4}], "map key must be str, got int"),
        ([[]], "event 0: empty array"),
        ([[5, 1]], "event 0: event tag (element 0) must be str, got int"),
        ([{"block_hashes": []}], "event 0: event map has no 'type' key"),
        ([{"type": None}], "event tag ('type') must be str, got nil"),
        (["BlockStored"], "event 0: expected an event array or map, got str"),
        ([["AllBlocksCleared"], 7], "event 1: expected an event array or map, got int"),
    ],
)
def test_malformed_events(events: list[Any], message: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_batch(pack([TS, events, 0]))
    assert message in str(info.value)


@pytest.mark.parametrize(
    "payload, message",
    [
        (pack([TS, []]) + b"\x00", "not a single valid msgpack value"),  # trailing bytes
        (GOLDEN["v0_33_0_map"][:-1], "not a single valid msgpack value"),  # truncated
        (b"", "not a single valid msgpack value"),
        (b"\x92\xa2\xff\xfe\x90", "not a single valid msgpack value"),  # invalid UTF-8
        (b"\x92\x01\xc1", "not a single valid msgpack value"),  # reserved byte
        (b"\x82\x91\x01\x01\x01\x01", "not a single valid msgpack value"),  # array as map key
        (pack("hello"), "envelope: expected an array"),
        (pack([TS]), "envelope: expected an array [ts, events, data_parallel_rank], got 1"),
        (pack(["now", []]), "envelope: field 'ts': expected a number, got str"),
        (pack([True, []]), "field 'ts': expected a number, got bool"),
        (pack([TS, {}]), "field 'events': expected array, got map"),
        (pack([TS, [], "0"]), "field 'data_parallel_rank': expected int or nil, got str"),
        (pack([TS, [], False]), "field 'data_parallel_rank': expected int or nil, got bool"),
        (pack({"ts": TS}), "envelope: map without 'ts' and 'events'"),
        (pack({"ts": TS, "events": [], 1: 2}), "envelope: map key must be str"),
    ],
)
def test_malformed_payloads(payload: bytes, message: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_batch(payload)
    assert message in str(info.value)


def test_decode_error_is_a_value_error_and_decode_event_names_the_tag() -> None:
    assert issubclass(DecodeError, ValueError)
    with pytest.raises(DecodeError, match=r"^BlockRemoved: field 'medium'"):
        decode_event(["BlockRemoved", [], 1])


# --- robustness: nothing but DecodeError escapes, for any bytes ------------------------

ROBUST = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_or_error(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except DecodeError:
        return
    assert isinstance(batch, EventBatch)


@ROBUST
@given(st.binary(max_size=300))
def test_arbitrary_bytes(payload: bytes) -> None:
    _decode_or_error(payload)


@ROBUST
@given(
    st.sampled_from(sorted(GOLDEN)),
    st.lists(
        st.tuples(
            st.sampled_from(["flip", "insert", "delete", "cut"]),
            st.integers(0, 400),
            st.integers(0, 255),
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_mutated_valid_payloads(name: str, mutations: list[tuple[str, int, int]]) -> None:
    data = bytearray(GOLDEN[name])
    for op, pos, byte in mutations:
        pos %= len(data) + 1
        if op == "flip" and pos < len(data):
            data[pos] = byte
        elif op == "insert":
            data.insert(pos, byte)
        elif op == "delete" and pos < len(data):
            del data[pos]
        elif op == "cut":
            del data[pos:]
    _decode_or_error(bytes(data))


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "ts"]),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(
            st.sampled_from(["type", "block_hashes", "medium", "ts", "x"])
            | inner.filter(lambda v: not isinstance(v, list | dict)),
            inner,
            max_size=4,
        )
    ),
    max_leaves=25,
)


@ROBUST
@given(
    st.lists(
        st.one_of(
            msgpack_values,
            st.builds(lambda tail: ["BlockStored", *tail], st.lists(msgpack_values, max_size=17)),
            st.builds(lambda tail: ["BlockRemoved", *tail], st.lists(msgpack_values, max_size=7)),
        ),
        max_size=4,
    ),
    msgpack_values,
)
def test_arbitrary_structures(events: list[Any], dp_rank: Any) -> None:
    _decode_or_error(pack([TS, events, dp_rank]))


def test_deeply_nested_extra_is_a_decode_error_or_kept() -> None:
    nested: Any = 1
    for _ in range(1000):
        nested = [nested]
    _decode_or_error(pack([TS, [["AllBlocksCleared", nested]], 0]))


# --- value domains: what the record schema (and vLLM) allow -----------------------------

BIG = 2**63  # one past Avro's long


def stored(**fields: Any) -> dict[str, Any]:
    ev = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None}
    ev.update({"token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None, "medium": "GPU"})
    ev.update({"lora_name": None, **fields})
    return ev


@pytest.mark.parametrize(
    "batch, message",
    [
        (
            [TS, [["BlockStored", [1], None, list(range(32)), BIG, None, "GPU"]], 0],
            "event 0 (BlockStored): field 'block_size': value out of range: "
            "9223372036854775808 (must be <= 2**63-1",
        ),
        (
            [TS, [stored(block_size=-1)]],
            "field 'block_size': value out of range: -1 (must be >= 1)",
        ),
        (
            [TS, [stored(block_size=0)]],
            "field 'block_size': value out of range: 0 with 4 token_ids",
        ),
        ([TS, [stored(token_ids=[1, BIG])]], "field 'token_ids': element 1: value out of range"),
        ([TS, [stored(token_ids=[5, -1])]], "'token_ids': element 1: value out of range: -1"),
        ([TS, [stored(lora_id=-3)]], "field 'lora_id': value out of range: -3 (must be >= 0)"),
        ([TS, [stored(lora_id=2**64 - 1)]], "field 'lora_id': value out of range: 18446744"),
        ([TS, [stored(group_idx=-1)]], "field 'group_idx': value out of range: -1"),
        ([TS, [stored(group_idx=BIG)]], "field 'group_idx': value out of range"),
        (
            [TS, [stored(kv_cache_spec_sliding_window=-128)]],
            "'kv_cache_spec_sliding_window': value",
        ),
        ([TS, [stored(lookahead_token_ids=[[1], [2, -2]])]], "element 1: element 1: value out of"),
        (
            [TS, [stored(lookahead_token_ids=[[BIG]])]],
            "'lookahead_token_ids': element 0: element 0",
        ),
        ([TS, [stored(block_hashes=[b"x", b""])]], "'block_hashes': element 1: value out of range"),
        ([TS, [stored(parent_block_hash=b"")]], "'parent_block_hash': value out of range: empty"),
        ([TS, [["BlockRemoved", [1], "GPU", -1]]], "(BlockRemoved): field 'group_idx': value out"),
        ([TS, [{"type": "BlockRemoved", "block_hashes": [b""]}]], "element 0: value out of range"),
        ([float("nan"), []], "envelope: field 'ts': value out of range: nan (must be finite)"),
        ([float("inf"), [], 0], "envelope: field 'ts': value out of range: inf"),
        ([float("-inf"), [], 0], "envelope: field 'ts': value out of range: -inf"),
        ([TS, [], -1], "field 'data_parallel_rank': value out of range: -1 (must be >= 0)"),
        (
            [TS, [], 2**31],
            "'data_parallel_rank': value out of range: 2147483648 (must be <= 2**31-1",
        ),
        ({"ts": TS, "events": [], "data_parallel_rank": BIG}, "'data_parallel_rank': value out"),
    ],
)
def test_values_out_of_their_domain_are_decode_errors(batch: Any, message: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_batch(pack(batch))
    assert message in str(info.value)


def test_each_domain_holds_its_edges_and_refuses_one_past_them() -> None:
    top = 2**63 - 1
    ev = stored(
        block_hashes=[-(2**63), 2**64 - 1, b"\x01"],
        token_ids=[0, top],
        block_size=top,
        lora_id=0,
        group_idx=top,
        kv_cache_spec_sliding_window=0,
        lookahead_token_ids=[[top, 0]],
    )
    placeholder = stored(token_ids=[], block_size=0, medium="CPU")  # offloading (spec §8)
    batch = decode_batch(pack([-1.5, [ev, placeholder], 2**31 - 1]))
    assert (batch.ts, batch.dp_rank) == (-1.5, 2**31 - 1)
    first, second = batch.events
    assert first.block_hashes == [b"\x80" + b"\x00" * 7, b"\xff" * 8, b"\x01"]
    assert (first.token_ids, first.block_size, first.lora_id) == ([0, top], top, 0)
    assert (second.block_size, second.token_ids) == (0, [])
    past = {
        "token_ids": [0, top + 1],
        "block_size": top + 1,
        "lora_id": -1,
        "group_idx": top + 1,
        "kv_cache_spec_sliding_window": -1,
        "lookahead_token_ids": [[top + 1, 0]],
    }
    for name, value in past.items():
        with pytest.raises(
            DecodeError, match=f"field '{name}': (element [01]: )*value out of range"
        ):
            decode_batch(pack([TS, [{**ev, name: value}], 0]))
    with pytest.raises(DecodeError, match="'data_parallel_rank': value out of range"):
        decode_batch(pack([TS, [ev], 2**31]))


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 2**256])
def test_decode_event_refuses_int_hashes_wider_than_64_bits(value: int) -> None:
    # vLLM 0.9.x with sha256 had 256-bit int hashes (it could not send them); reducing one
    # mod 2**64 would silently alias another block.
    with pytest.raises(DecodeError, match=r"element 0: value out of range: hash"):
        decode_event(["BlockRemoved", [value]])
