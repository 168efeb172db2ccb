"""The decoder's typed fast path (bridge.vllm.typed_decode) never diverges from the general one.

For every payload: if the fast path returns a batch, the general path returns the same batch
(compared by repr, so that ``1`` vs ``1.0`` vs ``True`` and ``-0.0`` vs ``0.0`` differ); and
``decode_batch`` gives exactly what the general path gives, the batch or the same error
message. Payloads: what every release sends (which must take the fast path), those mutated
value by value and byte by byte, and hand-written hostile ones.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from batch_util import hash_modes, paths, valid_payload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.vllm.decoder import DecodeError, _decode_general, decode_batch
from bridge.vllm.events import EventBatch
from bridge.vllm.releases import SUPPORTED_RELEASES, Release
from bridge.vllm.typed_decode import decode_typed

EDGE_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), -(2**63) + 1]
ODD_FLOATS = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e308, 5e-324]
KEYS = ["type", "ts", "block_hashes", "block_size", "token_ids", "medium", "group_idx", "x"]
TAGS = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]

scalars = (
    st.none()
    | st.booleans()
    | st.sampled_from(EDGE_INTS)
    | st.integers(-(2**63), 2**64 - 1)
    | st.sampled_from(ODD_FLOATS)
    | st.floats()
    | st.text(max_size=6)
    | st.sampled_from(TAGS)
    | st.binary(max_size=9)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS), inner),
    max_leaves=8,
)


def outcome(decode: Any, payload: bytes) -> tuple[str, str]:
    try:
        return ("batch", repr(decode(payload)))
    except DecodeError as exc:
        return ("error", str(exc))


def assert_same(payload: bytes) -> EventBatch | None:
    """The fast path's batch (or None), after checking it against the general path."""
    fast = decode_typed(payload)
    general = outcome(_decode_general, payload)
    if fast is not None:
        assert general == ("batch", repr(fast))
    assert outcome(decode_batch, payload) == general
    return fast


def mutate(root: Any, data: st.DataObject) -> Any:
    """One change somewhere in an unpacked batch: a value replaced, added or dropped."""
    path, node = data.draw(st.sampled_from(paths(root)))
    op = data.draw(st.sampled_from(["replace", "replace", "add", "drop", "retype"]))
    if op == "add" and type(node) is list:
        node.insert(data.draw(st.integers(0, len(node))), data.draw(values))
        return root
    if op == "add" and type(node) is dict:
        node[data.draw(st.sampled_from(KEYS) | st.text(max_size=3))] = data.draw(values)
        return root
    if op == "drop" and path:
        parent = root
        for step in path[:-1]:
            parent = parent[step]
        del parent[path[-1]]
        return root
    if op == "retype" and type(node) is int and type(node) is not bool:
        new: Any = data.draw(st.sampled_from([bool(node & 1), float(node), str(node)]))
    elif op == "retype" and type(node) is str:
        new = node.encode()
    else:
        new = data.draw(values)
    if not path:
        return new
    parent = root
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = new
    return root


PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("release", SUPPORTED_RELEASES, ids=str)
@pytest.mark.parametrize("seed", range(6))
def test_what_every_release_sends_takes_the_fast_path(release: Release, seed: int) -> None:
    for mode in hash_modes(release):
        payload = valid_payload(release, mode, seed, 5 + 7 * seed)
        assert assert_same(payload) is not None, (release, mode)


@pytest.mark.parametrize("release", SUPPORTED_RELEASES, ids=str)
@PROPERTY
@given(data=st.data())
def test_mutated_batches_decode_the_same(release: Release, data: st.DataObject) -> None:
    mode = data.draw(st.sampled_from(hash_modes(release)))
    payload = valid_payload(
        release, mode, data.draw(st.integers(0, 20)), data.draw(st.integers(1, 30))
    )
    obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    for _ in range(data.draw(st.integers(1, 3))):
        obj = mutate(obj, data)
    assert_same(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize(
    "release", [Release(0, 9, 0), Release(0, 23, 0), Release(0, 33, 0)], ids=str
)
@PROPERTY
@given(data=st.data())
def test_byte_mutated_batches_decode_the_same(release: Release, data: st.DataObject) -> None:
    mode = data.draw(st.sampled_from(hash_modes(release)))
    payload = bytearray(valid_payload(release, mode, data.draw(st.integers(0, 20)), 12))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(payload)))
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "cut"]))
        byte = data.draw(st.integers(0, 255))
        if op == "insert":
            payload.insert(pos, byte)
        elif pos == len(payload):
            continue
        elif op == "flip":
            payload[pos] = byte
        elif op == "delete":
            del payload[pos]
        else:
            del payload[pos:]
    assert_same(bytes(payload))


