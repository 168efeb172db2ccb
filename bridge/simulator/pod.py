"""Simulated vLLM pods: real ZeroMQ PUB + replay ROUTER sockets per DP rank (spec §2, §3, §6).

One thread per (pod, rank) does what vLLM's "zmq-publisher" thread does: numbers each
batch (from 0 per incarnation), encodes it, sends ``[topic, seq8, payload]`` on the PUB,
keeps the payload in a ``deque(maxlen=buffer_steps)``, and between live sends answers at
most one replay request per loop iteration. Faults are injected at the publisher:

* ``drop_seqs`` / ``drop_rate``: seq consumed and buffered, not sent live (a PUB drop,
  recoverable by replay);
* ``lose_seqs``: seq consumed, neither sent nor buffered (vLLM's encode-failure path,
  a permanent gap);
* ``restart_after`` / ``restart_at_batches``: the publisher is recreated (seq back to 0,
  empty buffer, new cache model with a new NONE_HASH). The sockets stay bound across a
  restart (a real engine restart rebinds; keeping them avoids port races in tests and
  is indistinguishable for a subscriber apart from the missing reconnect).

Every batch is written to a :class:`SentLog` (JSON lines) with its events in the
bridge's normal hash form, so tests can compare what the bridge delivered with what
was sent.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

import zmq

from bridge.ops.config import offset_port
from bridge.simulator.model import (
    ModelConfig,
    PrefixCacheModel,
    Prompt,
    TierKey,
    shared_templates,
)
from bridge.vllm.encoder import encode_batch, normal_hash
from bridge.vllm.events import BlockRemoved, BlockStored, EventBatch, VllmEvent
from bridge.vllm.framing import (
    FrameError,
    live_frames,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
)
from bridge.vllm.jsonview import event_to_json
from bridge.vllm.releases import Release, as_release

__all__ = [
    "PodSpec",
    "RankEndpoints",
    "SentLog",
    "SimulatedFleet",
    "SimulatedPod",
    "default_hash_mode",
    "resolve_hash_mode",
]

_HASH_MODES = ("int", "signed", "bytes")
_POLL_S = 0.05  # longest wait between checks of the stop flag
_MAX_EMPTY_STEPS = 10_000
_AUTO_PORT_RANGE = (20_000, 32_000)  # below Linux's ephemeral range
_AUTO_PORT_TRIES = 200


def default_hash_mode(release: Release) -> str:
    """vLLM's default: signed ``hash()`` ints before 0.10.2, unsigned 64-bit ints from it."""
    return "int" if release.supports_bytes_hashes else "signed"


def resolve_hash_mode(release: Release, hash_mode: str | None) -> str:
    """The hash mode to use for ``release``; ValueError for one that release cannot send."""
    if hash_mode is None:
        return default_hash_mode(release)
    if hash_mode not in _HASH_MODES:
        raise ValueError(f"unknown hash mode {hash_mode!r}: expected one of {_HASH_MODES}")
    if hash_mode == "bytes" and not release.supports_bytes_hashes:
        raise ValueError(
            f"vLLM {release} cannot send byte hashes: raw digests appear in 0.10.2 "
            f"(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0); use 'signed' (default) or 'int' "
            f"(sha256_cbor_64bit, 0.10.0+)"
        )
    if hash_mode == "signed" and release.supports_bytes_hashes:
        raise ValueError(
            f"vLLM {release} never sends signed hashes: from 0.10.2 integer hashes are the "
            f"unsigned low 64 bits of the digest; use 'int' (default) or 'bytes'"
        )
    return hash_mode


