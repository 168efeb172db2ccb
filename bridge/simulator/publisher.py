"""One simulated DP rank: vLLM's zmq-publisher thread on real ZeroMQ sockets (spec §2, §3, §6).

A :class:`RankPublisher`'s thread does what vLLM's "zmq-publisher" thread does: numbers each
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

import zmq

from bridge.simulator.model import PrefixCacheModel, Prompt, TierKey
from bridge.simulator.spec import RankEndpoints
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

if TYPE_CHECKING:
    from bridge.simulator.pod import SimulatedPod

_POLL_S = 0.05  # longest wait between checks of the stop flag
_MAX_EMPTY_STEPS = 10_000


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
