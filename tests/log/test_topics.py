"""Topics the bridge creates at start (partitions, replication, clear refusals) and the
librdkafka properties every Kafka client of the bridge gets. Real single-node broker."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from kafka_broker import topic_name

import bridge.log.checkpoints
import bridge.log.sink
from bridge.cli.commands import main
from bridge.ingest.runner import Bridge
from bridge.log.sink import ensure_topic
from bridge.ops.config import BridgeConfig, PodConfig

pytestmark = pytest.mark.kafka

POD = "name=a,model=m,pub=tcp://127.0.0.1:1,replay=tcp://127.0.0.1:2"


def partitions_of(admin: Any, topic: str) -> int:
    return len(admin.list_topics(topic, timeout=10).topics[topic].partitions)


def replication_of(admin: Any, topic: str) -> int:
    parts = admin.list_topics(topic, timeout=10).topics[topic].partitions.values()
    return min(len(p.replicas) for p in parts)


def open_and_close(cfg: BridgeConfig) -> None:
    bridge = Bridge(cfg)
    try:
        bridge.open()
    finally:
        bridge.close()


def test_created_topics_get_the_configured_partitions_and_replication(
    kafka_bootstrap, kafka_admin, request
):
    topic = topic_name(request.node.name)
    cfg = BridgeConfig(
        bootstrap_servers=kafka_bootstrap,
        topic=topic,
        topic_partitions=5,
        topic_replication=1,
        metrics_port=0,
    )
    open_and_close(cfg)
    assert partitions_of(kafka_admin, topic) == 5
    assert replication_of(kafka_admin, topic) == 1
    assert partitions_of(kafka_admin, f"{topic}.checkpoints") == 1  # compacted, one partition


def test_default_replication_is_the_brokers(kafka_bootstrap, kafka_admin, request):
    topic = topic_name(request.node.name)
    assert ensure_topic(kafka_bootstrap, topic, partitions=2, replication=-1)
    assert partitions_of(kafka_admin, topic) == 2
    assert replication_of(kafka_admin, topic) == 1  # the single broker's default


def test_replication_beyond_the_brokers_is_refused_naming_the_setting(
    kafka_bootstrap, request, capsys
):
    topic = topic_name(request.node.name)
    argv = ["run", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--pod", POD]
    argv += ["--metrics-port", "0", "--topic-replication", "3"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"Kafka refused to create topic {topic!r}" in err
    assert "topic_replication=3" in err and "--topic-replication" in err
    assert "cannot exceed the number of brokers" in err
    assert "replication factor" in err.lower()  # the broker's own reason is passed on


def test_existing_topic_with_fewer_partitions_is_logged_not_changed(
    kafka_bootstrap, kafka_admin, make_topic, caplog
):
    topic = make_topic(partitions=2)
    cfg = BridgeConfig(
        bootstrap_servers=kafka_bootstrap, topic=topic, topic_partitions=6, metrics_port=0
    )
    with caplog.at_level(logging.WARNING, logger="bridge.log.sink"):
        open_and_close(cfg)
    assert partitions_of(kafka_admin, topic) == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "bridge.log.sink"]
    assert any(
        f"topic {topic} exists with 2 partitions, fewer than topic_partitions=6" in line
        for line in lines
    ), lines


def test_kafka_properties_reach_producer_admin_and_checkpoint_consumer(
    kafka_bootstrap, make_topic, monkeypatch
):
    """Security and client settings go to every client; producer tuning only to the producer."""
    seen: dict[str, list[dict[str, Any]]] = {"producer": [], "admin": [], "consumer": []}

    def spy(kind: str, real: Any) -> Any:
        def make(conf: dict[str, Any], *a: Any, **kw: Any) -> Any:
            seen[kind].append(dict(conf))
            return real(conf, *a, **kw)

        return make

    monkeypatch.setattr(bridge.log.sink, "Producer", spy("producer", bridge.log.sink.Producer))
    monkeypatch.setattr(bridge.log.sink, "AdminClient", spy("admin", bridge.log.sink.AdminClient))
    monkeypatch.setattr(
        bridge.log.checkpoints, "Consumer", spy("consumer", bridge.log.checkpoints.Consumer)
    )
    topic = make_topic(partitions=1)
    props = {
        "client.id": "kvbridge-spy",
        "socket.keepalive.enable": "true",
        "enable.ssl.certificate.verification": "false",
        "linger.ms": "7",
    }
    cfg = BridgeConfig(
        bootstrap_servers=kafka_bootstrap,
        topic=topic,
        kafka=props,
        metrics_port=0,
        pods=[PodConfig("a", "m", "tcp://127.0.0.1:1")],
    )
    open_and_close(cfg)
    assert seen["producer"] and seen["admin"] and seen["consumer"], seen
    shared = {k: v for k, v in props.items() if k != "linger.ms"}
    for kind, confs in seen.items():
        for conf in confs:
            assert shared.items() <= conf.items(), (kind, conf)
    assert seen["producer"][0]["linger.ms"] == "7"
    assert all("linger.ms" not in c for c in seen["admin"] + seen["consumer"])
