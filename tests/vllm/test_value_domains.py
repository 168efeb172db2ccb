"""Decode -> Avro never fails on a decoded batch: out-of-domain values are DecodeErrors.

Valid batches of every release come from the simulator's cache model and the project's
encoder; mutations then put huge and negative ints, NaN and infinities, bytes for strings,
wrong types, and dropped or added fields anywhere in them. Each payload goes through exactly
what the pipeline does (``decode_batch``, then ``RecordCodec.encode_batch``) and must either
be refused with a DecodeError, whose EventsLost marker then encodes, or encode to records
that fastavro agrees with and that decode back to the same events.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from batch_util import Path, hash_modes, paths, valid_payload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.log.markers import EventsLost
from bridge.log.records import Envelope, RecordCodec
from bridge.vllm.decoder import DecodeError, decode_batch
from bridge.vllm.events import EventBatch
from bridge.vllm.releases import SUPPORTED_RELEASES, Release

CODEC = RecordCodec()
POD, MODEL, EPOCH, SEQ = "pod-a", "m", 3, 41
EDGE_INTS = [-1, -(2**31) - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), 0]
BAD_FLOATS = [float("nan"), float("inf"), float("-inf"), -0.0, 1e308]
KEYS = ["type", "ts", "block_size", "token_ids", "group_idx", "lora_id", "medium", "x"]

values = st.recursive(
    st.none()
    | st.booleans()
    | st.sampled_from(EDGE_INTS)
    | st.integers(-(2**63), 2**64 - 1)
    | st.sampled_from(BAD_FLOATS)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=9),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS), inner),
    max_leaves=8,
)


def at(root: Any, path: Path) -> Any:
    for step in path:
        root = root[step]
    return root


def mutate(root: Any, data: st.DataObject) -> Any:
    """One mutation of ``root`` (changed in place where possible; the new root returned)."""
    op = data.draw(st.sampled_from(["int", "float", "bytes", "value", "drop", "add"]))
    nodes = paths(root)
    kinds = {"int": int, "float": float, "bytes": str}
    if op in kinds:
        nodes = [(p, n) for p, n in nodes if type(n) is kinds[op]] or nodes
    path, node = data.draw(st.sampled_from(nodes))
    if op == "int":
        new: Any = data.draw(st.sampled_from(EDGE_INTS) | st.integers(-(2**63), 2**64 - 1))
    elif op == "float":
        new = data.draw(st.sampled_from(BAD_FLOATS))
    elif op == "bytes":
        new = node.encode() if type(node) is str else data.draw(st.binary(max_size=9))
    elif op == "add" and type(node) in (list, dict):
        if type(node) is list:
            node.insert(data.draw(st.integers(0, len(node))), data.draw(values))
        else:
            node[data.draw(st.sampled_from(KEYS))] = data.draw(values)
        return root
    elif op == "drop" and path:
        del at(root, path[:-1])[path[-1]]
        return root
    else:
        new = data.draw(values)
    if not path:
        return new
    at(root, path[:-1])[path[-1]] = new
    return root


def through_pipeline(payload: bytes) -> EventBatch | None:
    """What ``Pipeline.deliver`` does with a payload; None when it is refused (DecodeError).

    Anything but a DecodeError escaping, or records that do not read back as the decoded
    events, fails the test.
    """
    try:
        batch = decode_batch(payload)
    except DecodeError as exc:
        marker = EventsLost(SEQ, SEQ, f"undecodable batch: {exc}"[:500])
        env = Envelope(POD, MODEL, 0, EPOCH, SEQ, -1, 1767225600.0)
        assert CODEC.decode(CODEC.encode(env, marker)).event == marker
        return None
    out = CODEC.encode_batch(POD, MODEL, 0, EPOCH, SEQ, batch.ts, batch.extra, batch.events)
    assert len(out) == len(batch.events)
    for i, (value, event) in enumerate(zip(out, batch.events, strict=True)):
        env = Envelope(POD, MODEL, 0, EPOCH, SEQ, i, batch.ts, batch.extra)
        assert CODEC.encode_reference(env, event) == value  # fastavro writes the same bytes
        back = CODEC.decode(value)
        # repr: equality that holds for NaN inside opaque msgpack values (extra_keys)
        assert repr(back.envelope) == repr(env)
        assert repr(back.event) == repr(event)
    return batch


PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("release", SUPPORTED_RELEASES, ids=str)
@PROPERTY
@given(data=st.data())
def test_mutated_batches_encode_or_are_decode_errors(release: Release, data: st.DataObject) -> None:
    mode = data.draw(st.sampled_from(hash_modes(release)))
    payload = valid_payload(
        release, mode, data.draw(st.integers(0, 40)), data.draw(st.integers(1, 30))
    )
    assert through_pipeline(payload) is not None  # what vLLM sends is never refused
    obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    for _ in range(data.draw(st.integers(1, 3))):
        obj = mutate(obj, data)
    through_pipeline(msgpack.packb(obj, use_bin_type=True))


BAD_BLOCK_SIZE = [
    1767225600.0,
    [["BlockStored", [1], None, list(range(32)), 2**63, None, "GPU"]],
    0,
]
MAP_STORED = {"type": "BlockStored", "block_hashes": [], "parent_block_hash": None}
MAP_STORED |= {"token_ids": [], "block_size": 1, "lora_id": None, "medium": None, "lora_name": None}


@pytest.mark.parametrize(
    "batch, field",
    [
        (BAD_BLOCK_SIZE, "block_size"),  # issue 12: OverflowError in write_long, a silent hole
        ([1.0, [["BlockStored", [1], None, [1, 2**63], 2, None]], 0], "token_ids"),
        ([1.0, [["BlockStored", [1], 2**64 - 1, [1], 1, -(2**63)]], 0], "lora_id"),
        ([1.0, [["BlockRemoved", [5], "GPU", 2**63]], 0], "group_idx"),
        ([1.0, [{**MAP_STORED, "lookahead_token_ids": [[2**64 - 1]]}], 0], "lookahead_token_ids"),
        ([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], -1, None, "GPU"]], 0], "block_size"),
        ([1.0, [["BlockStored", [1], None, [-5, 2], 2, None, "GPU"]], 0], "token_ids"),
        ([float("nan"), [["AllBlocksCleared"]], 0], "ts"),
    ],
)
def test_values_avro_cannot_hold_or_vllm_never_sends_are_refused(batch: Any, field: str) -> None:
    with pytest.raises(
        DecodeError, match=f"'{field}': (element 0: |element 1: )*value out of range"
    ):
        decode_batch(msgpack.packb(batch, use_bin_type=True))
    assert through_pipeline(msgpack.packb(batch, use_bin_type=True)) is None
