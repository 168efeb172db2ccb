"""The consumer library on a real broker: where reading starts and stops, groups, errors."""

from __future__ import annotations

import json
import threading
import time

import pytest
from confluent_kafka import Producer
from e2e_util import run_cli, wait_for

from bridge.consume.reader import ReaderError, StartAt, StopAt, TopicReader
from bridge.log.records import Envelope, RecordCodec
from bridge.vllm.events import BlockStored

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(90)]

T0 = (int(time.time()) - 3600) * 1000  # record timestamps: T0 + 1000 * seq (ms), in the past
PER_PARTITION = 6


@pytest.fixture(scope="module")
def topic(kafka_bootstrap, kafka_admin):
    """3 partitions; partition p holds pod-p's seqs 0..5 with timestamps T0 + 1000 * seq."""
    from kafka_broker import create_topic, topic_name

    name = create_topic(kafka_admin, topic_name("consumer-lib"), 3)
    codec = RecordCodec()
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    for p in range(3):
        for seq in range(PER_PARTITION):
            env = Envelope(f"pod-{p}", "m", 0, 1, seq, 0, seq / 10)
            ev = BlockStored([seq.to_bytes(8, "big")], None, [], 16)
            producer.produce(
                name, codec.encode(env, ev), key=env.pod, partition=p, timestamp=T0 + 1000 * seq
            )
    assert producer.flush(30) == 0
    return name


def coords(records):
    return [(c.partition, c.offset, c.record.envelope.seq) for c in records]


def test_from_the_beginning_with_coordinates(kafka_bootstrap, topic):
    with TopicReader(kafka_bootstrap, topic) as r:
        got = list(r.read())
        assert r.next_offsets == {0: 6, 1: 6, 2: 6}
    assert len(got) == 18
    for p in range(3):
        mine = [c for c in got if c.partition == p]
        assert [(c.offset, c.record.envelope.seq) for c in mine] == [(i, i) for i in range(6)]
        assert [c.timestamp_ms for c in mine] == [T0 + 1000 * i for i in range(6)]
        assert {c.record.envelope.pod for c in mine} == {f"pod-{p}"}


def test_offsets_per_partition_and_stop_offsets(kafka_bootstrap, topic):
    with TopicReader(kafka_bootstrap, topic) as r:
        got = coords(r.read(StartAt.at_offsets({0: 4, 2: 1}), stop=StopAt.at_offsets({2: 2})))
    assert sorted(got) == [(0, 4, 4), (0, 5, 5), (2, 1, 1), (2, 2, 2)]
    with TopicReader(kafka_bootstrap, topic) as r:  # the old form: one partition, to_offset
        got = coords(r.read(StartAt("offset", offset=3, partition=1), to_offset=4))
    assert got == [(1, 3, 3), (1, 4, 4)]
    with TopicReader(kafka_bootstrap, topic) as r:
        got = coords(r.read(stop=StopAt(offset=0)))
    assert sorted(got) == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]


def test_timestamps_start_and_stop(kafka_bootstrap, topic):
    with TopicReader(kafka_bootstrap, topic) as r:
        got = coords(r.read(StartAt.at_timestamp(T0 + 3500), stop=StopAt.at_timestamp(T0 + 5000)))
        assert r.next_offsets == {0: 6, 1: 6, 2: 6}
    assert sorted(got) == [(p, o, o) for p in range(3) for o in (4, 5)]
    with TopicReader(kafka_bootstrap, topic) as r:
        got = coords(r.read(stop=StopAt.at_timestamp(T0 + 1999)))
        assert r.next_offsets == {0: 2, 1: 2, 2: 2}  # where a continuation starts
    assert sorted(got) == [(p, o, o) for p in range(3) for o in (0, 1)]
    with TopicReader(kafka_bootstrap, topic) as r:  # after the last record: nothing
        assert list(r.read(StartAt.at_timestamp(T0 + 10**6))) == []


def test_end_and_follow(kafka_bootstrap, make_topic):
    name = make_topic(partitions=1)
    codec = RecordCodec()
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def send(seq: int) -> None:
        env = Envelope("f", "m", 0, 1, seq, 0, 0.0)
        producer.produce(name, codec.encode(env, BlockStored([bytes(8)], None, [], 16)))
        assert producer.flush(10) == 0

    send(0)
    with TopicReader(kafka_bootstrap, name) as r:
        assert list(r.read(StartAt.end())) == []
    with TopicReader(kafka_bootstrap, name) as r:
        it = r.read(StartAt.end(), follow=True, idle_timeout=0.2)

        def later() -> None:
            wait_for(lambda: r.start_offsets, 10, "the reader to start")
            send(1)

        t = threading.Thread(target=later)
        t.start()
        first = next(it)  # waits for the record produced after reading began
        t.join()
        assert (first.offset, first.record.envelope.seq) == (1, 1)
        it.close()
    with TopicReader(kafka_bootstrap, name) as r:  # follow up to a bound, then stop
        send(2)
        got = coords(r.read(StartAt.beginning(), follow=True, stop=StopAt(offset=2)))
    assert got == [(0, 0, 0), (0, 1, 1), (0, 2, 2)]


