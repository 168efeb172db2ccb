"""`/metrics`, `/healthz`, `/readyz` of a running bridge, and what it logs.

Real parts: HTTP over local sockets, simulated vLLM pods over ZeroMQ, real Kafka brokers (the
outage test pauses a broker of its own, never the session's).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any
from urllib.error import HTTPError
from urllib.request import urlopen

import pytest
from bridge_util import metric, read_all, running_bridge
from confluent_kafka.admin import AdminClient
from e2e_util import Proc, free_port_block, wait_for
from kafka_broker import KafkaBroker, create_topic, topic_name
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client import Counter as PromCounter

from bridge.ops.config import PodConfig
from bridge.ops.health import HealthServer
from bridge.ops.logsetup import JsonFormatter
from bridge.simulator.pod import PodSpec, SimulatedFleet


def get(url: str) -> tuple[int, str, Any]:
    """(status, content type, body: JSON if it is JSON, else text)."""
    try:
        with urlopen(url, timeout=10) as r:
            status, ctype, raw = r.status, r.headers["Content-Type"], r.read()
    except HTTPError as exc:
        status, ctype, raw = exc.code, exc.headers["Content-Type"], exc.read()
    body = json.loads(raw) if ctype == "application/json" else raw.decode()
    return status, ctype, body


def test_endpoints_answer_from_the_probes():
    registry = CollectorRegistry()
    PromCounter("kvbridge_test_things", "things", registry=registry).inc(3)
    state = {"alive": True, "ready": False}

    def ready() -> tuple[bool, dict[str, Any]]:
        if state["ready"] is None:
            raise RuntimeError("boom")
        return state["ready"], {} if state["ready"] else {"reasons": ["kafka down"]}

    server = HealthServer(registry, lambda: (state["alive"], {"state": "running"}), ready)
    server.start(0, "127.0.0.1")
    base = f"http://127.0.0.1:{server.port}"
    try:
        status, ctype, body = get(base + "/metrics")
        assert status == 200 and ctype == CONTENT_TYPE_LATEST
        assert "kvbridge_test_things_total 3.0" in body
        assert get(base + "/healthz") == (200, "application/json", {"ok": True, "state": "running"})
        assert get(base + "/readyz") == (
            503,
            "application/json",
            {"ok": False, "reasons": ["kafka down"]},
        )
        state.update(alive=False, ready=True)
        assert get(base + "/healthz")[0] == 503
        assert get(base + "/readyz/")[:2] == (200, "application/json")
        state["ready"] = None
        status, _, body = get(base + "/readyz")
        assert status == 503 and "probe failed: boom" in body["error"]
        status, _, body = get(base + "/nope")
        assert status == 404 and "/readyz" in body["endpoints"]
    finally:
        server.close()


def test_readyz_follows_kafka_and_healthz_the_loop(tmp_path):
    """Ready once connected; 503 naming Kafka while the broker hangs (SIGSTOP); ready again
    after it continues; alive all along, since the event loop keeps turning."""
    with KafkaBroker() as broker, SimulatedFleet(PodSpec(name="hp", rate=20, seed=1)) as fleet:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        topic = create_topic(admin, topic_name("health"))
        pod = fleet["hp"]
        pods = [PodConfig("hp", "m", pod.pub, pod.replay)]
        with running_bridge(broker.bootstrap, topic, pods) as bridge:
            server = HealthServer(
                bridge.metrics.registry, bridge.probes.liveness, bridge.probes.readiness
            )
            server.start(0, "127.0.0.1")
            base = f"http://127.0.0.1:{server.port}"
            try:

                def readyz(status: int) -> Any:
                    code, _, body = get(base + "/readyz")
                    return body if code == status else None

                body = wait_for(lambda: readyz(200), 30, "/readyz 200")
                assert body["kafka"].startswith("reachable") and body["streams"] == 1
                wait_for(lambda: readyz(200)["streams_connected"] == 1, 30, "a connected stream")
                code, _, live = get(base + "/healthz")
                assert code == 200 and live["state"] == "running"
                assert live["loop_turned_seconds_ago"] < 5

                broker.pause()
                try:
                    body = wait_for(lambda: readyz(503), 30, "/readyz 503 while Kafka hangs")
                    assert any("Kafka is not reachable" in r for r in body["reasons"]), body
                    assert get(base + "/healthz")[0] == 200
                finally:
                    broker.resume()
                body = wait_for(lambda: readyz(200), 60, "/readyz 200 after Kafka is back")
                assert "reasons" not in body
            finally:
                server.close()


@pytest.mark.kafka
def test_kvbridge_run_serves_metrics_and_health(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=1)
    port = free_port_block(1)
    with SimulatedFleet(PodSpec(name="cli", rate=50, batches=50, seed=2)) as fleet:
        pod = fleet["cli"]
        args = ["run", "--bootstrap-servers", kafka_bootstrap, "--topic", topic]
        args += ["--pod", f"name=cli,model=m,pub={pod.pub},replay={pod.replay}"]
        args += ["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
        proc = Proc(args, tmp_path / "bridge.log")
        base = f"http://127.0.0.1:{port}"
        try:

            def ready() -> bool:
                try:
                    return get(base + "/readyz")[0] == 200
                except OSError:
                    return False  # not listening yet

            wait_for(ready, 60, "/readyz 200 from kvbridge run")
            assert get(base + "/healthz")[0] == 200
            fleet.wait_done(30)

            def all_acked() -> bool:
                _, ctype, text = get(base + "/metrics")
                assert ctype == CONTENT_TYPE_LATEST
                return 'kvbridge_last_seq{dp_rank="0",pod="cli"} 49.0' in text

            wait_for(all_acked, 30, "the last batch in /metrics")
            assert "metrics and health on http://127.0.0.1" in proc.output()
        finally:
            code = proc.stop()
        assert code == 0, (tmp_path / "bridge.log").read_text()


# -- logging: one line per state change, none per event ------------------------------------------


def bridge_log_run(bootstrap: str, topic: str, batches: int) -> tuple[list[logging.LogRecord], int]:
    """A pod with a dropped batch (gap, recovered by replay), a lost one and a restart; returns
    the bridge's log records and the records written to Kafka."""
    spec = PodSpec(
        name="lg",
        rate=100,  # slow enough that each replay ends before the next fault
        batches=batches,
        drop_seqs={10},  # in each incarnation
        lose_seqs={30},
        restart_at_batches={60},
        wait_for_subscriber=True,
        seed=5,
    )
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.name.startswith("bridge"):
                records.append(record)

    handler = Keep(logging.DEBUG)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with SimulatedFleet(spec) as fleet:
            pod = fleet["lg"]
            pods = [PodConfig("lg", "m", pod.pub, pod.replay)]
            with running_bridge(bootstrap, topic, pods, idle_probe=0.0) as bridge:
                fleet.wait_done(60)
                last = batches - 60 - 1  # the restarted incarnation's last seq

                def delivered() -> bool:
                    return metric(bridge, "kvbridge_last_seq", pod="lg", dp_rank="0") == last

                wait_for(delivered, 60, f"seq {last} of the second incarnation")
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    return records, len(read_all(bootstrap, topic))


