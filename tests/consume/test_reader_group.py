"""Group members that share the partitions (`read_group`, `consume --group --follow`), and
`replay --follow --every` printing and saving while it runs, on a real broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from confluent_kafka import Producer
from e2e_util import REPO, run_cli, wait_for

from bridge.consume.reader import ConsumedRecord, ReaderError, StartAt, TopicReader
from bridge.consume.state import CacheState, SnapshotError
from bridge.log.records import Envelope, RecordCodec
from bridge.vllm.events import BlockStored

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]

PARTS = 4
PODS = [f"pod-{i}" for i in range(8)]  # pod-i lives in partition i % 4: two pods each


class Writer:
    """Produces kv-events records keyed by pod, each pod's in its own fixed partition."""

    def __init__(self, bootstrap: str, topic: str, partitions: int = PARTS) -> None:
        self.topic = topic
        self.partitions = partitions
        self.codec = RecordCodec()
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
        self.next_seq: dict[str, int] = {}

    def send(self, pods: list[str], per_pod: int) -> int:
        for _ in range(per_pod):
            for pod in pods:
                seq = self.next_seq.get(pod, 0)
                self.next_seq[pod] = seq + 1
                i = int(pod.rsplit("-", 1)[1])
                env = Envelope(pod, "m", 0, 1, seq, 0, seq / 10)
                ev = BlockStored([(i * 10_000 + seq).to_bytes(8, "big")], None, [], 16)
                self.producer.produce(
                    self.topic,
                    self.codec.encode(env, ev),
                    key=pod,
                    partition=i % self.partitions,
                )
        assert self.producer.flush(30) == 0
        return per_pod * len(pods)


def topic_records(bootstrap: str, topic: str) -> set[tuple[int, int]]:
    with TopicReader(bootstrap, topic) as r:
        return {(c.partition, c.offset) for c in r.read()}


def topic_ends(bootstrap: str, topic: str) -> dict[int, int]:
    with TopicReader(bootstrap, topic) as r:
        return {p: r.watermarks(p)[1] for p in r.partitions()}


class Member:
    """One group member following the topic in a thread (the reader is used only there)."""

    def __init__(
        self, bootstrap: str, topic: str, group: str, overrides: dict[str, str] | None = None
    ) -> None:
        self.reader = TopicReader(bootstrap, topic, overrides, group_id=group)
        self.got: list[tuple[int, int, str, int]] = []  # (partition, offset, pod, seq)
        self.foreign: list[tuple[int, int]] = []  # records from partitions it did not own
        self.committed_at_stop: dict[int, int] | None = None
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            for cr in self.reader.read_group(idle_timeout=0.2):
                self.take(cr)
            self.committed_at_stop = self.reader.commit()
        except BaseException as exc:  # shown by the test
            self.error = exc
        finally:
            self.reader.close()

    def take(self, cr: ConsumedRecord) -> None:
        env = cr.record.envelope
        with self.lock:
            self.got.append((cr.partition, cr.offset, env.pod, env.seq))
            if cr.partition not in self.reader.assigned:
                self.foreign.append((cr.partition, cr.offset))

    def records(self) -> list[tuple[int, int, str, int]]:
        with self.lock:
            return list(self.got)

    def stop(self) -> None:
        self.reader.stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the member did not stop"


def coords(*lists: list[tuple[int, int, str, int]]) -> list[tuple[int, int]]:
    return [(p, o) for got in lists for p, o, _, _ in got]


def distinct(*members: Member) -> int:
    return len(set(coords(*(m.records() for m in members))))


def check_pod_order(got: list[tuple[int, int, str, int]]) -> None:
    """Within one member, each pod's records come in order and each in its pod's partition."""
    last: dict[str, int] = {}
    for p, _, pod, seq in got:
        assert p == int(pod.rsplit("-", 1)[1]) % PARTS
        assert seq > last.get(pod, -1), (pod, seq)
        last[pod] = seq


