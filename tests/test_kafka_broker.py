"""The test broker and its fixtures, against the real broker (no fakes)."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from kafka_broker import BrokerError, KafkaBroker, create_topic, topic_name


def produce(
    bootstrap: str, topic: str, records: list[tuple[bytes, bytes]], idempotent: bool = True
) -> list[str]:
    """Produce ``records`` (key, value) and return delivery errors (none means all landed).

    A fresh broker answers the first idempotent producer's InitProducerId with a retriable
    error for about a second; ``idempotent=False`` skips that where order does not matter."""
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": idempotent,
            "acks": "all",
            "partitioner": "murmur2_random",
            "message.timeout.ms": 20000,
        }
    )
    errors: list[str] = []

    def on_delivery(err: object, _msg: object) -> None:
        if err is not None:
            errors.append(str(err))

    for key, value in records:
        producer.produce(topic, key=key, value=value, on_delivery=on_delivery)
    assert producer.flush(30) == 0, "messages still queued after 30s"
    return errors


def consume(
    bootstrap: str, topic: str, count: int, partitions: int | None = None, timeout: float = 30.0
) -> list:
    """Read ``count`` messages of ``topic`` from the beginning: through a fresh consumer group,
    or, given the partition count, by assigning every partition (no group involved)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": topic_name("group"),
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 6000,
            "enable.auto.commit": False,
        }
    )
    messages = []
    try:
        if partitions is None:
            consumer.subscribe([topic])
        else:
            consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        while len(messages) < count:
            batch = consumer.consume(count - len(messages), timeout=timeout)
            if not batch:
                break
            for msg in batch:
                if msg.error() is not None:
                    raise KafkaException(msg.error())
                messages.append(msg)
    finally:
        consumer.close()
    assert len(messages) == count, f"read {len(messages)} of {count} messages within {timeout}s"
    return messages


def test_round_trip_keeps_per_key_order(
    kafka_bootstrap: str, make_topic: Callable[..., str]
) -> None:
    topic = make_topic(partitions=3)
    records = [(f"pod-{i % 4}".encode(), f"{i}".encode()) for i in range(40)]

    assert produce(kafka_bootstrap, topic, records) == []
    messages = consume(kafka_bootstrap, topic, len(records))

    by_key: dict[bytes, list[bytes]] = {}
    partitions: dict[bytes, set[int]] = {}
    for msg in messages:
        by_key.setdefault(msg.key(), []).append(msg.value())
        partitions.setdefault(msg.key(), set()).add(msg.partition())
    expected: dict[bytes, list[bytes]] = {}
    for key, value in records:
        expected.setdefault(key, []).append(value)
    assert by_key == expected
    assert all(len(p) == 1 for p in partitions.values()), partitions


@pytest.mark.parametrize("kafka_topic", [1, 3], indirect=True)
def test_kafka_topic_has_leaders_for_every_partition(
    kafka_topic: str, kafka_admin: AdminClient, request: pytest.FixtureRequest
) -> None:
    md = kafka_admin.list_topics(topic=kafka_topic, timeout=10).topics[kafka_topic]
    assert len(md.partitions) == request.node.callspec.params["kafka_topic"]
    assert all(p.leader == 1 for p in md.partitions.values())


def test_topics_are_unique(make_topic: Callable[..., str]) -> None:
    assert make_topic() != make_topic()


def _refuses_connections(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_pause_resume_restart_and_stop_a_private_broker() -> None:
    with KafkaBroker() as broker:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        topic = create_topic(admin, topic_name("outage"), partitions=2)
        assert produce(broker.bootstrap, topic, [(b"k", b"before")], idempotent=False) == []

        broker.pause()
        with pytest.raises(KafkaException):
            admin.list_topics(timeout=1)
        broker.resume()
        assert 1 in admin.list_topics(timeout=10).brokers

        pid = broker.pid
        broker.restart()
        assert broker.pid not in (None, pid)
        assert produce(broker.bootstrap, topic, [(b"k", b"after")], idempotent=False) == []
        values = [m.value() for m in consume(broker.bootstrap, topic, 2, partitions=2)]
        assert values == [b"before", b"after"]

        broker.stop()
        assert broker.pid is None
        assert _refuses_connections(broker.port)
    assert not broker.workdir.exists()


def test_startup_failure_reports_the_errors_logged() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        broker = KafkaBroker(port=taken.getsockname()[1], start_timeout=60)
        try:
            with pytest.raises(BrokerError, match="(?s)exited.*errors logged.*already in use"):
                broker.start()
            assert broker.pid is None
        finally:
            broker.close()
    assert not broker.workdir.exists()


def test_kafka_local_start_says_what_its_output_is(tmp_path) -> None:
    """`kafka-local.sh start` ends with a labelled bootstrap line a script can parse."""
    import subprocess

    from kafka_broker import SCRIPT

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    where = ["--port", str(ports[0]), "--controller-port", str(ports[1])]
    where += ["--data-dir", str(tmp_path / "kafka")]
    try:
        got = subprocess.run(
            ["bash", str(SCRIPT), "start", *where], capture_output=True, text=True, timeout=180
        )
        assert got.returncode == 0, got.stderr
        lines = got.stdout.splitlines()
        assert lines[-1] == f"kafka-local: bootstrap servers 127.0.0.1:{ports[0]}", got.stdout
        assert "ready (pid" in lines[-2]
        admin = AdminClient({"bootstrap.servers": lines[-1].rsplit(" ", 1)[1]})
        assert admin.list_topics(timeout=10).brokers
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", *where], capture_output=True, timeout=60)
    assert _refuses_connections(ports[0])
