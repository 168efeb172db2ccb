"""Prometheus metrics of one bridge process (own registry, so tests can run several)."""

from __future__ import annotations

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
            p + "records_out", "Records acknowledged by Kafka", ["pod"], registry=r
        )
        self.markers_out = Counter(
            p + "markers", "Marker records written", ["pod", "type"], registry=r
        )
        self.gaps = Counter(p + "gaps", "Sequence gaps detected", ["pod"], registry=r)
        self.replays = Counter(
            p + "replays", "Replay attempts by outcome", ["pod", "outcome"], registry=r
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
        self.e2e_lag = Histogram(
            p + "e2e_lag_seconds",
            "vLLM batch timestamp to Kafka acknowledgement",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)
