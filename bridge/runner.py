"""`kvbridge run`: one event loop over every stream's sockets, feeding the Kafka sink."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq
from confluent_kafka import KafkaException

from bridge.config import BridgeConfig, offset_port
from bridge.listener import SharedListener
from bridge.metrics import BridgeMetrics
from bridge.pipeline import Pipeline, StreamInfo
from bridge.records import RecordCodec
from bridge.replaylimit import ReplayLimiter
from bridge.sequencer import SequencerConfig
from bridge.sink import KafkaSink, ensure_topic
from bridge.subscriber import ReconnectPolicy, SocketRegistry, StreamSubscriber

log = logging.getLogger(__name__)

TIMER_SCAN = 0.05  # seconds between scans of the streams' timers


class Bridge:
    """Follows every configured pod and rank; stops when ``stop`` is set."""

    def __init__(self, config: BridgeConfig, metrics: BridgeMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or BridgeMetrics()
        self.stop = threading.Event()
        self.ctx = zmq.Context()
        # SUB + DEALER + a monitor pair (two sockets) per stream, and headroom for sockets being
        # recreated: lift libzmq's default limit of 1023.
        self.ctx.set(zmq.MAX_SOCKETS, max(1024, 6 * self._stream_count() + 256))
        self.poller = zmq.Poller()
        self.registry = SocketRegistry(self.poller)
        self.codec = RecordCodec()
        self._acked: dict[bytes, object] = {}
        self.sink = KafkaSink(
            config.bootstrap_servers,
            config.topic,
            config.kafka,
            on_success=self._on_acked,
            on_failure=self._on_failed,
        )
        self.pipeline = Pipeline(self.codec, self.sink, self.metrics)
        self.streams: list[StreamSubscriber] = []
        self.listeners: list[SharedListener] = []
        self.limiter = ReplayLimiter(config.max_replays)
        self.reconnect = ReconnectPolicy(
            config.reconnect_initial,
            config.reconnect_max,
            config.reconnect_factor,
            config.silence_timeout,
            config.idle_probe,
        )
        _raise_fd_limit(8 * self._stream_count() + 256)

    def _on_acked(self, key: bytes) -> None:
        c = self._acked.get(key)
        if c is None:
            c = self._acked[key] = self.metrics.records_out.labels(key.decode(errors="replace"))
        c.inc()  # type: ignore[attr-defined]

    def _on_failed(self, key: bytes | None, value: bytes | None, err: object) -> None:
        pod = (key or b"?").decode(errors="replace")
        self.metrics.produce_errors.labels(pod).inc()

    def _stream_count(self) -> int:
        return sum(p.dp_size for p in self.config.pods)

    def _sequencer_config(self, replay: bool) -> SequencerConfig:
        c = self.config
        return SequencerConfig(
            replay_enabled=replay,
            first_contact=c.first_contact,  # type: ignore[arg-type]
            replay_idle_timeout=c.replay_timeout,
            replay_deadline=c.replay_deadline,
            replay_max_attempts=c.replay_attempts,
        )

    def open(self) -> None:
        c = self.config
        ensure_topic(c.bootstrap_servers, c.topic, overrides=_admin_props(c.kafka))
        epoch = int(time.time() * 1000)
        if c.listen:
            ranks = max((p.dp_size for p in c.pods if p.pub is None), default=1)
            for rank in range(ranks):
                self.listeners.append(
                    SharedListener(
                        self.ctx,
                        offset_port(c.listen, rank),
                        self.registry,
                        c.rcvhwm,
                        c.max_message_bytes,
                        self.metrics,
                        self.pipeline.bad_input,
                    )
                )
                log.info(
                    "listening on %s for pods that connect (rank %d)",
                    self.listeners[-1].endpoint,
                    rank,
                )
        for pod in c.pods:
            for rank in range(pod.dp_size):
                pub = pod.pub_endpoint(rank)
                replay = pod.replay_endpoint(rank)
                where = pub or f"{self.listeners[rank].endpoint} topic {pod.topic}"
                info = StreamInfo(pod.name, pod.model, rank, where)
                sub = StreamSubscriber(
                    self.ctx,
                    info,
                    pub,
                    replay,
                    pod.topic.encode(),
                    self._sequencer_config(replay is not None),
                    epoch,
                    self.pipeline,
                    self.registry,
                    c.rcvhwm,
                    c.max_message_bytes,
                    self.pipeline.bad_input,
                    self.limiter,
                    self.reconnect,
                )
                sub.open()
                if pub is None:
                    self.listeners[rank].route(pod.topic, sub)
                self.streams.append(sub)
                log.info(
                    "following pod %s rank %d: pub %s, replay %s",
                    pod.name,
                    rank,
                    pub,
                    replay or "none (gaps cannot be recovered)",
                )

    def run(self) -> None:
        """The event loop; returns after ``stop`` is set and the producer is flushed."""
        handlers = self.registry.handlers
        sink = self.sink
        next_sync = 0.0
        next_scan = 0.0
        max_poll = self.config.poll_timeout
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                wait = min(max_poll, max(0.0, next_scan - now))
                ready = self.poller.poll(int(wait * 1000))
                now = time.monotonic()
                for sock, _ in ready:
                    handler = handlers.get(sock)
                    if handler is not None:
                        self._guarded(handler, now)
                if now >= next_scan:
                    next_scan = self._fire_timers(now)
                sink.poll(0)
                if now >= next_sync:
                    next_sync = now + 1.0
                    self.metrics.producer_queue.set(sink.pending())
                    for s in self.streams:
                        s.sync_metrics()
        finally:
            self.close()

    def _fire_timers(self, now: float) -> float:
        """Run due stream timers; returns when to scan again (at most TIMER_SCAN from now).

        Timers are scanned at most every TIMER_SCAN seconds rather than per loop turn, so the
        loop stays cheap with thousands of streams; replay and reconnect timers are seconds long.
        """
        earliest = now + TIMER_SCAN
        for s in self.streams:
            d = s.next_deadline()
            if d is None:
                continue
            if d <= now:
                self._guarded(s.on_tick, now)
                d = s.next_deadline()
                if d is None:
                    continue
            if d < earliest:
                earliest = d
        return max(earliest, now + 0.001)

    def _guarded(self, handler: Callable[[float], None], now: float) -> None:
        """A bug hit by one stream's input is logged and counted; the other streams go on."""
        try:
            handler(now)
        except (KafkaException, MemoryError):
            raise
        except Exception:
            owner = getattr(handler, "__self__", None)
            pod = owner.info.pod if isinstance(owner, StreamSubscriber) else "?"
            self.metrics.internal_errors.labels(pod).inc()
            log.exception("internal error while handling pod %s; continuing", pod)

    def close(self, flush_timeout: float = 30.0) -> None:
        for s in self.streams:
            s.sync_metrics()
            s.close()
        self.streams.clear()
        for listener in self.listeners:
            listener.close()
        self.listeners.clear()
        left = self.sink.flush(flush_timeout)
        if left:
            log.error(
                "%d records were not acknowledged by Kafka within %.0fs and are lost",
                left,
                flush_timeout,
            )
        self.ctx.term()


def _raise_fd_limit(wanted: int) -> None:
    """Each stream holds several file descriptors; lift the soft limit toward the hard one."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < wanted:
            log.warning(
                "open-file limit %d is below the %d this many streams want; raise it (ulimit -n)",
                hard,
                wanted,
            )


def _admin_props(kafka: dict[str, str]) -> dict[str, str]:
    """librdkafka properties that also apply to the AdminClient (security, not producer tuning)."""
    keep = ("security.", "sasl.", "ssl.", "client.id", "socket.", "broker.")
    return {k: v for k, v in kafka.items() if k.startswith(keep)}


__all__ = ["Bridge"]