@dataclass(frozen=True)
class PodSpec:
    """One simulated pod. Ports: rank r binds ``pub_port + r`` and ``replay_port + r``."""

    name: str = "pod"
    model: str = "demo-model"
    release: str | Release = "0.33.0"
    dp_size: int = 1
    hash_mode: str | None = None  # None: the release's default
    host: str = "127.0.0.1"
    pub_port: int | None = None  # None: free ports chosen at bind time
    replay_port: int | None = None  # None: pub_port + dp_size
    replay: bool = True  # bind a replay ROUTER (vLLM: replay_endpoint set)
    topic: str = "kv-events"
    rate: float = 10.0  # batches/s per rank; 0 = as fast as possible
    batches: int = 0  # batches per rank (all incarnations); 0 = forever
    buffer_steps: int = 10_000
    hwm: int = 100_000  # PUB SNDHWM/RCVHWM (vLLM's hwm)
    drop_rate: float = 0.0
    drop_seqs: frozenset[int] = frozenset()
    lose_seqs: frozenset[int] = frozenset()
    restart_after: int = 0  # restart each time an incarnation has consumed this many seqs
    restart_at_batches: frozenset[int] = frozenset()  # restart once N batches were consumed
    # Restart when the k-th replay request (1-based, per rank) arrives, before answering it:
    # the reply then comes from the new incarnation (a restart while a replay is in flight).
    restart_on_replay: frozenset[int] = frozenset()
    # Close and rebind the PUB and ROUTER at each restart, as a real engine restart does:
    # subscribers see a disconnect and reconnect (not with connect_pub).
    rebind_on_restart: bool = False
    seed: int = 0
    cache: ModelConfig = field(default_factory=ModelConfig)
    start_delay: float = 0.0  # seconds before the first batch (after wait_for_subscriber)
    # First batch only once a subscriber's subscription arrived. The PUB is then an XPUB:
    # the same socket to a SUB (ZMTP lets SUB talk to either), but it shows the
    # subscription, whereas a handshake alone leaves the first batches to the slow-joiner drop.
    wait_for_subscriber: bool = False
    # vLLM connects its PUB instead of binding when the endpoint has no '*' (llm-d's layout:
    # one bridge SUB bound for the fleet). Rank r connects to this endpoint's port + r.
    connect_pub: str | None = None

    def __post_init__(self) -> None:
        for name in ("drop_seqs", "lose_seqs", "restart_at_batches", "restart_on_replay"):
            object.__setattr__(self, name, frozenset(getattr(self, name)))
        if not self.name:
            raise ValueError("a pod needs a non-empty name")
        try:
            release = as_release(self.release)
            hash_mode = resolve_hash_mode(release, self.hash_mode)
        except ValueError as exc:
            raise ValueError(f"pod {self.name}: {exc}") from None
        object.__setattr__(self, "release", release)
        object.__setattr__(self, "hash_mode", hash_mode)
        if self.dp_size < 1:
            raise ValueError(f"pod {self.name}: dp_size must be >= 1")
        if self.dp_size > 1 and not release.has_dp_rank:
            raise ValueError(
                f"pod {self.name}: vLLM {release} has no data-parallel KV events "
                f"(rank offsets and data_parallel_rank appear in 0.9.1)"
            )
        if self.rate < 0 or self.batches < 0 or self.restart_after < 0 or self.start_delay < 0:
            raise ValueError(
                f"pod {self.name}: rate, batches, restart_after, start_delay must be >= 0"
            )
        if self.buffer_steps < 1 or self.hwm < 0:
            raise ValueError(f"pod {self.name}: buffer_steps must be >= 1, hwm >= 0")
        if not 0.0 <= self.drop_rate <= 1.0:
            raise ValueError(f"pod {self.name}: drop_rate must be within [0, 1]")
        if self.rebind_on_restart and self.connect_pub:
            raise ValueError(f"pod {self.name}: rebind_on_restart needs bound sockets")
        if self.replay_port is not None and self.pub_port is None:
            raise ValueError(f"pod {self.name}: replay_port needs an explicit pub_port")

    @property
    def rel(self) -> Release:
        assert isinstance(self.release, Release)
        return self.release


@dataclass(frozen=True)
class RankEndpoints:
    rank: int
    pub: str
    replay: str | None


