"""What the sequencer says: the actions it emits for the I/O layer, and why seqs are lost.

:class:`~bridge.ingest.sequencer.StreamSequencer` answers every input with a list of these.
The I/O layer (:mod:`bridge.ingest.subscriber`) sends replay requests and resets the DEALER;
the pipeline (:mod:`bridge.ingest.pipeline`) turns the rest into records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bridge.log.markers import TAIL_END

__all__ = [
    "LOST_BEFORE_FIRST_CONTACT",
    "LOST_NOT_IN_REPLAY_BUFFER",
    "LOST_REASONS",
    "LOST_REPLAY_COOLDOWN",
    "LOST_REPLAY_DISABLED",
    "LOST_REPLAY_INCOMPLETE",
    "LOST_REPLAY_TIMED_OUT",
    "LOST_RESTARTED",
    "LOST_RESTARTED_DURING_REPLAY",
    "LOST_SEQ_JUMP",
    "LOST_UNKNOWN_TAIL",
    "TAIL_END",
    "Action",
    "Deliver",
    "EventsLost",
    "PublisherRestarted",
    "ResetReplay",
    "SendReplay",
    "StreamStarted",
]

# Reasons carried by EventsLost (stable strings: usable as metric labels).
LOST_BEFORE_FIRST_CONTACT = "before first contact"  # published before we listened, no replay
LOST_NOT_IN_REPLAY_BUFFER = "not in replay buffer"  # evicted from the ring, or never buffered
LOST_REPLAY_DISABLED = "replay disabled"
LOST_REPLAY_COOLDOWN = "replay cooling down"  # a recent replay round gave up
LOST_REPLAY_TIMED_OUT = "replay timed out"  # gave up; the last attempt timed out
LOST_REPLAY_INCOMPLETE = "replay incomplete"  # gave up; the last reply had a hole or stopped short
LOST_RESTARTED_DURING_REPLAY = "publisher restarted during replay"
LOST_RESTARTED = "publisher restarted"
# The open end of an epoch closed by a restart or a seq jump: whatever the old incarnation
# published after the last seq accounted (its last batches dropped by the PUB, or heard after
# a reconnect whose incarnation was then unknown) can never be known. to_seq is TAIL_END.
LOST_UNKNOWN_TAIL = "unknown tail"
LOST_SEQ_JUMP = "seq jump"  # a seq too far ahead to be a gap: the stream starts afresh
LOST_REASONS = frozenset(
    {
        LOST_BEFORE_FIRST_CONTACT,
        LOST_NOT_IN_REPLAY_BUFFER,
        LOST_REPLAY_DISABLED,
        LOST_REPLAY_COOLDOWN,
        LOST_REPLAY_TIMED_OUT,
        LOST_REPLAY_INCOMPLETE,
        LOST_RESTARTED_DURING_REPLAY,
        LOST_RESTARTED,
        LOST_UNKNOWN_TAIL,
        LOST_SEQ_JUMP,
    }
)


@dataclass(frozen=True, slots=True)
class Deliver:
    """Batch ``seq`` of ``epoch``; ``replayed`` when it came from the replay socket."""

    epoch: int
    seq: int
    payload: bytes
    replayed: bool


@dataclass(frozen=True, slots=True)
class StreamStarted:
    """The stream's first epoch begins: consumers reset state for this stream.

    Every seq ``>= next_seq`` of the epoch is then delivered or reported lost, in order
    (``next_seq`` is 0: whatever was published before the bridge listened is reported lost).
    """

    epoch: int
    next_seq: int


@dataclass(frozen=True, slots=True)
class PublisherRestarted:
    """The publisher restarted (its seq went back): epoch ``epoch`` begins, reset state.

    ``last_seq`` is the last seq delivered in ``old_epoch`` (None if none); ``seq`` is the
    first seq known of the new incarnation: the live seq that revealed the restart, or, when a
    reconnect's check revealed it, the replayed ``last_seq`` (0 if the reply was empty). The
    new epoch is accounted from seq 0.
    """

    old_epoch: int
    epoch: int
    last_seq: int | None
    seq: int


@dataclass(frozen=True, slots=True)
class EventsLost:
    """Seqs ``from_seq..to_seq`` (inclusive) of ``epoch`` will never be delivered."""

    epoch: int
    from_seq: int
    to_seq: int
    reason: str


@dataclass(frozen=True, slots=True)
class SendReplay:
    """Send ``[b"", start_seq.to_bytes(8, "big")]`` on the DEALER; ``why`` is for the log."""

    start_seq: int
    why: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class ResetReplay:
    """Close and recreate the DEALER, so that replies to an abandoned request are dropped."""


Action = Deliver | StreamStarted | PublisherRestarted | EventsLost | SendReplay | ResetReplay
