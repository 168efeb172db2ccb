"""Stream integrity on real parts: simulated vLLM pods with faults -> the bridge -> Kafka.

Each test runs the bridge in-process against real ZeroMQ sockets and the session's real
broker, then checks the topic with the checker and against the simulator's sent-log.
"""

from __future__ import annotations

import pytest
from bridge_util import metric, read_all, running_bridge, wait_topic_agrees
from e2e_util import free_port_block, wait_for

from bridge.consume.checker import check_topic
from bridge.consume.sentlog import compare_with_sent
from bridge.log.markers import EventsLost, PublisherRestarted, StreamStarted
from bridge.ops.config import PodConfig
from bridge.simulator.pod import PodSpec, SimulatedFleet

pytestmark = pytest.mark.kafka


def pod_config(pod, replay: bool = True) -> PodConfig:
    return PodConfig(pod.name, pod.model, pod.pub, pod.replay if replay else None, pod.dp_size)


def wait_topic_matches(bootstrap: str, topic: str, fleet: SimulatedFleet, timeout: float = 60):
    """Until the topic agrees with everything the fleet published (or time runs out)."""
    wait_topic_agrees(bootstrap, topic, fleet.sent(), timeout)


def test_ten_percent_dropped_live_all_recovered(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=3)
    specs = [
        # Waiting for the bridge's subscription: a bridge slow to start (a loaded machine)
        # would otherwise get everything by its first contact's replay, with no live gap.
        PodSpec(
            name=f"p{i}",
            release=r,
            rate=200,
            batches=150,
            drop_rate=0.10,
            seed=i,
            wait_for_subscriber=True,
        )  # fmt: skip
        for i, r in enumerate(["0.9.0", "0.23.0", "0.33.0"])
    ]
    with SimulatedFleet(*specs) as fleet:
        pods = [pod_config(p) for p in fleet.pods]
        with running_bridge(kafka_bootstrap, topic, pods) as bridge:
            fleet.wait_done(timeout=60)
            assert sum(b["sent"] == "dropped" for b in fleet.sent()) >= 20
            wait_topic_matches(kafka_bootstrap, topic, fleet)
            assert sum(metric(bridge, "kvbridge_gaps_total", pod=p.name) for p in pods) >= 1
    report = check_topic(kafka_bootstrap, topic, sent=fleet.sent())
    assert report.ok, report.details()
    assert report.lost_batches == 0 and report.duplicates == 0
    assert report.batches == 450


def test_drops_older_than_the_buffer_are_reported_exactly(kafka_bootstrap, make_topic):
    topic = make_topic()
    # Seqs 10..29 never reach the bridge live, and the ring holds only 5 batches: when seq 30
    # (the last) arrives, the replay finds 26..30, so exactly 10..25 are gone.
    spec = PodSpec(
        name="small-ring",
        release="0.33.0",
        rate=100,
        batches=31,
        buffer_steps=5,
        drop_seqs=frozenset(range(10, 30)),
        wait_for_subscriber=True,
    )
    with (
        SimulatedFleet(spec) as fleet,
        running_bridge(kafka_bootstrap, topic, [pod_config(fleet.pods[0])]),
    ):
        fleet.wait_done(timeout=30)
        wait_topic_matches(kafka_bootstrap, topic, fleet)
    records = read_all(kafka_bootstrap, topic)
    lost = [r.event for r in records if isinstance(r.event, EventsLost)]
    assert {e.reason for e in lost} == {"not in replay buffer"}
    lost_seqs = {s for e in lost for s in range(e.from_seq, e.to_seq + 1)}
    # Usually exactly 10..25. When the bridge sees its SUB's connect event only after the
    # first batches (a loaded machine), the reconnect check replays earlier and finds more of
    # 10..25 still in the ring: fewer are lost, never more, and never 26..30.
    assert lost_seqs and lost_seqs <= set(range(10, 26)), sorted(lost_seqs)
    report = check_topic(kafka_bootstrap, topic, sent=fleet.sent())
    assert report.ok, report.details()  # everything else delivered, as sent
    assert report.lost_batches == len(lost_seqs)


def test_publisher_restart_opens_a_new_epoch(kafka_bootstrap, make_topic):
    topic = make_topic()
    spec = PodSpec(
        name="restarts",
        release="0.26.0",
        rate=100,
        batches=120,
        drop_rate=0.05,
        restart_at_batches=frozenset({50}),
        seed=4,
        # Without it a bridge slow to start (a loaded machine) first hears the pod after its
        # restart: one epoch, and the sent-log comparison maps it to the wrong incarnation.
        wait_for_subscriber=True,
    )
    with (
        SimulatedFleet(spec) as fleet,
        running_bridge(kafka_bootstrap, topic, [pod_config(fleet.pods[0])]),
    ):
        fleet.wait_done(timeout=30)
        wait_topic_matches(kafka_bootstrap, topic, fleet)
    records = read_all(kafka_bootstrap, topic)
    markers = [r for r in records if r.envelope.index < 0]
    assert [type(m.event) for m in markers] == [StreamStarted, EventsLost, PublisherRestarted]
    tail, restart = markers[1], markers[2]
    # The old epoch ends with its unknown tail: whatever came after seq 49, if anything.
    assert tail.event.open_ended and tail.event.from_seq == 50
    assert restart.event.first_seq == 0 and restart.event.last_seq == 49
    assert restart.envelope.epoch == restart.event.old_epoch + 1
    # Everything after the marker belongs to the new epoch, starting again at seq 0.
    after = records[records.index(restart) + 1 :]
    assert after[0].envelope.seq == 0 and {r.envelope.epoch for r in after} == {
        restart.envelope.epoch
    }
    report = check_topic(kafka_bootstrap, topic, sent=fleet.sent())
    assert report.ok and report.lost_batches == 0, report.details()