@PROPERTY
@given(
    st.lists(
        st.builds(
            lambda tag, tail: [tag, *tail], st.sampled_from(TAGS), st.lists(values, max_size=17)
        )
        | st.builds(
            lambda tag, rest: {"type": tag, **rest},
            st.sampled_from(TAGS),
            st.dictionaries(st.sampled_from(KEYS[2:]), values),
        ),
        max_size=4,
    ),
    values,
    st.lists(values, max_size=2),
)
def test_arbitrary_events_decode_the_same(events: list[Any], rank: Any, tail: list[Any]) -> None:
    assert_same(msgpack.packb([1767225600.5, events, rank, *tail], use_bin_type=True))
    assert_same(msgpack.packb([1767225600.5, events], use_bin_type=True))


STORED = ["BlockStored", [1], None, [1, 2, 3, 4], 4, None, "GPU"]
STORED_MAP = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None}
STORED_MAP |= {"token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU"}
REMOVED_MAP = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}


def batch(*events: Any, ts: Any = 1767225600.25, rank: Any = 0) -> bytes:
    return msgpack.packb([ts, list(events), rank], use_bin_type=True)


def ev_map_raw(*pairs: tuple[Any, Any]) -> bytes:
    """A map event as msgpack, keys in this order, duplicates kept."""
    raw = bytes([0x80 | len(pairs)])
    for key, value in pairs:
        raw += msgpack.packb(key) + msgpack.packb(value, use_bin_type=True)
    return raw


def batch_raw(*events: bytes) -> bytes:
    head = msgpack.packb(1767225600.25) + bytes([0x90 | len(events)])
    return b"\x93" + head + b"".join(events) + b"\x00"


