"""DNS discovery: the pure diff, the thread with a real getaddrinfo and an injectable resolver,
and end to end with a real bridge, broker and simulated pods."""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit

import pytest
from bridge_util import metric, read_all, running_bridge
from e2e_util import free_port_block, wait_for

from bridge.log.markers import PodRemoved
from bridge.ops.config import PodConfig
from bridge.ops.discovery.dns import DnsDiscovery, DnsSettings, DnsTracker, diff, pod_for, resolve
from bridge.ops.discovery.k8s import Add, Remove
from bridge.simulator.pod import PodSpec, SimulatedFleet

S = DnsSettings(name="vllm-headless.llm.svc.cluster.local", model="llama", interval=0.05)


def test_diff():
    assert diff([], []) == ([], [])
    assert diff(["10.0.0.2", "10.0.0.1"], ["10.0.0.3", "10.0.0.1"]) == (["10.0.0.3"], ["10.0.0.2"])
    assert diff(["a"], ["a"]) == ([], [])


def test_pod_for_ipv4_and_ipv6():
    p = pod_for("10.0.0.7", S)
    assert (p.name, p.model, p.pub, p.replay, p.uid) == (
        "10.0.0.7",
        "llama",
        "tcp://10.0.0.7:5557",
        "tcp://10.0.0.7:5558",
        None,
    )
    v6 = pod_for("fd00::7", DnsSettings(name="x", replay_port=None, dp_size=2))
    assert v6.pub == "tcp://[fd00::7]:5557" and v6.replay is None
    assert v6.pub_endpoint(1) == "tcp://[fd00::7]:5558"


def test_tracker_adds_and_removes():
    t = DnsTracker(S)
    first = t.on_resolved({"10.0.0.1", "10.0.0.2"})
    assert [a.pod.name for a in first if isinstance(a, Add)] == ["10.0.0.1", "10.0.0.2"]
    assert t.on_resolved({"10.0.0.2", "10.0.0.1"}) == []
    changed = t.on_resolved({"10.0.0.2", "10.0.0.3"})
    assert [type(a) for a in changed] == [Remove, Add]
    assert changed[0].name == "10.0.0.1" and S.name in changed[0].reason
    assert changed[1].pod.name == "10.0.0.3"
    assert [a.name for a in t.on_resolved(set())] == ["10.0.0.2", "10.0.0.3"]


def test_tracker_ignores_non_addresses_and_normalises():
    t = DnsTracker(S)
    actions = t.on_resolved({"not-an-ip", "fe80::1%eth0", "FD00::0001"})
    assert sorted(a.pod.name for a in actions) == ["fd00::1", "fe80::1"]


def test_tracker_shard_filter():
    t = DnsTracker(S, owns=lambda name: name.endswith(".1"))
    actions = t.on_resolved({"10.0.0.1", "10.0.0.2"})
    assert [a.pod.name for a in actions] == ["10.0.0.1"]


def test_real_getaddrinfo_on_localhost():
    addrs = resolve("localhost")
    assert "127.0.0.1" in addrs or "::1" in addrs
    assert resolve("no-such-host.invalid") == set()


class RecordingBridge:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pods: dict[str, PodConfig] = {}
        self.removed: list[tuple[str, str]] = []

    def add_pod(self, pod: PodConfig) -> bool:
        with self.lock:
            self.pods[pod.name] = pod
        return True

    def remove_pod(self, name: str, reason: str) -> None:
        with self.lock:
            self.pods.pop(name, None)
            self.removed.append((name, reason))

    def names(self) -> set[str]:
        with self.lock:
            return set(self.pods)


def test_thread_with_real_resolver_on_localhost():
    bridge = RecordingBridge()
    d = DnsDiscovery(bridge, DnsSettings(name="localhost", interval=0.05))
    d.start()
    try:
        wait_for(d.resolved.is_set, 10, "the first resolution")
        assert bridge.names() == resolve("localhost") and bridge.names()
    finally:
        d.stop()
        d.join(5)
    assert not d.is_alive()


def test_thread_follows_changes_and_keeps_pods_on_lookup_errors():
    answers: list[object] = [
        {"10.1.0.1", "10.1.0.2"},
        socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
        {"10.1.0.2", "10.1.0.3"},
    ]
    lock = threading.Lock()

    def resolver(name: str) -> set[str]:
        assert name == S.name
        with lock:
            answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            raise answer
        return set(answer)  # type: ignore[arg-type]

    bridge = RecordingBridge()
    d = DnsDiscovery(bridge, S, resolver=resolver)
    d.start()
    try:
        wait_for(lambda: bridge.names() == {"10.1.0.2", "10.1.0.3"}, 10, "the new address set")
        assert d.stats["errors"] == 1  # the failed lookup removed nothing
        labels = {"source": "dns", "kind": "lookup"}
        assert d.metrics.registry.get_sample_value("kvbridge_discovery_errors_total", labels) == 1
        assert bridge.removed == [("10.1.0.1", f"no longer in DNS {S.name}")]
    finally:
        d.stop()
        d.join(5)


@pytest.mark.kafka
def test_dns_discovered_pods_reach_kafka(kafka_bootstrap, make_topic):
    """Two simulated pods on one port pair, 127.0.0.1 and 127.0.0.2 (both loopback)."""
    topic = make_topic(partitions=2)
    port = free_port_block(2)
    specs = [
        PodSpec(name=f"p{i}", host=f"127.0.0.{i}", pub_port=port, rate=100, batches=0, seed=i)
        for i in (1, 2)
    ]
    addresses = [{"127.0.0.1", "127.0.0.2"}]

    def resolver(_name: str) -> set[str]:
        return set(addresses[-1])

    settings = DnsSettings(
        name="vllm", model="m", pub_port=port, replay_port=port + 1, interval=0.1
    )
    with SimulatedFleet(*specs) as fleet, running_bridge(kafka_bootstrap, topic, []) as bridge:
        assert {urlsplit(p.pub).port for p in fleet.pods} == {port}
        d = DnsDiscovery(bridge, settings, resolver=resolver)
        d.start()
        try:

            def pods() -> set[str]:
                return {r.envelope.pod for r in read_all(kafka_bootstrap, topic)}

            wait_for(lambda: {"127.0.0.1", "127.0.0.2"} <= pods(), 30, "events of both pods")
            addresses.append({"127.0.0.1"})
            wait_for(
                lambda: [
                    r
                    for r in read_all(kafka_bootstrap, topic)
                    if isinstance(r.event, PodRemoved) and r.envelope.pod == "127.0.0.2"
                ],
                30,
                "PodRemoved for 127.0.0.2",
            )
            changes = "kvbridge_discovery_changes_total"
            assert metric(bridge, changes, source="dns", action="added") == 2
            assert metric(bridge, changes, source="dns", action="removed") == 1
            assert metric(bridge, "kvbridge_discovery_pods", source="dns") == 1
        finally:
            d.stop()
            d.join(5)
