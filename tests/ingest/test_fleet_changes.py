"""Pods added and removed while the bridge runs, sharding across replicas, topic templates:
real bridges, real simulated pods, the session's real broker."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from bridge_util import read_all, running_bridge
from e2e_util import wait_for

from bridge.consume.checker import check_topic
from bridge.log.markers import PodRemoved, StreamStarted
from bridge.ops.config import BridgeConfig, ConfigError, PodConfig, check_topic_template
from bridge.ops.sharding import shard_of
from bridge.simulator.pod import PodSpec, SimulatedFleet

pytestmark = pytest.mark.kafka


def pod_config(pod, uid: str | None = None) -> PodConfig:
    return PodConfig(pod.name, pod.model, pod.pub, pod.replay, pod.dp_size, uid=uid)


def event_count(bootstrap: str, topic: str, pod: str) -> int:
    return sum(
        1 for r in read_all(bootstrap, topic) if r.envelope.pod == pod and r.envelope.index >= 0
    )


def test_add_remove_and_new_incarnation(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=2)
    spec = PodSpec(name="dyn", rate=100, batches=0, seed=3)
    with SimulatedFleet(spec) as fleet, running_bridge(kafka_bootstrap, topic, []) as bridge:
        (pod,) = fleet.pods
        assert bridge.add_pod(pod_config(pod, uid="uid-1"))
        wait_for(lambda: event_count(kafka_bootstrap, topic, "dyn") > 20, 30, "events of dyn")
        # Same name, new uid: a new incarnation (PodRemoved, then a new epoch).
        bridge.add_pod(pod_config(pod, uid="uid-2"))

        def two_starts() -> bool:
            recs = read_all(kafka_bootstrap, topic)
            return sum(isinstance(r.event, StreamStarted) for r in recs) == 2

        wait_for(two_starts, 30, "the second incarnation's StreamStarted")
        bridge.remove_pod("dyn", "deleted by the test")
        wait_for(
            lambda: (
                sum(isinstance(r.event, PodRemoved) for r in read_all(kafka_bootstrap, topic)) == 2
            ),
            30,
            "the second PodRemoved",
        )
        wait_for(lambda: not bridge.streams, 10, "the streams to close")
    recs = read_all(kafka_bootstrap, topic)
    kinds = [(type(r.event).__name__, r.envelope.epoch) for r in recs if r.envelope.index < 0]
    starts = [e for k, e in kinds if k == "StreamStarted"]
    removed = [(r.event.reason, r.envelope.epoch) for r in recs if isinstance(r.event, PodRemoved)]
    assert len(starts) == 2 and starts[1] > starts[0]
    assert removed[0][0].startswith("replaced by a new incarnation (uid uid-2)")
    assert removed[0][1] == starts[0]
    assert removed[1] == ("deleted by the test", starts[1])
    # Nothing after the final PodRemoved; the checker accepts the whole story.
    last_removed = max(i for i, r in enumerate(recs) if isinstance(r.event, PodRemoved))
    assert all(r.envelope.index < 0 or i < last_removed for i, r in enumerate(recs))
    report = check_topic(kafka_bootstrap, topic)
    assert report.ok, report.details()


def test_two_shards_split_the_fleet_without_overlap(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=3)
    specs = [PodSpec(name=f"s{i}", rate=100, batches=40, seed=i) for i in range(6)]
    with SimulatedFleet(*specs) as fleet:
        pods = [pod_config(p) for p in fleet.pods]
        owners = {p.name: shard_of(p.name, 2) for p in pods}
        assert set(owners.values()) == {0, 1}, "the test needs pods on both shards"
        with (
            running_bridge(kafka_bootstrap, topic, pods, shard_index=0, shard_count=2) as b0,
            running_bridge(kafka_bootstrap, topic, pods, shard_index=1, shard_count=2) as b1,
        ):
            assert {s.info.pod for s in b0.streams} == {n for n, o in owners.items() if o == 0}
            assert {s.info.pod for s in b1.streams} == {n for n, o in owners.items() if o == 1}
            assert b0.sink.transactional_id is None
            fleet.wait_done(timeout=60)
            wait_for(
                lambda: (
                    sum(r.envelope.index >= 0 for r in read_all(kafka_bootstrap, topic))
                    >= sum(len(b["events"]) for b in fleet.sent())
                ),
                60,
                "every event in the topic",
            )
            # A pod of the other shard is refused by add_pod.
            other = next(p for p in pods if owners[p.name] == 1)
            assert b0.add_pod(other) is False
    recs = read_all(kafka_bootstrap, topic)
    starts = Counter(r.envelope.pod for r in recs if isinstance(r.event, StreamStarted))
    assert starts == Counter({p.name: 1 for p in pods})
    report = check_topic(kafka_bootstrap, topic, sent=fleet.sent())
    assert report.ok and report.duplicates == 0, report.details()


def test_topic_template_gives_each_model_its_topic(kafka_bootstrap, tmp_path):
    base = f"tmpl-{tmp_path.name[-10:]}".replace("_", "-")
    specs = [
        PodSpec(name="a", model="org/llama-3", rate=100, batches=20, seed=1),
        PodSpec(name="b", model="qwen", rate=100, batches=20, seed=2),
    ]
    with SimulatedFleet(*specs) as fleet:
        pods = [pod_config(p) for p in fleet.pods]
        with running_bridge(kafka_bootstrap, base + ".{model}", pods) as bridge:
            assert bridge.checkpoint_topic == base + ".checkpoints"
            fleet.wait_done(timeout=60)
            for pod, topic in (("a", base + ".org_llama-3"), ("b", base + ".qwen")):
                want = sum(len(b["events"]) for b in fleet.sent(pod))
                wait_for(
                    lambda t=topic, w=want: (
                        sum(r.envelope.index >= 0 for r in read_all(kafka_bootstrap, t)) >= w
                    ),
                    60,
                    f"the events of {pod} in {topic}",
                )
    assert {r.envelope.pod for r in read_all(kafka_bootstrap, base + ".qwen")} == {"b"}
    assert {r.envelope.pod for r in read_all(kafka_bootstrap, base + ".org_llama-3")} == {"a"}


@pytest.mark.parametrize(
    "template, ok",
    [
        ("kv-events", True),
        ("kv-events.{model}", True),
        ("kv.{model}.{pod}", True),
        ("kv-events.{namespace}", False),
        ("kv events", False),
        ("kv-events.{model", False),
    ],
)
def test_topic_template_validation(template, ok):
    if ok:
        check_topic_template(template)
        cfg = BridgeConfig(topic=template)
        pod = PodConfig("p-1", "meta-llama/Llama 3", "tcp://h:1")
        assert "/" not in cfg.topic_for(pod) and " " not in cfg.topic_for(pod)
    else:
        with pytest.raises(ConfigError, match="topic="):
            check_topic_template(template)


def test_pod_config_uid_is_part_of_identity():
    a = PodConfig("p", "m", "tcp://h:1", uid="1")
    assert a != dataclasses.replace(a, uid="2")


def test_ipv6_pod_endpoint(kafka_bootstrap, make_topic):
    """A pod IP from Kubernetes may be IPv6 (tcp://[fd00::1a]:5557): the sockets enable it."""
    import time

    import zmq

    from bridge.vllm.encoder import encode_batch
    from bridge.vllm.events import BlockStored, EventBatch
    from bridge.vllm.framing import live_frames

    topic = make_topic()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.IPV6, 1)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://[::1]")
    pod = PodConfig("v6", "m", f"tcp://[::1]:{port}")
    try:
        with running_bridge(kafka_bootstrap, topic, [pod], first_contact="live") as bridge:
            wait_for(lambda: bridge.streams[0].connected, 30, "the IPv6 subscription")
            seq = 0

            def sent_and_seen() -> bool:
                nonlocal seq
                ev = BlockStored([seq.to_bytes(8, "big")], None, [1] * 16, 16)
                payload = encode_batch(EventBatch(time.time(), [ev], 0), "0.33.0")
                pub.send_multipart(live_frames(b"kv-events", seq, payload))
                seq += 1
                return any(r.envelope.index >= 0 for r in read_all(kafka_bootstrap, topic))

            wait_for(sent_and_seen, 30, "an event from the IPv6 pod", interval=0.3)
    finally:
        pub.close()
        ctx.term()
