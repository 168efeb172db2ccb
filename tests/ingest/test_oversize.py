"""Records larger than the topic accepts: split when they can be, written as lost when not,
and never a crash or a silent hole; frames over the ZeroMQ size limit are counted."""

from __future__ import annotations

import random

import msgpack
import pytest
import zmq
from bridge_util import metric, read_all, running_bridge
from e2e_util import wait_for
from test_bad_input import HostilePod, valid

from bridge.consume.checker import check_topic
from bridge.consume.sentlog import compare_with_sent
from bridge.consume.state import CacheState
from bridge.log.markers import RECORD_TOO_LARGE, EventsLost
from bridge.ops.config import PodConfig
from bridge.simulator.pod import PodSpec, SimulatedFleet
from bridge.vllm.encoder import encode_batch
from bridge.vllm.events import BlockStored, EventBatch, hash_from_int
from bridge.vllm.framing import live_frames
from bridge.vllm.jsonview import event_to_json

SMALL_TOPIC = {"max.message.bytes": str(64 * 1024)}
TS = 1767225600.0


def _with_huge_envelope_field(seq: int, size: int) -> bytes:
    """A valid batch (0.33 envelope) whose envelope has an unknown trailing field of ``size``."""
    ts, events, rank = msgpack.unpackb(valid(seq), raw=False)
    return msgpack.packb([ts, events, rank, b"\x07" * size], use_bin_type=True)


def _sent(pod: str, seq: int, events: list) -> dict:
    return {
        "pod": pod,
        "dp_rank": 0,
        "incarnation": 0,
        "seq": seq,
        "sent": "live",
        "events": [event_to_json(e) for e in events],
    }


@pytest.mark.kafka
def test_unsplittable_oversized_batch_is_one_events_lost_and_the_bridge_goes_on(
    kafka_bootstrap, make_topic
):
    topic = make_topic(partitions=2, config=SMALL_TOPIC)
    ctx = zmq.Context()
    big = HostilePod(ctx)
    spec = PodSpec(name="good", release="0.33.0", rate=200, batches=60, seed=5)
    with SimulatedFleet(spec) as fleet:
        good = fleet["good"]
        pods = [PodConfig("big", "m", big.endpoint), PodConfig("good", "m", good.pub, good.replay)]
        with running_bridge(kafka_bootstrap, topic, pods) as bridge:
            big.wait_subscribed()
            big.send(live_frames(b"", 0, valid(0)))
            # Over the topic's 64 KiB (broker side), then over librdkafka's 1 MB (client side).
            big.send(live_frames(b"", 1, _with_huge_envelope_field(1, 200_000)))
            big.send(live_frames(b"", 2, _with_huge_envelope_field(2, 1_200_000)))
            big.send(live_frames(b"", 3, valid(3)))
            fleet.wait_done(timeout=30)
            wait_for(
                lambda: metric(bridge, "kvbridge_last_seq", pod="big", dp_rank="0") == 3,
                30,
                "the oversized pod's seq 3 to be delivered",
            )
            n_good = sum(len(b["events"]) for b in fleet.sent("good"))
            wait_for(
                lambda: metric(bridge, "kvbridge_records_out_total", pod="good") >= n_good + 1,
                60,
                "the good pod's records to be acknowledged",
            )
            bridge.pipeline.flush_metrics()
            assert (
                metric(bridge, "kvbridge_decode_errors_total", pod="big", kind="oversized_record")
                == 2
            )
            assert (
                metric(bridge, "kvbridge_batches_lost_total", pod="big", reason=RECORD_TOO_LARGE)
                == 2
            )
            assert metric(bridge, "kvbridge_produce_errors_total", pod="big") == 0
        sent_good = fleet.sent("good")
    ctx.destroy(linger=0)
    records = read_all(kafka_bootstrap, topic)
    mine = [r for r in records if r.envelope.pod == "big"]
    lost = [r.event for r in mine if isinstance(r.event, EventsLost)]
    assert [(e.from_seq, e.to_seq) for e in lost] == [(1, 1), (2, 2)]
    for e in lost:
        assert e.reason.startswith(RECORD_TOO_LARGE)
        assert "max.message.bytes 65536" in e.reason
    seqs = [r.envelope.seq for r in mine if r.envelope.index >= 0]
    assert seqs == [0, 3]  # nothing of the lost batches is in the topic
    report = check_topic(kafka_bootstrap, topic)
    assert report.ok, report.details()
    good_report = check_topic(kafka_bootstrap, topic, pods=["good"], sent=sent_good)
    assert good_report.ok and good_report.lost_batches == 0, good_report.details()
    assert good_report.sent_differences == []


def _long_stored(n_blocks: int, parent: bytes | None, first: int = 0) -> BlockStored:
    rng = random.Random(n_blocks + first)
    return BlockStored(
        block_hashes=[hash_from_int(0xABC0000 + first + i) for i in range(n_blocks)],
        parent_block_hash=parent,
        token_ids=[rng.randrange(100_000, 150_000) for _ in range(n_blocks * 16)],
        block_size=16,
        medium="GPU",
        group_idx=0,
        extra_keys=[None] * n_blocks,
    )