@pytest.mark.kafka
def test_info_logs_state_changes_not_events(kafka_bootstrap, make_topic):
    small, small_written = bridge_log_run(kafka_bootstrap, make_topic(), 100)
    big, big_written = bridge_log_run(kafka_bootstrap, make_topic(), 400)
    assert big_written > 3 * small_written

    def info(records: list[logging.LogRecord]) -> list[str]:
        return [r.getMessage() for r in records if r.levelno == logging.INFO]

    def templates(records: list[logging.LogRecord]) -> Counter[str]:
        return Counter(str(r.msg) for r in records if r.levelno >= logging.INFO)

    lines = info(small)
    text = "\n".join(lines)
    assert "pod lg rank 0: connected to" in text
    # (first contact asks for a replay from 0 only if the first batch it sees is not seq 0:
    # that depends on whether the pod started before the subscription, so it is not asserted)
    # the gap of the dropped batch, logged with its cause
    assert "pod lg rank 0: replay from seq 10 (gap: seq 11 arrived, 10 expected)" in text
    assert "StreamStarted" in text and "PublisherRestarted" in text
    lost = [
        r.getMessage() for r in small if r.levelno == logging.WARNING and "lost" in r.getMessage()
    ]
    assert len(lost) == 2 and all("batches 30..30 lost" in line for line in lost), lost
    # Four times the events, the same state changes: the same lines. (Not exactly the same
    # counts: how many replays a run asks for depends on timing, e.g. whether the SUB's
    # connect event is seen before the first batches, which adds a reconnect check.)
    big_t, small_t = templates(big), templates(small)
    assert set(big_t) == set(small_t), (big_t, small_t)
    assert all(n <= small_t[t] + 2 for t, n in big_t.items()), (big_t, small_t)
    assert len(lines) < 20, text


def test_json_log_lines_carry_extra_fields():
    record = logging.LogRecord(
        "bridge.x", logging.INFO, __file__, 1, "pod %s: %s", ("a", "up"), None
    )
    record.pod = "a"
    out = json.loads(JsonFormatter().format(record))
    assert out["msg"] == "pod a: up" and out["level"] == "info" and out["pod"] == "a"
    assert out["logger"] == "bridge.x" and out["ts"].endswith("Z")