@pytest.mark.parametrize("strategy", ["default", "cooperative-sticky"])
def test_members_share_partitions_and_take_over_at_the_commit(
    kafka_bootstrap, make_topic, strategy
):
    conf = {} if strategy == "default" else {"partition.assignment.strategy": strategy}
    topic = make_topic(partitions=PARTS)
    group = f"g-{topic}"
    w = Writer(kafka_bootstrap, topic)
    total = w.send(PODS, 5)

    a = Member(kafka_bootstrap, topic, group, conf)
    b: Member | None = None
    try:
        wait_for(lambda: len(a.records()) == total, 30, "member a to read the first records")
        assert a.reader.assigned == frozenset(range(PARTS))

        # b joins: a hands its partitions over with a commit, each then starts at the commit.
        b = Member(kafka_bootstrap, topic, group, conf)

        def settled() -> bool:
            sa, sb = a.reader.assigned, b.reader.assigned
            return bool(sa) and bool(sb) and not sa & sb and sa | sb == set(range(PARTS))

        wait_for(settled, 30, "the group to split the partitions between a and b")
        owned_a, owned_b = a.reader.assigned, b.reader.assigned
        seen_a, seen_b = len(a.records()), len(b.records())
        total += w.send(PODS, 5)
        wait_for(lambda: distinct(a, b) >= total, 30, "a and b to read the new records")
        read = coords(a.records(), b.records())
        assert len(read) == len(set(read)) == total, "every record read exactly once"
        new_a, new_b = a.records()[seen_a:], b.records()[seen_b:]
        assert (a.reader.assigned, b.reader.assigned) == (owned_a, owned_b), "no rebalance since"
        assert {p for p, *_ in new_a} == owned_a  # each reads all of its partitions ...
        assert {p for p, *_ in new_b} == owned_b  # ... and nothing of the other's

        # a stops (commits); b takes its partitions over from that commit.
        a.stop()
        assert a.error is None, a.error
        assert a.committed_at_stop == {p: o for p, o in topic_ends(kafka_bootstrap, topic).items()
                                       if p in owned_a}  # fmt: skip
        wait_for(
            lambda: b.reader.assigned == frozenset(range(PARTS)), 30, "b to own every partition"
        )
        seen_b = len(b.records())
        total += w.send(PODS, 4)
        wait_for(lambda: distinct(a, b) >= total, 30, "b to read the last records")
        b.stop()
        assert b.error is None, b.error
        took_over = b.records()[seen_b:]
        assert {p for p, *_ in took_over} == set(range(PARTS))
        for p in owned_a:  # b continued exactly where a's commit said
            first = min(o for q, o, *_ in took_over if q == p)
            assert first == a.committed_at_stop[p]

        read = coords(a.records(), b.records())
        assert len(read) == len(set(read)), "a record was read twice"
        assert set(read) == topic_records(kafka_bootstrap, topic), "a record was skipped"
        assert not a.foreign and not b.foreign
        check_pod_order(a.records())
        check_pod_order(b.records())
        with TopicReader(kafka_bootstrap, topic, group_id=group) as r:
            assert r.committed() == topic_ends(kafka_bootstrap, topic)
    finally:
        for m in (a, b):
            if m is not None and m.thread.is_alive():
                m.stop()


def test_a_member_falls_back_to_the_end_without_a_commit(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=2)
    group = f"g-{topic}"
    w = Writer(kafka_bootstrap, topic, partitions=2)
    w.send(PODS[:2], 3)  # before the member: not read with the end as fallback
    with TopicReader(kafka_bootstrap, topic, group_id=group) as r:
        it = r.read_group(StartAt.end(), idle_timeout=0.2)
        got: list[tuple[int, int, int]] = []

        def produce_once_assigned() -> None:
            wait_for(lambda: r.assigned == {0, 1}, 30, "the member to be assigned")
            w.send(PODS[:2], 2)

        t = threading.Thread(target=produce_once_assigned)
        t.start()
        for cr in it:
            got.append((cr.partition, cr.offset, cr.record.envelope.seq))
            if len(got) == 4:
                break
        t.join()
        assert sorted(got) == [(p, o, o) for p in (0, 1) for o in (3, 4)]
        assert r.commit() == {0: 5, 1: 5}
    with TopicReader(kafka_bootstrap, topic) as r, pytest.raises(ReaderError, match="group"):
        next(r.read_group())


def _default_sigint() -> None:
    # A test run started in the background of a non-interactive shell (CI, nohup ... &) hands
    # its children SIGINT ignored, and Python then keeps it ignored: the Ctrl-C tests below
    # would wait forever. Give the child the default a terminal user has.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def start_cli(args: list[str], out: Path, err: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(out, "wb") as o, open(err, "wb") as e:
        return subprocess.Popen(
            [sys.executable, "-m", "bridge", *args],
            cwd=REPO,
            stdout=o,
            stderr=e,
            env=env,
            preexec_fn=_default_sigint,
        )


def lines_of(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # still being written
    return out


def owns(err: Path) -> set[int] | None:
    """The partitions the process says it owns now (from its last assign/revoke log line)."""
    state: set[int] | None = None
    for line in err.read_text().splitlines():
        if "assigned partitions" in line:
            tail = line.rsplit("owns ", 1)[1].strip()
            state = set() if tail == "none" else {int(x) for x in tail.split(",")}
        elif "revoked partitions" in line and state is not None:
            gone = line.split("revoked partitions ", 1)[1].split(" ", 1)[0]
            state -= {int(x) for x in gone.split(",")}
    return state


def stop_cli(proc: subprocess.Popen[bytes], sig: signal.Signals, err: Path) -> None:
    proc.send_signal(sig)
    try:
        rc = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"did not stop on {sig.name}: {err.read_text()[-2000:]}") from None
    assert rc == 0, err.read_text()[-2000:]