HOSTILE: list[bytes] = [
    batch(["BlockRemoved", [True]]),
    batch(["BlockRemoved", [1], "GPU", True]),
    batch(["BlockStored", [1], None, [1, True], 2, None]),
    batch(["BlockStored", [1], False, [1], 1, None]),
    batch(STORED, rank=True),
    batch(STORED, rank=2**31),
    batch(STORED, rank=-1),
    batch(STORED, ts=True),
    batch(STORED, ts=2**64 - 1),
    batch(STORED, ts=-(2**63)),
    batch(STORED, ts=float("nan")),
    batch(STORED, ts=float("-inf")),
    batch(STORED, ts="1.0"),
    batch(["BlockStored", [2**64 - 1, -(2**63), b"\x01"], -1, [0, 2**63 - 1], 2**63 - 1, 0]),
    batch(["BlockStored", [1], None, [2**63], 1, None]),
    batch(["BlockStored", [1], None, [-1], 1, None]),
    batch(["BlockStored", [b""], None, [1], 1, None]),
    batch(["BlockStored", [1], b"", [1], 1, None]),
    batch(["BlockStored", [1], None, [1], 0, None]),
    batch(["BlockStored", [1], None, [], 0, None]),
    batch(["BlockStored", [1], None, [1], 1.0, None]),
    batch(["BlockStored", [1], None, [1], 1]),  # missing lora_id: required in arrays
    batch(["BlockStored", [1], None, [1]]),
    batch([*STORED, None, [[1, "a", 2.5, True, None]]]),  # extra_keys of scalars
    batch([*STORED, None, [[b"\x00"]]]),  # bin extra key: the general path's
    batch([*STORED, None, [[[1, 2]], {"a": 1}]]),  # nested extra keys
    batch([*STORED, None, [None], 0, "full_attention", 4, "local", "own", "s", [[1], [2]]]),
    batch([*STORED, None, [None], 0, "full_attention", 4, "local", "own", "s", [[1]], "new"]),
    batch([*STORED, None, [None], 0, None, None, None, None, None, [[2**63]]]),
    batch(["BlockRemoved", [1], "GPU", 0, "local", "own"]),
    batch(["BlockRemoved", [1], "GPU", 0, "local", "own", [1]]),  # remaining_copy_counts
    batch(["BlockRemoved"]),
    batch(["BlockRemoved", []]),
    batch(["AllBlocksCleared"]),
    batch(["AllBlocksCleared", 1]),
    batch(["Unknown", 1, 2]),
    batch([]),
    batch(["blockstored", [1], None, [1], 1, None]),
    batch(STORED_MAP, REMOVED_MAP, {"type": "AllBlocksCleared"}),
    batch(STORED, REMOVED_MAP),  # an array and a map in one batch
    batch(REMOVED_MAP, STORED),
    batch({**REMOVED_MAP, "remaining_copy_counts": [0]}),
    batch({**REMOVED_MAP, "medium": b"GPU"}),
    batch({**REMOVED_MAP, "type": "Unknown"}),
    batch({k: v for k, v in STORED_MAP.items() if k != "parent_block_hash"}),
    batch({k: v for k, v in STORED_MAP.items() if k != "type"}),
    batch({**STORED_MAP, "lookahead_token_ids": None, "session_id": "s"}),
    batch({**STORED_MAP, "extra_keys": [[1, "x"]], "group_idx": 2**63 - 1}),
    batch({**STORED_MAP, "group_idx": 2**63}),
    batch({"type": "AllBlocksCleared", "x": 1}),
    batch({"type": 1, "block_hashes": [1]}),
    msgpack.packb([1.0, [{1: 2, "type": "BlockRemoved", "block_hashes": [1]}], 0]),
    msgpack.packb({"ts": 1.0, "events": [STORED], "data_parallel_rank": 0}),
    msgpack.packb([1.0, [STORED]]),
    msgpack.packb([1.0, [STORED], None]),
    msgpack.packb([1.0, [STORED], 0, "extra"]),
    msgpack.packb([1.0]),
    msgpack.packb([1.0, "events", 0]),
    msgpack.packb(1.0),
    batch(STORED) + b"\x00",  # trailing bytes
    batch(STORED)[:-1],  # truncated
    b"",
    b"\x93\xca\x3f\x80\x00\x00\x91\x92\xacBlockRemoved\x91\x01\x00",  # float32 ts
    b"\x93\xcb" + bytes(8) + b"\x91\x92\xacBlockRemoved\x91\xd4\x01\x00\x00",  # ext hash
    b"\x93\xcb" + bytes(8) + b"\x91\x93\xacBlockRemoved\x91\x01\xa3\xff\xfe\xfd\x00",  # bad utf-8
    b"\x93\xcb" + bytes(8) + b"\x91\x93\xacBlockRemoved\x91\x01\xa3\xed\xa0\x80\x00",  # surrogate
    b"\x93\xcb" + bytes(8) + b"\x91\x93\xacBlockRemoved\x91\x01\xc4\x03GPU\x00",  # bin medium
    b"\x93\xcb" + bytes(8) + b"\x91\x92\xc4\x0cBlockRemoved\x91\x01\x00",  # bin tag
    b"\x93\xcb" + bytes(8) + b"\xdc\x00\x01\x92\xacBlockRemoved\x91\x01\x00",  # array16 events
    b"\x93\xcb" + bytes(8) + b"\x91\x92\xacBlockRemoved\x91\xcf" + b"\xff" * 8 + b"\x00",
    b"\x93\xcb" + bytes(8) + b"\x91\x92\xacBlockRemoved\x91\xd3\x80" + bytes(7) + b"\x00",
    batch_raw(ev_map_raw(("type", "BlockRemoved"), ("block_hashes", [1]), ("block_hashes", [2]))),
    batch_raw(ev_map_raw(("type", "BlockRemoved"), ("block_hashes", "x"), ("block_hashes", [2]))),
    batch_raw(ev_map_raw(("type", "BlockRemoved"), ("block_hashes", [2]), ("block_hashes", "x"))),
    batch_raw(ev_map_raw(("type", "BlockStored"), ("type", "BlockRemoved"), ("block_hashes", [1]))),
    batch_raw(
        ev_map_raw(("type", "BlockRemoved"), ("block_hashes", [1]), ("type", "BlockRemoved"))
    ),
    batch_raw(ev_map_raw(("block_hashes", [1]), ("medium", "GPU"), ("type", "BlockRemoved"))),
]


@pytest.mark.parametrize("payload", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_batches_decode_the_same(payload: bytes) -> None:
    assert_same(payload)


def test_the_fast_path_takes_what_it_should() -> None:
    """Not a behaviour (both paths agree anyway), but a fast path that declines everything
    would pass every other test: the plain forms, edge values included, must take it."""
    plain = [
        HOSTILE[13],  # hash and token edges
        batch(STORED_MAP, REMOVED_MAP, {"type": "AllBlocksCleared"}),
        batch([*STORED, None, [[1, "a", 2.5, True, None]]]),
        batch(["BlockStored", [1], None, [], 0, None]),  # an offloading placeholder
        msgpack.packb([1.0, [STORED]]),  # 0.9.0: no rank
        batch(STORED, ts=7),
        HOSTILE[-1],  # "type" last
    ]
    for payload in plain:
        assert assert_same(payload) is not None
    assert decode_typed(batch(["BlockStored", [1], None, [1], 0, None])) is None
    assert decode_typed(batch(["BlockRemoved", [1], "GPU", 0, "local", "own", [1]])) is None
