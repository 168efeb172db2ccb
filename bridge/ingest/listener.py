"""One SUB socket the bridge binds, for vLLM pods that connect to it (llm-d's layout).

vLLM connects its PUB when its endpoint has no ``*``; every pod then shares this socket and
is told apart by the topic frame (e.g. ``kv@pod-a@llama``). DP rank r of a pod connects to
the endpoint's port + r, so the bridge binds one listener per rank.

With ``--listen-discover`` a topic that matches no stream and parses as ``kv@<pod>@<model>``
makes :class:`ListenDiscovery` follow that pod at once (the decision is the pure
:func:`bridge.ingest.listentopics.decide`), and the message is given to the new stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq
from prometheus_client import Counter

from bridge.ingest.listentopics import Follow, NotOwned, Refuse, decide, parse_topic
from bridge.ingest.subscriber import RECV_BUDGET, SocketRegistry, StreamSubscriber
from bridge.ops.metrics import BridgeMetrics
from bridge.ops.ratelimit import RateLimitedLog
from bridge.vllm.framing import FrameError, parse_live

log = logging.getLogger(__name__)

LISTENER = "listener"  # the pod label for bad input that no pod can be blamed for

# (listener, topic frame, now) -> the stream that takes it, or None (counted and logged)
DiscoverHook = Callable[["SharedListener", bytes, float], StreamSubscriber | None]


class SharedListener:
    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        registry: SocketRegistry,
        rcvhwm: int,
        max_message_bytes: int,
        metrics: BridgeMetrics,
        bad_input: RateLimitedLog,
        rank: int = 0,
    ) -> None:
        self.endpoint = endpoint
        self.rank = rank  # the DP rank of the pods that connect here (port + rank)
        self.routes: dict[bytes, StreamSubscriber] = {}
        self.discover: DiscoverHook | None = None
        self.metrics = metrics
        self.bad_input = bad_input
        self.registry = registry
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise RuntimeError(
                f"cannot bind the listen socket {endpoint}: {exc.strerror}; is the port in use? "
                "(with DP size N the bridge binds port..port+N-1)"
            ) from exc
        self.sock = sock
        registry.add(sock, self.on_readable)

    def route(self, topic: str, stream: StreamSubscriber) -> None:
        self.routes[topic.encode()] = stream

    def on_readable(self, now: float) -> None:
        for _ in range(RECV_BUDGET):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = parse_live(frames)
            except FrameError as exc:
                self.metrics.decode_errors.labels(LISTENER, "frames").inc()
                self.bad_input.warning(
                    LISTENER, "frames", "bad message on %s: %s", self.endpoint, exc
                )
                continue
            stream = self.routes.get(msg.topic)
            if stream is None:
                if self.discover is not None:
                    stream = self.discover(self, msg.topic, now)
                    if stream is None:
                        continue  # counted and logged by the hook
                else:
                    self.metrics.decode_errors.labels(LISTENER, "unknown_topic").inc()
                    self.bad_input.warning(
                        LISTENER,
                        "unknown_topic",
                        "message with topic %r on %s matches no configured pod (add a pod with "
                        "topic=%s, or give --listen-discover)",
                        msg.topic,
                        self.endpoint,
                        msg.topic.decode(errors="replace"),
                    )
                    continue
            stream.handle_live(msg, now)

    def close(self) -> None:
        self.registry.remove(self.sock)
        self.sock.close(linger=0)


class ListenDiscovery:
    """``--listen-discover``: follows the pod a ``kv@<pod>@<model>`` topic names, through
    ``Bridge.add_pod``, within ``max_pods`` discovered pods. Runs on the event loop's thread
    (the listeners' handler), so the pod is followed before the triggering message is handed
    on: nothing is dropped.

    Counted: ``kvbridge_listen_discovered_total{kind="pod"|"rank"}`` (pods followed, ranks
    added to one), ``kvbridge_listen_not_owned_total`` (messages of pods another shard owns,
    ignored), and refusals as ``kvbridge_decode_errors_total{pod="listener",kind}`` with kind
    ``unknown_topic``, ``too_many_pods`` or ``name_taken``.
    """

    def __init__(self, bridge: Any, max_pods: int, replay_template: str | None) -> None:
        self.bridge = bridge
        self.max_pods = max_pods
        self.replay_template = replay_template
        self.discovered: set[str] = set()
        registry = bridge.metrics.registry
        self.found = Counter(
            "kvbridge_listen_discovered",
            "Pods (kind=pod) and ranks of known pods (kind=rank) followed from listen topics",
            ["kind"],
            registry=registry,
        )
        self.not_owned = Counter(
            "kvbridge_listen_not_owned",
            "Listen messages of discovered pods another shard owns (ignored)",
            registry=registry,
        )

    def attach(self, listeners: list[SharedListener]) -> None:
        for listener in listeners:
            listener.discover = self

    def __call__(
        self, listener: SharedListener, topic: bytes, now: float
    ) -> StreamSubscriber | None:
        b = self.bridge
        if len(self.discovered) >= self.max_pods:
            self.discovered.intersection_update(b.pods)  # forget pods removed since
        parsed = parse_topic(topic)
        owns = None if parsed is None else b.owns(parsed.pod)
        d = decide(
            topic, listener.rank, b.pods, self.discovered, owns, self.max_pods, self.replay_template
        )
        if isinstance(d, NotOwned):
            self.not_owned.inc()
            return None
        if isinstance(d, Refuse):
            b.metrics.decode_errors.labels(LISTENER, d.kind).inc()
            b.pipeline.bad_input.warning(
                LISTENER,
                d.kind,
                "message with topic %r on %s dropped: it %s",
                topic,
                listener.endpoint,
                d.why,
            )
            return None
        assert isinstance(d, Follow)
        pod = d.pod
        new = pod.name not in b.pods
        if not b.add_pod(pod):  # another shard owns it (checked above; kept for safety)
            self.not_owned.inc()
            return None
        b._serve_requests()  # follow it now: this is the event loop's thread
        if b.pods.get(pod.name) != pod:
            return None  # failed: counted and logged as an internal error by the bridge
        self.discovered.add(pod.name)
        self.found.labels("pod" if new else "rank").inc()
        log.info(
            "discovered pod %s (model %s) from topic %r on %s: %d rank(s), replay %s",
            pod.name,
            pod.model,
            pod.topic,
            listener.endpoint,
            pod.dp_size,
            pod.replay or "none (gaps are written as EventsLost)",
        )
        return listener.routes.get(topic)
