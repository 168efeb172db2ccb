"""The simulated vLLM pods, checked with raw pyzmq SUB/DEALER sockets as a client uses them."""

from __future__ import annotations

import argparse
import io
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.cli.simulate import build_specs, configure_parser, run
from bridge.simulator.model import (
    FIXED_NONE_HASH,
    ModelConfig,
    PrefixCacheModel,
    apply_events,
    chain_hash,
    residency,
    shared_templates,
)
from bridge.simulator.pod import PodSpec, SentLog, SimulatedFleet
from bridge.simulator.publisher import normalized
from bridge.vllm.decoder import decode_batch
from bridge.vllm.encoder import encode_batch
from bridge.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from bridge.vllm.jsonview import event_to_json
from bridge.vllm.releases import SUPPORTED_RELEASES, Release

END = b"\xff" * 8
TIMEOUT = 10.0


# --- raw ZeroMQ client helpers (deliberately not the bridge's code) ------------------------


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def subscribe(ctx: zmq.Context, endpoint: str, prefix: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.setsockopt(zmq.SUBSCRIBE, prefix)
    sub.connect(endpoint)
    return sub


def recv_until(
    sock: zmq.Socket, done: Callable[[list[list[bytes]]], bool], timeout: float = TIMEOUT
) -> list[list[bytes]]:
    """Receive multipart messages until ``done(messages)`` holds; fail after ``timeout``."""
    messages: list[list[bytes]] = []
    deadline = time.monotonic() + timeout
    while not done(messages):
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000) + 1):
            pytest.fail(f"timed out after {len(messages)} messages")
        messages.append(sock.recv_multipart())
    return messages


