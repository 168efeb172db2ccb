"""Prometheus metrics of one bridge process (own registry, so tests can run several).

The per-event counts are not Prometheus calls: the hot path adds to plain ints and dicts in a
:class:`StreamStats` per stream (no lock, no label lookup per event), and the event loop moves
them into the Prometheus children about once a second (:meth:`StreamStats.flush`) and once more
when the bridge stops, so every value is exact after a clean stop and at most ~1 s behind while
it runs.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class BridgeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        p = "kvbridge_"
        self.batches_in = Counter(
            p + "batches_in", "vLLM batches received", ["pod", "source"], registry=r
        )
        self.events_in = Counter(
            p + "events_in", "vLLM events decoded", ["pod", "type"], registry=r
        )
        self.records_out = Counter(
            p + "records_out",
            "Records (events and markers) acknowledged by Kafka; exactly-once: committed",
            ["pod"],
            registry=r,
        )
        self.events_out = Counter(
            p + "events_out",
            "vLLM events acknowledged by Kafka as records (exactly-once: committed), by type",
            ["pod", "type"],
            registry=r,
        )
        self.markers_out = Counter(
            p + "markers", "Marker records written", ["pod", "type"], registry=r
        )
        self.gaps = Counter(p + "gaps", "Sequence gaps detected", ["pod"], registry=r)
        self.replays = Counter(
            p + "replays",
            "Replay attempts by outcome (bad_reply: a reply refused as no answer to the request)",
            ["pod", "outcome"],
            registry=r,
        )
        self.batches_lost = Counter(
            p + "batches_lost", "vLLM batches lost beyond recovery", ["pod", "reason"], registry=r
        )
        self.decode_errors = Counter(
            p + "decode_errors", "Undecodable payloads or frames", ["pod", "kind"], registry=r
        )
        self.unknown_events = Counter(
            p + "unknown_events",
            "Events with a tag this bridge does not know",
            ["pod", "tag"],
            registry=r,
        )
        self.produce_errors = Counter(
            p + "produce_errors", "Records Kafka failed to take", ["pod"], registry=r
        )
        self.duplicates = Counter(
            p + "duplicate_batches",
            "Batches dropped as duplicates of delivered ones",
            ["pod"],
            registry=r,
        )
        self.restarts = Counter(
            p + "publisher_restarts", "Publisher restarts seen", ["pod"], registry=r
        )
        self.dp_mismatch = Counter(
            p + "dp_rank_mismatch",
            "Batches whose data_parallel_rank disagrees with the stream",
            ["pod"],
            registry=r,
        )
        self.seq_jumps = Counter(
            p + "seq_jumps",
            "Live seqs beyond max_seq_jump of anything known: the stream started afresh there",
            ["pod"],
            registry=r,
        )
        self.held_dropped = Counter(
            p + "held_dropped",
            "Live batches not held during a replay (max_held were): the replay fetches them",
            ["pod"],
            registry=r,
        )
        self.unverified_reconnects = Counter(
            p + "unverified_reconnects",
            "Reconnects after which the publisher's incarnation could not be verified",
            ["pod"],
            registry=r,
        )
        self.internal_errors = Counter(
            p + "internal_errors",
            "Unexpected errors while handling a pod (a bug: please report it)",
            ["pod"],
            registry=r,
        )
        self.last_seq = Gauge(p + "last_seq", "Last delivered seq", ["pod", "dp_rank"], registry=r)
        self.producer_queue = Gauge(
            p + "producer_queue", "Records waiting in the Kafka producer", registry=r
        )
        self.connected = Gauge(
            p + "connected",
            "1 while the stream's SUB socket is connected to its pod (0: disconnected)",
            ["pod", "dp_rank"],
            registry=r,
        )
        self.silent = Gauge(
            p + "stream_silent",
            "1 while the stream has heard nothing at all (no live message, no replayed batch) "
            "for longer than the silent warning after it was opened",
            ["pod", "dp_rank"],
            registry=r,
        )
        self.since_last_event = Gauge(
            p + "seconds_since_last_event",
            "Seconds since the stream last received a vLLM batch live from its pod (updated ~1/s)",
            ["pod", "dp_rank"],
            registry=r,
        )
        self.e2e_lag = Histogram(
            p + "e2e_lag_seconds",
            "vLLM batch timestamp to Kafka acknowledgement (exactly-once: to the commit)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)


class StreamStats:
    """Counts of one (pod, dp_rank) stream kept as plain numbers on the hot path.

    ``flush`` adds what was counted since the previous flush to the Prometheus children
    (resolved once per stream) and zeroes the pending counts.
    """

    __slots__ = (
        "_m",
        "pod",
        "rank",
        "batches_live",
        "batches_replay",
        "events_in",
        "events_out",
        "records_out",
        "last_seq",
        "_children",
    )

    def __init__(self, metrics: BridgeMetrics, pod: str, dp_rank: int) -> None:
        self._m = metrics
        self.pod = pod
        self.rank = str(dp_rank)
        self.batches_live = 0
        self.batches_replay = 0
        self.events_in: dict[type, int] = {}  # event class -> count
        self.events_out: dict[type, int] = {}
        self.records_out = 0
        self.last_seq: int | None = None
        self._children: dict[Any, Any] = {}

    def _child(self, family: Any, *labels: str) -> Any:
        key = (id(family), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = family.labels(*labels)
        return c

    def add_out(self, by_type: dict[type, int], records: int) -> None:
        """A batch's records were acknowledged (or committed)."""
        out = self.events_out
        for t, n in by_type.items():
            out[t] = out.get(t, 0) + n
        self.records_out += records

    def flush(self) -> None:
        m = self._m
        pod = self.pod
        if self.batches_live:
            self._child(m.batches_in, pod, "live").inc(self.batches_live)
            self.batches_live = 0
        if self.batches_replay:
            self._child(m.batches_in, pod, "replay").inc(self.batches_replay)
            self.batches_replay = 0
        if self.events_in:
            for t, n in self.events_in.items():
                self._child(m.events_in, pod, t.__name__).inc(n)
            self.events_in.clear()
        if self.events_out:
            for t, n in self.events_out.items():
                self._child(m.events_out, pod, t.__name__).inc(n)
            self.events_out.clear()
        if self.records_out:
            self._child(m.records_out, pod).inc(self.records_out)
            self.records_out = 0
        if self.last_seq is not None:
            self._child(m.last_seq, pod, self.rank).set(self.last_seq)
            self.last_seq = None

    def connection(
        self,
        connected: bool | None,
        last_message: float,
        now: float | None = None,
        silent: bool = False,
    ) -> None:
        """Connection state (None: unknown, not set), seconds since the last message
        (``last_message`` on the monotonic clock; 0: none yet, not set), silence."""
        self._child(self._m.silent, self.pod, self.rank).set(1 if silent else 0)
        if connected is not None:
            self._child(self._m.connected, self.pod, self.rank).set(1 if connected else 0)
        if last_message > 0:
            age = (time.monotonic() if now is None else now) - last_message
            self._child(self._m.since_last_event, self.pod, self.rank).set(max(0.0, age))


class LagRecorder:
    """End-to-end lag samples taken at an exactly-once commit, observed at the next flush
    (at-least-once observes each batch's lag in its delivery callback)."""

    __slots__ = ("_hist", "pending")

    def __init__(self, metrics: BridgeMetrics) -> None:
        self._hist = metrics.e2e_lag
        self.pending: list[float] = []

    def flush(self) -> None:
        if self.pending:
            observe = self._hist.observe
            for v in self.pending:
                observe(v)
            self.pending.clear()
