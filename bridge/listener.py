"""One SUB socket the bridge binds, for vLLM pods that connect to it (llm-d's layout).

vLLM connects its PUB when its endpoint has no ``*``; every pod then shares this socket and
is told apart by the topic frame (e.g. ``kv@pod-a@llama``). DP rank r of a pod connects to
the endpoint's port + r, so the bridge binds one listener per rank.
"""

from __future__ import annotations

import zmq

from bridge.metrics import BridgeMetrics
from bridge.ratelimit import RateLimitedLog
from bridge.subscriber import RECV_BUDGET, SocketRegistry, StreamSubscriber
from bridge.vllm.framing import FrameError, parse_live

LISTENER = "listener"  # the pod label for bad input that no pod can be blamed for


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
    ) -> None:
        self.endpoint = endpoint
        self.routes: dict[bytes, StreamSubscriber] = {}
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
                self.metrics.decode_errors.labels(LISTENER, "unknown_topic").inc()
                self.bad_input.warning(
                    LISTENER,
                    "unknown_topic",
                    "message with topic %r on %s matches no configured pod (add a pod with "
                    "topic=%s)",
                    msg.topic,
                    self.endpoint,
                    msg.topic.decode(errors="replace"),
                )
                continue
            stream.handle_live(msg, now)

    def close(self) -> None:
        self.registry.remove(self.sock)
        self.sock.close(linger=0)
