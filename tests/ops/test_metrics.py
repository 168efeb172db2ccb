"""The Prometheus metrics tell what a run did: counts equal what is in the topic, exactly."""

from __future__ import annotations

from collections import Counter

import pytest
from bridge_util import metric, read_all, running_bridge
from e2e_util import wait_for

from bridge.log.records import Record
from bridge.ops.config import PodConfig
from bridge.simulator.model import ModelConfig
from bridge.simulator.pod import PodSpec, SimulatedFleet

BATCHES = 80
DROPPED = {10, 11, 40}  # two runs of missed live batches: two gaps, two replays
# A small cache, so that evictions (BlockRemoved) and a clear come within a few dozen steps.
CACHE = ModelConfig(capacity=48, clear_prob=0.02)


def samples(bridge, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of one metric, by its labels."""
    out = {}
    for family in bridge.metrics.registry.collect():
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def by_label(bridge, name: str, label: str) -> Counter:
    out: Counter = Counter()
    for labels, value in samples(bridge, name).items():
        out[dict(labels)[label]] += value
    return out


def run_fleet(kafka_bootstrap: str, topic: str, **bridge_kw) -> tuple[object, list, list[Record]]:
    specs = [
        PodSpec(
            name="m-a",
            release="0.33.0",
            rate=300,
            batches=BATCHES,
            seed=1,
            drop_seqs=frozenset(DROPPED),
            cache=CACHE,
            wait_for_subscriber=True,
            start_delay=0.5,
        ),
        PodSpec(
            name="m-b",
            release="0.23.0",
            rate=300,
            batches=BATCHES,
            seed=2,
            hash_mode="bytes",
            cache=CACHE,
            wait_for_subscriber=True,
            start_delay=0.5,
        ),
    ]
    with SimulatedFleet(*specs) as fleet:
        pods = [PodConfig(s.name, "m", fleet[s.name].pub, fleet[s.name].replay) for s in specs]
        with running_bridge(
            kafka_bootstrap, topic, pods, first_contact="live", idle_probe=0.0, **bridge_kw
        ) as bridge:
            fleet.wait_done(timeout=60)
            sent = fleet.sent()
            n_batches = len(sent)

            def all_delivered() -> bool:
                got = sum(by_label(bridge, "kvbridge_batches_in_total", "pod").values())
                return got >= n_batches

            wait_for(all_delivered, 60, "every batch to be delivered (metrics flushed ~1/s)")
            # While running: connected, with a recent message, per stream.
            for s in specs:
                assert metric(bridge, "kvbridge_connected", pod=s.name, dp_rank="0") == 1
                age = metric(bridge, "kvbridge_seconds_since_last_event", pod=s.name, dp_rank="0")
                assert 0 <= age < 60
        records = read_all(kafka_bootstrap, topic)
    return bridge, sent, records


def check_counts(bridge, sent: list, records: list[Record]) -> None:
    """The metrics after a clean stop against the sent log and the topic."""
    events = [r for r in records if r.envelope.index >= 0]
    sent_types = Counter(ev["type"] for b in sent for ev in b["events"])
    topic_types = Counter(type(r.event).__name__ for r in events)
    assert topic_types == sent_types  # the run itself was complete
    assert set(topic_types) >= {"BlockStored", "BlockRemoved"}

    events_in = by_label(bridge, "kvbridge_events_in_total", "type")
    assert +events_in == topic_types
    events_out = by_label(bridge, "kvbridge_events_out_total", "type")
    assert +events_out == topic_types
    per_pod_in = by_label(bridge, "kvbridge_events_in_total", "pod")
    assert +per_pod_in == Counter(r.envelope.pod for r in events)

    records_out = by_label(bridge, "kvbridge_records_out_total", "pod")
    assert +records_out == Counter(r.envelope.pod for r in records)
    markers = by_label(bridge, "kvbridge_markers_total", "type")
    assert +markers == Counter(type(r.event).__name__ for r in records if r.envelope.index < 0)

    batches = by_label(bridge, "kvbridge_batches_in_total", "source")
    assert batches["live"] + batches["replay"] == len(sent)
    assert batches["replay"] >= len(DROPPED)
    for pod in ("m-a", "m-b"):
        last = max(b["seq"] for b in sent if b["pod"] == pod)
        assert metric(bridge, "kvbridge_last_seq", pod=pod, dp_rank="0") == last

    # The injected gaps: two runs of dropped batches on m-a, both recovered by replay.
    assert metric(bridge, "kvbridge_gaps_total", pod="m-a") == 2
    assert metric(bridge, "kvbridge_gaps_total", pod="m-b") == 0
    replays = by_label(bridge, "kvbridge_replays_total", "outcome")
    assert replays["requested"] == 2 and replays["succeeded"] == 2
    assert replays["failed"] == 0 and replays["given_up"] == 0
    assert sum(samples(bridge, "kvbridge_batches_lost_total").values()) == 0
    assert sum(samples(bridge, "kvbridge_decode_errors_total").values()) == 0
    assert sum(samples(bridge, "kvbridge_produce_errors_total").values()) == 0

    # One lag observation per batch that produced records.
    with_events = len({(b["pod"], b["seq"]) for b in sent if b["events"]})
    assert metric(bridge, "kvbridge_e2e_lag_seconds_count") == with_events
    assert samples(bridge, "kvbridge_producer_queue")  # set at least once


@pytest.mark.kafka
def test_metrics_match_the_topic(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=3)
    bridge, sent, records = run_fleet(kafka_bootstrap, topic)
    check_counts(bridge, sent, records)


@pytest.mark.kafka
def test_metrics_match_the_topic_exactly_once(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=3)
    bridge, sent, records = run_fleet(
        kafka_bootstrap, topic, exactly_once=True, transactional_id=f"tx-{topic}"
    )
    check_counts(bridge, sent, records)


def test_stream_stats_flush_moves_counts_once():
    """Sans-I/O: plain counts reach Prometheus at flush, exactly once; gauges as given."""
    from bridge.ops.metrics import BridgeMetrics, LagRecorder, StreamStats
    from bridge.vllm.events import BlockRemoved, BlockStored

    m = BridgeMetrics()
    st = StreamStats(m, "p", 1)
    st.batches_live += 3
    st.batches_replay += 1
    st.events_in[BlockStored] = 5
    st.events_in[BlockRemoved] = 2
    st.add_out({BlockStored: 5}, 6)
    st.last_seq = 41

    def value(name: str, **labels: str) -> float:
        v = m.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

    assert value("kvbridge_events_in_total", pod="p", type="BlockStored") == 0  # not yet
    st.flush()
    st.flush()  # nothing pending: no double counting
    assert value("kvbridge_batches_in_total", pod="p", source="live") == 3
    assert value("kvbridge_batches_in_total", pod="p", source="replay") == 1
    assert value("kvbridge_events_in_total", pod="p", type="BlockStored") == 5
    assert value("kvbridge_events_in_total", pod="p", type="BlockRemoved") == 2
    assert value("kvbridge_events_out_total", pod="p", type="BlockStored") == 5
    assert value("kvbridge_records_out_total", pod="p") == 6
    assert value("kvbridge_last_seq", pod="p", dp_rank="1") == 41
    st.events_in[BlockStored] = 1
    st.flush()
    assert value("kvbridge_events_in_total", pod="p", type="BlockStored") == 6

    st.connection(None, 0.0, now=10.0)  # unknown connection, no message yet: nothing set
    assert m.registry.get_sample_value("kvbridge_connected", {"pod": "p", "dp_rank": "1"}) is None
    st.connection(True, 7.5, now=10.0)
    assert value("kvbridge_connected", pod="p", dp_rank="1") == 1
    assert value("kvbridge_seconds_since_last_event", pod="p", dp_rank="1") == 2.5

    lag = LagRecorder(m)
    lag.pending += [0.002, 0.2]
    lag.flush()
    lag.flush()
    assert value("kvbridge_e2e_lag_seconds_count") == 2
