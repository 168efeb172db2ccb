"""The broker for a benchmark run, fresh topics, and counting what a topic holds.

Without ``--bootstrap`` the bench starts its own single-node broker with the tests'
:class:`KafkaBroker` (``tests/kafka_broker.py``: ``scripts/kafka-local.sh run`` on free
ports in a temporary directory) and stops it at the end.
"""

from __future__ import annotations

import importlib.util
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

REPO = Path(__file__).resolve().parent.parent

__all__ = ["BrokerInfo", "TopicCounter", "broker", "new_topic"]


def _kafka_broker_module() -> ModuleType:
    """tests/kafka_broker.py, loaded by path (tests/ is not a package)."""
    name = "kafka_broker"
    if name in sys.modules:
        return sys.modules[name]
    path = REPO / "tests" / "kafka_broker.py"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class BrokerInfo:
    bootstrap: str
    pid: int | None  # the JVM's pid when this bench started it (for its CPU time)
    started_here: bool


JIT_OPTIONS = {"full": "", "c1": "-XX:TieredStopAtLevel=1"}


@contextmanager
def broker(bootstrap: str | None, heap: str = "1g", jit: str = "c1") -> Iterator[BrokerInfo]:
    """Use the broker at ``bootstrap``, or start (and finally stop) a private one.

    ``jit``: "full" (the JVM's default tiered compilation) or "c1" (the tests' fast start).
    """
    if bootstrap:
        yield BrokerInfo(bootstrap, None, False)
        return
    kb = _kafka_broker_module().KafkaBroker(heap=heap, java_opts=JIT_OPTIONS[jit])
    with kb:
        yield BrokerInfo(kb.bootstrap, kb.pid, True)


def new_topic(bootstrap: str, hint: str, partitions: int = 6) -> str:
    """Create a uniquely named topic (the bridge's default partition count) with leaders."""
    module = _kafka_broker_module()
    admin = AdminClient({"bootstrap.servers": bootstrap})
    return module.create_topic(admin, module.topic_name(f"bench-{hint}"), partitions)


class TopicCounter:
    """Records in a topic (sum of its partitions' high watermarks): acknowledged = visible."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.topic = topic
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"kvbridge-bench-{uuid.uuid4().hex[:12]}",
                "enable.auto.commit": False,
            }
        )
        md = self._consumer.list_topics(topic, timeout=10).topics[topic]
        self._partitions = [TopicPartition(topic, p) for p in sorted(md.partitions)]

    def total(self) -> int:
        n = 0
        for tp in self._partitions:
            _, high = self._consumer.get_watermark_offsets(tp, timeout=10, cached=False)
            n += high
        return n

    def wait_stable(self, quiet: float = 0.3, timeout: float = 10.0) -> int:
        """The count once it has not changed for ``quiet`` seconds."""
        deadline = time.monotonic() + timeout
        last, since = self.total(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = self.total()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet:
                break
        return last

    def close(self) -> None:
        self._consumer.close()
