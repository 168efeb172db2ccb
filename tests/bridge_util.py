"""Running a real Bridge in-process (its own thread) against real sockets and a real broker."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from bridge.consume.reader import TopicReader
from bridge.consume.sentlog import compare_with_sent
from bridge.ingest.runner import Bridge
from bridge.log.records import Record
from bridge.ops.config import BridgeConfig, PodConfig
from bridge.ops.localrun import wait_until


@contextmanager
def running_bridge(bootstrap: str, topic: str, pods: list[PodConfig], **kw) -> Iterator[Bridge]:
    cfg = BridgeConfig(bootstrap_servers=bootstrap, topic=topic, pods=pods, metrics_port=0, **kw)
    bridge = Bridge(cfg)
    bridge.open()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            bridge.run()
        except BaseException as exc:  # surfaced by the test below
            errors.append(exc)

    t = threading.Thread(target=loop, name="bridge", daemon=True)
    t.start()
    try:
        yield bridge
    finally:
        bridge.stop.set()
        t.join(60)
        assert not t.is_alive(), "bridge did not stop"
    if errors:
        raise errors[0]


def read_all(bootstrap: str, topic: str) -> list[Record]:
    with TopicReader(bootstrap, topic) as r:
        return [c.record for c in r.read()]


def wait_topic_agrees(
    bootstrap: str,
    topic: str,
    sent: list[dict],
    timeout: float = 60,
    what: str = "the topic to hold what the pods published",
    pod: str | None = None,
) -> None:
    """Until the topic's records (of ``pod`` only, if given) agree with the sent-log
    (:func:`compare_with_sent`); else an AssertionError with the first differences."""
    last: list[str] = []

    def agree() -> bool:
        records = read_all(bootstrap, topic)
        if pod is not None:
            records = [r for r in records if r.envelope.pod == pod]
        last[:] = compare_with_sent(records, sent)
        return not last

    try:
        wait_until(agree, timeout, what, interval=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last[:10]}") from None


def metric(bridge: Bridge, name: str, **labels: str) -> float:
    value = bridge.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value
