"""Simulated vLLM pods and fleets: a PUB and a replay ROUTER bound per DP rank, each rank
published by a :class:`~bridge.simulator.publisher.RankPublisher` thread.

Every batch is written to a :class:`~bridge.simulator.publisher.SentLog` (JSON lines) with
its events in the bridge's normal hash form, so tests can compare what the bridge delivered
with what was sent.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable
from typing import Any, TextIO

import zmq

from bridge.ops.config import offset_port
from bridge.simulator.model import TierKey, shared_templates
from bridge.simulator.publisher import RankPublisher, SentLog
from bridge.simulator.spec import PodSpec, RankEndpoints, default_hash_mode, resolve_hash_mode
from bridge.vllm.releases import Release

__all__ = [
    "PodSpec",
    "RankEndpoints",
    "SentLog",
    "SimulatedFleet",
    "SimulatedPod",
    "default_hash_mode",
    "resolve_hash_mode",
]

_AUTO_PORT_RANGE = (20_000, 32_000)  # below Linux's ephemeral range
_AUTO_PORT_TRIES = 200


class SimulatedPod:
    """One vLLM pod: a PUB and (optionally) a replay ROUTER per DP rank, bound at creation."""

    def __init__(
        self,
        spec: PodSpec,
        context: zmq.Context | None = None,
        log: SentLog | None = None,
        stop_event: threading.Event | None = None,
    ) -> None:
        self.spec = spec
        self.context = context or zmq.Context.instance()
        self.pub_kind = zmq.XPUB if spec.wait_for_subscriber else zmq.PUB
        self.log = log or SentLog()
        self.stop_event = stop_event or threading.Event()
        self.templates = shared_templates(spec.cache)
        self._sockets: list[zmq.Socket] = []
        self._sockets_lock = threading.Lock()
        self.publishers: list[RankPublisher] = []
        self._started = False
        self._bind()

    # --- description --------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def model(self) -> str:
        """The served model's name (what the bridge puts in each record)."""
        return self.spec.model

    @property
    def release(self) -> Release:
        return self.spec.rel

    @property
    def hash_mode(self) -> str:
        return str(self.spec.hash_mode)

    @property
    def dp_size(self) -> int:
        return self.spec.dp_size

    @property
    def topic(self) -> str:
        return self.spec.topic

    @property
    def endpoints(self) -> list[RankEndpoints]:
        return [p.endpoints for p in self.publishers]

    @property
    def pub(self) -> str:
        """Rank 0's PUB endpoint (the base: rank r is on port + r)."""
        return self.publishers[0].endpoints.pub

    @property
    def replay(self) -> str | None:
        """Rank 0's replay endpoint (rank r is on port + r), None without replay."""
        return self.publishers[0].endpoints.replay

    def describe(self) -> dict[str, Any]:
        """The endpoints-file entry for this pod."""
        return {
            "name": self.name,
            "model": self.model,
            "release": str(self.release),
            "dp_size": self.dp_size,
            "pub": self.pub,
            "replay": self.replay,
            "topic": self.topic,
        }

    # --- sockets ------------------------------------------------------------------------

    def _bind(self) -> None:
        spec = self.spec
        if spec.pub_port is not None:
            replay_port = (
                spec.replay_port if spec.replay_port is not None else (spec.pub_port + spec.dp_size)
            )
            self._bind_at(spec.pub_port, replay_port)
            return
        rng = random.Random()
        lo, hi = _AUTO_PORT_RANGE
        for _ in range(_AUTO_PORT_TRIES):
            base = rng.randrange(lo, hi - 2 * spec.dp_size)
            try:
                self._bind_at(base, base + spec.dp_size)
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE:
                    raise
        raise RuntimeError(f"pod {spec.name}: found no free block of {2 * spec.dp_size} ports")

    def _bind_at(self, pub_port: int, replay_port: int) -> None:
        spec = self.spec
        try:
            for rank in range(spec.dp_size):
                pub = self._socket(self.pub_kind)
                pub.sndhwm = spec.hwm
                pub.rcvhwm = spec.hwm
                if spec.connect_pub:
                    pub_ep = offset_port(spec.connect_pub, rank)
                    pub.connect(pub_ep)
                else:
                    pub_ep = self._bind_one(pub, pub_port + rank)
                router = None
                replay_ep = None
                if spec.replay:
                    router = self._socket(zmq.ROUTER)
                    hwm = spec.rel.replay_sndhwm(spec.buffer_steps)
                    if hwm is not None:
                        router.sndhwm = hwm
                    replay_ep = self._bind_one(router, replay_port + rank)
                eps = RankEndpoints(rank, pub_ep, replay_ep)
                self.publishers.append(RankPublisher(self, rank, pub, router, eps))
        except BaseException:
            self.publishers.clear()
            self._close_sockets()
            raise

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.linger = 0
        self._sockets.append(sock)
        return sock

    def new_socket(self, kind: int) -> zmq.Socket:
        """A socket of this pod (closed with it), for a publisher that rebinds."""
        with self._sockets_lock:
            return self._socket(kind)

    def forget_socket(self, sock: zmq.Socket) -> None:
        with self._sockets_lock:
            if sock in self._sockets:
                self._sockets.remove(sock)

    def _bind_one(self, sock: zmq.Socket, port: int) -> str:
        endpoint = f"tcp://{self.spec.host}:{port}"
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            if self.spec.pub_port is None and exc.errno == zmq.EADDRINUSE:
                raise  # auto ports: the caller tries another block
            raise RuntimeError(
                f"pod {self.spec.name}: cannot bind {endpoint}: {exc.strerror}. Is another "
                f"process using it? With dp_size N, rank r uses pub_port+r and replay_port+r, "
                f"so the replay port must be >= pub_port + N"
            ) from exc
        return endpoint

    def _close_sockets(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets.clear()

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        for p in self.publishers:
            p.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the publisher threads and close every socket (linger 0)."""
        self.stop_event.set()
        for p in self.publishers:
            p.join(timeout)
        stuck = [p for p in self.publishers if p.alive]
        if not stuck:
            self._close_sockets()
        else:  # never close a socket under a running thread
            raise RuntimeError(f"pod {self.name}: publisher thread(s) did not stop")

    def check(self) -> None:
        """Raise the first error a publisher thread died with, if any."""
        for p in self.publishers:
            if p.error is not None:
                raise RuntimeError(f"pod {self.name} dp{p.rank}: publisher failed") from p.error

    def resident(self, rank: int = 0) -> dict[TierKey, set[bytes]]:
        """Current cache contents of ``rank`` (normal-form hashes per (medium, group_idx))."""
        return self.publishers[rank].resident()

    def copies(self, rank: int = 0) -> dict[TierKey, dict[bytes, int]]:
        """How many copies of each resident hash ``rank`` holds, per tier (the truth)."""
        return self.publishers[rank].copies()

    def publisher(self, rank: int = 0) -> RankPublisher:
        return self.publishers[rank]

    @property
    def done(self) -> bool:
        return all(p.stats.done for p in self.publishers)

    def stats(self) -> list[dict[str, Any]]:
        return [p.stats.as_dict() for p in self.publishers]


class SimulatedFleet:
    """Several simulated pods sharing one ZeroMQ context and sent-log; a context manager.

    ``with SimulatedFleet(PodSpec(name="a"), PodSpec(name="b", release="0.9.0")) as fleet:``
    binds every socket, starts publishing, and stops everything on exit.
    """

    def __init__(
        self,
        *specs: PodSpec,
        sent_log: TextIO | None = None,
        keep_records: bool = True,
        start: bool = True,
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"pod names must be unique, got {names}")
        self.context = zmq.Context()
        # PUB + ROUTER + monitor sockets per rank: lift libzmq's default limit of 1023.
        ranks = sum(spec.dp_size for spec in specs)
        self.context.set(zmq.MAX_SOCKETS, max(1024, 6 * ranks + 64))
        self.log = SentLog(sent_log, keep=keep_records)
        self.stop_event = threading.Event()
        self._start = start
        self.pods: list[SimulatedPod] = []
        try:
            for spec in specs:
                self.pods.append(SimulatedPod(spec, self.context, self.log, self.stop_event))
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> SimulatedFleet:
        if self._start:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __getitem__(self, name: str) -> SimulatedPod:
        for pod in self.pods:
            if pod.name == name:
                return pod
        raise KeyError(name)

    def start(self) -> None:
        for pod in self.pods:
            pod.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop all publishers promptly and close all sockets (idempotent)."""
        self.stop_event.set()
        errors = []
        for pod in self.pods:
            try:
                pod.stop(timeout)
            except RuntimeError as exc:
                errors.append(exc)
        if not errors and not self.context.closed:
            self.context.term()
        if errors:
            raise errors[0]

    def _publishers(self, pod: str | None) -> Iterable[RankPublisher]:
        pods = self.pods if pod is None else [self[pod]]
        return [p for x in pods for p in x.publishers]

    def wait_sent(self, n_batches: int, timeout: float = 10.0, pod: str | None = None) -> None:
        """Wait until every rank (of ``pod``, or of all pods) consumed >= ``n_batches`` seqs.

        TimeoutError if that takes longer than ``timeout`` seconds; RuntimeError if a
        publisher thread failed.
        """
        pubs = list(self._publishers(pod))

        def ready() -> bool:
            return any(p.error for p in pubs) or all(p.stats.batches >= n_batches for p in pubs)

        ok = self.log.wait_for(ready, timeout)
        self.check()
        if not ok:
            counts = {f"{p.spec.name}/dp{p.rank}": p.stats.batches for p in pubs}
            raise TimeoutError(f"not every rank sent {n_batches} batches in {timeout}s: {counts}")

    def wait_done(self, timeout: float = 10.0) -> None:
        """Wait until every rank of every pod with a finite ``batches`` has sent them all."""
        pubs = [p for p in self._publishers(None) if p.spec.batches]
        ok = self.log.wait_for(
            lambda: any(p.error for p in pubs) or all(p.stats.done for p in pubs), timeout
        )
        self.check()
        if not ok:
            raise TimeoutError(f"pods not done within {timeout}s")

    def check(self) -> None:
        for pod in self.pods:
            pod.check()

    def sent(self, pod: str | None = None, rank: int | None = None) -> list[dict[str, Any]]:
        """Sent-log records so far (optionally of one pod / rank), in sending order."""
        return [
            r
            for r in self.log.records()
            if (pod is None or r["pod"] == pod) and (rank is None or r["dp_rank"] == rank)
        ]

    def resident(self, pod: str, rank: int = 0) -> dict[TierKey, set[bytes]]:
        return self[pod].resident(rank)

    def copies(self, pod: str, rank: int = 0) -> dict[TierKey, dict[bytes, int]]:
        return self[pod].copies(rank)

    def endpoints(self) -> list[dict[str, Any]]:
        """The endpoints-file content: one entry per pod."""
        return [pod.describe() for pod in self.pods]

    def idle_since(self) -> float:
        """Monotonic time of the last batch or replay of any rank."""
        return max((p.stats.last_activity for p in self._publishers(None)), default=0.0)

    @property
    def done(self) -> bool:
        return all(pod.done for pod in self.pods)

    def stats(self) -> dict[str, int]:
        """Totals over every rank of every pod."""
        totals: dict[str, int] = {}
        for p in self._publishers(None):
            for key, value in p.stats.as_dict().items():
                if isinstance(value, int) and not isinstance(value, bool):
                    totals[key] = totals.get(key, 0) + value
        return totals
