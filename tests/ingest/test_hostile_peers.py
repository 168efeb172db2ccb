"""Hostile peers on real parts (issue: nothing lost silently, no pod takes another down):
empty batches, a seq that jumps by 10^15 (or past a configured max_seq_jump), a replay ROUTER
whose replies are not answers to the request, and a replay so slow that live batches overflow
max_held. Each bad thing is contained to its pod, written as what it is, and the
counters stay meaningful; a well-behaved neighbour stays complete."""

from __future__ import annotations

import threading

import msgpack
import pytest
import zmq
from bridge_util import metric, read_all, running_bridge, wait_topic_agrees
from e2e_util import wait_for
from test_bad_input import HostilePod, valid

from bridge.consume.checker import check_topic
from bridge.log.markers import EmptyBatch, EventsLost, PublisherRestarted, StreamStarted
from bridge.ops.config import PodConfig
from bridge.simulator.pod import PodSpec, SimulatedFleet
from bridge.vllm.encoder import encode_batch
from bridge.vllm.events import EventBatch
from bridge.vllm.framing import (
    live_frames,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
)

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]


def lost_total(bridge, pod: str) -> float:
    samples = bridge.metrics.registry.collect()
    return sum(
        s.value
        for fam in samples
        if fam.name == "kvbridge_batches_lost"
        for s in fam.samples
        if s.name.endswith("_total") and s.labels.get("pod") == pod
    )


