"""Sequencing of one (pod, dp_rank) KV-event stream: gaps, replay, restarts. Sans-I/O.

vLLM numbers its batches 0, 1, 2, ... per publisher incarnation, sends them on a PUB socket
(which may drop) and keeps the last N in a replay buffer behind a ROUTER socket (spec §2, §3).
:class:`StreamSequencer` turns what arrives on the two sockets into a complete, ordered account
of the stream: inputs go in (``on_*`` methods, with the caller's clock ``now`` in seconds), a
list of actions comes out. It does no I/O, starts no threads and never reads a clock.

Guarantees, for every input sequence:

* per epoch, :class:`Deliver` and :class:`EventsLost` actions account for the seqs
  ``0, 1, 2, ...`` contiguously and in order: each seq is either delivered once or reported
  lost once, never both, and the seqs accounted always reach the highest seq seen so far
  whenever no replay is under way (not counting live messages discarded by a reconnect's
  check, below);
* :class:`StreamStarted` opens the first epoch, :class:`PublisherRestarted` each later one,
  before any other action of that epoch, and no action of an epoch follows its successor's
  opening;
* a payload is delivered exactly as it was received for that seq;
* an epoch never mixes incarnations of the publisher, except after a reconnect whose
  incarnation could not be checked (counted in ``unverified_reconnects``, see below).

Restarts show themselves on the live socket when the seq goes back. A restart while the bridge
is disconnected does not when the new incarnation is already past our last delivered seq, so a
reconnect of an epoch that delivered something checks the incarnation first: its replay asks
from ``last_seq`` (not ``last_seq + 1``) and compares that batch's payload with the one we
delivered (vLLM replays the bytes it sent, spec §3.3). Until the first reply decides, live
messages are held. The first reply:

* ``last_seq`` with the same payload: same incarnation, the reply goes on as usual;
* ``last_seq`` with another payload, or the end marker with no batch ``>= last_seq`` (the same
  incarnation still buffers ``last_seq`` or, if it evicted it, newer batches): restarted. The
  old epoch is accounted up to what was known of it at the reconnect, the live messages held
  since the reconnect are discarded (their incarnation is unknown; the replay fetches them
  again), :class:`PublisherRestarted` opens the new epoch and, as on first contact, a new
  replay asks from 0 (the rest of the deciding reply is abandoned with :class:`ResetReplay`:
  it started at ``last_seq`` and could not be trusted apart from that replay anyway);
* a later seq: undecidable (``last_seq`` evicted, or a new incarnation far ahead), taken as
  the same incarnation; so is a reconnect whose check cannot run (replay disabled, cooling
  down) or whose recovery gives up before any reply.

A checking attempt that times out is retried like any other, and each retry checks again.
Only reconnects check: a gap's replay asks from ``next_seq``. The first reply of an attempt
cannot be lost to the ROUTER's send high-water mark (the DEALER's queue was drained or
the DEALER recreated), so an empty reply is a real answer. A reconnect before anything of the
epoch was accounted (first contact) forgets what it heard and replays from 0 afresh.

The I/O layer executes :class:`SendReplay` and :class:`ResetReplay`, calls :meth:`on_tick`
whenever ``now >= next_deadline()``, maps a replay reply whose seq frame is ``ff`` x 8 to
:meth:`StreamSequencer.on_replay_end`, and forwards everything else to the consumers.
Timers fire only in :meth:`StreamSequencer.on_tick`.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass
from typing import Literal

from bridge.ingest.actions import (
    LOST_BEFORE_FIRST_CONTACT,
    LOST_NOT_IN_REPLAY_BUFFER,
    LOST_REPLAY_COOLDOWN,
    LOST_REPLAY_DISABLED,
    LOST_REPLAY_INCOMPLETE,
    LOST_REPLAY_TIMED_OUT,
    LOST_RESTARTED,
    LOST_RESTARTED_DURING_REPLAY,
    LOST_SEQ_JUMP,
    LOST_UNKNOWN_TAIL,
    TAIL_END,
    Action,
    Deliver,
    EventsLost,
    PublisherRestarted,
    ResetReplay,
    SendReplay,
    StreamStarted,
)

__all__ = ["SequencerConfig", "StreamSequencer", "payload_digest"]

_REFUSED = 2**64  # _attempt_prev once a reply of the attempt was refused: ignore the rest


def payload_digest(payload: bytes) -> bytes:
    """A short fingerprint of a batch payload, kept in checkpoints to recognise the batch."""
    return hashlib.blake2b(payload, digest_size=8).digest()


@dataclass(frozen=True, slots=True)
class SequencerConfig:
    replay_enabled: bool = True  # False: no replay endpoint -> every gap is lost at once
    first_contact: Literal["replay", "live"] = "replay"  # replay from 0 first, or live only
    replay_idle_timeout: float = 2.0  # s without any reply during an attempt -> attempt failed
    replay_deadline: float = 30.0  # s for one whole attempt
    replay_max_attempts: int = 3  # consecutive failed attempts before giving up on a gap
    backoff_initial: float = 0.2
    backoff_max: float = 5.0
    backoff_factor: float = 2.0
    replay_cooldown: float = 30.0  # after giving up, gaps within this time are lost at once
    max_held: int = 10_000  # live messages held while a replay runs
    # A live seq this far beyond the highest known is no gap but a discontinuity (a restart
    # the seq did not show, or a bug of the pod): the epoch ends with an unknown tail and a
    # new one starts at that seq. Replay replies beyond it are refused. vLLM's ring holds
    # 10,000 batches by default, so a larger gap could not be replayed anyway.
    max_seq_jump: int = 100_000

    def __post_init__(self) -> None:
        problems = []
        if self.first_contact not in ("replay", "live"):
            problems.append(f"first_contact must be 'replay' or 'live', not {self.first_contact!r}")
        if self.replay_idle_timeout <= 0 or self.replay_deadline <= 0:
            problems.append("replay_idle_timeout and replay_deadline must be > 0")
        if self.replay_max_attempts < 1:
            problems.append("replay_max_attempts must be >= 1")
        if self.backoff_initial < 0 or self.backoff_max < 0 or self.backoff_factor < 1:
            problems.append("backoff_initial and backoff_max must be >= 0, backoff_factor >= 1")
        if self.replay_cooldown < 0:
            problems.append("replay_cooldown must be >= 0")
        if self.max_held < 0:
            problems.append("max_held must be >= 0")
        if self.max_seq_jump < 1:
            problems.append("max_seq_jump must be >= 1")
        if problems:
            raise ValueError("invalid SequencerConfig: " + "; ".join(problems))


def _counter(name: str, doc: str) -> property:
    attr = "_n_" + name
    return property(lambda self: getattr(self, attr), doc=doc)


class StreamSequencer:
    """State machine for one (pod, dp_rank) stream. See the module docstring.

    State, per epoch: ``_next`` (every seq below it is accounted for), ``_live_max`` (highest
    seq seen on the live socket: a live seq at or below it means a restart), ``_seen_max``
    (highest seq known to exist, live or replayed; may lag ``_next - 1`` on the hot path),
    ``_held`` (live messages above ``_next``, increasing). A *recovery* runs while held or
    known seqs are unaccounted: attempts (one SendReplay each, then replies) separated by
    backoff waits; it ends in success (everything known accounted) or gives up. ``_verify``:
    a reconnect's incarnation check awaits its first reply (attempts ask from ``_last``);
    ``_verify_boundary`` / ``_verify_seen`` are ``_live_max`` / the highest known seq at that
    reconnect (held messages above the boundary arrived after it).
    """

    __slots__ = (
        "_cfg",
        "_epoch",
        "_expect",
        "_next",
        "_last",
        "_last_payload",
        "_last_digest",
        "_live_max",
        "_seen_max",
        "_held",
        "_started",
        "_recovering",
        "_in_flight",
        "_attempt_first",
        "_attempt_from",
        "_attempt_broken",
        "_attempt_start",
        "_attempt_prev",
        "_failures",
        "_backoff",
        "_idle_at",
        "_deadline_at",
        "_retry_at",
        "_cooldown_until",
        "_verify",
        "_verify_boundary",
        "_verify_seen",
        "_n_gaps",
        "_n_replays_requested",
        "_n_replays_succeeded",
        "_n_replays_failed",
        "_n_replays_given_up",
        "_n_duplicates_dropped",
        "_n_stale_replies",
        "_n_replay_discarded",
        "_n_held_dropped",
        "_n_restarts",
        "_n_lost",
        "_n_reconnects_verified",
        "_n_restarts_on_reconnect",
        "_n_unverified_reconnects",
        "_n_unverified_discarded",
        "_n_bad_replies",
        "_n_seq_jumps",
        "_n_unknown_tails",
    )

    def __init__(self, config: SequencerConfig, epoch: int) -> None:
        self._cfg = config
        self._epoch = epoch
        self._expect = -1  # == _next when the hot path applies, else -1
        self._next = 0
        self._last: int | None = None
        self._last_payload: bytes | None = None  # a reference, for the reconnect check
        self._last_digest: bytes | None = None  # instead, after resume(): payload_digest()
        self._live_max: int | None = None
        self._seen_max: int | None = None
        self._held: deque[tuple[int, bytes]] = deque()
        self._started = False  # StreamStarted / PublisherRestarted emitted for this epoch
        self._recovering = False
        self._in_flight = False
        self._attempt_first = False
        self._attempt_from = 0
        self._attempt_broken = False
        self._attempt_start = 0  # the seq the attempt's request asked from
        self._attempt_prev = -1  # the last seq of the attempt's reply so far
        self._failures = 0  # consecutive failed attempts (one that made progress counts 1)
        self._backoff = 0.0
        self._idle_at = 0.0
        self._deadline_at = 0.0
        self._retry_at = 0.0
        self._cooldown_until = float("-inf")
        self._verify = False
        self._verify_boundary = -1
        self._verify_seen = -1
        self._n_gaps = 0
        self._n_replays_requested = 0
        self._n_replays_succeeded = 0
        self._n_replays_failed = 0
        self._n_replays_given_up = 0
        self._n_duplicates_dropped = 0
        self._n_stale_replies = 0
        self._n_replay_discarded = 0
        self._n_held_dropped = 0
        self._n_restarts = 0
        self._n_lost = 0
        self._n_reconnects_verified = 0
        self._n_restarts_on_reconnect = 0
        self._n_unverified_reconnects = 0
        self._n_unverified_discarded = 0
        self._n_bad_replies = 0
        self._n_seq_jumps = 0
        self._n_unknown_tails = 0

    # ------------------------------------------------------------------ inputs

    def on_live(self, seq: int, payload: bytes, now: float) -> list[Action]:
        """A message ``[topic, seq, payload]`` arrived on the SUB socket."""
        if seq == self._expect:  # in order, nothing pending: the 99.9% case
            self._expect = self._next = seq + 1
            self._live_max = self._last = seq
            self._last_payload = payload
            return [Deliver(self._epoch, seq, payload, False)]
        return self._on_live_slow(seq, payload, now)

    def live_in_order(self, seq: int, payload: bytes) -> bool:
        """:meth:`on_live`'s hot path without an action list: True if ``seq`` is the next in
        order with nothing pending; it is then accepted, and the caller delivers it exactly as
        ``Deliver(epoch, seq, payload, False)``. False: nothing changed; call :meth:`on_live`."""
        if seq != self._expect:
            return False
        self._expect = self._next = seq + 1
        self._live_max = self._last = seq
        self._last_payload = payload
        return True

    def resume(self, last_seq: int, digest: bytes | None) -> None:
        """Continue this epoch after a bridge restart: ``last_seq`` was the last batch written
        (a checkpoint), ``digest`` its :func:`payload_digest` (None: unknown). Call before any
        input; the next :meth:`on_connect` replays from ``last_seq`` and checks the publisher's
        incarnation against ``digest`` like after any reconnect."""
        self._next = last_seq + 1
        self._last = self._live_max = self._seen_max = last_seq
        self._last_payload = None
        self._last_digest = digest
        self._started = True  # the epoch was opened by the bridge run that wrote the checkpoint
        self._sync()

    def _is_last_payload(self, payload: bytes) -> bool:
        if self._last_payload is not None:
            return payload == self._last_payload
        if self._last_digest is not None:
            return payload_digest(payload) == self._last_digest
        return True  # nothing to compare with (resumed at a loss marker): assume the same

    def on_connect(self, now: float) -> list[Action]:
        """The transport (re)connected: check the incarnation and replay what was missed."""
        out: list[Action] = []
        cfg = self._cfg
        if self._next == 0 and (self._held or self._seen_max is not None):
            # Nothing of this epoch accounted yet: what we heard may come from a publisher that
            # is gone, and nothing is owed to it. Start the first contact afresh.
            self._n_unverified_discarded += len(self._held)
            self._held.clear()
            self._live_max = self._seen_max = None
        can_replay = cfg.replay_enabled and now >= self._cooldown_until
        if self._last is not None and not self._verify:
            if can_replay:
                self._verify = True
                self._verify_boundary = -1 if self._live_max is None else self._live_max
                self._verify_seen = self._highest()
            else:
                self._n_unverified_reconnects += 1
        if can_replay:
            if self._recovering:
                self._restart_attempt(out, now, "reconnected during a replay")
            elif self._next > 0 or cfg.first_contact == "replay":
                why = "reconnected" if self._next > 0 else "first contact"
                self._begin_recovery(out, now, why)
        self._sync()
        return out

    def on_replay_batch(self, seq: int, payload: bytes, now: float) -> list[Action]:
        """A replayed batch ``seq`` arrived on the DEALER."""
        if not self._in_flight:
            self._n_stale_replies += 1
            return []
        self._idle_at = now + self._cfg.replay_idle_timeout
        out: list[Action] = []
        if self._attempt_prev == _REFUSED:
            self._n_replay_discarded += 1
            return out
        if not self._plausible_reply(seq):
            # Not an answer to our request: a ROUTER sends seqs >= the start, increasing, and
            # never far beyond what the publisher can have published. Believe nothing of this
            # reply: the attempt fails at its end (or timeout) and is retried.
            self._n_bad_replies += 1
            self._attempt_broken = True
            self._attempt_prev = _REFUSED
            return out
        self._attempt_prev = seq
        if self._verify:  # the first reply of a reconnect's check decides
            last = self._last
            assert last is not None
            if seq == last and not self._is_last_payload(payload):
                self._restarted_on_reconnect(out, seq, now)
                return out
            self._verify = False
            if seq == last:
                self._n_reconnects_verified += 1
                self._attempt_first = False  # a gap after the probe is a hole: retried
                self._release(out)  # live messages held while checking
                return out
            self._n_unverified_reconnects += 1
            self._release(out)
        first = self._attempt_first
        self._attempt_first = False
        if self._seen_max is None or seq > self._seen_max:
            self._seen_max = seq
        if self._attempt_broken:
            self._n_replay_discarded += 1
            return out
        nxt = self._next
        if seq < nxt:
            self._n_duplicates_dropped += 1
            return out
        if seq > nxt:
            if not first:
                # A hole inside the reply (a slow reader's batches dropped by the ROUTER before
                # vLLM 0.33, or a seq that was never buffered): retry from _next after the end.
                self._attempt_broken = True
                self._n_replay_discarded += 1
                return out
            # The first reply starts later: the ring no longer holds _next..seq-1.
            self._account_to(out, seq, LOST_NOT_IN_REPLAY_BUFFER)
        self._deliver(out, seq, payload, True)
        self._release(out)
        self._sync()
        return out

    def on_replay_sent(self, now: float) -> None:
        """The I/O wrote the last SendReplay only now (it waited for a fleet-wide replay slot):
        the attempt's idle timeout and deadline count from here."""
        if self._in_flight:
            self._idle_at = now + self._cfg.replay_idle_timeout
            self._deadline_at = now + self._cfg.replay_deadline

    def on_replay_end(self, now: float) -> list[Action]:
        """The end marker (seq ``ff`` x 8) arrived on the DEALER."""
        if not self._in_flight:
            self._n_stale_replies += 1
            return []
        out: list[Action] = []
        self._in_flight = False
        if self._verify and not self._attempt_broken:  # nothing >= last_seq buffered: restarted
            self._restarted_on_reconnect(out, 0, now)
            return out
        self._attempt_over(out, now, timed_out=False)
        self._sync()
        return out

    def on_tick(self, now: float) -> list[Action]:
        """Fire due timers (attempt timeouts, backoff)."""
        if not self._recovering:
            return []
        out: list[Action] = []
        if self._in_flight and (now >= self._idle_at or now >= self._deadline_at):
            self._in_flight = False
            out.append(ResetReplay())
            self._attempt_over(out, now, timed_out=True)
        if self._recovering and not self._in_flight and now >= self._retry_at:
            self._send(out, now, f"retry after {self._failures} failed attempt(s)")
        self._sync()
        return out

    def next_deadline(self) -> float | None:
        """When :meth:`on_tick` must be called next (None: no timer armed)."""
        if self._in_flight:
            return min(self._idle_at, self._deadline_at)
        if self._recovering:
            return self._retry_at
        return None

    # ------------------------------------------------------------------ properties

    @property
    def config(self) -> SequencerConfig:
        return self._cfg

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def last_seq(self) -> int | None:
        """Last seq delivered in the current epoch (None before any)."""
        return self._last

    @property
    def next_seq(self) -> int:
        """Lowest seq of the current epoch not yet delivered or reported lost."""
        return self._next

    @property
    def replay_in_flight(self) -> bool:
        """A replay request awaits replies (the DEALER should be read)."""
        return self._in_flight

    @property
    def recovering(self) -> bool:
        """A recovery is under way: an attempt in flight or a backoff wait before the next."""
        return self._recovering

    @property
    def held(self) -> int:
        """Live messages held until a replay fills the range below them."""
        return len(self._held)

    @property
    def verifying(self) -> bool:
        """A reconnect's incarnation check awaits its first reply (live messages are held)."""
        return self._verify

    def in_cooldown(self, now: float) -> bool:
        """True while gaps are reported lost without replay after a recovery gave up."""
        return now < self._cooldown_until

    gaps = _counter("gaps", "Live messages that skipped past the next expected seq.")
    replays_requested = _counter("replays_requested", "SendReplay actions emitted (attempts).")
    replays_succeeded = _counter("replays_succeeded", "Recoveries that ended complete.")
    replays_failed = _counter("replays_failed", "Attempts that timed out or came back short.")
    replays_given_up = _counter("replays_given_up", "Recoveries abandoned after max attempts.")
    duplicates_dropped = _counter("duplicates_dropped", "Messages for already accounted seqs.")
    stale_replies = _counter("stale_replies", "Replies arriving with no attempt in flight.")
    replay_discarded = _counter("replay_discarded", "Replies ignored beyond a hole in a reply.")
    held_dropped = _counter("held_dropped", "Live messages dropped because max_held were held.")
    restarts = _counter("restarts", "Publisher restarts detected.")
    lost = _counter("lost", "Seqs reported lost (sum of EventsLost range sizes).")
    reconnects_verified = _counter(
        "reconnects_verified", "Reconnect checks that found the same incarnation."
    )
    restarts_detected_on_reconnect = _counter(
        "restarts_on_reconnect", "Restarts revealed by a reconnect's check (also in restarts)."
    )
    unverified_reconnects = _counter(
        "unverified_reconnects",
        "Reconnects taken for the same incarnation unchecked: first reply above last_seq, "
        "no replay possible, or gave up before any reply.",
    )
    unverified_discarded = _counter(
        "unverified_discarded",
        "Live messages dropped because their incarnation was unknown (replayed again instead).",
    )

    bad_replies = _counter(
        "bad_replies",
        "Replay replies refused: below the requested seq, not increasing, or beyond max_seq_jump "
        "(each fails its attempt).",
    )
    seq_jumps = _counter(
        "seq_jumps", "Live seqs beyond max_seq_jump of the highest known: a new epoch each."
    )
    unknown_tails = _counter(
        "unknown_tails", "Epochs closed with an open-ended EventsLost (restart or seq jump)."
    )

    def __repr__(self) -> str:
        return (
            f"<StreamSequencer epoch={self._epoch} next={self._next} live_max={self._live_max}"
            f" held={len(self._held)} recovering={self._recovering} in_flight={self._in_flight}"
            f" verifying={self._verify}>"
        )

    # ------------------------------------------------------------------ internals

    def _on_live_slow(self, seq: int, payload: bytes, now: float) -> list[Action]:
        out: list[Action] = []
        live_max = self._live_max
        # A PUB never repeats a seq: going back (or to 0 after anything higher) is a restart.
        if (live_max is not None and seq <= live_max) or (seq == 0 and self._highest() > 0):
            self._restart(out, seq)
            live_max = None
        elif self._started and seq - self._highest() > self._cfg.max_seq_jump:
            self._jump(out, seq, payload)
            return out
        nxt = self._next
        expected = nxt if live_max is None else max(nxt, live_max + 1)
        if seq > expected and (live_max is not None or nxt > 0):
            self._n_gaps += 1
        self._live_max = seq
        if self._seen_max is None or seq > self._seen_max:
            self._seen_max = seq
        cfg = self._cfg
        if seq < nxt:  # already delivered from a replay
            self._n_duplicates_dropped += 1
        elif self._recovering:
            if seq == nxt and not self._held and not self._verify:
                self._deliver(out, seq, payload, False)
            else:
                self._hold(seq, payload)
        elif seq == nxt:
            self._deliver(out, seq, payload, False)
        elif nxt == 0:  # first message of this incarnation, and it is not seq 0
            if cfg.replay_enabled and cfg.first_contact == "replay" and now >= self._cooldown_until:
                self._hold(seq, payload)
                self._begin_recovery(out, now, f"first message is seq {seq}")
            else:
                self._lose(out, 0, seq - 1, LOST_BEFORE_FIRST_CONTACT)
                self._deliver(out, seq, payload, False)
        elif cfg.replay_enabled and now >= self._cooldown_until:
            self._hold(seq, payload)
            self._begin_recovery(out, now, f"gap: seq {seq} arrived, {nxt} expected")
        else:
            reason = LOST_REPLAY_COOLDOWN if cfg.replay_enabled else LOST_REPLAY_DISABLED
            self._lose(out, nxt, seq - 1, reason)
            self._deliver(out, seq, payload, False)
        self._sync()
        return out

    def _plausible_reply(self, seq: int) -> bool:
        if seq < self._attempt_start or seq <= self._attempt_prev:
            return False
        known = -1 if self._seen_max is None else self._seen_max
        return seq - max(known, self._attempt_start) <= self._cfg.max_seq_jump

    def _highest(self) -> int:
        seen = -1 if self._seen_max is None else self._seen_max
        return max(seen, self._next - 1)

    def _restart(self, out: list[Action], seq: int) -> None:
        self._n_restarts += 1
        if self._in_flight:
            out.append(ResetReplay())
        if self._verify:
            # Whatever arrived since the reconnect may be of any incarnation: drop it, and close
            # the old epoch with what was known of it at the reconnect.
            held = self._held
            while held and held[-1][0] > self._verify_boundary:
                held.pop()
                self._n_unverified_discarded += 1
            self._seen_max = self._verify_seen
            self._verify = False
        reason = LOST_RESTARTED_DURING_REPLAY if self._recovering else LOST_RESTARTED
        self._close_epoch(out, reason)
        old = self._epoch
        out.append(PublisherRestarted(old, old + 1, self._last, seq))
        self._new_epoch(0)
        self._started = True  # PublisherRestarted opens the new epoch

    def _close_epoch(self, out: list[Action], reason: str) -> None:
        """Account the epoch up to the highest seq known, then end it with its unknown tail:
        batches the old incarnation published after that (dropped by the PUB, or heard after
        a reconnect and discarded with their unknown incarnation) can never be fetched."""
        if self._seen_max is not None:
            self._account_to(out, self._seen_max + 1, reason)
        if self._started and self._next <= TAIL_END:
            out.append(EventsLost(self._epoch, self._next, TAIL_END, LOST_UNKNOWN_TAIL))
            self._n_unknown_tails += 1
            self._next = TAIL_END + 1

    def _new_epoch(self, next_seq: int) -> None:
        self._epoch += 1
        self._next = next_seq
        self._last = self._live_max = self._seen_max = None
        self._last_payload = None
        self._last_digest = None
        self._held.clear()
        self._started = False
        self._verify = False
        self._recovering = self._in_flight = False
        self._failures = 0

    def _jump(self, out: list[Action], seq: int, payload: bytes) -> None:
        """Live ``seq`` is beyond ``max_seq_jump`` of anything known: not a gap to replay (nor
        to count as lost batches) but a discontinuity. The epoch ends, and a new one starts
        at ``seq`` with StreamStarted, so consumers reset the stream's state."""
        self._n_seq_jumps += 1
        if self._in_flight:
            out.append(ResetReplay())
        self._close_epoch(out, LOST_SEQ_JUMP)
        self._new_epoch(seq)
        self._live_max = self._seen_max = seq
        self._deliver(out, seq, payload, False)  # StreamStarted(epoch, seq) first
        self._sync()

    def _restarted_on_reconnect(self, out: list[Action], seq: int, now: float) -> None:
        """A reconnect's check revealed a restart: new epoch, then a first contact."""
        self._n_restarts_on_reconnect += 1
        self._restart(out, seq)
        if self._cfg.first_contact == "replay":
            self._begin_recovery(out, now, "publisher restarted while disconnected")
        self._sync()

    def _hold(self, seq: int, payload: bytes) -> None:
        if len(self._held) < self._cfg.max_held:
            self._held.append((seq, payload))
        else:  # still in vLLM's ring: the recovery fetches it (it counts in _seen_max)
            self._n_held_dropped += 1

    def _begin_recovery(self, out: list[Action], now: float, why: str) -> None:
        self._recovering = True
        self._failures = 0
        self._send(out, now, why)

    def _restart_attempt(self, out: list[Action], now: float, why: str) -> None:
        if self._in_flight:
            out.append(ResetReplay())
        self._send(out, now, why)

    def _send(self, out: list[Action], now: float, why: str) -> None:
        # A reconnect's check asks from the last delivered seq, to compare its payload.
        if self._verify:
            why += f"; checking that seq {self._last} is unchanged"
        start = self._last if self._verify else self._next
        out.append(SendReplay(start, why))
        self._attempt_start = start
        self._attempt_prev = -1
        self._n_replays_requested += 1
        self._in_flight = True
        self._attempt_first = True
        self._attempt_broken = False
        self._attempt_from = self._next
        self._idle_at = now + self._cfg.replay_idle_timeout
        self._deadline_at = now + self._cfg.replay_deadline

    def _complete(self) -> bool:
        return (
            not self._verify
            and not self._held
            and (self._seen_max is None or self._next > self._seen_max)
        )

    def _attempt_over(self, out: list[Action], now: float, timed_out: bool) -> None:
        """An attempt ended (end marker or timeout; _in_flight already cleared)."""
        if self._complete():
            self._recovering = False
            self._failures = 0
            self._n_replays_succeeded += 1
            if not self._started:  # first contact, nothing ever published: start empty
                self._start(out)
            return
        progressed = self._next > self._attempt_from
        if progressed and not timed_out and not self._attempt_broken:
            # A clean reply that moved forward but stopped short (tail cut, or a new gap
            # appeared among the held messages): ask again at once.
            self._failures = 0
            self._send(out, now, "the reply stopped short; asking for the rest")
            return
        self._n_replays_failed += 1
        self._failures = 1 if progressed else self._failures + 1
        reason = LOST_REPLAY_TIMED_OUT if timed_out else LOST_REPLAY_INCOMPLETE
        cfg = self._cfg
        if self._failures >= cfg.replay_max_attempts:
            self._give_up(out, now, reason)
            return
        if self._failures == 1:
            self._backoff = cfg.backoff_initial
        else:  # grown step by step: no float overflow however many attempts are allowed
            self._backoff = min(cfg.backoff_max, self._backoff * cfg.backoff_factor)
        self._retry_at = now + min(cfg.backoff_max, self._backoff)

    def _give_up(self, out: list[Action], now: float, reason: str) -> None:
        self._n_replays_given_up += 1
        if self._verify:  # no reply decided: keep following, unchecked
            self._verify = False
            self._n_unverified_reconnects += 1
        self._recovering = False
        self._failures = 0
        self._cooldown_until = now + self._cfg.replay_cooldown
        if self._seen_max is not None:
            self._account_to(out, self._seen_max + 1, reason)

    def _start(self, out: list[Action]) -> None:
        out.append(StreamStarted(self._epoch, self._next))
        self._started = True

    def _deliver(self, out: list[Action], seq: int, payload: bytes, replayed: bool) -> None:
        """Deliver ``seq``, which must equal ``_next``."""
        if not self._started:
            self._start(out)
        out.append(Deliver(self._epoch, seq, payload, replayed))
        self._next = seq + 1
        self._last = seq
        self._last_payload = payload

    def _lose(self, out: list[Action], first: int, last: int, reason: str) -> None:
        """Report ``first..last`` lost; ``first`` must equal ``_next``."""
        if not self._started:
            self._start(out)
        out.append(EventsLost(self._epoch, first, last, reason))
        self._n_lost += last - first + 1
        self._next = last + 1

    def _account_to(self, out: list[Action], end: int, reason: str) -> None:
        """Account every seq below ``end``: held ones delivered, the others lost, in order."""
        held = self._held
        while held and held[0][0] < end:
            seq, payload = held.popleft()
            if seq < self._next:
                self._n_duplicates_dropped += 1
                continue
            if seq > self._next:
                self._lose(out, self._next, seq - 1, reason)
            self._deliver(out, seq, payload, False)
        if end > self._next:
            self._lose(out, self._next, end - 1, reason)

    def _release(self, out: list[Action]) -> None:
        """Deliver held messages that are now in order; drop those already delivered."""
        held = self._held
        while held and held[0][0] <= self._next:
            seq, payload = held.popleft()
            if seq == self._next:
                self._deliver(out, seq, payload, False)
            else:
                self._n_duplicates_dropped += 1

    def _sync(self) -> None:
        # Outside a recovery everything seen is accounted and nothing is held, so a live
        # seq equal to _next is in order (and above _live_max): the hot path may take it.
        self._expect = self._next if self._started and not self._recovering else -1
