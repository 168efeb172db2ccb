"""Pods that never reach the bridge live, on real parts: a PUB the bridge cannot reach
while the engine's replay ROUTER holds every batch (first contact must not wait for a live
message), and a pod with nothing reachable at all (reported: log, metric, /readyz)."""

from __future__ import annotations

import logging

import pytest
from bridge_util import metric, running_bridge, wait_topic_agrees
from e2e_util import wait_for

from bridge.ops.config import PodConfig
from bridge.ops.localrun import free_port
from bridge.simulator.pod import PodSpec, SimulatedFleet

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]


def test_first_contact_replays_the_ring_although_no_live_message_arrives(
    kafka_bootstrap, make_topic
):
    topic = make_topic()
    # The engine publishes 30 batches and goes idle; the bridge's pub= names a port where
    # nothing listens (e.g. a wrong port, or an engine that connects out): only replay works.
    spec = PodSpec(name="unreachable-pub", release="0.33.0", rate=300, batches=30, seed=5)
    with SimulatedFleet(spec) as fleet:
        fleet.wait_done(timeout=20)
        pod = fleet.pods[0]
        dead = f"tcp://127.0.0.1:{free_port()}"
        cfg = PodConfig(pod.name, pod.model, dead, pod.replay, 1)
        with running_bridge(kafka_bootstrap, topic, [cfg], idle_probe=0.5):
            sent = fleet.sent()
            wait_topic_agrees(kafka_bootstrap, topic, sent, 30, "the ring's batches in the topic")
    assert len(sent) == 30


def test_a_pod_that_sends_nothing_is_reported(kafka_bootstrap, make_topic, caplog):
    topic = make_topic()
    dead_pub, dead_replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    spec = PodSpec(name="talker", release="0.33.0", rate=100, batches=20, seed=6,
                   wait_for_subscriber=True)  # fmt: skip
    caplog.set_level(logging.WARNING, logger="bridge.ingest.subscriber")
    with SimulatedFleet(spec) as fleet:
        talker = fleet.pods[0]
        pods = [
            PodConfig("mute", "m", dead_pub, dead_replay, 1),
            PodConfig(talker.name, talker.model, talker.pub, talker.replay, 1),
        ]
        with running_bridge(kafka_bootstrap, topic, pods, silent_warning=1.0) as bridge:
            fleet.wait_done(timeout=20)
            wait_for(
                lambda: metric(bridge, "kvbridge_stream_silent", pod="mute", dp_rank="0") == 1,
                20,
                "the silent gauge of the mute pod",
            )
            ok, details = bridge.probes.readiness()
            assert details["streams_silent"] == ["mute rank 0"]
            assert metric(bridge, "kvbridge_stream_silent", pod="talker", dp_rank="0") == 0
    warnings = [r.getMessage() for r in caplog.records if "mute" in r.getMessage()]
    assert any(
        "nothing received in" in w and "never connected" in w and "--listen" in w for w in warnings
    ), warnings
    assert not any("talker" in r.getMessage() and "nothing received" in r.getMessage()
                   for r in caplog.records)  # fmt: skip