class Router:
    """A replay ROUTER on a thread: each request's ``(identity, start seq)`` is recorded and
    handed to :meth:`answer`."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.requests: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def answer(self, identity: bytes, start: int) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, start = parse_replay_request(self.sock.recv_multipart())
            self.requests.append(start)
            self.answer(identity, start)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)


class EvilRouter(Router):
    """Answers every request with one batch at seq ``reply_seq`` (far beyond anything
    published) and the end marker."""

    def __init__(self, ctx: zmq.Context, reply_seq: int) -> None:
        self.reply_seq = reply_seq
        super().__init__(ctx)

    def answer(self, identity: bytes, start: int) -> None:
        self.sock.send_multipart(
            [identity, *replay_reply_frames("0.33.0", b"", self.reply_seq, b"\x00")]
        )
        self.sock.send_multipart([identity, *replay_end_frames("0.33.0")])


@pytest.fixture
def good_fleet():
    spec = PodSpec(name="good", release="0.33.0", rate=200, batches=60, seed=7,
                   wait_for_subscriber=True)  # fmt: skip
    with SimulatedFleet(spec) as fleet:
        yield fleet


def good_pod(fleet) -> PodConfig:
    g = fleet["good"]
    return PodConfig("good", "m", g.pub, g.replay)


def assert_good_complete(bootstrap: str, topic: str, fleet) -> None:
    fleet.wait_done(timeout=30)
    wait_topic_agrees(bootstrap, topic, fleet.sent(), 30, "good's batches", pod="good")
    report = check_topic(bootstrap, topic, pods=["good"])
    assert report.ok and report.lost_batches == 0, report.details()


def test_empty_batches_are_accounted_not_holes(kafka_bootstrap, make_topic, good_fleet):
    topic = make_topic(partitions=2)
    ctx = zmq.Context()
    evil = HostilePod(ctx)
    pods = [PodConfig("empty", "m", evil.endpoint), good_pod(good_fleet)]
    try:
        with running_bridge(kafka_bootstrap, topic, pods) as bridge:
            evil.wait_subscribed()
            evil.send(live_frames(b"", 0, valid(0)))
            evil.send(live_frames(b"", 1, msgpack.packb([1767225601.0, [], 0])))  # array form
            evil.send(live_frames(b"", 2, encode_batch(EventBatch(1767225602.0, [], 0), "0.33.0")))
            evil.send(live_frames(b"", 3, valid(3)))
            wait_for(
                lambda: metric(bridge, "kvbridge_last_seq", pod="empty", dp_rank="0") == 3,
                30,
                "the empty pod's seq 3",
            )
            assert_good_complete(kafka_bootstrap, topic, good_fleet)
    finally:
        evil.sock.close(linger=0)
        ctx.term()
    mine = [r for r in read_all(kafka_bootstrap, topic) if r.envelope.pod == "empty"]
    empties = [r.envelope.seq for r in mine if isinstance(r.event, EmptyBatch)]
    assert empties == [1, 2]
    report = check_topic(kafka_bootstrap, topic, pods=["empty"])
    assert report.ok and not report.holes, report.details()
    assert report.batches == 4 and report.events == 2


@pytest.mark.parametrize(
    "jump, settings",
    [(1 + 10**15, {}), (61, {"max_seq_jump": 50})],  # the default limit (100,000), and one set
    ids=["10**15", "max_seq_jump=50"],
)
def test_a_seq_jump_is_a_new_stream_not_a_loss(
    kafka_bootstrap, make_topic, good_fleet, jump, settings
):
    topic = make_topic(partitions=2)
    ctx = zmq.Context()
    evil = HostilePod(ctx)
    pods = [PodConfig("jumper", "m", evil.endpoint), good_pod(good_fleet)]
    try:
        with running_bridge(kafka_bootstrap, topic, pods, **settings) as bridge:
            evil.wait_subscribed()
            for seq in (0, 1, jump, jump + 1):
                evil.send(live_frames(b"", seq, valid(seq % 1000)))
            wait_for(
                lambda: metric(bridge, "kvbridge_last_seq", pod="jumper", dp_rank="0") == jump + 1,
                30,
                "the jumper's seq after the jump",
            )
            assert lost_total(bridge, "jumper") == 0  # not 10^15 batches lost
            wait_for(
                lambda: metric(bridge, "kvbridge_seq_jumps_total", pod="jumper") == 1,
                10,
                "the seq jump counted",
            )
            assert_good_complete(kafka_bootstrap, topic, good_fleet)
    finally:
        evil.sock.close(linger=0)
        ctx.term()
    mine = [r for r in read_all(kafka_bootstrap, topic) if r.envelope.pod == "jumper"]
    markers = [r.event for r in mine if r.envelope.index < 0]
    assert [type(m) for m in markers] == [StreamStarted, EventsLost, StreamStarted]
    assert markers[1].open_ended and markers[1].from_seq == 2 and markers[1].reason
    assert markers[2].next_seq == jump
    assert mine[-1].envelope.seq == jump + 1 and mine[-1].envelope.epoch > mine[0].envelope.epoch
    report = check_topic(kafka_bootstrap, topic, pods=["jumper"])
    assert report.ok and report.lost_batches == 0, report.details()


def test_replies_beyond_the_request_are_refused(kafka_bootstrap, make_topic, good_fleet):
    topic = make_topic(partitions=2)
    ctx = zmq.Context()
    evil = HostilePod(ctx)
    router = EvilRouter(ctx, reply_seq=10**6)
    pods = [PodConfig("liar", "m", evil.endpoint, router.endpoint), good_pod(good_fleet)]
    try:
        with running_bridge(
            kafka_bootstrap, topic, pods, replay_timeout=0.5, first_contact="live"
        ) as bridge:
            evil.wait_subscribed()
            for seq in (*range(0, 35), 36):  # 35 never arrives: a gap
                evil.send(live_frames(b"", seq, valid(seq)))
            wait_for(lambda: len(router.requests) >= 3, 30, "three replay attempts")
            wait_for(
                lambda: metric(bridge, "kvbridge_last_seq", pod="liar", dp_rank="0") == 36,
                30,
                "seq 36 once the replay gave up",
            )
            evil.send(live_frames(b"", 37, valid(37)))
            wait_for(
                lambda: metric(bridge, "kvbridge_last_seq", pod="liar", dp_rank="0") == 37,
                30,
                "seq 37",
            )
            assert lost_total(bridge, "liar") == 1  # seq 35 only, not ~2,000,000
            wait_for(
                lambda: (
                    metric(bridge, "kvbridge_replays_total", pod="liar", outcome="bad_reply") >= 3
                ),
                10,
                "the refused replies counted",
            )
            assert metric(bridge, "kvbridge_restarts_total", pod="liar") == 0
            assert_good_complete(kafka_bootstrap, topic, good_fleet)
    finally:
        router.close()
        evil.sock.close(linger=0)
        ctx.term()
    # From 35 (the gap), or from an earlier seq when the SUB's connect event came late and
    # its reconnect check (which asks from the last delivered seq) took the attempts over.
    assert router.requests and all(r <= 35 for r in router.requests), router.requests
    mine = [r for r in read_all(kafka_bootstrap, topic) if r.envelope.pod == "liar"]
    assert len({r.envelope.epoch for r in mine}) == 1
    assert not any(isinstance(r.event, PublisherRestarted) for r in mine)
    lost = [r.event for r in mine if isinstance(r.event, EventsLost)]
    assert [(e.from_seq, e.to_seq) for e in lost] == [(35, 35)]
    report = check_topic(kafka_bootstrap, topic, pods=["liar"])
    assert report.ok, report.details()


class SlowRouter(Router):
    """Answers honestly (every batch from the requested seq to ``last``) once ``release`` is
    set: a replay that takes long while live batches keep coming."""

    def __init__(self, ctx: zmq.Context, last: int) -> None:
        self.last = last
        self.release = threading.Event()
        super().__init__(ctx)

    def answer(self, identity: bytes, start: int) -> None:
        while not self.release.wait(0.05):
            if self._stop.is_set():
                return
        for seq in range(start, self.last + 1):
            self.sock.send_multipart(
                [identity, *replay_reply_frames("0.33.0", b"", seq, valid(seq))]
            )
        self.sock.send_multipart([identity, *replay_end_frames("0.33.0")])


def test_live_batches_beyond_max_held_are_counted_and_fetched_by_the_replay(
    kafka_bootstrap, make_topic, good_fleet
):
    """max_held=3: while the replay of seq 5 waits, 6..8 are held and 9..15 are dropped and
    counted; the replay brings 5..15 from the pod's ring, so nothing is lost."""
    topic = make_topic(partitions=2)
    ctx = zmq.Context()
    pod = HostilePod(ctx)
    router = SlowRouter(ctx, last=15)
    pods = [PodConfig("busy", "m", pod.endpoint, router.endpoint), good_pod(good_fleet)]
    try:
        with running_bridge(
            kafka_bootstrap, topic, pods, max_held=3, replay_timeout=20.0, first_contact="live"
        ) as bridge:
            pod.wait_subscribed()
            for seq in (*range(0, 5), *range(6, 16)):  # 5 never arrives live: a gap
                pod.send(live_frames(b"", seq, valid(seq)))
            wait_for(
                lambda: metric(bridge, "kvbridge_held_dropped_total", pod="busy") == 7,
                30,
                "9..15 dropped while 6..8 are held",
            )
            router.release.set()
            wait_for(
                lambda: metric(bridge, "kvbridge_last_seq", pod="busy", dp_rank="0") == 15,
                30,
                "seq 15 after the replay",
            )
            assert lost_total(bridge, "busy") == 0
            assert_good_complete(kafka_bootstrap, topic, good_fleet)
    finally:
        router.close()
        pod.sock.close(linger=0)
        ctx.term()
    assert router.requests[:1] == [5], router.requests
    mine = [r for r in read_all(kafka_bootstrap, topic) if r.envelope.pod == "busy"]
    assert sorted({r.envelope.seq for r in mine if r.envelope.index >= 0}) == list(range(16))
    assert not any(isinstance(r.event, EventsLost) for r in mine)
    report = check_topic(kafka_bootstrap, topic, pods=["busy"])
    assert report.ok and report.lost_batches == 0, report.details()