def test_consumer_group_commit_and_resume(kafka_bootstrap, topic):
    group = f"g-{topic}"
    with TopicReader(kafka_bootstrap, topic, group_id=group) as r:
        got = coords(r.read(StartAt.committed(), stop=StopAt(offset=1)))
        assert sorted(got) == [(p, o, o) for p in range(3) for o in (0, 1)]
        assert r.commit() == {0: 2, 1: 2, 2: 2}
    with TopicReader(kafka_bootstrap, topic, group_id=group) as r:
        assert r.committed() == {0: 2, 1: 2, 2: 2}
        got = coords(r.read(StartAt.committed()))
    assert sorted(got) == [(p, o, o) for p in range(3) for o in range(2, 6)]
    with TopicReader(kafka_bootstrap, topic) as r, pytest.raises(ReaderError, match="group"):
        list(r.read(StartAt.committed()))


def test_clear_errors(kafka_bootstrap, topic):
    with (
        TopicReader(kafka_bootstrap, "no-such-topic-xyz") as r,
        pytest.raises(ReaderError, match="not found"),
    ):
        list(r.read())
    with TopicReader(kafka_bootstrap, topic) as r:
        with pytest.raises(ReaderError, match="partition 7 does not exist"):
            list(r.read(StartAt.at_offsets({7: 0})))
        with pytest.raises(ReaderError, match="partition 5 does not exist"):
            list(r.read(stop=StopAt.at_offsets({5: 0})))


def test_consume_cli_offsets_and_times(kafka_bootstrap, topic):
    base = ["consume", "--bootstrap-servers", kafka_bootstrap, "--topic", topic]
    got = run_cli([*base, "--from-offset", "1:3", "--to-timestamp", str(T0 + 4000)])
    assert got.returncode == 0, got.stderr
    lines = [json.loads(x) for x in got.stdout.splitlines()]
    assert [(x["partition"], x["offset"], x["timestamp"]) for x in lines] == [
        (1, 3, T0 + 3000),
        (1, 4, T0 + 4000),
    ]
    got = run_cli([*base, "--from-offset", "9:0"])
    assert got.returncode == 1 and "partition 9 does not exist" in got.stderr
    got = run_cli([*base, "--from-timestamp", "last tuesday"])
    assert got.returncode == 2 and "expected ISO 8601" in got.stderr
    got = run_cli([*base, "--from-offset", "3"])
    assert got.returncode == 2 and "needs --partition" in got.stderr


def test_relative_times_and_durations_work_as_the_docs_write_them(kafka_bootstrap, topic, tmp_path):
    """``--from-timestamp -10m``, ``--to-timestamp -1h`` (README), not only ``=-10m``."""
    from bridge.consume.state import CacheState

    base = ["--bootstrap-servers", kafka_bootstrap, "--topic", topic]
    got = run_cli(["consume", *base, "--from-timestamp", "-10m"])  # every record is older
    assert got.returncode == 0, got.stderr
    assert got.stdout == ""
    got = run_cli(["consume", *base, "--from-timestamp", "-1h30m", "--to-timestamp", "-5m"])
    assert got.returncode == 0, got.stderr
    assert len(got.stdout.splitlines()) == 3 * PER_PARTITION
    snap = tmp_path / "s.json"
    got = run_cli(["replay", *base, "--to-timestamp", "-2h", "--snapshot", str(snap)])
    assert got.returncode == 0, got.stderr
    assert CacheState.load(snap)[0].resident_blocks() == 0  # as of before the first record
    got = run_cli(["replay", *base, "--to-timestamp", "-1m", "--snapshot", str(snap)])
    assert got.returncode == 0, got.stderr
    assert CacheState.load(snap)[0].resident_blocks() == 3 * PER_PARTITION
    got = run_cli(["run", "--replay-timeout", "-5s", "--pod", "name=a,model=m,pub=tcp://h:1"])
    assert got.returncode == 2 and "a duration cannot be negative" in got.stderr, got.stderr


def test_an_offset_past_a_short_partitions_end_says_what_the_partition_holds(
    kafka_bootstrap, topic, make_topic
):
    """A partition that is simply short (or empty) is no sign of a recreated topic."""
    empty = make_topic(partitions=3)
    got = run_cli(
        [
            "consume",
            "--bootstrap-servers",
            kafka_bootstrap,
            "--topic",
            empty,
            "--from-offset",
            "2:10",
        ]
    )
    assert got.returncode == 0, got.stderr
    assert (
        "partition 2 is empty: offset 10 is past its end; starting at the end (offset 0)"
        in got.stderr
    )
    assert "recreated" not in got.stderr
    got = run_cli(
        [
            "consume",
            "--bootstrap-servers",
            kafka_bootstrap,
            "--topic",
            topic,
            "--from-offset",
            "1:10",
        ]
    )
    assert got.returncode == 0, got.stderr
    assert (
        f"partition 1 holds offsets 0..{PER_PARTITION - 1}: offset 10 is past its end" in got.stderr
    )


def test_follow_ticks_while_idle_and_stops_on_request(kafka_bootstrap, topic):
    ticks: list[int] = []
    with TopicReader(kafka_bootstrap, topic) as r:

        def tick() -> None:
            ticks.append(r.records_read)
            if ticks.count(18) == 2:  # a second poll after reading everything: idle
                threading.Thread(target=r.stop).start()

        got = coords(r.read(follow=True, idle_timeout=0.1, tick=tick))
    assert len(got) == 18  # the generator ended by itself after stop()
    assert ticks[0] == 0 and ticks[-2:] == [18, 18]  # before the first poll, and while idle