class SentLog:
    """Thread-safe record of every batch (JSON lines to ``sink``, flushed per line).

    With ``keep`` the records are also kept in memory for :meth:`records`.
    """

    def __init__(self, sink: TextIO | None = None, keep: bool = True) -> None:
        self._sink = sink
        self._keep = keep
        self._records: list[dict[str, Any]] = []
        self._cond = threading.Condition()

    def write(self, record: dict[str, Any], then: Callable[[], None] | None = None) -> None:
        """Log one record; ``then()`` runs under the same lock, before waiters wake."""
        line = json.dumps(record, separators=(",", ":"))
        with self._cond:
            if self._keep:
                self._records.append(record)
            if self._sink is not None:
                self._sink.write(line + "\n")
                self._sink.flush()
            if then is not None:
                then()
            self._cond.notify_all()

    def records(self) -> list[dict[str, Any]]:
        with self._cond:
            return list(self._records)

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` holds (re-checked after each write or ``notify``)."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()


def normalized(event: VllmEvent, hash_mode: str) -> VllmEvent:
    """A copy of ``event`` with its hashes as the bridge's decoder yields them."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return dataclasses.replace(
            event,
            block_hashes=[normal_hash(h, hash_mode) for h in event.block_hashes],
            parent_block_hash=None if parent is None else normal_hash(parent, hash_mode),
        )
    if isinstance(event, BlockRemoved):
        return dataclasses.replace(
            event, block_hashes=[normal_hash(h, hash_mode) for h in event.block_hashes]
        )
    return event


@dataclass
class RankStats:
    batches: int = 0  # seqs consumed, all incarnations
    live: int = 0
    dropped: int = 0
    lost: int = 0
    restarts: int = 0
    replays: int = 0  # well-formed replay requests answered
    replay_requests: int = 0  # well-formed replay requests received
    replayed_batches: int = 0
    invalid_requests: int = 0  # ignored without a reply, as vLLM
    done: bool = False  # every batch of ``batches`` consumed
    last_activity: float = 0.0  # monotonic time of the last batch or replay

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class RankPublisher:
    """vLLM's ZmqEventPublisher for one DP rank, driven by its own thread."""

    def __init__(
        self,
        pod: SimulatedPod,
        rank: int,
        pub: zmq.Socket,
        router: zmq.Socket | None,
        endpoints: RankEndpoints,
    ) -> None:
        self.pod = pod
        self.spec = pod.spec
        self.rank = rank
        self.endpoints = endpoints
        self._pub = pub
        self._router = router
        self._topic = self.spec.topic.encode()
        self._drop_rng = random.Random(f"kvbridge-drops:{self.spec.seed}:{self.spec.name}:{rank}")
        self._lock = threading.Lock()  # guards the model (stepped here, read by resident())
        self.stats = RankStats()
        self.incarnation = -1
        self._new_incarnation()
        self._thread = threading.Thread(
            target=self._run, name=f"sim-{self.spec.name}-dp{rank}", daemon=True
        )
        self.error: BaseException | None = None

    # --- state --------------------------------------------------------------------------

    def _new_incarnation(self) -> None:
        spec = self.spec
        with self._lock:
            self.incarnation += 1
            self.model = PrefixCacheModel(
                spec.rel,
                str(spec.hash_mode),
                f"{spec.seed}:{spec.name}:{self.rank}:{self.incarnation}",
                spec.cache,
                templates=self.pod.templates,
            )
            self.next_seq = 0
            self.buffer: deque[tuple[int, bytes]] = deque(maxlen=spec.buffer_steps)
            self._incarnation_batches = 0

    def resident(self) -> dict[TierKey, set[bytes]]:
        with self._lock:
            return self.model.resident()

    def copies(self) -> dict[TierKey, dict[bytes, int]]:
        with self._lock:
            return self.model.copies()

    def served_prompts(self) -> list[Prompt]:
        with self._lock:
            return self.model.served_prompts()

    def resident_prefix(self, prompt: Prompt) -> tuple[dict[TierKey, int], int]:
        with self._lock:
            return self.model.resident_prefix(prompt)

    # --- thread -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        stop = self.pod.stop_event
        try:
            if self.spec.wait_for_subscriber and not self._wait_for_subscriber():
                return
            if self.spec.start_delay and stop.wait(self.spec.start_delay):
                return
            period = 1.0 / self.spec.rate if self.spec.rate else 0.0
            next_due = time.monotonic()
            self.stats.last_activity = next_due
            while not stop.is_set():
                if self._router is not None and self._router.poll(0):
                    self._serve_replay()
                if not self.stats.done:
                    now = time.monotonic()
                    if now >= next_due:
                        self._publish_one()
                        next_due += period
                        continue
                    timeout = min(next_due - now, _POLL_S)
                else:
                    timeout = _POLL_S
                if self._router is not None:
                    self._router.poll(int(timeout * 1000) + 1)
                else:
                    stop.wait(timeout)
        except BaseException as exc:  # surfaced by SimulatedPod.check()
            self.error = exc
            raise
        finally:
            self.pod.log.notify()

    def _wait_for_subscriber(self) -> bool:
        """Block until a subscription arrived on the XPUB (or stop). The XPUB has added it
        to its filter before handing it over: from here on, batches reach that subscriber."""
        stop = self.pod.stop_event
        while not stop.is_set():
            if self._pub.poll(int(_POLL_S * 1000)) and self._pub.recv()[:1] == b"\x01":
                return True
        return False

    # --- publishing ---------------------------------------------------------------------

    def _restart_due(self) -> bool:
        spec = self.spec
        if spec.restart_after and self._incarnation_batches >= spec.restart_after:
            return True
        return self.stats.batches in spec.restart_at_batches and self._incarnation_batches > 0

    def _restart(self) -> None:
        self._new_incarnation()
        self.stats.restarts += 1
        if self.spec.rebind_on_restart:
            self._pub = self._rebind(self._pub, self.endpoints.pub, self.pod.pub_kind)
            if self._router is not None:
                assert self.endpoints.replay is not None
                self._router = self._rebind(self._router, self.endpoints.replay, zmq.ROUTER)

    def _rebind(self, old: zmq.Socket, endpoint: str, kind: int) -> zmq.Socket:
        """Close ``old`` and bind a new socket of ``kind`` at ``endpoint`` (libzmq closes the
        listener asynchronously: retry while the port is still taken)."""
        pod = self.pod
        pod.forget_socket(old)
        old.close(linger=0)
        new = pod.new_socket(kind)
        if kind in (zmq.PUB, zmq.XPUB):
            new.sndhwm = new.rcvhwm = self.spec.hwm
        else:
            hwm = self.spec.rel.replay_sndhwm(self.spec.buffer_steps)
            if hwm is not None:
                new.sndhwm = hwm
        deadline = time.monotonic() + 5.0
        while True:
            try:
                new.bind(endpoint)
                return new
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _publish_one(self) -> None:
        spec = self.spec
        if self._restart_due():
            self._restart()
        with self._lock:
            for _ in range(_MAX_EMPTY_STEPS):
                events = self.model.step()
                if events:
                    break
            else:
                raise RuntimeError(f"{spec.name} dp{self.rank}: the model produced no events")
        ts = time.time()
        rel = spec.rel
        batch = EventBatch(ts, events, self.rank if rel.has_dp_rank else None)
        seq = self.next_seq
        self.next_seq += 1
        self._incarnation_batches += 1
        if seq in spec.lose_seqs:
            sent = "lost"
        else:
            payload = encode_batch(batch, rel, spec.hash_mode)  # type: ignore[arg-type]
            dropped = seq in spec.drop_seqs or (
                spec.drop_rate > 0 and self._drop_rng.random() < spec.drop_rate
            )
            if not dropped:
                self._pub.send_multipart(live_frames(self._topic, seq, payload))
            self.buffer.append((seq, payload))
            sent = "dropped" if dropped else "live"
        record = {
            "pod": spec.name,
            "model": spec.model,
            "dp_rank": self.rank,
            "incarnation": self.incarnation,
            "seq": seq,
            "ts": ts,
            "sent": sent,
            "release": str(rel),
            "events": [event_to_json(normalized(e, str(spec.hash_mode))) for e in events],
        }

        def count() -> None:
            st = self.stats
            st.batches += 1
            setattr(st, sent, getattr(st, sent) + 1)
            st.last_activity = time.monotonic()
            if spec.batches and st.batches >= spec.batches:
                st.done = True

        # Counted under the log's lock: whoever sees the count also finds the record.
        self.pod.log.write(record, count)

    def _serve_replay(self) -> None:
        assert self._router is not None
        frames = self._router.recv_multipart()
        self.stats.last_activity = time.monotonic()
        try:
            identity, start = parse_replay_request(frames)
        except FrameError:
            if len(frames) != 3:
                self.stats.invalid_requests += 1  # vLLM logs "Invalid replay request", no reply
                return
            # vLLM checks only the frame count: [identity, anything, int.from_bytes(anything)]
            identity, start = bytes(frames[0]), int.from_bytes(frames[2], "big")
        self.stats.replay_requests += 1
        if self.stats.replay_requests in self.spec.restart_on_replay:
            self._restart()
            if self.spec.rebind_on_restart:
                return  # the engine that got the request is gone: no answer
        rel = self.spec.rel
        for seq, payload in list(self.buffer):
            if seq >= start:
                self._router.send_multipart(
                    [identity, *replay_reply_frames(rel, self._topic, seq, payload)]
                )
                self.stats.replayed_batches += 1
        self.stats.replays += 1  # counted before the end marker a client may wait for
        self._router.send_multipart([identity, *replay_end_frames(rel)])
        self.stats.last_activity = time.monotonic()


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
