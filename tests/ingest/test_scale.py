"""Many pods in one bridge process: socket limits, fleet-wide replay limit, completeness."""

from __future__ import annotations

import pytest
from bridge_util import metric, running_bridge
from e2e_util import Proc, free_port_block, read_json, wait_for

from bridge.consume.checker import check_topic
from bridge.consume.sentlog import load_sent_log
from bridge.ops.config import PodConfig

pytestmark = pytest.mark.kafka


def test_200_pods_in_one_bridge_all_complete(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=6)
    n, batches = 200, 15
    sent_log, endpoints = tmp_path / "sent.jsonl", tmp_path / "pods.json"
    sim = Proc(
        f"simulate --pods {n} --name pod --release 0.23.0,0.33.0 --base-port 0 --rate 5 "
        f"--batches {batches} --drop-rate 0.05 --sent-log {sent_log} --endpoints-file {endpoints}"
        " --start-delay 1".split(),
        tmp_path / "sim.log",
    )
    try:
        pods_json = wait_for(lambda: read_json(endpoints), 60, "the simulator's endpoints")
        pods = [PodConfig(p["name"], p["model"], p["pub"], p["replay"]) for p in pods_json]
        with running_bridge(kafka_bootstrap, topic, pods, max_replays=8) as bridge:

            def all_sent() -> bool:
                return sent_log.exists() and len(load_sent_log(str(sent_log))) == n * batches

            wait_for(all_sent, 120, "every simulated batch to be sent", interval=0.5)

            def complete() -> bool:
                last = [metric(bridge, "kvbridge_last_seq", pod=p.name, dp_rank="0") for p in pods]
                return all(x == batches - 1 for x in last)

            wait_for(complete, 120, "every pod's last batch to be delivered", interval=0.5)
            # First contact asks every pod for a replay from 0, at most 8 at a time.
            requested = sum(
                metric(bridge, "kvbridge_replays_total", pod=p.name, outcome="requested")
                for p in pods
            )
            assert requested >= n
            assert len(bridge.limiter.active) <= 8
    finally:
        sim.stop()
    report = check_topic(kafka_bootstrap, topic, sent=load_sent_log(str(sent_log)))
    assert report.ok, report.details()[:20]
    assert len(report.streams) == n and report.lost_batches == 0


def test_1000_pods_open_in_one_process(kafka_bootstrap, make_topic):
    """1,000 pods x (SUB + DEALER + monitor) fit the ZeroMQ socket and file limits."""
    topic = make_topic()
    base = free_port_block(1)
    pods = [
        # Nothing listens there: the sockets connect lazily and retry in the background.
        PodConfig(f"pod-{i}", "m", f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base}")
        for i in range(1000)
    ]
    with running_bridge(kafka_bootstrap, topic, pods) as bridge:
        assert len(bridge.streams) == 1000
        assert all(s.sub is not None and s.dealer is not None for s in bridge.streams)
        assert len(bridge.registry.handlers) == 3000
