"""bridge.vllm.framing: live and replay frames, both sides, incl. real ZeroMQ sockets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from bridge.vllm.framing import (
    END_SEQ,
    REPLAY_END,
    FrameError,
    LiveMessage,
    ReplayBatch,
    ReplayEnd,
    live_frames,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
    replay_request,
)
from bridge.vllm.releases import Release

SEQ5 = bytes.fromhex("0000000000000005")
PAYLOAD = bytes.fromhex("93cb41da556e402000009000")
seqs = st.integers(0, 2**63 - 1)  # batch seqs: Avro longs (2**63.. are refused)


def test_end_seq_is_minus_one_as_signed_int64() -> None:
    assert END_SEQ == (-1).to_bytes(8, "big", signed=True) == b"\xff" * 8


# --- live -------------------------------------------------------------------------------


def test_live_frames_and_parse() -> None:
    frames = live_frames(b"kv@10.0.0.1@m", 5, PAYLOAD)
    assert frames == [b"kv@10.0.0.1@m", SEQ5, PAYLOAD]
    assert parse_live(frames) == LiveMessage(b"kv@10.0.0.1@m", 5, PAYLOAD)
    top = (2**63 - 1).to_bytes(8, "big")
    assert parse_live([b"", top, b""]) == LiveMessage(b"", 2**63 - 1, b"")


@given(st.binary(max_size=20), st.integers(0, 2**63 - 1), st.binary(max_size=50))
def test_live_round_trip(topic: bytes, seq: int, payload: bytes) -> None:
    assert parse_live(live_frames(topic, seq, payload)) == LiveMessage(topic, seq, payload)


@pytest.mark.parametrize(
    "frames, message",
    [
        ([SEQ5, PAYLOAD], "expected 3 frames [topic, seq, payload], got 2"),
        ([b"t", SEQ5, PAYLOAD, b""], "got 4"),
        ([b"t", SEQ5[1:], PAYLOAD], "exactly 8 bytes, got 7"),
        ([b"t", SEQ5 + b"\x00", PAYLOAD], "exactly 8 bytes, got 9"),
    ],
)
def test_parse_live_refuses(frames: list[bytes], message: str) -> None:
    with pytest.raises(FrameError) as info:
        parse_live(frames)
    assert message in str(info.value)


@pytest.mark.parametrize("seq", [-1, 2**64, True, 1.0])
def test_builders_refuse_bad_seq(seq: object) -> None:
    with pytest.raises(ValueError, match="sequence number"):
        live_frames(b"", seq, b"")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sequence number"):
        replay_request(seq)  # type: ignore[arg-type]


# --- replay (spec §11.5) ----------------------------------------------------------------


def test_spec_example_exchange_0_26_and_later() -> None:
    assert replay_request(5) == [b"", SEQ5]
    identity = bytes.fromhex("006b8b4567")
    assert parse_replay_request([identity, b"", SEQ5]) == (identity, 5)
    reply = replay_reply_frames("0.26.0", b"kv-events", 5, PAYLOAD)
    assert reply == [b"", bytes.fromhex("6b762d6576656e7473"), SEQ5, PAYLOAD]
    assert parse_replay_reply(reply) == ReplayBatch(b"kv-events", 5, PAYLOAD)
    end = replay_end_frames(Release(0, 34, 0))
    assert end == [b"", b"", b"\xff" * 8, b""]
    assert parse_replay_reply(end) is REPLAY_END


def test_spec_example_exchange_before_0_26() -> None:
    reply = replay_reply_frames("0.25.1", b"kv-events", 5, PAYLOAD)
    assert reply == [b"", SEQ5, PAYLOAD]
    assert parse_replay_reply(reply) == ReplayBatch(None, 5, PAYLOAD)
    end = replay_end_frames("0.9.0")
    assert end == [b"", b"\xff" * 8, b""]
    result = parse_replay_reply(end)
    assert isinstance(result, ReplayEnd) and result == REPLAY_END


@pytest.mark.parametrize("release", ["0.9.0", "0.25.1", "0.26.0", "0.34.0"])
@given(topic=st.binary(max_size=12), seq=seqs, payload=st.binary(max_size=30))
def test_replay_round_trip(release: str, topic: bytes, seq: int, payload: bytes) -> None:
    got = parse_replay_reply(replay_reply_frames(release, topic, seq, payload))
    has_topic = Release.parse(release).replay_has_topic
    assert got == ReplayBatch(topic if has_topic else None, seq, payload)
    assert parse_replay_reply(replay_end_frames(release)) is REPLAY_END
    assert parse_replay_request([b"id", *replay_request(seq)]) == (b"id", seq)


def test_topic_of_eight_ff_bytes_is_not_an_end_marker() -> None:
    reply = replay_reply_frames("0.26.0", END_SEQ, 3, b"\x90")
    assert parse_replay_reply(reply) == ReplayBatch(END_SEQ, 3, b"\x90")


def test_replayed_seq_cannot_be_the_end_marker() -> None:
    with pytest.raises(ValueError, match="end marker"):
        replay_reply_frames("0.26.0", b"", 2**64 - 1, b"")


@pytest.mark.parametrize(
    "frames, message",
    [
        ([b"id", SEQ5], "expected 3 frames [identity, b'', seq] on the ROUTER, got 2"),
        ([b"id", b"", SEQ5, b""], "got 4"),
        ([b"id", b"x", SEQ5], "must be empty"),
        ([b"id", b"", SEQ5[:4]], "exactly 8 bytes, got 4"),
    ],
)
def test_parse_replay_request_refuses(frames: list[bytes], message: str) -> None:
    with pytest.raises(FrameError) as info:
        parse_replay_request(frames)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "frames, message",
    [
        ([SEQ5, PAYLOAD], "expected 3 or 4 frames"),
        ([b"", b"t", b"t", SEQ5, PAYLOAD], "got 5"),
        ([b"x", SEQ5, PAYLOAD], "empty delimiter"),
        ([b"", SEQ5[:7], PAYLOAD], "exactly 8 bytes, got 7"),
        ([b"", b"kv", b"", END_SEQ], "exactly 8 bytes, got 0"),
    ],
)
def test_parse_replay_reply_refuses(frames: list[bytes], message: str) -> None:
    with pytest.raises(FrameError) as info:
        parse_replay_reply(frames)
    assert message in str(info.value)


def test_release_is_checked() -> None:
    with pytest.raises(ValueError, match="newer than the newest"):
        replay_end_frames("0.40.0")


# --- over real ZeroMQ sockets -----------------------------------------------------------


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _recv(sock: zmq.Socket, timeout_ms: int = 5000) -> list[bytes]:
    assert sock.poll(timeout_ms, zmq.POLLIN), "no message within the timeout"
    return sock.recv_multipart()


@pytest.mark.parametrize("release", ["0.25.1", "0.26.0"])
def test_dealer_router_exchange(ctx: zmq.Context, release: str) -> None:
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")

    dealer.send_multipart(replay_request(5))
    identity, start = parse_replay_request(_recv(router))
    assert start == 5
    for seq in (start, start + 1):
        router.send_multipart([identity, *replay_reply_frames(release, b"kv-events", seq, PAYLOAD)])
    router.send_multipart([identity, *replay_end_frames(release)])

    got = [parse_replay_reply(_recv(dealer)) for _ in range(3)]
    topic = b"kv-events" if Release.parse(release).replay_has_topic else None
    assert got == [ReplayBatch(topic, 5, PAYLOAD), ReplayBatch(topic, 6, PAYLOAD), REPLAY_END]


def test_single_frame_request_is_refused_as_vllm_would(ctx: zmq.Context) -> None:
    """AIBrix's request (seq frame only, no delimiter) arrives as 2 frames: not a request."""
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(SEQ5)
    with pytest.raises(FrameError):
        parse_replay_request(_recv(router))


def test_pub_sub_live_frames(ctx: zmq.Context) -> None:
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    # Slow joiner: publish until the subscription has reached the publisher.
    seq = 0
    while not sub.poll(50, zmq.POLLIN):
        assert seq < 200, "subscriber never received anything"
        pub.send_multipart(live_frames(b"kv", seq, PAYLOAD))
        seq += 1
    message = parse_live(sub.recv_multipart())
    assert message.topic == b"kv" and message.payload == PAYLOAD and 0 <= message.seq < seq


@pytest.mark.parametrize("seq", [2**63, 2**64 - 2])
def test_received_batch_seqs_past_an_avro_long_are_frame_errors(seq: int) -> None:
    # vLLM counts from 0; a record's seq is an Avro long, so such a batch could not be written.
    with pytest.raises(FrameError, match=f"live message: value out of range: seq {seq}"):
        parse_live(live_frames(b"t", seq, PAYLOAD))
    for release in ("0.25.1", "0.26.0"):
        with pytest.raises(FrameError, match=f"replay reply: value out of range: seq {seq}"):
            parse_replay_reply(replay_reply_frames(release, b"t", seq, PAYLOAD))
    assert parse_replay_reply([b"", b"", END_SEQ, b""]) is REPLAY_END  # the end marker stays