def test_consume_group_follow_processes_share_the_work(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=PARTS)
    group = f"g-{topic}"
    w = Writer(kafka_bootstrap, topic)
    total = w.send(PODS, 3)
    args = ["consume", "--bootstrap-servers", kafka_bootstrap, "--topic", topic]
    args += ["--group", group, "--follow"]
    out1, err1, out2, err2 = (tmp_path / n for n in ("1.out", "1.err", "2.out", "2.err"))
    p1 = start_cli(args, out1, err1)
    p2: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: len(lines_of(out1)) == total, 60, "the first consumer's records")
        p2 = start_cli(args, out2, err2)

        def settled() -> bool:
            a, b = owns(err1), owns(err2)
            return bool(a) and bool(b) and not a & b and (a | b) == set(range(PARTS))

        wait_for(settled, 60, "the two consumers to split the partitions")
        owned1, owned2 = owns(err1), owns(err2)
        seen1, seen2 = len(lines_of(out1)), len(lines_of(out2))
        total += w.send(PODS, 3)
        wait_for(lambda: len(lines_of(out1)) + len(lines_of(out2)) >= total, 30, "the new records")
        assert {x["partition"] for x in lines_of(out1)[seen1:]} == owned1
        assert {x["partition"] for x in lines_of(out2)[seen2:]} == owned2

        stop_cli(p1, signal.SIGINT, err1)  # commits and leaves: p2 takes over
        wait_for(lambda: owns(err2) == set(range(PARTS)), 30, "the second to own everything")
        total += w.send(PODS, 2)
        wait_for(lambda: len(lines_of(out1)) + len(lines_of(out2)) >= total, 30, "the last records")
        stop_cli(p2, signal.SIGTERM, err2)
    finally:
        for p in (p1, p2):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    got = [(x["partition"], x["offset"]) for x in lines_of(out1) + lines_of(out2)]
    assert len(got) == len(set(got)) == total, "every record printed exactly once"
    assert set(got) == topic_records(kafka_bootstrap, topic)
    with TopicReader(kafka_bootstrap, topic, group_id=group) as r:
        assert r.committed() == topic_ends(kafka_bootstrap, topic)


def summaries(text: str) -> list[int]:
    """The "records applied" of each summary printed so far (complete ones only)."""
    out = []
    for block in text.split("== replay at ")[1:]:
        lines = block.splitlines()
        if len(lines) >= 2 and lines[1].startswith("records applied: "):
            out.append(int(lines[1].split()[2]))
    return out


def load_snapshot(path: Path) -> tuple[CacheState, dict[int, int]] | None:
    try:
        state, _, offsets = CacheState.load(path)
    except SnapshotError:
        return None
    return state, offsets


def test_replay_follow_prints_and_saves_every_interval(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=2)
    w = Writer(kafka_bootstrap, topic, partitions=2)
    first = w.send(PODS[:4], 3)
    snap, out, err = tmp_path / "state.json", tmp_path / "replay.out", tmp_path / "replay.err"
    args = ["replay", "--bootstrap-servers", kafka_bootstrap, "--topic", topic]
    proc = start_cli([*args, "--follow", "--every", "1", "--snapshot", str(snap)], out, err)
    try:
        # Printed again while nothing new comes: at least twice with the first records.
        wait_for(lambda: summaries(out.read_text()).count(first) >= 2, 30, "two summaries")
        loaded = wait_for(lambda: load_snapshot(snap), 10, "the snapshot")
        state, offsets = loaded
        assert state.applied == first and sum(offsets.values()) == first

        second = w.send(PODS[:4], 2)
        total = first + second
        wait_for(lambda: total in summaries(out.read_text()), 30, "a summary with the new records")

        def snapshot_has_all() -> bool:
            got = load_snapshot(snap)
            return got is not None and got[0].applied == total

        wait_for(snapshot_has_all, 10, "the snapshot to be rewritten with the new records")
        state, offsets = CacheState.load(snap)[0], CacheState.load(snap)[2]
        assert offsets == {0: total // 2, 1: total // 2}
        for pod in PODS[:4]:
            assert state.streams[(pod, 0)].last_seq == 4
            assert state.resident(pod, 0)  # the blocks are there
        assert state.resident_blocks() == total
        last_row = out.read_text().split("== replay at ")[-1]
        assert "pod-3" in last_row

        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, err.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert summaries(out.read_text())[-1] == total  # printed once more at the stop
    assert CacheState.load(snap)[0].applied == total


def test_every_and_group_option_errors():
    got = run_cli(["replay", "--bootstrap-servers", "127.0.0.1:1", "--every", "5"])
    assert got.returncode == 2 and "add --follow" in got.stderr
    got = run_cli(["replay", "--bootstrap-servers", "127.0.0.1:1", "--follow", "--every", "0"])
    assert got.returncode == 2 and "positive number of seconds" in got.stderr
    got = run_cli(["replay", "--bootstrap-servers", "127.0.0.1:1", "--follow", "--every", "x"])
    assert got.returncode == 2 and "--every" in got.stderr
    base = ["consume", "--bootstrap-servers", "127.0.0.1:1", "--group", "g", "--follow"]
    got = run_cli([*base, "--from-timestamp=-5m"])
    assert got.returncode == 2 and "shares the partitions" in got.stderr
