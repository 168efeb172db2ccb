"""bridge.vllm.encoder and bridge.vllm.releases: the spec's bytes, msgspec's bytes, round trips."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.vllm.decoder import decode_batch
from bridge.vllm.encoder import HashMode, encode_batch, normal_hash, wire_hash
from bridge.vllm.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
    VllmEvent,
)
from bridge.vllm.releases import (
    BLOCK_REMOVED_FIELDS,
    BLOCK_STORED_FIELDS,
    MAX_RELEASE,
    MIN_RELEASE,
    SUPPORTED_RELEASES,
    Release,
    WireField,
    has_default,
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
HASH_MODES: tuple[HashMode, ...] = ("int", "signed", "bytes")


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def gpu_stored(parent: bytes | None) -> BlockStored:
    return BlockStored(
        [D2],
        parent,
        list(TOKENS),
        4,
        medium="GPU",
        extra_keys=[None],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


# --- releases ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected, as_str",
    [
        ("0.9.0", Release(0, 9, 0), "0.9.0"),
        ("0.10.2", Release(0, 10, 2), "0.10.2"),
        ("v0.33.0", Release(0, 33, 0), "0.33.0"),
        (" 0.34.0 ", Release(0, 34, 0), "0.34.0"),
        ("0.10.1.1", Release(0, 10, 1), "0.10.1"),  # post-release wheel, same kv_events.py
    ],
)
def test_release_parse(text: str, expected: Release, as_str: str) -> None:
    assert Release.parse(text) == expected
    assert str(Release.parse(text)) == as_str


@pytest.mark.parametrize(
    "text, message",
    [
        ("0.8.5", "has no KV-cache events"),
        ("0.35.0", "newer than the newest release"),
        ("1.0.0", "newer than the newest release"),
        ("0.24", "expected MAJOR.MINOR.PATCH"),
        ("0.24.0rc1", "expected MAJOR.MINOR.PATCH"),
        ("latest", "expected MAJOR.MINOR.PATCH"),
    ],
)
def test_release_parse_refuses(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        Release.parse(text)
    assert "0.9.0 to 0.34.0" in str(info.value)


def test_release_order_and_supported_list() -> None:
    assert Release(0, 9, 1) < Release(0, 10, 0) < Release(0, 10, 2) < Release(0, 34, 0)
    assert SUPPORTED_RELEASES[0] == MIN_RELEASE == Release(0, 9, 0)
    assert SUPPORTED_RELEASES[-1] == MAX_RELEASE == Release(0, 34, 0)
    assert list(SUPPORTED_RELEASES) == sorted(set(SUPPORTED_RELEASES))
    assert Release(0, 12, 0).is_supported and not Release(0, 35, 0).is_supported


@pytest.mark.parametrize(
    "prop, first",
    [
        ("has_dp_rank", "0.9.1"),
        ("supports_bytes_hashes", "0.10.2"),
        ("map_events", "0.24.0"),
        ("replay_has_topic", "0.26.0"),
    ],
)
def test_release_flags_switch_at_their_first_release(prop: str, first: str) -> None:
    r = Release.parse(first)
    before = max(x for x in [*SUPPORTED_RELEASES, Release(0, 25, 1), Release(0, 23, 1)] if x < r)
    assert getattr(r, prop) and getattr(MAX_RELEASE, prop)
    assert not getattr(before, prop) and not getattr(MIN_RELEASE, prop)


def test_replay_sndhwm() -> None:
    assert Release(0, 32, 0).replay_sndhwm(10_000) is None
    assert Release(0, 33, 0).replay_sndhwm(10_000) == 20_002
    assert Release(0, 34, 0).replay_sndhwm(10) == 22


def test_field_tables_per_release() -> None:
    base = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
    assert Release(0, 9, 0).stored_fields == base
    assert Release(0, 10, 2).stored_fields == (*base, "medium")
    assert len(Release(0, 13, 0).stored_fields) + 1 == 7  # spec: array lengths incl. tag
    assert len(Release(0, 16, 0).stored_fields) + 1 == 8
    assert len(Release(0, 19, 1).stored_fields) + 1 == 9
    assert len(Release(0, 21, 0).stored_fields) + 1 == 10
    assert len(Release(0, 23, 0).stored_fields) + 1 == 12
    assert Release(0, 33, 0).stored_fields == tuple(f.name for f in BLOCK_STORED_FIELDS)
    assert Release(0, 33, 0).stored_fields[-1] == "lookahead_token_ids"
    assert Release(0, 30, 0).stored_fields[-1] == "session_id"
    assert Release(0, 9, 0).removed_fields == ("block_hashes",)
    assert [len(Release.parse(v).removed_fields) + 1 for v in ("0.10.1", "0.19.1", "0.23.0")] == [
        2,
        3,
        4,
    ]
    assert Release(0, 29, 0).removed_fields == (
        "block_hashes",
        "medium",
        "group_idx",
        "locality",
        "ownership",
    )
    required = [f.name for f in BLOCK_STORED_FIELDS if not f.has_default]
    assert required == [*base, "medium", "lora_name"]
    assert not has_default("medium") and has_default("group_idx") and has_default("extra_keys")
    assert [f.name for f in BLOCK_REMOVED_FIELDS if f.has_default] == [
        "group_idx",
        "locality",
        "ownership",
    ]


# --- hashes -----------------------------------------------------------------------------


def test_wire_hash_modes_match_the_spec_examples() -> None:
    assert wire_hash(D1, "int") == 9434072892605428128
    assert wire_hash(D2, "int") == 15683421030328334953
    assert wire_hash(D1, "signed") == -9012671181104123488
    assert wire_hash(D2, "signed") == -2763323043381216663
    assert wire_hash(D1, "bytes") == D1
    assert normal_hash(D1, "int") == normal_hash(D1, "signed") == D1[-8:]
    assert normal_hash(D1, "bytes") == D1
    assert wire_hash(b"\x01", "signed") == 1 and normal_hash(b"\x01", "int") == bytes(7) + b"\x01"
    with pytest.raises(ValueError, match="unknown hash mode"):
        wire_hash(D1, "hex")  # type: ignore[arg-type]


# --- the spec's example payloads, byte for byte -----------------------------------------


def test_golden_0_9_0() -> None:
    batch = EventBatch(TS, [BlockStored([D2], D1, list(TOKENS), 4), BlockRemoved([D1])])
    assert encode_batch(batch, "0.9.0", "signed") == GOLDEN["v0_9_0_signed"]
    decoded = decode_batch(GOLDEN["v0_9_0_signed"])
    assert decoded.events[0].block_hashes == [normal_hash(D2, "signed")]


@pytest.mark.parametrize("release, name", [("0.23.0", "v0_23_0_uint"), ("0.33.0", "v0_33_0_map")])
def test_golden_0_23_and_0_33(release: str, name: str) -> None:
    batch = EventBatch(TS, [gpu_stored(D1), BlockRemoved([D1], "GPU", 0)], dp_rank=0)
    assert encode_batch(batch, release) == GOLDEN[name]
    assert encode_batch(batch, release, "int") == GOLDEN[name]
    expected = EventBatch(
        TS,
        [
            BlockStored(
                [D2[-8:]],
                D1[-8:],
                list(TOKENS),
                4,
                medium="GPU",
                extra_keys=[None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            BlockRemoved([D1[-8:]], "GPU", 0),
        ],
        dp_rank=0,
    )
    assert decode_batch(GOLDEN[name]) == expected


def test_golden_0_33_bytes() -> None:
    batch = EventBatch(TS, [gpu_stored(None), AllBlocksCleared()], dp_rank=None)
    assert encode_batch(batch, "0.33.0", "bytes") == GOLDEN["v0_33_0_bytes"]  # dp None -> 0
    assert decode_batch(GOLDEN["v0_33_0_bytes"]) == EventBatch(
        TS, [gpu_stored(None), AllBlocksCleared()], dp_rank=0
    )


def test_map_header_follows_struct_size_not_pair_count() -> None:
    ev = BlockStored([b"\x00" * 8], None, [], 0, medium="GPU")
    # 0.30.0: 14 fields + tag = 15 -> fixmap; 0.33.0: 16 -> map16 even with 8 pairs.
    assert encode_batch(EventBatch(0.0, [ev]), "0.30.0")[11] == 0x88
    assert encode_batch(EventBatch(0.0, [ev]), "0.33.0")[11:14] == b"\xde\x00\x08"
    removed = encode_batch(EventBatch(0.0, [BlockRemoved([], "GPU")]), "0.34.0")
    assert removed[11] == 0x83  # fixmap: type, block_hashes, medium


# --- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch, release, mode, message",
    [
        (
            EventBatch(0.0, [BlockStored([], None, [], 0, medium="GPU")]),
            "0.10.1",
            "int",
            "event 0 (BlockStored): field 'medium' is not sent by vLLM 0.10.1 (first in 0.10.2)",
        ),
        (
            EventBatch(0.0, [AllBlocksCleared(), BlockRemoved([], group_idx=1)]),
            "0.19.1",
            "int",
            "event 1 (BlockRemoved): field 'group_idx' is not sent by vLLM 0.19.1",
        ),
        (
            EventBatch(0.0, [BlockStored([], None, [], 0, lookahead_token_ids=[])]),
            "0.32.0",
            "int",
            "'lookahead_token_ids' is not sent by vLLM 0.32.0 (first in 0.33.0)",
        ),
        (EventBatch(0.0, []), "0.10.1", "bytes", "vLLM 0.10.1 cannot send byte hashes"),
        (EventBatch(0.0, [], dp_rank=1), "0.9.0", "int", "no data_parallel_rank"),
        (EventBatch(0.0, [], extra={"#3": pack(1)}), "0.9.0", "int", "2-element envelope"),
        (EventBatch(0.0, [], extra={"#4": pack(1)}), "0.9.1", "int", "contiguous positions"),
        (EventBatch(0.0, [], extra={"x": pack(1)}), "0.9.1", "int", "'x' cannot be written"),
        (EventBatch(0.0, [], extra={"#3": b"\xc1"}), "0.9.1", "int", "not one msgpack value"),
        (
            EventBatch(0.0, [AllBlocksCleared({"#2": pack(1)})]),
            "0.23.0",
            "int",
            "must be contiguous positions starting at #1",
        ),
        (
            EventBatch(0.0, [AllBlocksCleared({"type": pack(1)})]),
            "0.24.0",
            "int",
            "not clash with a known field name",
        ),
        (
            EventBatch(0.0, [BlockRemoved([], extra={"locality": pack("x")})]),
            "0.24.0",
            "int",
            "not clash",
        ),
        (EventBatch(0.0, [UnknownEvent("X", b"\x92\x01")]), "0.24.0", "int", "not one msgpack"),
        (EventBatch(0.0, []), "0.35.0", "int", "newer than the newest release"),
        (EventBatch(0.0, []), Release(0, 8, 4), "int", "has no KV-cache events"),
        (EventBatch(0.0, []), "0.24.0", "hex", "unknown hash mode"),
        (EventBatch(0.0, [], dp_rank=2**64), "0.24.0", "int", "dp_rank must be a 64-bit int"),
        (
            EventBatch(0.0, [BlockStored([], None, [2**64], 0)]),
            "0.24.0",
            "int",
            "event 0 (BlockStored): cannot encode",
        ),
        (
            EventBatch(0.0, [BlockStored([7], None, [], 0)]),  # type: ignore[list-item]
            "0.24.0",
            "int",
            "hashes must be bytes (normal form), got int",
        ),
    ],
)
def test_refusals(batch: EventBatch, release: Any, mode: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        encode_batch(batch, release, mode)
    assert message in str(info.value)


# --- hypothesis strategies --------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
# Values in the decoder's domains (every msgpack int width still occurs): token ids, ids and
# indexes are Avro longs >= 0, block sizes >= 1, ranks Avro ints >= 0, timestamps finite.
ints = st.integers(0, 2**63 - 1)
opt_ints = st.none() | ints
opt_strs = st.none() | st.text(max_size=40)
hashes = st.binary(min_size=1, max_size=40)
FIELD_STRATEGIES: dict[str, st.SearchStrategy[Any]] = {
    "block_hashes": st.lists(hashes, max_size=4),
    "parent_block_hash": st.none() | hashes,
    "token_ids": st.lists(ints, max_size=20),
    "block_size": st.integers(1, 2**63 - 1),
    "lora_id": opt_ints,
    "medium": opt_strs,
    "lora_name": opt_strs,
    "extra_keys": st.none() | st.lists(st.none() | st.lists(values, max_size=3), max_size=4),
    "group_idx": opt_ints,
    "kv_cache_spec_kind": opt_strs,
    "kv_cache_spec_sliding_window": opt_ints,
    "locality": opt_strs,
    "ownership": opt_strs,
    "session_id": opt_strs,
    "lookahead_token_ids": st.none() | st.lists(st.lists(ints, max_size=4), max_size=3),
}
KNOWN_NAMES = {f.name for f in BLOCK_STORED_FIELDS} | {"type"}


def extras(release: Release, first_position: int) -> st.SearchStrategy[dict[str, bytes]]:
    packed = values.map(pack)
    if release.map_events:
        names = st.text(max_size=12).filter(lambda n: n not in KNOWN_NAMES)
        return st.dictionaries(names, packed, max_size=2)
    return st.lists(packed, max_size=2).map(
        lambda vs: {f"#{first_position + i}": v for i, v in enumerate(vs)}
    )


def typed_event(
    cls: type, fields: tuple[WireField, ...], release: Release, with_extra: bool
) -> st.SearchStrategy[VllmEvent]:
    kwargs = {f.name: FIELD_STRATEGIES[f.name] for f in fields if f.since <= release}
    if with_extra:
        kwargs["extra"] = extras(release, len(fields) + 1)
    return st.builds(cls, **kwargs)


def unknown_event(release: Release) -> st.SearchStrategy[UnknownEvent]:
    tags = st.text(max_size=12).filter(
        lambda t: t not in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
    )

    def build(tag: str, body: list[Any]) -> UnknownEvent:
        obj: Any = [tag, *body]
        if release.map_events:
            obj = {"type": tag, **{f"k{i}": v for i, v in enumerate(body)}}
        return UnknownEvent(tag, pack(obj))

    return st.builds(build, tags, st.lists(values, max_size=3))


def batches(release: Release, with_extra: bool) -> st.SearchStrategy[EventBatch]:
    event = st.one_of(
        typed_event(BlockStored, BLOCK_STORED_FIELDS, release, with_extra),
        typed_event(BlockRemoved, BLOCK_REMOVED_FIELDS, release, with_extra),
        typed_event(AllBlocksCleared, (), release, with_extra),
        *([unknown_event(release)] if with_extra else []),
    )
    kwargs: dict[str, Any] = {
        "ts": st.floats(allow_nan=False, allow_infinity=False) | st.integers(0, 2**40),
        "events": st.lists(event, max_size=5),
    }
    if release.has_dp_rank:
        kwargs["dp_rank"] = st.none() | st.integers(0, 2**31 - 1)
        if with_extra:
            kwargs["extra"] = st.lists(values.map(pack), max_size=2).map(
                lambda vs: {f"#{3 + i}": v for i, v in enumerate(vs)}
            )
    return st.builds(EventBatch, **kwargs)


def modes_for(release: Release) -> tuple[HashMode, ...]:
    return HASH_MODES if release.supports_bytes_hashes else ("int", "signed")


def normalized(batch: EventBatch, release: Release, mode: HashMode) -> EventBatch:
    """What decode_batch must return for encode_batch(batch, release, mode)."""
    events: list[VllmEvent] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored | BlockRemoved):
            kw = {f: getattr(ev, f) for f in ev.__dataclass_fields__ if f not in ("block_hashes",)}
            kw["block_hashes"] = [normal_hash(h, mode) for h in ev.block_hashes]
            if isinstance(ev, BlockStored) and ev.parent_block_hash is not None:
                kw["parent_block_hash"] = normal_hash(ev.parent_block_hash, mode)
            ev = type(ev)(**kw)
        events.append(ev)
    dp_rank = (0 if batch.dp_rank is None else batch.dp_rank) if release.has_dp_rank else None
    return EventBatch(float(batch.ts), events, dp_rank, dict(batch.extra))


PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- round trip: decode(encode(b)) == b, hashes in normal form ---------------------------


@pytest.mark.parametrize("release", SUPPORTED_RELEASES, ids=str)
@PROPERTY
@given(data=st.data())
def test_round_trip(release: Release, data: st.DataObject) -> None:
    batch = data.draw(batches(release, with_extra=True))
    mode = data.draw(st.sampled_from(modes_for(release)))
    payload = encode_batch(batch, release, mode)
    assert decode_batch(payload) == normalized(batch, release, mode)
    # re-encoding the decoded batch gives the same bytes (hashes already in normal form)
    again = encode_batch(decode_batch(payload), release, "bytes" if mode == "bytes" else "int")
    if mode != "signed":
        assert again == payload


# --- oracle: msgspec structs as each vLLM release declares them -------------------------


def msgspec_types(release: Release) -> dict[str, type]:
    """vLLM's KV-event structs for ``release``, from the spec's tables (§4)."""

    class KVCacheEvent(
        msgspec.Struct,
        array_like=not release.map_events,
        omit_defaults=True,
        gc=False,
        tag=True,
    ):
        pass

    def event_struct(name: str, fields: tuple[WireField, ...]) -> type:
        spec = [
            (f.name, Any, None) if f.has_default else (f.name, Any)
            for f in fields
            if f.since <= release
        ]
        return msgspec.defstruct(name, spec, bases=(KVCacheEvent,))

    batch_fields: list[Any] = [("ts", float), ("events", list)]
    if release.has_dp_rank:
        batch_fields.append(("data_parallel_rank", Any, None))
    return {
        "BlockStored": event_struct("BlockStored", BLOCK_STORED_FIELDS),
        "BlockRemoved": event_struct("BlockRemoved", BLOCK_REMOVED_FIELDS),
        "AllBlocksCleared": event_struct("AllBlocksCleared", ()),
        "KVEventBatch": msgspec.defstruct(
            "KVEventBatch", batch_fields, array_like=True, omit_defaults=True, gc=False
        ),
    }


def msgspec_encode(batch: EventBatch, release: Release, mode: HashMode) -> bytes:
    types = msgspec_types(release)
    events: list[Any] = []
    for ev in batch.events:
        if isinstance(ev, UnknownEvent):
            events.append(msgspec.Raw(ev.raw))
            continue
        cls = types[type(ev).__name__]
        kw = {name: getattr(ev, name) for name in cls.__struct_fields__}
        if "block_hashes" in kw:
            kw["block_hashes"] = [wire_hash(h, mode) for h in kw["block_hashes"]]
        if kw.get("parent_block_hash") is not None:
            kw["parent_block_hash"] = wire_hash(kw["parent_block_hash"], mode)
        events.append(cls(**kw))
    args: list[Any] = [float(batch.ts), events]
    if release.has_dp_rank:
        args.append(0 if batch.dp_rank is None else batch.dp_rank)
    return msgspec.msgpack.Encoder().encode(types["KVEventBatch"](*args))


@pytest.mark.parametrize("release", SUPPORTED_RELEASES, ids=str)
@PROPERTY
@given(data=st.data())
def test_matches_msgspec(release: Release, data: st.DataObject) -> None:
    batch = data.draw(batches(release, with_extra=False))
    mode = data.draw(st.sampled_from(modes_for(release)))
    assert encode_batch(batch, release, mode) == msgspec_encode(batch, release, mode)


def test_msgspec_oracle_reproduces_the_spec_dumps() -> None:
    """The oracle itself is faithful: it yields the real vLLM bytes of §11."""
    old = EventBatch(TS, [BlockStored([D2], D1, list(TOKENS), 4), BlockRemoved([D1])])
    assert msgspec_encode(old, Release(0, 9, 0), "signed") == GOLDEN["v0_9_0_signed"]
    new = EventBatch(TS, [gpu_stored(D1), BlockRemoved([D1], "GPU", 0)], 0)
    assert msgspec_encode(new, Release(0, 23, 0), "int") == GOLDEN["v0_23_0_uint"]
    assert msgspec_encode(new, Release(0, 33, 0), "int") == GOLDEN["v0_33_0_map"]
    cleared = EventBatch(TS, [gpu_stored(None), AllBlocksCleared()], 0)
    assert msgspec_encode(cleared, Release(0, 33, 0), "bytes") == GOLDEN["v0_33_0_bytes"]


@pytest.mark.parametrize("release", ["0.30.0", "0.33.0", "0.34.0"])
def test_full_block_stored_map_matches_msgspec(release: str) -> None:
    rel = Release.parse(release)
    full = BlockStored(
        [D1, D2],
        D1,
        list(TOKENS) * 2,
        4,
        lora_id=3,
        medium="CPU",
        lora_name="adapter",
        extra_keys=[["adapter", 1], None],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=4096,
        locality="LOCAL",
        ownership="kvcr",
        session_id="s-1",
        lookahead_token_ids=[[1], [2]] if rel.stored_fields[-1] == "lookahead_token_ids" else None,
    )
    batch = EventBatch(TS, [full], 7)
    assert encode_batch(batch, rel) == msgspec_encode(batch, rel, "int")