def live_until(sub: zmq.Socket, last_seq: int) -> list[list[bytes]]:
    """Live messages up to and including the one with ``last_seq``."""
    return recv_until(sub, lambda m: bool(m) and int.from_bytes(m[-1][1], "big") == last_seq)


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """Ask for every buffered batch >= start; messages up to and including the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        return recv_until(dealer, lambda m: bool(m) and m[-1][-2] == END)
    finally:
        dealer.close()


def replayed_seqs(messages: list[list[bytes]]) -> list[int]:
    return [int.from_bytes(m[-2], "big") for m in messages[:-1]]


def records_by_seq(fleet: SimulatedFleet, pod: str, rank: int = 0, incarnation: int = 0):
    return {
        r["seq"]: r
        for r in fleet.sent(pod, rank)
        if r["incarnation"] == incarnation and r["pod"] == pod
    }


def assert_payload_matches(payload: bytes, record: dict[str, Any]) -> None:
    batch = decode_batch(payload)
    assert [event_to_json(e) for e in batch.events] == record["events"]
    assert batch.ts == record["ts"]
    release = Release.parse(record["release"])
    assert batch.dp_rank == (record["dp_rank"] if release.has_dp_rank else None)


def spec(**kw: Any) -> PodSpec:
    kw.setdefault("name", "p")
    kw.setdefault("rate", 0.0)
    kw.setdefault("cache", ModelConfig(capacity=64))
    return PodSpec(**kw)


# --- live stream ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("release", "hash_mode"),
    [("0.9.0", None), ("0.10.2", "bytes"), ("0.23.0", None), ("0.33.0", "bytes")],
)
def test_live_frames_seq_and_payloads_match_sent_log(ctx, release, hash_mode):
    s = spec(release=release, hash_mode=hash_mode, batches=30, rate=200, wait_for_subscriber=True)
    with SimulatedFleet(s, start=False) as fleet:
        pod = fleet["p"]
        sub = subscribe(ctx, pod.pub)
        fleet.start()
        messages = live_until(sub, 29)
        fleet.wait_done(TIMEOUT)
        records = records_by_seq(fleet, "p")
    seqs = []
    for frames in messages:
        assert len(frames) == 3
        topic, seq8, payload = frames
        assert topic == b"kv-events"
        assert len(seq8) == 8
        seq = int.from_bytes(seq8, "big")
        seqs.append(seq)
        assert records[seq]["sent"] == "live"
        assert_payload_matches(payload, records[seq])
        envelope = msgpack.unpackb(payload)
        assert len(envelope) == (2 if release == "0.9.0" else 3)
        event = envelope[1][0]
        assert isinstance(event, dict) == Release.parse(release).map_events
    assert seqs == list(range(seqs[0], 30))  # contiguous, in order, up to the last
    assert sorted(records) == list(range(30))


def test_topic_prefix_filtering_and_empty_topic(ctx):
    with SimulatedFleet(
        spec(name="a", topic="", batches=5, wait_for_subscriber=True, rate=100),
        spec(name="b", topic="kv@b", batches=5, wait_for_subscriber=True, rate=100),
        start=False,
    ) as fleet:
        sub_a = subscribe(ctx, fleet["a"].pub, b"")
        sub_b_wrong = subscribe(ctx, fleet["b"].pub, b"other")
        sub_b = subscribe(ctx, fleet["b"].pub, b"kv@")
        fleet.start()
        got_a = live_until(sub_a, 4)
        got_b = live_until(sub_b, 4)
        fleet.wait_done(TIMEOUT)
        assert {m[0] for m in got_a} == {b""}
        assert {m[0] for m in got_b} == {b"kv@b"}
        # the wrongly-filtered SUB got nothing although everything up to seq 4 was sent
        assert not sub_b_wrong.poll(0)


# --- replay -----------------------------------------------------------------------------


@pytest.mark.parametrize(("release", "with_topic"), [("0.23.0", False), ("0.26.0", True)])
def test_replay_reply_shape_and_end_marker(ctx, release, with_topic):
    with SimulatedFleet(spec(release=release, batches=10)) as fleet:
        fleet.wait_done(TIMEOUT)
        pod = fleet["p"]
        records = records_by_seq(fleet, "p")
        messages = replay(ctx, pod.replay, 4)
        assert replayed_seqs(messages) == list(range(4, 10))
        for frames in messages[:-1]:
            if with_topic:
                assert len(frames) == 4
                assert frames[:2] == [b"", b"kv-events"]
            else:
                assert len(frames) == 3
                assert frames[0] == b""
            assert len(frames[-2]) == 8
            assert_payload_matches(frames[-1], records[int.from_bytes(frames[-2], "big")])
        end = [b"", b"", END, b""] if with_topic else [b"", END, b""]
        assert messages[-1] == end
        # newer than anything sent (including ff*8): only the end marker
        assert replay(ctx, pod.replay, 10) == [end]
        assert replay(ctx, pod.replay, (1 << 64) - 1) == [end]


def test_replayed_payloads_are_byte_identical_to_live(ctx):
    with SimulatedFleet(spec(batches=12, rate=200, wait_for_subscriber=True), start=False) as fleet:
        sub = subscribe(ctx, fleet["p"].pub)
        fleet.start()
        live = {int.from_bytes(m[1], "big"): m[2] for m in live_until(sub, 11)}
        replayed = {
            int.from_bytes(m[-2], "big"): m[-1] for m in replay(ctx, fleet["p"].replay, 0)[:-1]
        }
    assert live
    assert all(replayed[seq] == payload for seq, payload in live.items())


def test_malformed_replay_requests_get_no_reply(ctx):
    with SimulatedFleet(spec(release="0.33.0", batches=10)) as fleet:
        fleet.wait_done(TIMEOUT)
        pod = fleet["p"]
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(pod.replay)
        dealer.send_multipart([(0).to_bytes(8, "big")])  # AIBrix: no empty delimiter
        dealer.send_multipart([b"", (1).to_bytes(8, "big"), b"extra"])  # one frame too many
        dealer.send_multipart([b"", (7).to_bytes(8, "big")])  # well-formed
        # Requests are served in order: a reply to either bad request would come first.
        messages = recv_until(dealer, lambda m: bool(m) and m[-1][-2] == END)
        assert replayed_seqs(messages) == [7, 8, 9]
        stats = pod.publisher(0).stats
        assert stats.invalid_requests == 2
        assert stats.replays == 1
        dealer.close()


def test_replay_of_evicted_seqs_starts_late(ctx):
    with SimulatedFleet(spec(batches=30, buffer_steps=10)) as fleet:
        fleet.wait_done(TIMEOUT)
        assert replayed_seqs(replay(ctx, fleet["p"].replay, 0)) == list(range(20, 30))
        assert replayed_seqs(replay(ctx, fleet["p"].replay, 25)) == list(range(25, 30))


def test_replay_router_sndhwm_per_release():
    with SimulatedFleet(
        spec(name="old", release="0.26.0", buffer_steps=50),
        spec(name="new", release="0.33.0", buffer_steps=50),
        start=False,
    ) as fleet:
        assert fleet["old"].publisher(0)._router.sndhwm == 1000  # ZeroMQ default
        assert fleet["new"].publisher(0)._router.sndhwm == 2 * (50 + 1)


def test_no_replay_endpoint():
    with SimulatedFleet(spec(replay=False), start=False) as fleet:
        assert fleet["p"].replay is None
        assert fleet.endpoints()[0]["replay"] is None


# --- faults -----------------------------------------------------------------------------


def test_drop_seqs_missing_live_but_present_in_replay(ctx):
    drops = {15, 16, 25}
    s = spec(batches=40, rate=200, drop_seqs=drops, wait_for_subscriber=True)
    with SimulatedFleet(s, start=False) as fleet:
        sub = subscribe(ctx, fleet["p"].pub)
        fleet.start()
        live = [int.from_bytes(m[1], "big") for m in live_until(sub, 39)]
        fleet.wait_done(TIMEOUT)
        records = records_by_seq(fleet, "p")
        messages = replay(ctx, fleet["p"].replay, 0)
    assert live[0] < min(drops)
    assert live == [seq for seq in range(live[0], 40) if seq not in drops]
    assert replayed_seqs(messages) == list(range(40))
    for frames in messages[:-1]:
        assert_payload_matches(frames[-1], records[int.from_bytes(frames[-2], "big")])
    assert {seq for seq, r in records.items() if r["sent"] == "dropped"} == drops


def test_drop_rate_one_sends_nothing_live_but_buffers_everything(ctx):
    with SimulatedFleet(spec(batches=8, drop_rate=1.0, wait_for_subscriber=True), start=False) as f:
        sub = subscribe(ctx, f["p"].pub)
        f.start()
        f.wait_done(TIMEOUT)
        assert replayed_seqs(replay(ctx, f["p"].replay, 0)) == list(range(8))
        assert {r["sent"] for r in f.sent()} == {"dropped"}
        assert not sub.poll(0)  # the subscriber was connected before the first batch


def test_lose_seqs_absent_everywhere(ctx):
    s = spec(batches=30, rate=200, lose_seqs={12, 20}, wait_for_subscriber=True)
    with SimulatedFleet(s, start=False) as fleet:
        sub = subscribe(ctx, fleet["p"].pub)
        fleet.start()
        live = [int.from_bytes(m[1], "big") for m in live_until(sub, 29)]
        fleet.wait_done(TIMEOUT)
        records = records_by_seq(fleet, "p")
        replayed = replayed_seqs(replay(ctx, fleet["p"].replay, 0))
    assert live[0] < 12
    assert live == [seq for seq in range(live[0], 30) if seq not in (12, 20)]
    assert replayed == [seq for seq in range(30) if seq not in (12, 20)]
    assert records[12]["sent"] == records[20]["sent"] == "lost"
    assert records[12]["events"]  # the engine produced events; they were lost


def test_restart_resets_seq_and_empties_buffer(ctx):
    s = spec(batches=25, rate=300, restart_after=10, wait_for_subscriber=True)
    with SimulatedFleet(s, start=False) as fleet:
        sub = subscribe(ctx, fleet["p"].pub)
        fleet.start()
        # the last batch is the 5th of the 3rd incarnation: seq 4
        got = recv_until(
            sub,
            lambda m: (
                sum(int.from_bytes(x[1], "big") == 0 for x in m) >= 2
                and int.from_bytes(m[-1][1], "big") == 4
            ),
        )
        fleet.wait_done(TIMEOUT)
        sent = fleet.sent("p")
        messages = replay(ctx, fleet["p"].replay, 0)
        assert fleet["p"].publisher(0).stats.restarts == 2
    live = [int.from_bytes(m[1], "big") for m in got]
    assert live[-15:] == [*range(10), *range(5)]
    assert [(r["incarnation"], r["seq"]) for r in sent] == (
        [(0, i) for i in range(10)] + [(1, i) for i in range(10)] + [(2, i) for i in range(5)]
    )
    # only the current incarnation's batches are buffered
    assert replayed_seqs(messages) == list(range(5))
    last = {r["seq"]: r for r in sent if r["incarnation"] == 2}
    for frames in messages[:-1]:
        assert_payload_matches(frames[-1], last[int.from_bytes(frames[-2], "big")])


def test_restart_at_batches():
    with SimulatedFleet(spec(batches=12, restart_at_batches={5})) as fleet:
        fleet.wait_done(TIMEOUT)
        sent = [(r["incarnation"], r["seq"]) for r in fleet.sent()]
    assert sent == [(0, i) for i in range(5)] + [(1, i) for i in range(7)]


def _hashes_by_incarnation(release: str) -> dict[int, set[Any]]:
    with SimulatedFleet(spec(batches=4, restart_after=2, release=release)) as fleet:
        fleet.wait_done(TIMEOUT)
        stored: dict[int, set[Any]] = {}
        for r in fleet.sent():
            stored.setdefault(r["incarnation"], set()).update(
                h for e in r["events"] if e["type"] == "BlockStored" for h in e["block_hashes"]
            )
    return stored


def test_restart_uses_new_none_hash_before_0_29():
    """Up to 0.28 NONE_HASH is random per process: a restarted engine hashes anew."""
    stored = _hashes_by_incarnation("0.28.0")
    assert stored[0] and stored[1] and not stored[0] & stored[1]


def test_none_hash_is_fixed_from_0_29():
    """From 0.29 (sha256) NONE_HASH comes from a fixed seed: the same prefix, the same hash,
    across restarts and pods (the pods share prompt templates)."""
    stored = _hashes_by_incarnation("0.29.0")
    assert stored[0] & stored[1]
    release = Release.parse("0.29.0")
    a, b = PrefixCacheModel(release, "int", 1), PrefixCacheModel(release, "int", 2)
    assert a.none_hash == b.none_hash == FIXED_NONE_HASH
    old = Release.parse("0.28.0")
    assert PrefixCacheModel(old, "int", 1).none_hash != PrefixCacheModel(old, "int", 2).none_hash


# --- data parallelism -------------------------------------------------------------------


def test_dp_ranks_on_offset_ports_with_their_dp_rank(ctx):
    s = spec(release="0.20.0", dp_size=3, batches=6, rate=100, wait_for_subscriber=True)
    with SimulatedFleet(s, start=False) as fleet:
        pod = fleet["p"]
        port = [int(e.pub.rsplit(":", 1)[1]) for e in pod.endpoints]
        rport = [int(e.replay.rsplit(":", 1)[1]) for e in pod.endpoints]
        assert port == [port[0] + r for r in range(3)]
        assert rport == [port[0] + 3 + r for r in range(3)]
        subs = [subscribe(ctx, e.pub) for e in pod.endpoints]
        fleet.start()
        for rank, sub in enumerate(subs):
            for frames in live_until(sub, 5):
                assert decode_batch(frames[2]).dp_rank == rank
        fleet.wait_done(TIMEOUT)
        for rank, e in enumerate(pod.endpoints):
            messages = replay(ctx, e.replay, 0)
            assert replayed_seqs(messages) == list(range(6))  # independent counters
            assert {decode_batch(m[-1]).dp_rank for m in messages[:-1]} == {rank}
            assert [r["seq"] for r in fleet.sent("p", rank)] == list(range(6))
        # ranks run different workloads
        assert fleet.resident("p", 0) != fleet.resident("p", 1)


def test_dp_rejected_for_0_9_0_and_replay_port_collision():
    with pytest.raises(ValueError, match="0.9.1"):
        PodSpec(release="0.9.0", dp_size=2)
    with SimulatedFleet(spec(dp_size=2), start=False) as fleet:
        base = int(fleet["p"].pub.rsplit(":", 1)[1])
        # the replay port overlaps rank 1's PUB port: vLLM fails with "Address already in use"
        with pytest.raises(RuntimeError, match="replay port must be >= pub_port"):
            SimulatedFleet(spec(name="q", dp_size=2, pub_port=base + 4, replay_port=base + 5))


# --- sent-log and fleet API -------------------------------------------------------------


def test_sent_log_lines_match_records_and_resident_matches_events():
    sink = io.StringIO()
    cache = ModelConfig(capacity=32, clear_prob=0.05, cpu_offload_prob=0.5, cpu_capacity=20)
    specs = [spec(name="a", release="0.17.0", cache=cache, batches=60), spec(name="b", batches=60)]
    with SimulatedFleet(*specs, sent_log=sink) as fleet:
        fleet.wait_sent(60, TIMEOUT)
        lines = [json.loads(x) for x in sink.getvalue().splitlines()]
        assert lines == fleet.sent()
        assert len(lines) == 120
        for name in ("a", "b"):
            state: dict = {}
            for r in fleet.sent(name):
                for e in r["events"]:
                    apply_events(state, [_event_from_json(e)])
            assert state == fleet.copies(name)
            assert residency(state) == fleet.resident(name)
        kinds = {e["type"] for r in fleet.sent("a") for e in r["events"]}
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
        assert {e["medium"] for r in fleet.sent("a") for e in r["events"] if "medium" in e} == {
            "GPU",
            "CPU",
        }
    assert set(lines[0]) == {
        "pod", "model", "dp_rank", "incarnation", "seq", "ts", "sent", "release", "events"
    }  # fmt: skip


def _event_from_json(e: dict[str, Any]):
    if e["type"] == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = [bytes.fromhex(h.removeprefix("0x")) for h in e["block_hashes"]]
    if e["type"] == "BlockRemoved":
        return BlockRemoved(hashes, medium=e["medium"], group_idx=e["group_idx"])
    return BlockStored(hashes, None, e["token_ids"], e["block_size"], medium=e["medium"],
                       group_idx=e["group_idx"])  # fmt: skip


def test_sent_log_is_thread_safe():
    sink = io.StringIO()
    log = SentLog(sink)

    def writer(i: int) -> None:
        for j in range(200):
            log.write({"writer": i, "n": j, "pad": "x" * 50})

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = [json.loads(x) for x in sink.getvalue().splitlines()]
    assert len(lines) == 800 == len(log.records())
    for i in range(4):
        assert [x["n"] for x in lines if x["writer"] == i] == list(range(200))


def test_stop_is_prompt_and_closes_sockets():
    fleet = SimulatedFleet(
        spec(rate=5), spec(name="q", rate=0, dp_size=2), spec(name="idle", wait_for_subscriber=True)
    )
    with fleet:
        fleet.wait_sent(1, TIMEOUT, pod="q")
        fleet.wait_sent(1, TIMEOUT, pod="p")
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 2.0
    assert fleet.context.closed
    assert not any(p.alive for pod in fleet.pods for p in pod.publishers)


def test_wait_sent_times_out_with_counts():
    with SimulatedFleet(spec(batches=2)) as fleet, pytest.raises(TimeoutError, match="p/dp0"):
        fleet.wait_sent(3, timeout=0.5)


# --- the model (pure) -------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    release=st.sampled_from(SUPPORTED_RELEASES),
    capacity=st.integers(8, 80),
    clear_prob=st.sampled_from([0.0, 0.02]),
    offload=st.sampled_from([0.0, 0.4]),
)
def test_model_properties(seed, release, capacity, clear_prob, offload):
    mode = "int" if release.supports_bytes_hashes else "signed"
    cfg = ModelConfig(
        capacity=capacity, clear_prob=clear_prob, cpu_offload_prob=offload, cpu_capacity=16
    )
    m = PrefixCacheModel(release, mode, seed, cfg)
    raw: dict[tuple, set[bytes]] = {}  # raw digests, to check chaining
    state: dict = {}
    stored_fields = set(release.stored_fields)
    for _ in range(150):
        events = m.step()
        seen_cpu = False
        for e in events:
            if isinstance(e, BlockStored) and e.medium != "CPU":
                assert not seen_cpu  # connector events follow the block pool's
                parent = m.none_hash if e.parent_block_hash is None else e.parent_block_hash
                gpu = raw.get(m.gpu_key, set())
                assert e.parent_block_hash is None or e.parent_block_hash in gpu
                assert len(e.token_ids) == len(e.block_hashes) * 16 and e.block_size == 16
                assert all(0 <= t <= 150_000 for t in e.token_ids)
                for i, h in enumerate(e.block_hashes):
                    assert len(h) == 32
                    assert h == chain_hash(parent, e.token_ids[i * 16 : (i + 1) * 16])
                    parent = h
                assert e.medium == ("GPU" if "medium" in stored_fields else None)
                assert e.group_idx == (0 if "group_idx" in stored_fields else None)
                want_kind = "full_attention" if "kv_cache_spec_kind" in stored_fields else None
                assert e.kv_cache_spec_kind == want_kind
                want_extra = [None] * len(e.block_hashes) if "extra_keys" in stored_fields else None
                assert e.extra_keys == want_extra
                assert e.lora_id is None and e.lora_name is None and e.session_id is None
            elif isinstance(e, BlockStored):
                seen_cpu = True
                assert "medium" in stored_fields
                assert (e.parent_block_hash, e.token_ids, e.block_size) == (None, [], 0)
            elif isinstance(e, BlockRemoved):
                assert len(e.block_hashes) == 1
                assert e.block_hashes[0] in raw[(e.medium, e.group_idx)]
                assert e.extra == {}  # remaining_copy_counts only when asked for
                seen_cpu = seen_cpu or e.medium == "CPU"
            apply_events(raw, [e])
        if events:  # every release can encode what the model emits
            encode_batch(EventBatch(0.0, events, 0 if release.has_dp_rank else None), release, mode)
        apply_events(state, [normalized(e, mode) for e in events])
        assert m.gpu_blocks <= capacity
        assert m.cpu_blocks <= 16
        assert m.copies() == state


def test_model_is_deterministic_and_shares_templates():
    release = Release.parse("0.33.0")
    a1 = PrefixCacheModel(release, "int", 7)
    a2 = PrefixCacheModel(release, "int", 7)
    b = PrefixCacheModel(release, "int", 8)
    steps = 200
    ev_a1 = [a1.step() for _ in range(steps)]
    assert ev_a1 == [a2.step() for _ in range(steps)]
    ev_b = [b.step() for _ in range(steps)]
    assert ev_a1 != ev_b
    # every request starts with a shared template (or an earlier conversation): the first
    # stored block of each pod is the first block of one of the templates
    firsts = {
        tuple(e.token_ids[:16])
        for evs in (ev_a1, ev_b)
        for x in evs
        for e in x
        if isinstance(e, BlockStored) and e.parent_block_hash is None
    }
    templates = {tuple(t[:16]) for t in shared_templates(ModelConfig())}
    assert firsts and firsts <= templates


def test_model_empty_steps_produce_no_events_and_clear_is_first():
    m = PrefixCacheModel(Release.parse("0.23.0"), "int", 3, ModelConfig(clear_prob=0.2))
    results = [m.step() for _ in range(400)]
    assert any(r == [] for r in results)  # decode steps that fill no block
    clears = [r for r in results if any(isinstance(e, AllBlocksCleared) for e in r)]
    assert clears and all(isinstance(r[0], AllBlocksCleared) for r in clears)


# --- CLI --------------------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(list(argv))


def test_cli_port_layout_names_and_release_cycle():
    specs = build_specs(_args("--pods", "3", "--dp-size", "2", "--release", "0.9.1,0.33.0"))
    assert [s.name for s in specs] == ["pod-0", "pod-1", "pod-2"]
    assert [str(s.release) for s in specs] == ["0.9.1", "0.33.0", "0.9.1"]
    assert [s.hash_mode for s in specs] == ["signed", "int", "signed"]
    assert [(s.pub_port, s.replay_port) for s in specs] == [
        (5557, 5559),
        (5561, 5563),
        (5565, 5567),
    ]
    one = build_specs(_args())[0]
    assert (one.name, one.pub_port, one.replay_port, str(one.release)) == (
        "pod",
        5557,
        5558,
        "0.33.0",
    )


def test_cli_refuses_bytes_hashes_before_0_10_2(capsys):
    assert run(_args("--release", "0.10.1", "--hash-mode", "bytes")) == 2
    assert "0.10.2" in capsys.readouterr().err


def test_cli_runs_until_done(tmp_path, capsys):
    eps, log = tmp_path / "eps.json", tmp_path / "sent.jsonl"
    argv = ["--pods", "2", "--dp-size", "2", "--release", "0.9.1,0.26.0", "--base-port", "0",
            "--batches", "5", "--rate", "0", "--exit-when-done", "--linger", "0",
            "--endpoints-file", str(eps), "--sent-log", str(log)]  # fmt: skip
    assert run(_args(*argv)) == 0
    pods = json.loads(eps.read_text())
    assert [(p["name"], p["release"], p["dp_size"]) for p in pods] == [
        ("pod-0", "0.9.1", 2),
        ("pod-1", "0.26.0", 2),
    ]
    assert all(p["pub"].startswith("tcp://127.0.0.1:") and p["replay"] for p in pods)
    records = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(records) == 2 * 2 * 5
    out = capsys.readouterr().out
    assert out.count("pod-") >= 2 and "20 batches" in out


def test_physical_copies_are_stored_and_removed_one_by_one_as_vllm_does():
    """A block-aligned prompt served again recomputes its last block into a second physical
    block of the same hash: one BlockStored per copy, one BlockRemoved per evicted copy
    (vllm#55092). Counting stores and removes per hash is exact; a set is not."""
    cfg = ModelConfig(capacity=24, repeat_prob=0.6, followup_prob=0.0, gen_tokens=(1, 40))
    m = PrefixCacheModel(Release.parse("0.20.0"), "int", 5, cfg)
    counts: dict = {}
    as_set: dict = {}
    copies_seen = removed_while_copied = 0
    for _ in range(600):
        events = [normalized(e, "int") for e in m.step()]
        for e in events:
            if isinstance(e, BlockRemoved):
                tier = counts.get((e.medium, e.group_idx), {})
                removed_while_copied += tier.get(e.block_hashes[0], 0) > 1
            apply_events(counts, [e])
            if isinstance(e, BlockStored):
                tier = counts[(e.medium, e.group_idx)]
                copies_seen += any(tier[h] > 1 for h in e.block_hashes)
            for t, hs in list(as_set.items()):  # the old set semantics, for contrast
                if isinstance(e, BlockRemoved) and t == (e.medium, e.group_idx):
                    hs.difference_update(e.block_hashes)
            if isinstance(e, BlockStored):
                as_set.setdefault((e.medium, e.group_idx), set()).update(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                as_set.clear()
        assert counts == m.copies()
    assert copies_seen >= 5 and removed_while_copied >= 5, (copies_seen, removed_while_copied)
    truth = m.resident()
    assert {t: hs for t, hs in as_set.items() if hs} != truth  # a set loses held hashes


@pytest.mark.parametrize("release, reannounced", [("0.25.0", False), ("0.26.0", True)])
def test_report_mode_full_re_announces_hits_from_0_26(release, reannounced):
    cfg = ModelConfig(capacity=32, report_full_prob=1.0, followup_prob=0.8)
    m = PrefixCacheModel(Release.parse(release), "int", 11, cfg)
    resident: dict = {}
    again = 0
    for _ in range(300):
        for e in (normalized(x, "int") for x in m.step()):
            if isinstance(e, BlockStored) and e.parent_block_hash is None:
                tier = resident.get((e.medium, e.group_idx), {})
                again += bool(e.block_hashes) and all(h in tier for h in e.block_hashes)
            apply_events(resident, [e])
            # Re-announcements add no copy: the truth never counts more than the stores.
        for t, c in m.copies().items():
            assert all(c[h] <= resident[t][h] for h in c)
            assert set(c) <= set(resident[t])
    assert (again > 5) is reannounced, again


def test_offload_chunk_mode_stores_and_removes_a_block_once_per_chunk():
    cfg = ModelConfig(capacity=40, cpu_offload_prob=1.0, cpu_capacity=12, offload_chunk_blocks=3)
    m = PrefixCacheModel(Release.parse("0.33.0"), "int", 3, cfg)
    state: dict = {}
    twice = 0
    for _ in range(300):
        events = [normalized(e, "int") for e in m.step()]
        apply_events(state, events)
        twice += any(n > 1 for n in state.get(("CPU", None), {}).values())
        cpu_stores = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
        assert all(len(e.block_hashes) <= 3 for e in cpu_stores)
        assert state == m.copies()
        assert m.cpu_blocks <= 12
    assert twice > 10


def test_copy_counts_tell_how_many_copies_stay():
    import msgpack

    cfg = ModelConfig(capacity=24, repeat_prob=0.6, followup_prob=0.0, copy_counts=True)
    m = PrefixCacheModel(Release.parse("0.33.0"), "int", 5, cfg)
    state: dict = {}
    kept = 0
    for _ in range(400):
        for e in (normalized(x, "int") for x in m.step()):
            if isinstance(e, BlockRemoved):
                left = msgpack.unpackb(e.extra["remaining_copy_counts"])
                assert len(left) == len(e.block_hashes)
                kept += any(left)
            apply_events(state, [e])
        assert state == m.copies()
    assert kept >= 3
    # Array-encoded releases cannot carry a field by name: none is sent.
    old = PrefixCacheModel(Release.parse("0.23.0"), "int", 5, cfg)
    events = [e for _ in range(400) for e in old.step()]
    assert not any(isinstance(e, BlockRemoved) and e.extra for e in events)