def test_no_replay_endpoint_reports_gaps_and_never_hangs(kafka_bootstrap, make_topic):
    topic = make_topic()
    spec = PodSpec(
        name="no-replay",
        release="0.23.0",
        rate=100,
        batches=80,
        replay=False,
        drop_seqs=frozenset({5, 6, 40}),
        wait_for_subscriber=True,
    )
    with SimulatedFleet(spec) as fleet:
        pod = fleet.pods[0]
        with running_bridge(kafka_bootstrap, topic, [pod_config(pod, replay=False)]) as bridge:
            fleet.wait_done(timeout=30)
            wait_topic_matches(kafka_bootstrap, topic, fleet)
            assert metric(bridge, "kvbridge_last_seq", pod="no-replay", dp_rank="0") == 79
    lost = [r.event for r in read_all(kafka_bootstrap, topic) if isinstance(r.event, EventsLost)]
    assert [(e.from_seq, e.to_seq) for e in lost] == [(5, 6), (40, 40)]
    assert {e.reason for e in lost} == {"replay disabled"}


def test_four_dp_ranks_are_four_independent_streams(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=2)
    spec = PodSpec(
        name="dp4", release="0.33.0", dp_size=4, rate=100, batches=60, drop_rate=0.05, seed=9
    )
    with (
        SimulatedFleet(spec) as fleet,
        running_bridge(kafka_bootstrap, topic, [pod_config(fleet.pods[0])]),
    ):
        fleet.wait_done(timeout=30)
        wait_topic_matches(kafka_bootstrap, topic, fleet)
    records = read_all(kafka_bootstrap, topic)
    assert {r.envelope.dp_rank for r in records} == {0, 1, 2, 3}
    assert len({r.envelope.seq for r in records if r.envelope.dp_rank == 3}) == 60
    report = check_topic(kafka_bootstrap, topic, sent=fleet.sent())
    assert report.ok and len(report.streams) == 4, report.details()


def test_pod_killed_and_restarted_on_the_same_ports(kafka_bootstrap, make_topic):
    topic = make_topic()
    first = PodSpec(
        name="phoenix", release="0.33.0", rate=100, batches=60, seed=1, wait_for_subscriber=True
    )
    with SimulatedFleet(first) as fleet:
        pod = fleet.pods[0]
        config = pod_config(pod)
        ports = (int(pod.pub.rsplit(":", 1)[1]), int(pod.replay.rsplit(":", 1)[1]))
        bridge_cm = running_bridge(kafka_bootstrap, topic, [config])
        bridge = bridge_cm.__enter__()
        try:
            fleet.wait_done(timeout=30)
            wait_topic_matches(kafka_bootstrap, topic, fleet)
            sent_before = fleet.sent()
            fleet.stop()  # the engine dies: sockets closed
            second = PodSpec(
                name="phoenix",
                release="0.33.0",
                rate=20,
                batches=40,
                seed=2,
                pub_port=ports[0],
                replay_port=ports[1],
            )
            with SimulatedFleet(second) as fleet2:
                fleet2.wait_done(timeout=30)

                def restarted() -> bool:
                    return metric(bridge, "kvbridge_publisher_restarts_total", pod="phoenix") == 1

                wait_for(restarted, 30, "the bridge to see the new incarnation")
                sent_after = fleet2.sent()
                for b in sent_after:
                    b["incarnation"] += 1  # the second process is the stream's 2nd incarnation

                def complete() -> bool:
                    return not compare_with_sent(
                        read_all(kafka_bootstrap, topic), sent_before + sent_after
                    )

                wait_for(complete, 60, "the new incarnation to be complete", interval=0.5)
        finally:
            bridge_cm.__exit__(None, None, None)
    report = check_topic(kafka_bootstrap, topic)
    assert report.ok and report.lost_batches == 0, report.details()


def test_pods_connecting_to_a_bound_bridge_socket(kafka_bootstrap, make_topic):
    """llm-d's layout: vLLM connects its PUB to one SUB the bridge binds; topics tell pods apart."""
    topic = make_topic(partitions=2)
    base = free_port_block(2)
    listen = f"tcp://127.0.0.1:{base}"
    specs = [
        PodSpec(
            name=f"llmd-{i}",
            release="0.33.0",
            rate=100,
            batches=80,
            drop_rate=0.05,
            topic=f"kv@llmd-{i}@m",
            connect_pub=listen,
            dp_size=2,
            seed=i,
        )
        for i in range(3)
    ]
    with SimulatedFleet(*specs, start=False) as fleet:
        pods = [
            PodConfig(p.name, p.model, None, p.replay, p.dp_size, topic=p.topic) for p in fleet.pods
        ]
        with running_bridge(kafka_bootstrap, topic, pods, listen=listen) as bridge:
            fleet.start()
            fleet.wait_done(timeout=30)
            wait_topic_matches(kafka_bootstrap, topic, fleet)
            assert (
                metric(bridge, "kvbridge_decode_errors_total", pod="listener", kind="unknown_topic")
                == 0
            )
    report = check_topic(kafka_bootstrap, topic, sent=fleet.sent())
    assert report.ok and len(report.streams) == 6, report.details()
