"""The hand-written Avro encoder (bridge.log.avro) writes exactly what fastavro writes."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from bridge.log import avro as avro_encode
from bridge.log.markers import EventsLost, PodRemoved, PublisherRestarted, StreamStarted
from bridge.log.records import Envelope, RecordCodec, schema_dir
from bridge.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, UnknownEvent

LONG_MIN, LONG_MAX = -(1 << 63), (1 << 63) - 1
TEXT = ["", "GPU", "cpu", "ünïcødé", "模型", "emoji 🚀", "x" * 63, "y" * 64, "z" * 300]


def rand_long(rng: random.Random) -> int:
    return rng.choice(
        [
            0,
            1,
            -1,
            63,
            64,
            -64,
            -65,
            127,
            128,
            8191,
            8192,
            LONG_MIN,
            LONG_MAX,
            rng.randint(-(1 << 40), 1 << 40),
            rng.randint(LONG_MIN, LONG_MAX),
            rng.randint(0, 200_000),
        ]
    )


def rand_bytes(rng: random.Random) -> bytes:
    return rng.randbytes(rng.choice([0, 1, 8, 8, 32, 32, 63, 64, 65, 200]))


def opt(rng: random.Random, make: Any) -> Any:
    return None if rng.random() < 0.5 else make(rng)


def rand_text(rng: random.Random) -> str:
    return (
        rng.choice(TEXT)
        if rng.random() < 0.7
        else "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(0, 80)))
    )


def rand_extra(rng: random.Random) -> dict[str, bytes]:
    if rng.random() < 0.5:
        return {}
    return {rand_text(rng) + str(i): rand_bytes(rng) for i in range(rng.randint(1, 70))}


def rand_tokens(rng: random.Random) -> list[int]:
    kind = rng.random()
    n = rng.choice([0, 1, 16, 64, 65, 512])
    if kind < 0.6:
        return [rng.randint(0, 150_000) for _ in range(n)]
    if kind < 0.8:  # past the varint table, up to 64 bits, negative
        return [rand_long(rng) for _ in range(n)]
    return [rng.randint(0, 3_000_000) for _ in range(n)]


def rand_hashes(rng: random.Random) -> list[bytes]:
    n = rng.choice([0, 1, 1, 2, 5, 32, 70])
    mode = rng.random()
    if mode < 0.4:
        return [rng.randbytes(8) for _ in range(n)]
    if mode < 0.8:
        return [rng.randbytes(32) for _ in range(n)]
    return [rand_bytes(rng) for _ in range(n)]


def rand_event(rng: random.Random) -> Any:
    kind = rng.randrange(8)
    if kind == 0:
        return BlockStored(
            block_hashes=rand_hashes(rng),
            parent_block_hash=opt(rng, rand_bytes),
            token_ids=rand_tokens(rng),
            block_size=rand_long(rng),
            lora_id=opt(rng, rand_long),
            medium=opt(rng, rand_text),
            lora_name=opt(rng, rand_text),
            extra_keys=opt(
                rng,
                lambda r: [
                    r.choice([None, 1, "k", [1, "a", b"\x00"], {"x": -5}, 2**63])
                    for _ in range(r.choice([0, 1, 3, 70]))
                ],
            ),
            group_idx=opt(rng, rand_long),
            kv_cache_spec_kind=opt(rng, rand_text),
            kv_cache_spec_sliding_window=opt(rng, rand_long),
            locality=opt(rng, rand_text),
            ownership=opt(rng, rand_text),
            session_id=opt(rng, rand_text),
            lookahead_token_ids=opt(
                rng, lambda r: [rand_tokens(r) for _ in range(r.choice([0, 1, 2, 66]))]
            ),
            extra=rand_extra(rng),
        )
    if kind == 1:
        return BlockRemoved(
            rand_hashes(rng),
            medium=opt(rng, rand_text),
            group_idx=opt(rng, rand_long),
            locality=opt(rng, rand_text),
            ownership=opt(rng, rand_text),
            extra=rand_extra(rng),
        )
    if kind == 2:
        return AllBlocksCleared(extra=rand_extra(rng))
    if kind == 3:
        return UnknownEvent(rand_text(rng), rand_bytes(rng))
    if kind == 4:
        return StreamStarted(rand_long(rng), rand_text(rng))
    if kind == 5:
        return PublisherRestarted(rand_long(rng), opt(rng, rand_long), rand_long(rng))
    if kind == 6:
        return EventsLost(rand_long(rng), rand_long(rng), rand_text(rng))
    return PodRemoved(rand_text(rng))


def rand_envelope(rng: random.Random) -> Envelope:
    return Envelope(
        pod=rand_text(rng),
        model=rand_text(rng),
        dp_rank=rng.choice([0, 1, 7, 1000, -1]),
        epoch=rand_long(rng),
        seq=rand_long(rng),
        index=rng.choice([-1, 0, 1, 63, 64, 1023, 1024, 100_000]),
        ts=rng.choice([0.0, 1.5, -2.25, 1_767_225_600.123456, rng.random() * 2e9]),
        batch_extra=rand_extra(rng),
    )


@pytest.fixture(scope="module")
def codec() -> RecordCodec:
    return RecordCodec()


def test_the_repository_schema_takes_the_fast_path(codec: RecordCodec) -> None:
    # If this fails, kv_event.avsc changed: update bridge/log/avro.py (and its
    # SCHEMA_FINGERPRINT) to the new schema, then this file's randomized checks must pass.
    assert codec._fast
    assert codec.fingerprint == avro_encode.SCHEMA_FINGERPRINT


@pytest.mark.parametrize("seed", range(6))
def test_randomized_events_encode_byte_for_byte_like_fastavro(
    codec: RecordCodec, seed: int
) -> None:
    rng = random.Random(seed)
    kinds = set()
    for _ in range(400):
        env, event = rand_envelope(rng), rand_event(rng)
        kinds.add(type(event))
        fast = codec.encode(env, event)
        assert fast == codec.encode_reference(env, event), (env, event)
        back = codec.decode(fast)
        assert back.envelope.index == env.index and back.envelope.seq == env.seq
    assert len(kinds) == 8


def test_encode_batch_equals_encode_of_each_event(codec: RecordCodec) -> None:
    rng = random.Random(42)
    for _ in range(100):
        env = rand_envelope(rng)
        events = [rand_event(rng) for _ in range(rng.choice([0, 1, 7, 40]))]
        values = codec.encode_batch(
            env.pod, env.model, env.dp_rank, env.epoch, env.seq, env.ts, env.batch_extra, events
        )
        assert len(values) == len(events)
        for i, (value, event) in enumerate(zip(values, events, strict=True)):
            e = Envelope(env.pod, env.model, env.dp_rank, env.epoch, env.seq, i, env.ts)
            e.batch_extra = env.batch_extra
            assert value == codec.encode_reference(e, event)


def test_registry_header_is_the_prefix(codec: RecordCodec) -> None:
    header = b"\x00" + (1234).to_bytes(4, "big")
    reg = RecordCodec(header=header)
    env = Envelope("pod-a", "m", 0, 5, 6, 0, 1.0)
    event = BlockRemoved([b"\x01" * 8])
    value = reg.encode(env, event)
    assert value.startswith(header)
    assert value[len(header) :] == codec.encode(env, event)[len(codec.header) :]
    batch = reg.encode_batch("pod-a", "m", 0, 5, 6, 1.0, {}, [event])
    assert batch == [value]


@pytest.mark.parametrize("bad", [1 << 63, -(1 << 63) - 1, 1 << 64])
def test_out_of_range_longs_fail_like_fastavro(codec: RecordCodec, bad: int) -> None:
    env = Envelope("p", "m", 0, 1, 2, 0, 1.0)
    event = BlockStored([b"\x00" * 8], None, [1, bad], 16)
    with pytest.raises(OverflowError):
        codec.encode_reference(env, event)
    with pytest.raises(OverflowError):
        codec.encode(env, event)


def test_other_schemas_use_fastavro(tmp_path: Path, codec: RecordCodec) -> None:
    raw = json.loads((schema_dir() / "kv_event.avsc").read_text())
    raw["fields"].insert(2, {"name": "zone", "type": "string", "default": "eu"})
    path = tmp_path / "kv_event.avsc"
    path.write_text(json.dumps(raw))
    other = RecordCodec(path)
    assert not other._fast
    env = Envelope("p", "m", 0, 1, 2, 0, 1.0)
    event = BlockRemoved([b"\x00" * 8])
    # fastavro fills the new field's default; the hand-written encoder would not know it.
    value = other.encode(env, event)
    assert value == other.encode_reference(env, event)
    assert value[len(other.header) :] != codec.encode(env, event)[len(codec.header) :]
    assert other.encode_batch("p", "m", 0, 1, 2, 1.0, {}, [event]) == [value]


def test_encode_batch_past_the_index_table(codec: RecordCodec) -> None:
    events = [BlockRemoved([i.to_bytes(8, "big")]) for i in range(1030)]
    values = codec.encode_batch("p", "m", 0, 1, 2, 3.0, {}, events)
    for i in (0, 1023, 1024, 1029):
        env = Envelope("p", "m", 0, 1, 2, i, 3.0)
        assert values[i] == codec.encode_reference(env, events[i])
