"""Shared fixtures: one real Kafka broker per test session, started only if a test needs it.

- ``kafka_bootstrap``: the ``bootstrap.servers`` string of the session's broker. Set
  ``KVBRIDGE_TEST_BOOTSTRAP`` to use a broker you run yourself instead (e.g. docker-compose's
  ``localhost:9092``).
- ``kafka_broker``: the session's :class:`KafkaBroker` itself. Do not pause, kill or restart
  it: outage tests start their own ``KafkaBroker()`` (a context manager).
- ``make_topic(partitions=1, config=None)``: a fresh, uniquely named topic whose partitions
  all have leaders. ``kafka_topic``: the same with one partition, or
  ``@pytest.mark.parametrize("kafka_topic", [3], indirect=True)`` for three.

Tests using these get the ``kafka`` marker automatically (``-m "not kafka"`` skips them).
If the session fails, the tail of the broker log is printed in the terminal summary (and the
broker's directory is kept when a test failed).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka.admin import AdminClient
from kafka_broker import KafkaBroker, create_topic, topic_name

KAFKA_FIXTURES = {"kafka_broker", "kafka_bootstrap", "kafka_admin", "make_topic", "kafka_topic"}

_broker_log: dict[str, str] = {}


@pytest.fixture(scope="session")
def kafka_broker(request: pytest.FixtureRequest) -> Iterator[KafkaBroker]:
    broker = KafkaBroker()
    try:
        broker.start()  # on failure BrokerError carries the log tail into the test report
        yield broker
    finally:
        failed = request.session.testsfailed > 0
        broker.keep_workdir = failed
        _broker_log["where"] = f"kept in {broker.log_path}" if failed else "removed"
        _broker_log["tail"] = broker.log_tail(80)
        broker.close()


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest) -> str:
    external = os.environ.get("KVBRIDGE_TEST_BOOTSTRAP")
    if external:
        return external
    return request.getfixturevalue("kafka_broker").bootstrap


@pytest.fixture(scope="session")
def kafka_admin(kafka_bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": kafka_bootstrap})


@pytest.fixture
def make_topic(kafka_admin: AdminClient, request: pytest.FixtureRequest) -> Callable[..., str]:
    def make(partitions: int = 1, config: dict[str, str] | None = None) -> str:
        return create_topic(kafka_admin, topic_name(request.node.name), partitions, config)

    return make


@pytest.fixture
def kafka_topic(make_topic: Callable[..., str], request: pytest.FixtureRequest) -> str:
    return make_topic(partitions=getattr(request, "param", 1))


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_sessionstart(session: pytest.Session) -> None:
    # SIGTERM (`timeout`, CI) would end Python without teardown; as KeyboardInterrupt,
    # pytest still stops the broker and removes its directory.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if KAFKA_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kafka)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int) -> None:
    if exitstatus != 0 and _broker_log.get("tail"):
        terminalreporter.write_sep("-", f"kafka broker log ({_broker_log['where']})")
        terminalreporter.write_line(_broker_log["tail"])
