"""The bridge: one event loop over every stream's sockets, feeding the Kafka sink.

:class:`Bridge` follows the pods (added and removed while it runs), opens each stream at its
checkpoint, turns the loop, and makes what it read durable: checkpoints of acknowledged
batches (at-least-once) or Kafka transactions (exactly-once). Its topics are kept by
:mod:`bridge.ingest.topics`, its health answered by :mod:`bridge.ingest.probes`; the
process around it (signals, exit codes) is :mod:`bridge.cli.run`.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import zmq
from confluent_kafka import KafkaError, KafkaException

from bridge.ingest.listener import ListenDiscovery, SharedListener
from bridge.ingest.pipeline import Pipeline, StreamInfo
from bridge.ingest.probes import BridgeProbes
from bridge.ingest.replaylimit import ReplayLimiter
from bridge.ingest.sequencer import SequencerConfig, payload_digest
from bridge.ingest.subscriber import ReconnectPolicy, SocketRegistry, StreamSubscriber
from bridge.ingest.topics import Topics
from bridge.log.checkpoints import Checkpoint, checkpoint_key, load_checkpoints
from bridge.log.markers import KAFKA_REFUSED, EventsLost, PodRemoved
from bridge.log.partitioning import TopicPin, partition_for
from bridge.log.records import RecordCodec
from bridge.log.sink import Fenced, KafkaSink, ensure_topic
from bridge.ops.config import (
    BridgeConfig,
    PodConfig,
    offset_port,
    shared_kafka_properties,
    topic_base,
)
from bridge.ops.metrics import BridgeMetrics
from bridge.ops.sharding import shard_of

log = logging.getLogger(__name__)

TIMER_SCAN = 0.05  # seconds between scans of the streams' timers
GC_GEN0_THRESHOLD = 20_000  # allocations between young collections in the event loop (default 700)


class Bridge:
    """Follows every configured pod and rank; stops when ``stop`` is set."""

    def __init__(self, config: BridgeConfig, metrics: BridgeMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or BridgeMetrics()
        self.stop = threading.Event()
        self.ctx = zmq.Context()
        # SUB + DEALER + a monitor pair (two sockets) per stream, and headroom for sockets being
        # recreated and pods discovered later: lift libzmq's default limit of 1023.
        self.ctx.set(zmq.MAX_SOCKETS, max(4096, 6 * self._stream_count() + 256))
        self.poller = zmq.Poller()
        self.registry = SocketRegistry(self.poller)
        self.codec = RecordCodec()
        if config.schema_registry_url:  # Confluent wire format, schema id from the registry
            from bridge.log.registry import writer_codec

            subject_topic = config.topic if "{" not in config.topic else topic_base(config.topic)
            self.codec = writer_codec(
                config.schema_registry_url, subject_topic, config.schema_registry
            )
        self._acked: dict[bytes, object] = {}
        self.exactly_once = config.exactly_once
        base = topic_base(config.topic)
        txn_id = config.transactional_id or f"kvbridge-{base}"
        if config.shard_count > 1:
            txn_id += f"-shard{config.shard_index}"
        self.sink = KafkaSink(
            config.bootstrap_servers,
            config.topic if "{" not in config.topic else base,
            config.kafka,
            on_success=self._on_acked,
            on_failure=self._on_failed,
            transactional_id=txn_id if config.exactly_once else None,
        )
        self.pipeline = Pipeline(
            self.codec, self.sink, self.metrics, track_acks=not config.exactly_once
        )
        self.checkpoint_topic = config.checkpoint_topic or f"{base}.checkpoints"
        self.sink.side_topics.add(self.checkpoint_topic)
        self.committed: dict[tuple[str, int], Checkpoint] = {}
        self._in_transaction = False
        self.unacknowledged = 0  # after close(): records Kafka did not acknowledge in time
        self._lost_reported: set[tuple[str, int, int, int]] = set()
        self.streams: list[StreamSubscriber] = []
        self.pods: dict[str, PodConfig] = {}  # the pods followed (this shard's), by name
        self._requests: deque[tuple[str, PodConfig | str, str]] = deque()  # from other threads
        self.probes = BridgeProbes(self)  # /healthz, /readyz
        self.topics = Topics(
            config, self.sink, self.codec, self.metrics.registry, on_adopt=self._record_pin
        )
        self._last_epoch: dict[str, int] = {}
        self.listeners: list[SharedListener] = []
        self.limiter = ReplayLimiter(config.max_replays)
        self.reconnect = ReconnectPolicy(
            config.reconnect_initial,
            config.reconnect_max,
            config.reconnect_factor,
            config.silence_timeout,
            config.idle_probe,
            config.silent_warning,
        )
        _raise_fd_limit(8 * self._stream_count() + 256)

    def _on_acked(self, key: bytes) -> None:
        c = self._acked.get(key)
        if c is None:
            c = self._acked[key] = self.metrics.records_out.labels(key.decode(errors="replace"))
        c.inc()  # type: ignore[attr-defined]

    def _on_failed(self, key: bytes | None, value: bytes | None, err: object) -> None:
        """Kafka refused a record for good: write that batch as lost, once, so it is not silent."""
        pod = (key or b"?").decode(errors="replace")
        self.metrics.produce_errors.labels(pod).inc()
        if value is None or self.sink.fatal is not None:
            return
        if self.exactly_once and not self.sink.refused_locally:
            # Exactly-once: the transaction aborts and the streams rewind, nothing is lost
            # (a record produce() refused outright never entered it: written as lost).
            return
        try:
            env = self.codec.decode(value).envelope
        except Exception:  # not one of ours (a checkpoint): counted and logged by the sink
            return
        ident = (env.pod, env.dp_rank, env.epoch, env.seq)
        stream = next((s for s in self.streams if (s.info.pod, s.info.dp_rank) == ident[:2]), None)
        if env.index < 0 or stream is None or ident in self._lost_reported:
            return
        self._lost_reported.add(ident)
        reason = f"{KAFKA_REFUSED}: {getattr(err, 'str', lambda: err)()}"[:500]
        self.pipeline.marker(stream.info, env.epoch, env.seq, EventsLost(env.seq, env.seq, reason))

    def _stream_count(self) -> int:
        c = self.config
        discovered = c.listen_max_pods * c.listen_ranks if c.listen and c.listen_discover else 0
        return sum(p.dp_size for p in c.pods) + discovered

    def _sequencer_config(self, replay: bool) -> SequencerConfig:
        c = self.config
        return SequencerConfig(
            replay_enabled=replay,
            first_contact=c.first_contact,  # type: ignore[arg-type]
            replay_idle_timeout=c.replay_timeout,
            replay_deadline=c.replay_deadline,
            replay_max_attempts=c.replay_attempts,
            max_held=c.max_held,
            max_seq_jump=c.max_seq_jump,
        )

    def owns(self, pod_name: str) -> bool:
        """Whether this replica follows ``pod_name`` (rendezvous hashing over the shards)."""
        c = self.config
        return shard_of(pod_name, c.shard_count) == c.shard_index

    # -- partition pinning (bridge/ingest/topics.py, bridge/log/partitioning.py) ---------------
    def _record_pin(self, pin: TopicPin) -> None:
        """After adopting a new count: rewrite the checkpoints of the topic's streams that keep
        their partition with the new count, so the next start pins it even if those streams
        stay idle. Those that move keep theirs until their new epoch writes one (a crash before
        that moves them again, into another fresh epoch)."""
        own_none = "{" not in self.config.topic  # a checkpoint without a topic is of this one
        for (pod, rank), cp in list(self.committed.items()):
            if not (cp.topic == pin.topic or (cp.topic is None and own_none)):
                continue
            if cp.partitions == pin.pinned or pin.moves(pod.encode(), cp.partitions):
                continue
            cp = replace(cp, topic=pin.topic, partitions=pin.pinned)
            self.committed[(pod, rank)] = cp
            self.sink.produce(checkpoint_key(pod, rank), cp.encode(), topic=self.checkpoint_topic)

    def open(self) -> None:
        c = self.config
        admin = shared_kafka_properties(c.kafka)
        mine = [p for p in c.pods if self.owns(p.name)]
        if c.shard_count > 1:
            log.info(
                "shard %d of %d: following %d of the %d configured pods",
                c.shard_index,
                c.shard_count,
                len(mine),
                len(c.pods),
            )
        topics = {c.topic_for(p) for p in mine}
        if "{" not in c.topic:
            topics.add(c.topic)  # created up front even before a pod is discovered
        for topic in sorted(topics):
            self.topics.ensure(topic)
        ensure_topic(
            c.bootstrap_servers,
            self.checkpoint_topic,
            partitions=1,
            replication=c.topic_replication,
            overrides=admin,
            config={"cleanup.policy": "compact"},
        )
        if self.exactly_once:
            # Fences an older bridge with this id and aborts its open transaction, so the
            # checkpoints read next are the committed ones.
            self.sink.init_transactions()
            self._in_transaction = True
        self.committed = load_checkpoints(
            c.bootstrap_servers, self.checkpoint_topic, overrides=admin
        )
        self.topics.load(self.committed.values())
        if self.committed:
            log.info(
                "resuming %d streams from checkpoints in %s",
                len(self.committed),
                self.checkpoint_topic,
            )
        self._epoch = int(time.time() * 1000)
        if c.listen:
            ranks = max((p.dp_size for p in c.pods if p.pub is None), default=1)
            for rank in range(max(ranks, c.listen_ranks)):
                self.listeners.append(
                    SharedListener(
                        self.ctx,
                        offset_port(c.listen, rank),
                        self.registry,
                        c.rcvhwm,
                        c.max_message_bytes,
                        self.metrics,
                        self.pipeline.bad_input,
                        rank,
                    )
                )
                log.info(
                    "listening on %s for pods that connect (rank %d)",
                    self.listeners[-1].endpoint,
                    rank,
                )
            if c.listen_discover:  # pods named by kv@<pod>@<model> topics are followed
                ListenDiscovery(self, c.listen_max_pods, c.listen_replay).attach(self.listeners)
        for pod in mine:
            self._follow(pod)
        self.sink.started = True  # from now on, Kafka outages are warned about as they happen

    def _follow(self, pod: PodConfig, fresh_epoch: bool = False, first_rank: int = 0) -> None:
        self.pods[pod.name] = pod
        for rank in range(first_rank, pod.dp_size):
            self.streams.append(self._open_stream(pod, rank, fresh_epoch))
            pub, replay = pod.pub_endpoint(rank), pod.replay_endpoint(rank)
            log.info(
                "following pod %s rank %d%s: pub %s, replay %s",
                pod.name,
                rank,
                "" if pod.uid is None else f" (uid {pod.uid})",
                pub,
                replay or "none (gaps cannot be recovered)",
            )

    # -- pods added and removed while running (discovery) ---------------------------------------
    def add_pod(self, pod: PodConfig) -> bool:
        """Follow ``pod`` from the next loop turn; callable from any thread. A pod already
        followed under that name with another uid or endpoints is replaced (PodRemoved, then a
        new StreamStarted). Returns False if another shard owns it."""
        if not self.owns(pod.name):
            return False
        if pod.pub is None and not (pod.topic and pod.dp_size <= len(self.listeners)):
            raise ValueError(
                f"pod {pod.name}: discovered pods need a pub endpoint, or a topic and a listen "
                f"socket for each of its {pod.dp_size} rank(s)"
            )
        self.topics.ensure(self.config.topic_for(pod))  # blocking: done in the caller's thread
        self._requests.append(("add", pod, ""))
        return True

    def remove_pod(self, name: str, reason: str) -> None:
        """Stop following ``name`` and write PodRemoved for its streams; any thread."""
        self._requests.append(("remove", name, reason))

    def _serve_requests(self) -> None:
        while self._requests:
            op, what, reason = self._requests.popleft()
            try:
                if op == "add":
                    assert isinstance(what, PodConfig)
                    old = self.pods.get(what.name)
                    if old == what:
                        continue
                    if old is not None and _grows(old, what):  # more ranks: keep the others
                        self._follow(what, fresh_epoch=True, first_rank=old.dp_size)
                        continue
                    if old is not None:
                        why = (
                            f"replaced by a new incarnation (uid {what.uid})"
                            if old.uid != what.uid
                            else "replaced: its endpoints changed"
                        )
                        self._unfollow(what.name, why)
                    self._follow(what, fresh_epoch=True)
                else:
                    assert isinstance(what, str)
                    self._unfollow(what, reason)
            except (KafkaException, Fenced, MemoryError):
                raise
            except Exception:
                self.metrics.internal_errors.labels(str(getattr(what, "name", what))).inc()
                log.exception("internal error while %sing pod %s; continuing", op, what)

    def _unfollow(self, name: str, reason: str) -> None:
        pod = self.pods.pop(name, None)
        if pod is None:
            return
        keep = []
        for s in self.streams:
            if s.info.pod != name:
                keep.append(s)
                continue
            seq = s.sequencer.last_seq
            self.pipeline.marker(
                s.info, s.sequencer.epoch, -1 if seq is None else seq, PodRemoved(reason)
            )
            self._last_epoch[name] = max(self._last_epoch.get(name, 0), s.sequencer.epoch)
            s.sync_metrics()
            s.close()
            key = (name, s.info.dp_rank)
            if self.committed.pop(key, None) is not None or s.info.written is not None:
                # Forget its checkpoint: a pod of that name later is a new incarnation.
                self.sink.produce(
                    checkpoint_key(name, s.info.dp_rank), None, topic=self.checkpoint_topic
                )
        self.streams = keep
        for listener in self.listeners:
            listener.routes.pop(pod.topic.encode(), None)
        log.info("pod %s removed: %s", name, reason)

    def _open_stream(
        self, pod: PodConfig, rank: int, fresh_epoch: bool = False
    ) -> StreamSubscriber:
        c = self.config
        pub = pod.pub_endpoint(rank)
        replay = pod.replay_endpoint(rank)
        where = pub or f"{self.listeners[rank].endpoint} topic {pod.topic}"
        topic = c.topic_for(pod)
        pin = self.topics.pin_of(topic)
        info = StreamInfo(pod.name, pod.model, rank, where, topic=topic, uid=pod.uid)
        info.partition = partition_for(info.key, pin.pinned)
        cp = self.committed.get((pod.name, rank))
        if cp is not None and cp.uid != pod.uid:
            log.info(
                "pod %s rank %d: checkpoint is of incarnation %s, the pod is %s: starting afresh",
                pod.name,
                rank,
                cp.uid,
                pod.uid,
            )
            cp = None
        if cp is not None and cp.topic in (None, topic) and pin.moves(info.key, cp.partitions):
            before = partition_for(info.key, pin.previous(cp.partitions))
            log.warning(
                "pod %s rank %d: moves from partition %d to %d of %s (%d partitions now "
                "pinned): a new epoch starts there with StreamStarted, after epoch %d",
                pod.name,
                rank,
                before,
                info.partition,
                topic,
                pin.pinned,
                cp.epoch,
            )
            self._last_epoch[pod.name] = max(self._last_epoch.get(pod.name, 0), cp.epoch)
            cp = None
            fresh_epoch = True
        epoch = self._epoch
        if fresh_epoch:
            # A pod seen again: a new epoch, after any this bridge gave the pod before.
            epoch = max(int(time.time() * 1000), self._last_epoch.get(pod.name, 0) + 1)
        sub = StreamSubscriber(
            self.ctx,
            info,
            pub,
            replay,
            pod.topic.encode(),
            self._sequencer_config(replay is not None),
            epoch if cp is None else cp.epoch,
            self.pipeline,
            self.registry,
            c.rcvhwm,
            c.max_message_bytes,
            self.pipeline.bad_input,
            self.limiter,
            self.reconnect,
        )
        if cp is not None:
            sub.sequencer.resume(cp.seq, cp.digest)
            info.written = info.acked = info.delivered = (cp.epoch, cp.seq, None)
            log.info(
                "pod %s rank %d: resuming epoch %d after seq %d", pod.name, rank, cp.epoch, cp.seq
            )
        sub.open()
        if pub is None:
            self.listeners[rank].route(pod.topic, sub)
        return sub

    # -- checkpoints and transactions ----------------------------------------------------------
    def _write_checkpoints(self, source: str) -> int:
        """Produce a checkpoint for every stream whose ``source`` position moved; returns count."""
        n = 0
        for s in self.streams:
            info = s.info
            pos = getattr(info, source)
            if pos is None or pos == info.written:
                continue
            epoch, seq, payload = pos
            digest = None if payload is None else payload_digest(payload)
            pin = self.topics.pins.get(info.topic or "")
            cp = Checkpoint(
                epoch, seq, digest, info.uid, info.topic, None if pin is None else pin.pinned
            )
            self.sink.produce(
                checkpoint_key(info.pod, info.dp_rank), cp.encode(), topic=self.checkpoint_topic
            )
            info.written = pos
            self.committed[(info.pod, info.dp_rank)] = cp
            n += 1
        return n

    COMMIT_SLICE = 1.0  # longest one commit_transaction call blocks (SIGTERM is seen between)

    def _commit(self, deadline: float | None = None) -> bool:
        """Exactly-once: checkpoints of what was delivered, then commit, all or nothing.

        Retries while Kafka is unreachable, in slices of COMMIT_SLICE (librdkafka resumes a
        commit that timed out), until it succeeds or the transaction aborts (True), or
        until ``deadline`` (shutdown) passes or, without one, ``stop`` is set (False: the
        transaction is still open; close() tries again within the shutdown timeout)."""
        pending = dict(self.committed)
        self._write_checkpoints("delivered")
        started = time.monotonic()
        last_log: float | None = None
        while True:
            now = time.monotonic()
            budget = self.config.commit_timeout if deadline is None else deadline - now
            try:
                self.sink.commit(max(0.0, min(self.COMMIT_SLICE, budget)))
                self.pipeline.produced = 0
                self.pipeline.committed()
                return True
            except KafkaException as exc:
                err = exc.args[0]
                self.sink.check_fatal()
                if err.fatal():
                    raise
                if err.txn_requires_abort():
                    log.warning(
                        "transaction aborted (%s); rewinding streams to the last commit", err.str()
                    )
                    self.committed = pending
                    self.pipeline.aborted()
                    left = self.config.commit_timeout if deadline is None else deadline - now
                    self.sink.abort(max(0.0, min(self.config.commit_timeout, left)))
                    self._rewind()
                    return True
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                if err.code() == KafkaError._TIMED_OUT:
                    if last_log is None or now - last_log >= 10.0:
                        last_log = now
                        log.warning(
                            "commit waiting for Kafka for %.0fs (%s); %d records in the open "
                            "transaction",
                            now - started,
                            err.str(),
                            self.pipeline.produced,
                        )
                    if deadline is None and self.stop.is_set():
                        return False
                    continue
                log.warning("commit failed (%s); retrying", err.str())
                if deadline is not None:
                    time.sleep(min(0.5, max(0.0, deadline - now)))
                elif self.stop.wait(0.5):
                    if not err.retriable():
                        raise
                    return False

    def _rewind(self) -> None:
        """After an aborted transaction: reopen every stream at its last committed checkpoint
        (vLLM's replay buffer supplies the batches the aborted transaction held)."""
        old, self.streams = self.streams, []
        for s in old:
            s.close()
        for s in old:
            self.streams.append(self._open_stream(self.pods[s.info.pod], s.info.dp_rank))
        self.pipeline.produced = 0

    def run(self) -> None:
        """The event loop; returns after ``stop`` is set and the producer is flushed."""
        handlers = self.registry.handlers
        sink = self.sink
        next_sync = 0.0
        next_scan = 0.0
        max_poll = self.config.poll_timeout
        c = self.config
        next_commit = time.monotonic() + (c.commit_interval if self.exactly_once else 1.0)
        # The hot path allocates a few short-lived objects per event and makes no reference
        # cycles: collect less often, and never rescan what start-up built (the varint table,
        # schemas, sockets). ~4% of the loop's time went to the collector with the defaults.
        gc_threshold = gc.get_threshold()
        gc.collect()
        gc.freeze()
        gc.set_threshold(max(gc_threshold[0], GC_GEN0_THRESHOLD), *gc_threshold[1:])
        self.topics.start_watch()
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                self.last_turn = now  # for liveness()
                wait = min(max_poll, max(0.0, next_scan - now))
                ready = self.poller.poll(int(wait * 1000))
                now = time.monotonic()
                for sock, _ in ready:
                    handler = handlers.get(sock)
                    if handler is not None:
                        self._guarded(handler, now)
                if now >= next_scan:
                    next_scan = self._fire_timers(now)
                if self._requests:
                    self._serve_requests()
                sink.poll(0)
                if sink.fatal is not None:
                    sink.check_fatal()
                if self.exactly_once:
                    if now >= next_commit or self.pipeline.produced >= c.commit_max_events:
                        self._commit()
                        next_commit = time.monotonic() + c.commit_interval
                elif now >= next_commit:
                    self._write_checkpoints("acked")
                    next_commit = now + c.checkpoint_interval
                if now >= next_sync:
                    next_sync = now + 1.0
                    self.metrics.producer_queue.set(sink.pending())
                    for s in self.streams:
                        s.sync_metrics()
                    self.pipeline.flush_metrics()
        finally:
            gc.set_threshold(*gc_threshold)
            gc.unfreeze()
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
        except (KafkaException, Fenced, MemoryError):
            raise
        except Exception:
            owner = getattr(handler, "__self__", None)
            pod = owner.info.pod if isinstance(owner, StreamSubscriber) else "?"
            self.metrics.internal_errors.labels(pod).inc()
            log.exception("internal error while handling pod %s; continuing", pod)

    CLOSE_TIMEOUT = 1.0  # after the shutdown timeout: releasing the producer (bridge/log/sink.py)

    def close(self) -> None:
        """Stop reading, then make what was read durable: flush and checkpoint (at-least-once)
        or checkpoint and commit (exactly-once), within the shutdown timeout.

        Returns within the shutdown timeout plus a few seconds even when Kafka is down: what
        Kafka has not acknowledged (committed) by then is dropped, ``unacknowledged`` says how
        many records, and the checkpoints stay at the last acknowledged (committed) batch, so
        the next start re-reads those batches from the engines' replay buffers."""
        timeout = self.config.shutdown_timeout
        deadline = time.monotonic() + timeout
        self.topics.stop_watch(timeout)
        for s in self.streams:
            s.sync_metrics()
            s.close()
        for listener in self.listeners:
            listener.close()
        self.listeners.clear()
        committed = True
        try:
            self.sink.poll(0)  # learn of a fatal error (fencing) before committing
            if self.sink.fatal is None:
                if self._in_transaction:
                    committed = self._commit(deadline)
                # At-least-once: checkpoints only if there is time left to deliver them (else
                # they would be dropped with the rest; a full queue would not even take them).
                elif not self.exactly_once and not self.sink.flush(
                    max(0.0, deadline - time.monotonic())
                ):
                    self._write_checkpoints("acked")
            self.sink.flush(max(0.0, deadline - time.monotonic()))
        finally:
            self.pipeline.flush_metrics()  # exact at the end: what was acked while flushing
            self.streams.clear()
            open_txn = 0 if committed or self.sink.fatal is not None else self.pipeline.produced
            left = self.sink.close(self.CLOSE_TIMEOUT)  # drops what is still not acknowledged
            self.unacknowledged = max(left, open_txn)
            if self.unacknowledged and self.exactly_once:
                log.error(
                    "shutdown: the open transaction (%d records) was not committed within "
                    "--shutdown-timeout (%gs), Kafka unreachable; it is left to abort, and every "
                    "stream resumes from its last committed checkpoint on the next start, "
                    "re-reading those batches from the engines' replay buffers (what they no "
                    "longer hold is written as EventsLost)",
                    self.unacknowledged,
                    timeout,
                )
            elif self.unacknowledged:
                log.error(
                    "shutdown: %d records were not acknowledged by Kafka within "
                    "--shutdown-timeout (%gs) and are dropped; the checkpoints stay at each "
                    "stream's last acknowledged batch, so the next start re-reads the rest from "
                    "the engines' replay buffers (what they no longer hold is written as "
                    "EventsLost)",
                    self.unacknowledged,
                    timeout,
                )
            # destroy, not term: a socket left open by a failed open() would block term()
            self.ctx.destroy(linger=0)


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


def _grows(old: PodConfig, new: PodConfig) -> bool:
    """Whether ``new`` is ``old`` with more data-parallel ranks (a listen pod seen on a higher
    rank): the ranks followed already are kept, the new ones are added."""
    return new.dp_size > old.dp_size and replace(new, dp_size=old.dp_size) == old


__all__ = ["Bridge"]
