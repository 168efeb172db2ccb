"""Avro records: every field survives, values are single-object encoded, bad values fail clearly."""

from __future__ import annotations

import io
import json

import pytest
from fastavro import schemaless_reader
from fastavro.schema import fingerprint, parse_schema
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.log.markers import EventsLost, PodRemoved, PublisherRestarted, StreamStarted
from bridge.log.records import Envelope, RecordCodec, RecordError, crc64_avro, schema_dir
from bridge.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, UnknownEvent

CODEC = RecordCodec()
ENV = Envelope("pod-a", "llama", 1, 1767225600000, 42, 3, 1767225600.5, {"#3": b"\xc0"})

hashes = st.one_of(st.binary(min_size=8, max_size=8), st.binary(min_size=32, max_size=32))
maybe_str = st.none() | st.text(max_size=12)
maybe_int = st.none() | st.integers(-(2**63), 2**63 - 1)
longs = st.integers(-(2**63), 2**63 - 1)
extra = st.dictionaries(st.text(max_size=8), st.binary(max_size=8), max_size=2)
msgpack_values = st.recursive(
    st.none() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5) | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=6,
)

stored = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, max_size=4),
    parent_block_hash=st.none() | hashes,
    token_ids=st.lists(st.integers(0, 2**31), max_size=20),
    block_size=longs,
    lora_id=maybe_int,
    medium=maybe_str,
    lora_name=maybe_str,
    extra_keys=st.none() | st.lists(st.none() | st.lists(msgpack_values, max_size=3), max_size=4),
    group_idx=maybe_int,
    kv_cache_spec_kind=maybe_str,
    kv_cache_spec_sliding_window=maybe_int,
    locality=maybe_str,
    ownership=maybe_str,
    session_id=maybe_str,
    lookahead_token_ids=st.none() | st.lists(st.lists(longs, max_size=3), max_size=3),
    extra=extra,
)
removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, max_size=3),
    medium=maybe_str,
    group_idx=maybe_int,
    locality=maybe_str,
    ownership=maybe_str,
    extra=extra,
)
markers = st.one_of(
    st.builds(StreamStarted, next_seq=longs, endpoint=st.text(max_size=20)),
    st.builds(PublisherRestarted, old_epoch=longs, last_seq=st.none() | longs, first_seq=longs),
    st.builds(EventsLost, from_seq=longs, to_seq=longs, reason=st.text(max_size=20)),
    st.builds(PodRemoved, reason=st.text(max_size=20)),
)
anything = st.one_of(
    stored,
    removed,
    st.builds(AllBlocksCleared, extra=extra),
    st.builds(UnknownEvent, tag=st.text(max_size=10), raw=st.binary(max_size=10)),
    markers,
)


@settings(max_examples=300, deadline=None)
@given(anything)
def test_every_event_and_marker_round_trips(event):
    rec = CODEC.decode(CODEC.encode(ENV, event))
    assert rec.envelope == ENV
    assert rec.event == event


def test_single_object_header_names_the_writer_schema():
    value = CODEC.encode(ENV, AllBlocksCleared())
    assert value[:2] == b"\xc3\x01"
    raw = json.loads((schema_dir() / "kv_event.avsc").read_text())
    parsed = parse_schema(raw)
    # fastavro's independent fingerprint is the little-endian hex of the same 8 bytes.
    assert value[2:10].hex() == fingerprint(CODEC.canonical, "CRC-64-AVRO")
    body = schemaless_reader(io.BytesIO(value[10:]), parsed, return_record_name=True)
    assert body["pod"] == "pod-a" and body["event"][0] == "io.kvbridge.v1.AllBlocksCleared"


def test_crc64_avro_known_value():
    # The Avro spec's fingerprint of the empty input is the algorithm's seed.
    assert crc64_avro(b"") == 0xC15D213AA4D7A795
    assert crc64_avro(b'"int"') == int.from_bytes(
        bytes.fromhex(fingerprint('"int"', "CRC-64-AVRO")), "little"
    )


@pytest.mark.parametrize(
    "value, needle",
    [
        (b"", "single-object"),
        (b"\x07\x01" + bytes(20), "single-object"),
        (b"\x00\x01" + bytes(20), "schema-registry-url"),  # Confluent framing, no registry
        (b"\xc3\x01" + bytes(8) + b"\x00", "unknown schema"),
    ],
)
def test_foreign_values_fail_clearly(value, needle):
    with pytest.raises(RecordError, match=needle):
        CODEC.decode(value)


def test_truncated_body_fails_clearly():
    value = CODEC.encode(ENV, BlockStored([b"\x01" * 32], None, [1, 2, 3], 16))
    with pytest.raises(RecordError, match="corrupt"):
        CODEC.decode(value[:-5])