@pytest.mark.kafka
def test_long_block_stored_is_split_and_rebuilt_whole(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=1, config=SMALL_TOPIC)
    ctx = zmq.Context()
    pod = HostilePod(ctx)
    long_ev = _long_stored(3000, hash_from_int(7))  # ~48k tokens: ~170 KB as one record
    small = _long_stored(2, long_ev.block_hashes[-1], first=5000)
    batches = [
        (0, [_long_stored(1, None, first=9000)]),
        (1, [small, long_ev, _long_stored(1, small.block_hashes[-1], first=7000)]),
        (2, [_long_stored(2, long_ev.block_hashes[-1], first=8000)]),
    ]
    with running_bridge(kafka_bootstrap, topic, [PodConfig("p", "m", pod.endpoint)]) as bridge:
        pod.wait_subscribed()
        for seq, events in batches:
            pod.send(live_frames(b"", seq, encode_batch(EventBatch(TS + seq, events, 0), "0.33.0")))
        n_records = 1 + sum(len(e) for _, e in batches) + 2  # StreamStarted; 2 more parts
        wait_for(
            lambda: metric(bridge, "kvbridge_records_out_total", pod="p") >= n_records,
            60,
            "the records to be acknowledged",
        )
        assert metric(bridge, "kvbridge_decode_errors_total", pod="p", kind="oversized_record") == 0
    ctx.destroy(linger=0)
    records = read_all(kafka_bootstrap, topic)
    assert not [r for r in records if isinstance(r.event, EventsLost)]
    parts = [r for r in records if r.envelope.seq == 1 and r.envelope.index == 1]
    assert len(parts) >= 3  # ~170 KB over a 64 KiB topic
    assert [r.envelope.part for r in parts] == list(range(len(parts)))
    assert {r.envelope.parts for r in parts} == {len(parts)}
    chain = long_ev.parent_block_hash
    for r in parts:  # each part a BlockStored of its own, the parent chain unbroken
        assert r.event.parent_block_hash == chain
        chain = r.event.block_hashes[-1]
    assert [h for r in parts for h in r.event.block_hashes] == long_ev.block_hashes
    assert [t for r in parts for t in r.event.token_ids] == long_ev.token_ids
    # The state rebuilt from the topic holds exactly what was stored.
    state = CacheState()
    for r in records:
        state.apply(r)
    stored = {h for _, events in batches for e in events for h in e.block_hashes}
    assert state.resident("p", 0) == {("GPU", 0): stored}
    assert state.duplicates == 0
    # The checker counts the split event as one event; the sent-log comparison agrees.
    sent = [_sent("p", seq, events) for seq, events in batches]
    report = check_topic(kafka_bootstrap, topic, sent=sent)
    assert report.ok, report.details()
    assert report.events == 5 and report.duplicates == 0  # the split event counts once
    assert report.sent_differences == []
    assert compare_with_sent(records, sent) == []


@pytest.mark.kafka
def test_a_batch_that_cannot_be_encoded_is_events_lost_not_a_hole(kafka_bootstrap, make_topic):
    topic = make_topic()
    ctx = zmq.Context()
    pod = HostilePod(ctx)
    bad = BlockStored([hash_from_int(1)], None, [1, 2, 3, (1 << 64) - 1], 4, medium="GPU")
    with running_bridge(kafka_bootstrap, topic, [PodConfig("p", "m", pod.endpoint)]) as bridge:
        pod.wait_subscribed()
        pod.send(live_frames(b"", 0, valid(0)))
        # A token id past Avro's 64-bit long: msgpack carries it, the record cannot hold it.
        pod.send(live_frames(b"", 1, encode_batch(EventBatch(TS, [bad], 0), "0.33.0")))
        pod.send(live_frames(b"", 2, valid(2)))
        wait_for(
            lambda: metric(bridge, "kvbridge_last_seq", pod="p", dp_rank="0") == 2,
            30,
            "seq 2 to be delivered",
        )
    ctx.destroy(linger=0)
    records = read_all(kafka_bootstrap, topic)
    lost = [r.event for r in records if isinstance(r.event, EventsLost)]
    assert [(e.from_seq, e.to_seq) for e in lost] == [(1, 1)]
    # Encoding refused it (or, with stricter decoding, the decoder did): named either way.
    assert lost[0].reason.startswith(("internal error encoding the batch", "undecodable batch"))
    assert "OverflowError" in lost[0].reason or "undecodable" in lost[0].reason
    report = check_topic(kafka_bootstrap, topic)
    assert report.ok and report.hole_batches == 0, report.details()


@pytest.mark.kafka
def test_frame_over_the_zeromq_limit_is_counted_and_the_stream_accounted(
    kafka_bootstrap, make_topic
):
    topic = make_topic()
    ctx = zmq.Context()
    pod = HostilePod(ctx)  # a real PUB-compatible socket, no replay endpoint
    pods = [PodConfig("p", "m", pod.endpoint)]
    with running_bridge(kafka_bootstrap, topic, pods, max_message_bytes=64 * 1024) as bridge:
        pod.wait_subscribed()
        pod.send(live_frames(b"", 0, valid(0)))
        wait_for(
            lambda: metric(bridge, "kvbridge_last_seq", pod="p", dp_rank="0") == 0,
            30,
            "seq 0 to be delivered",
        )
        pod.send(live_frames(b"", 1, _with_huge_envelope_field(1, 128 * 1024)))
        pod.wait_subscribed()  # ZeroMQ dropped the connection; the bridge's SUB came back
        pod.send(live_frames(b"", 2, valid(2)))
        wait_for(
            lambda: metric(bridge, "kvbridge_last_seq", pod="p", dp_rank="0") == 2,
            30,
            "seq 2 after the oversized frame",
        )
        assert metric(bridge, "kvbridge_decode_errors_total", pod="p", kind="oversized_frame") == 1
    ctx.destroy(linger=0)
    records = read_all(kafka_bootstrap, topic)
    lost = [r.event for r in records if isinstance(r.event, EventsLost)]
    assert [(e.from_seq, e.to_seq) for e in lost] == [(1, 1)]  # no replay endpoint here
    assert [r.envelope.seq for r in records if r.envelope.index >= 0] == [0, 2]
    report = check_topic(kafka_bootstrap, topic)
    assert report.ok and report.hole_batches == 0, report.details()
