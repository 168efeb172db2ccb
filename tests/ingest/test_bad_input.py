"""Bad input from one pod is counted, logged and marked, and never harms other pods or events."""

from __future__ import annotations

import os

import msgpack
import pytest
import zmq
from bridge_util import metric, read_all, running_bridge
from e2e_util import run_cli, wait_for

from bridge.log.markers import EventsLost, StreamStarted
from bridge.ops.config import PodConfig
from bridge.simulator.pod import PodSpec, SimulatedFleet
from bridge.vllm.encoder import encode_batch
from bridge.vllm.events import BlockStored, EventBatch
from bridge.vllm.framing import live_frames


def valid(seq: int) -> bytes:
    ev = BlockStored([seq.to_bytes(8, "big")], None, [1, 2, 3, 4], 4, medium="GPU", group_idx=0)
    return encode_batch(EventBatch(1767225600.0 + seq, [ev], 0), "0.33.0")


class HostilePod:
    """An XPUB (wire-compatible with vLLM's PUB) that tells us when a subscriber is ready."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def wait_subscribed(self, timeout_ms: int = 20_000) -> None:
        """Until a subscribe message arrives (unsubscribes of a dropped connection are skipped)."""
        while True:
            assert self.sock.poll(timeout_ms), "the bridge never subscribed"
            if self.sock.recv()[:1] == b"\x01":
                return

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)


@pytest.mark.kafka
def test_hostile_pod_is_contained(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=2)
    ctx = zmq.Context()
    evil = HostilePod(ctx)
    good_spec = PodSpec(name="good", release="0.23.0", rate=200, batches=60, seed=3)
    with SimulatedFleet(good_spec) as fleet:
        good = fleet["good"]
        pods = [
            PodConfig("evil", "m", evil.endpoint),  # no replay endpoint
            PodConfig("good", "m", good.pub, good.replay),
        ]
        with running_bridge(kafka_bootstrap, topic, pods, max_message_bytes=64 * 1024) as bridge:
            evil.wait_subscribed()
            bad_struct = msgpack.packb([1.0, [["BlockStored", "not-a-list", None, [], 4]], 0])
            evil.send(live_frames(b"", 0, valid(0)))
            evil.send([b"", b"\x00" * 8])  # two frames
            evil.send([b"", b"\x00" * 7, valid(1)])  # seq frame of 7 bytes
            evil.send(live_frames(b"", 1, os.urandom(64)))  # random bytes
            evil.send(live_frames(b"", 2, valid(2)[:-3]))  # truncated msgpack
            evil.send(live_frames(b"", 3, bad_struct))  # wrong types inside an event
            evil.send(live_frames(b"", 4, valid(4)))
            fleet.wait_done(timeout=30)

            def evil_done() -> bool:
                return metric(bridge, "kvbridge_last_seq", pod="evil", dp_rank="0") == 4

            wait_for(evil_done, 30, "the hostile pod's seq 4 to be delivered")
            # Oversized: ZeroMQ drops the connection; the bridge reconnects and reports the gap.
            evil.send(live_frames(b"", 5, b"\x00" * (128 * 1024)))
            evil.wait_subscribed()  # the bridge's SUB came back
            evil.send(live_frames(b"", 6, valid(6)))

            def evil_recovered() -> bool:
                return metric(bridge, "kvbridge_last_seq", pod="evil", dp_rank="0") == 6

            wait_for(evil_recovered, 30, "the hostile pod's seq 6 after the oversized message")
            n_good = sum(len(b["events"]) for b in fleet.sent("good"))
            wait_for(
                lambda: metric(bridge, "kvbridge_records_out_total", pod="good") >= n_good + 1,
                60,
                "the good pod's records to be acknowledged",
            )
            assert metric(bridge, "kvbridge_decode_errors_total", pod="evil", kind="frames") == 2
            assert metric(bridge, "kvbridge_decode_errors_total", pod="evil", kind="payload") == 3
            assert metric(bridge, "kvbridge_decode_errors_total", pod="good", kind="payload") == 0

        records = read_all(kafka_bootstrap, topic)
    ctx.destroy(linger=0)
    evil_recs = [r for r in records if r.envelope.pod == "evil"]
    events = [(r.envelope.seq, type(r.event).__name__) for r in evil_recs]
    assert events[0] == (0, "StreamStarted")
    assert (0, "BlockStored") in events and (4, "BlockStored") in events
    assert (6, "BlockStored") in events
    lost = [r.event for r in evil_recs if isinstance(r.event, EventsLost)]
    assert [(e.from_seq, e.to_seq) for e in lost] == [(1, 1), (2, 2), (3, 3), (5, 5)]
    assert all("undecodable" in e.reason for e in lost[:3])
    # The good pod: everything it sent, nothing lost, one StreamStarted.
    good_recs = [r for r in records if r.envelope.pod == "good"]
    assert [type(r.event) for r in good_recs if r.envelope.index < 0] == [StreamStarted]
    got = [(r.envelope.seq, r.envelope.index) for r in good_recs if r.envelope.index >= 0]
    want = [(b["seq"], i) for b in fleet.sent("good") for i in range(len(b["events"]))]
    assert got == want


def out_of_range(seq: int, event: list[object], ts: float | None = None) -> bytes:
    """A batch with a value the record schema cannot hold or vLLM never sends."""
    return msgpack.packb([1767225600.0 + seq if ts is None else ts, [event], 0])


@pytest.mark.kafka
def test_out_of_range_values_become_one_events_lost_each(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=2)
    ctx = zmq.Context()
    evil = HostilePod(ctx)
    good_spec = PodSpec(name="good", release="0.33.0", rate=200, batches=60, seed=5)
    issue_12 = ["BlockStored", [1], None, list(range(32)), 2**63, None, "GPU"]
    bad = {  # seq -> (payload, the field its EventsLost reason must name)
        1: (out_of_range(1, issue_12), "block_size"),
        2: (out_of_range(2, ["BlockStored", [2**63], None, [7, 2**63], 2, None]), "token_ids"),
        3: (out_of_range(3, ["BlockStored", [3], None, [1, -1], 2, None, "GPU"]), "token_ids"),
        4: (out_of_range(4, ["BlockStored", [4], None, [1, 2], -1, None, "GPU"]), "block_size"),
        5: (out_of_range(5, ["BlockRemoved", [5], "GPU", -1]), "group_idx"),
        6: (out_of_range(6, ["AllBlocksCleared"], ts=float("nan")), "ts"),
    }
    with SimulatedFleet(good_spec) as fleet:
        good = fleet["good"]
        pods = [
            PodConfig("evil", "m", evil.endpoint),  # no replay endpoint
            PodConfig("good", "m", good.pub, good.replay),
        ]
        with running_bridge(kafka_bootstrap, topic, pods) as bridge:
            evil.wait_subscribed()
            evil.send(live_frames(b"", 0, valid(0)))
            for seq, (payload, _) in bad.items():
                evil.send(live_frames(b"", seq, payload))
            evil.send([b"", (2**63).to_bytes(8, "big"), valid(7)])  # a seq no record can hold
            evil.send(live_frames(b"", 7, valid(7)))
            fleet.wait_done(timeout=30)
            wait_for(
                lambda: metric(bridge, "kvbridge_last_seq", pod="evil", dp_rank="0") == 7,
                30,
                "the hostile pod's seq 7 to be delivered",
            )
            n_good = sum(len(b["events"]) for b in fleet.sent("good"))
            wait_for(
                lambda: metric(bridge, "kvbridge_records_out_total", pod="good") >= n_good + 1,
                60,
                "the good pod's records to be acknowledged",
            )
            wait_for(
                lambda: metric(bridge, "kvbridge_records_out_total", pod="evil") >= 2 + 1 + 6,
                30,
                "the hostile pod's records and markers to be acknowledged",
            )
            errors = metric(bridge, "kvbridge_decode_errors_total", pod="evil", kind="payload")
            assert errors == len(bad)
            assert metric(bridge, "kvbridge_decode_errors_total", pod="evil", kind="frames") == 1
            assert metric(bridge, "kvbridge_decode_errors_total", pod="good", kind="payload") == 0
            assert metric(bridge, "kvbridge_internal_errors_total", pod="evil") == 0

        records = read_all(kafka_bootstrap, topic)
    ctx.destroy(linger=0)
    evil_recs = [r for r in records if r.envelope.pod == "evil"]
    delivered = [
        (r.envelope.seq, type(r.event).__name__) for r in evil_recs if r.envelope.index >= 0
    ]
    assert delivered == [(0, "BlockStored"), (7, "BlockStored")]
    lost = [r.event for r in evil_recs if isinstance(r.event, EventsLost)]
    assert [(e.from_seq, e.to_seq) for e in lost] == [(seq, seq) for seq in bad]
    for e in lost:
        field = bad[e.from_seq][1]
        assert e.reason.startswith("undecodable batch: "), e.reason
        assert f"field '{field}': " in e.reason and "value out of range" in e.reason, e.reason
    assert "9223372036854775808" in lost[0].reason  # the value itself is named
    good_recs = [r for r in records if r.envelope.pod == "good"]
    got = [(r.envelope.seq, r.envelope.index) for r in good_recs if r.envelope.index >= 0]
    want = [(b["seq"], i) for b in fleet.sent("good") for i in range(len(b["events"]))]
    assert got == want
    # `kvbridge check`: every seq of both streams delivered or covered by its EventsLost.
    check = run_cli(["check", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "-v"])
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.startswith("OK: 2 streams"), check.stdout
    assert "hole" not in check.stdout and f", {len(bad)} lost" in check.stdout, check.stdout
