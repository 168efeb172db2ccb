"""The thin I/O layer of one (pod, dp_rank) stream: SUB + DEALER sockets driving the sequencer."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from bridge.ingest.actions import (
    Deliver,
    EventsLost,
    PublisherRestarted,
    ResetReplay,
    SendReplay,
    StreamStarted,
)
from bridge.ingest.pipeline import Pipeline, StreamInfo
from bridge.ingest.replaylimit import ReplayLimiter
from bridge.ingest.sequencer import SequencerConfig, StreamSequencer
from bridge.log import markers
from bridge.ops.ratelimit import RateLimitedLog
from bridge.vllm.framing import (
    FrameError,
    LiveMessage,
    ReplayBatch,
    live_seq_payload,
    parse_replay_reply,
    replay_request,
)

log = logging.getLogger(__name__)

# Messages taken from one socket per loop turn, so one busy pod cannot starve the others. Small
# enough that the producer's delivery reports are served (sink.poll, once per turn) while the
# records are still in the CPU caches: with 512, a 16-pod backlog turn queued ~57,000 records
# before their reports were served (more CPU per event and ~35 MB more RSS in a drain).
RECV_BUDGET = 64
_NOBLOCK = int(zmq.NOBLOCK)


@dataclass(frozen=True, slots=True)
class ReconnectPolicy:
    """After a disconnect libzmq reconnects by itself, except after a protocol error (e.g. a
    message over MAXMSGSIZE), when it gives the endpoint up. If no reconnect happened within
    the backoff, the bridge recreates the socket: exponential backoff with jitter. A stream
    silent for ``silence_timeout`` seconds (0 = never) is reconnected the same way."""

    initial: float = 1.0
    maximum: float = 30.0
    factor: float = 2.0
    silence_timeout: float = 0.0
    # After this long without a live message, ask the replay socket once for anything newer:
    # a dropped last batch is otherwise invisible until the engine publishes again.
    idle_probe: float = 2.0
    # A stream that has heard nothing at all (no live message, no replayed batch) this long
    # after it was opened is reported: a warning saying what to check, the silent gauge and
    # /readyz's details (0 = never).
    silent_warning: float = 30.0

    def delay(self, attempts: int) -> float:
        base = min(self.maximum, self.initial * self.factor ** min(attempts, 64))
        return base * random.uniform(0.5, 1.0)


class SocketRegistry:
    """What a subscriber needs from the event loop: (un)registering sockets for polling."""

    def __init__(self, poller: zmq.Poller) -> None:
        self.poller = poller
        self.handlers: dict[zmq.Socket, Callable[[float], None]] = {}

    def add(self, sock: zmq.Socket, handler: Callable[[float], None]) -> None:
        self.handlers[sock] = handler
        self.poller.register(sock, zmq.POLLIN)

    def remove(self, sock: zmq.Socket) -> None:
        self.handlers.pop(sock, None)
        self.poller.unregister(sock)


class StreamSubscriber:
    def __init__(
        self,
        ctx: zmq.Context,
        info: StreamInfo,
        pub_endpoint: str | None,
        replay_endpoint: str | None,
        topic: bytes,
        seq_config: SequencerConfig,
        epoch: int,
        pipeline: Pipeline,
        registry: SocketRegistry,
        rcvhwm: int,
        max_message_bytes: int,
        bad_input: RateLimitedLog,
        limiter: ReplayLimiter,
        reconnect: ReconnectPolicy,
    ) -> None:
        self.ctx = ctx
        self.info = info
        self.pub_endpoint = pub_endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.sequencer = StreamSequencer(seq_config, epoch)
        self.pipeline = pipeline
        self.registry = registry
        self.rcvhwm = rcvhwm
        self.max_message_bytes = max_message_bytes
        self.bad_input = bad_input
        self.limiter = limiter
        self.reconnect = reconnect
        self.replay_waiting: int | None = None  # start seq queued behind the fleet-wide limit
        self.last_message = 0.0
        self.probe_at: float | None = None
        # Until the first message, probes repeat (backing off): the engine's ring may hold
        # everything although nothing arrives live (a PUB that cannot be reached).
        self.probe_interval = reconnect.idle_probe
        self.opened_at: float | None = None  # the first tick's time
        self.heard = False  # any live message or replayed batch since open
        self.silent = False  # reported as silent (nothing heard after silent_warning)
        self._silent_warn_at: float | None = None
        self.metrics = pipeline.metrics
        self.connected = False
        self.reconnect_at: float | None = None
        self.reconnect_attempts = 0
        # Disconnected and libzmq did not try to reconnect: it gave the endpoint up after a
        # protocol error, which after a handshake means a message over MAXMSGSIZE.
        self.gave_up = False
        self._synced: tuple[int, ...] = (0,) * 10
        self.sub: zmq.Socket | None = None
        self.dealer: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None

    # -- sockets -------------------------------------------------------------------------------
    def open(self) -> None:
        """Connect the sockets; a stream fed by a shared listener (no pub endpoint) has no SUB."""
        if self.pub_endpoint is not None:
            self._open_sub()
        self._open_dealer()

    def _open_sub(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        # ZMTP heartbeats: a silent dead peer shows up as a disconnect, then a reconnect.
        sub.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
        sub.setsockopt(zmq.RECONNECT_IVL, 200)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.monitor = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        )
        self.gave_up = False
        if "[" in self.pub_endpoint:  # tcp://[fd00::1a]:5557: IPv6 is off by default
            sub.setsockopt(zmq.IPV6, 1)
        sub.connect(self.pub_endpoint)
        self.sub = sub
        self.registry.add(sub, self.on_sub_readable)
        self.registry.add(self.monitor, self.on_monitor)

    def _close_sub(self) -> None:
        for sock in (self.sub, self.monitor):
            if sock is not None:
                self.registry.remove(sock)
        if self.sub is not None:
            self.sub.disable_monitor()
            self.sub.close(linger=0)
        if self.monitor is not None:
            self.monitor.close(linger=0)
        self.sub = self.monitor = None

    def _open_dealer(self) -> None:
        if self.replay_endpoint is None:
            return
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)  # a replay may be large; the sequencer bounds the work
        dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        if "[" in self.replay_endpoint:
            dealer.setsockopt(zmq.IPV6, 1)
        dealer.connect(self.replay_endpoint)
        self.dealer = dealer
        self.registry.add(dealer, self.on_dealer_readable)

    def _close_dealer(self) -> None:
        if self.dealer is not None:
            self.registry.remove(self.dealer)
            self.dealer.close(linger=0)
            self.dealer = None

    def close(self) -> None:
        self.limiter.release(self, 0.0)
        self._close_dealer()
        self._close_sub()

    def _backoff(self) -> float:
        return self.reconnect.delay(self.reconnect_attempts)

    # -- inputs --------------------------------------------------------------------------------
    def on_monitor(self, now: float) -> None:
        assert self.monitor is not None
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED and not self.connected:
                self.connected = True
                self.reconnect_at = None
                self.reconnect_attempts = 0
                self.last_message = now
                log.info(
                    "pod %s rank %d: connected to %s",
                    self.info.pod,
                    self.info.dp_rank,
                    self.pub_endpoint,
                )
                self._apply(self.sequencer.on_connect(now), now)
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.gave_up = False  # an ordinary disconnect: libzmq is reconnecting
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                self.gave_up = True
                self.reconnect_at = now + self._backoff()
                log.warning(
                    "pod %s rank %d: disconnected from %s; reconnecting",
                    self.info.pod,
                    self.info.dp_rank,
                    self.pub_endpoint,
                )

    def on_sub_readable(self, now: float) -> None:
        sub = self.sub
        assert sub is not None
        recv = sub.recv
        on_live = self.on_live
        for _ in range(RECV_BUDGET):
            # recv_multipart asks the socket for RCVMORE per frame (~1 µs each); a frame's own
            # `more` flag is free. The rest of a multipart message is there once its first is.
            try:
                frame = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [frame.bytes]
            while frame.more:
                frame = recv(_NOBLOCK, copy=False)
                frames.append(frame.bytes)
            try:
                seq, payload = live_seq_payload(frames)
            except FrameError as exc:
                self.metrics.decode_errors.labels(self.info.pod, "frames").inc()
                self.bad_input.warning(self.info.pod, "frames", "bad live message: %s", exc)
                continue
            on_live(seq, payload, now)

    def handle_live(self, msg: LiveMessage, now: float) -> None:
        """One well-framed live message for this stream (from its SUB or a shared listener)."""
        self.on_live(msg.seq, msg.payload, now)

    def on_live(self, seq: int, payload: bytes, now: float) -> None:
        """Live batch ``seq``: in order (the hot path) it goes straight to the pipeline, as the
        sequencer's ``Deliver`` would; anything else takes the sequencer's actions."""
        self.last_message = now
        if not self.heard:
            self._heard()
        if self.dealer is not None and self.reconnect.idle_probe > 0:
            self.probe_at = now + self.reconnect.idle_probe
        sequencer = self.sequencer
        if not sequencer.live_in_order(seq, payload):
            self._apply(sequencer.on_live(seq, payload, now), now)
            return
        self.pipeline.deliver(self.info, sequencer.epoch, seq, payload, False)
        if (
            self.replay_waiting is None
            and not sequencer.replay_in_flight
            and self.limiter.holds(self)
        ):
            self.limiter.release(self, now)

    def on_dealer_readable(self, now: float) -> None:
        dealer = self.dealer
        for _ in range(RECV_BUDGET):
            if dealer is None or dealer is not self.dealer:
                return  # reset while handling the previous message
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = parse_replay_reply(frames)
            except FrameError as exc:
                self.metrics.decode_errors.labels(self.info.pod, "replay_frames").inc()
                self.bad_input.warning(self.info.pod, "replay_frames", "bad replay reply: %s", exc)
                continue
            if isinstance(reply, ReplayBatch):
                self._heard()
                self._apply(self.sequencer.on_replay_batch(reply.seq, reply.payload, now), now)
            else:
                self._apply(self.sequencer.on_replay_end(now), now)

    def _silence_deadline(self) -> float | None:
        t = self.reconnect.silence_timeout
        if t <= 0 or not self.connected:
            return None
        return self.last_message + t

    def _heard(self) -> None:
        if not self.heard:
            self.heard = True
            self.probe_interval = self.reconnect.idle_probe
            if self.silent:
                self.silent = False
                log.info("pod %s rank %d: first message received", self.info.pod, self.info.dp_rank)

    def _first_tick(self, now: float) -> None:
        self.opened_at = now
        policy = self.reconnect
        if policy.silent_warning > 0:
            self._silent_warn_at = now + policy.silent_warning
        if self.dealer is not None and policy.idle_probe > 0 and self.probe_at is None:
            # First contact does not wait for a live message: if none comes, ask the ring.
            self.probe_at = now + policy.idle_probe

    def _warn_silent(self, now: float) -> None:
        self.silent = True
        self._silent_warn_at = now + 300.0  # then every 5 minutes while it lasts
        assert self.opened_at is not None
        if self.pub_endpoint is None:
            where = "on the shared --listen socket (is the engine's PUB connecting to it?)"
        elif self.connected:
            where = (
                f"although the SUB is connected to {self.pub_endpoint}: is the engine publishing "
                f"(--kv-events-config enable_kv_cache_events) on topic {self.topic.decode()!r}?"
            )
        else:
            where = (
                f"and the SUB never connected to {self.pub_endpoint}: the engine must bind "
                "(its endpoint 'tcp://*:PORT'); if its endpoint has no '*' it connects out, "
                "then run the bridge with --listen"
            )
        replay = (
            f"; the replay socket {self.replay_endpoint} did not answer either"
            if self.dealer is not None
            else ""
        )
        log.warning(
            "pod %s rank %d: nothing received in %.0fs %s%s",
            self.info.pod,
            self.info.dp_rank,
            now - self.opened_at,
            where,
            replay,
        )

    def on_tick(self, now: float) -> None:
        if self.opened_at is None:
            self._first_tick(now)
        if not self.heard and self._silent_warn_at is not None and now >= self._silent_warn_at:
            self._warn_silent(now)
        silent_at = self._silence_deadline()
        if silent_at is not None and now >= silent_at:
            log.warning(
                "pod %s rank %d: nothing from %s for %.0fs; reconnecting",
                self.info.pod,
                self.info.dp_rank,
                self.pub_endpoint,
                now - self.last_message,
            )
            self.connected = False
            self.reconnect_at = now
        if self.reconnect_at is not None and now >= self.reconnect_at:
            if self.gave_up:
                self._oversized_frame()
            self.reconnect_attempts += 1
            log.warning(
                "pod %s rank %d: recreating the socket to %s (attempt %d)",
                self.info.pod,
                self.info.dp_rank,
                self.pub_endpoint,
                self.reconnect_attempts,
            )
            self._close_sub()
            self._open_sub()
            self.reconnect_at = now + self._backoff()
        if self.probe_at is not None and now >= self.probe_at:
            self.probe_at = None
            if not self.heard and self.dealer is not None:
                self.probe_interval = min(30.0, self.probe_interval * 2)
                self.probe_at = now + self.probe_interval
            if self.replay_waiting is None and not self.sequencer.replay_in_flight:
                # Same as after a reconnect: replay whatever may have been missed.
                self._apply(self.sequencer.on_connect(now), now)
        if self.replay_waiting is None:
            self._apply(self.sequencer.on_tick(now), now)

    def _oversized_frame(self) -> None:
        """libzmq dropped the connection without reconnecting: a message over the size limit."""
        self.gave_up = False
        self.metrics.decode_errors.labels(self.info.pod, "oversized_frame").inc()
        self.bad_input.warning(
            self.info.pod,
            "oversized_frame",
            "rank %d: a message from %s was over the ZeroMQ size limit (%d bytes) and ZeroMQ "
            "dropped the connection; reconnecting, the batch is recovered by replay or "
            "written as EventsLost. Raise --max-message-bytes if the pod's batches are that "
            "large (--max-message-bytes, KVBRIDGE_MAX_MESSAGE_BYTES)",
            self.info.dp_rank,
            self.pub_endpoint,
            self.max_message_bytes,
        )

    def next_deadline(self) -> float | None:
        """The earliest timer: reconnect, silence, or the sequencer's (not while queued)."""
        d = None if self.replay_waiting is not None else self.sequencer.next_deadline()
        if self.opened_at is None:
            return 0.0  # the first tick arms the timers
        silent = None if self.heard else self._silent_warn_at
        for t in (self.reconnect_at, self._silence_deadline(), self.probe_at, silent):
            if t is not None and (d is None or t < d):
                d = t
        return d

    # -- actions -------------------------------------------------------------------------------
    def _apply(self, actions: list, now: float) -> None:
        for action in actions:
            if type(action) is Deliver:
                self.pipeline.deliver(
                    self.info, action.epoch, action.seq, action.payload, action.replayed
                )
            elif isinstance(action, SendReplay):
                if self.limiter.acquire(self):
                    self._send_replay(action.start_seq, action.why)
                else:
                    self.replay_waiting = action.start_seq
                    log.info(
                        "pod %s rank %d: replay from %d (%s) waits for a free replay slot "
                        "(max %d in flight)",
                        self.info.pod,
                        self.info.dp_rank,
                        action.start_seq,
                        action.why,
                        self.limiter.limit,
                    )
            elif isinstance(action, ResetReplay):
                self.replay_waiting = None
                self._close_dealer()
                self._open_dealer()
            elif isinstance(action, StreamStarted):
                m = markers.StreamStarted(action.next_seq, self.info.endpoint)
                self.pipeline.marker(self.info, action.epoch, action.next_seq, m)
            elif isinstance(action, PublisherRestarted):
                self.metrics.restarts.labels(self.info.pod).inc()
                m = markers.PublisherRestarted(action.old_epoch, action.last_seq, action.seq)
                self.pipeline.marker(self.info, action.epoch, action.seq, m)
            elif isinstance(action, EventsLost):
                m = markers.EventsLost(action.from_seq, action.to_seq, action.reason)
                self.pipeline.marker(self.info, action.epoch, action.from_seq, m)
            else:
                raise TypeError(f"unexpected sequencer action {action!r}")
        seq = self.sequencer
        if self.replay_waiting is None and not seq.replay_in_flight and self.limiter.holds(self):
            self.limiter.release(self, now)

    def grant_replay(self, now: float) -> None:
        """The limiter gave this stream a replay slot: send what was queued."""
        start, self.replay_waiting = self.replay_waiting, None
        if start is None or not self.sequencer.replay_in_flight:
            self.limiter.release(self, now)
            return
        self._send_replay(start, "after waiting for a replay slot")
        self.sequencer.on_replay_sent(now)

    def sync_metrics(self) -> None:
        """Carry the sequencer's counters, the connection state and the time since the last
        message into Prometheus (called about once a second and when the bridge stops)."""
        stats = self.pipeline.stats(self.info)
        # A stream fed by a shared listener has no connection of its own: no connected gauge.
        stats.connection(
            self.connected if self.pub_endpoint else None, self.last_message, silent=self.silent
        )
        seq, pod = self.sequencer, self.info.pod
        current = (
            seq.gaps,
            seq.replays_requested,
            seq.replays_succeeded,
            seq.replays_failed,
            seq.replays_given_up,
            seq.duplicates_dropped,
            seq.unverified_reconnects,
            seq.bad_replies,
            seq.seq_jumps,
            seq.held_dropped,
        )
        last = self._synced
        if current == last:
            return
        m = self.metrics
        counters = (
            m.gaps.labels(pod),
            m.replays.labels(pod, "requested"),
            m.replays.labels(pod, "succeeded"),
            m.replays.labels(pod, "failed"),
            m.replays.labels(pod, "given_up"),
            m.duplicates.labels(pod),
            m.unverified_reconnects.labels(pod),
            m.replays.labels(pod, "bad_reply"),
            m.seq_jumps.labels(pod),
            m.held_dropped.labels(pod),
        )
        for counter, now_value, before in zip(counters, current, last, strict=True):
            if now_value > before:
                counter.inc(now_value - before)
        self._synced = current

    def _send_replay(self, start_seq: int, why: str = "") -> None:
        log.info(
            "pod %s rank %d: replay from seq %d%s",
            self.info.pod,
            self.info.dp_rank,
            start_seq,
            f" ({why})" if why else "",
        )
        if self.dealer is None:
            return  # no replay endpoint: the sequencer's timeout reports the loss
        try:
            self.dealer.send_multipart(replay_request(start_seq), zmq.NOBLOCK)
        except zmq.Again:
            self.bad_input.warning(
                self.info.pod, "replay_send", "replay request not sent (queue full)"
            )
