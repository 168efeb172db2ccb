"""ZeroMQ multipart frames of vLLM's KV-event publisher, both sides (spec §2, §3). Pure.

Live (PUB → SUB): ``[topic, seq (8 bytes, unsigned big-endian), payload]``.
Replay request (DEALER → ROUTER): ``[b"", start_seq8]``; the ROUTER sees the
identity frame first. Replay reply (as received on the DEALER): one message per
buffered batch, ``[b"", seq8, payload]`` before 0.26.0 and
``[b"", topic, seq8, payload]`` from 0.26.0, then an end marker whose sequence
frame is ``END_SEQ``.

Received batches' seqs must be below 2**63: the record schema's ``seq`` is an Avro long,
and vLLM counts from 0, so a larger one is a corrupt frame (FrameError), not a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bridge.vllm.releases import Release, as_release

__all__ = [
    "END_SEQ",
    "REPLAY_END",
    "FrameError",
    "LiveMessage",
    "ReplayBatch",
    "ReplayEnd",
    "live_frames",
    "live_seq_payload",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "replay_end_frames",
    "replay_reply_frames",
    "replay_request",
]

END_SEQ = b"\xff" * 8
"""Sequence frame of the replay end marker: ``(-1).to_bytes(8, "big", signed=True)``."""

_MAX_SEQ = (1 << 64) - 1
_MAX_BATCH_SEQ = (1 << 63) - 1  # Avro long: the highest seq a record can carry


class FrameError(ValueError):
    """A multipart message that does not have the shape the protocol prescribes."""


@dataclass(slots=True, frozen=True)
class LiveMessage:
    topic: bytes
    seq: int
    payload: bytes


@dataclass(slots=True, frozen=True)
class ReplayBatch:
    """One replayed batch; ``topic`` is None for releases before 0.26.0 (none sent)."""

    topic: bytes | None
    seq: int
    payload: bytes


@dataclass(slots=True, frozen=True)
class ReplayEnd:
    """The end marker of a replay reply."""


REPLAY_END = ReplayEnd()


def _seq_bytes(seq: int) -> bytes:
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq <= _MAX_SEQ:
        raise ValueError(f"sequence number must be an int in [0, 2**64-1], got {seq!r}")
    return seq.to_bytes(8, "big")


def _seq_of(frame: bytes, what: str) -> int:
    if len(frame) != 8:
        raise FrameError(f"{what}: sequence frame must be exactly 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def _batch_seq(seq: int, what: str) -> int:
    if seq > _MAX_BATCH_SEQ:
        raise FrameError(
            f"{what}: value out of range: seq {seq} (must be <= 2**63-1, an Avro long)"
        )
    return seq


def parse_live(frames: Sequence[bytes]) -> LiveMessage:
    """A PUB message ``[topic, seq8, payload]``; FrameError for any other shape."""
    seq, payload = live_seq_payload(frames)
    return LiveMessage(bytes(frames[0]), seq, payload)


def live_seq_payload(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """:func:`parse_live`'s checks, returning only ``(seq, payload)``: the bridge's hot path,
    which needs neither the topic nor a :class:`LiveMessage` per batch."""
    if len(frames) != 3:
        raise FrameError(
            f"live message: expected 3 frames [topic, seq, payload], got {len(frames)}"
        )
    seq = _seq_of(frames[1], "live message")
    if seq > _MAX_BATCH_SEQ:
        _batch_seq(seq, "live message")
    return seq, bytes(frames[2])


def live_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The frames vLLM's PUB socket sends for one batch."""
    return [topic, _seq_bytes(seq), payload]


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch with ``seq >= start_seq``."""
    return [b"", _seq_bytes(start_seq)]


def parse_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int]:
    """ROUTER side: ``[identity, b"", seq8]`` -> ``(identity, start_seq)``.

    Any other shape raises FrameError; vLLM ignores such requests without a reply.
    """
    if len(frames) != 3:
        raise FrameError(
            f"replay request: expected 3 frames [identity, b'', seq] on the ROUTER, "
            f"got {len(frames)} (a DEALER must send [b'', seq])"
        )
    identity, delimiter, seq = frames
    if len(delimiter) != 0:
        raise FrameError("replay request: the frame after the identity must be empty")
    return bytes(identity), _seq_of(seq, "replay request")


def parse_replay_reply(frames: Sequence[bytes]) -> ReplayBatch | ReplayEnd:
    """One replay reply message as received on a DEALER, for any release (spec §3.2).

    The leading empty frame is dropped; the sequence is the second-to-last frame
    and marks the end iff it is ``END_SEQ``; with 3 frames left the first is the topic.
    """
    if not 3 <= len(frames) <= 4:
        raise FrameError(
            f"replay reply: expected 3 or 4 frames ([b'', (topic,) seq, payload]), "
            f"got {len(frames)}"
        )
    if len(frames[0]) != 0:
        raise FrameError("replay reply: the first frame must be the empty delimiter")
    seq = _seq_of(frames[-2], "replay reply")
    if seq == _MAX_SEQ:
        return REPLAY_END
    topic = bytes(frames[1]) if len(frames) == 4 else None
    return ReplayBatch(topic, _batch_seq(seq, "replay reply"), bytes(frames[-1]))


def replay_reply_frames(
    release: Release | str, topic: bytes, seq: int, payload: bytes
) -> list[bytes]:
    """What ``release``'s ROUTER sends after the identity frame for one replayed batch."""
    seq8 = _seq_bytes(seq)
    if seq8 == END_SEQ:
        raise ValueError("a replayed batch cannot have seq 2**64-1: it reads as the end marker")
    if as_release(release).replay_has_topic:
        return [b"", topic, seq8, payload]
    return [b"", seq8, payload]


def replay_end_frames(release: Release | str) -> list[bytes]:
    """What ``release``'s ROUTER sends after the identity frame to end a replay."""
    if as_release(release).replay_has_topic:
        return [b"", b"", END_SEQ, b""]
    return [b"", END_SEQ, b""]
