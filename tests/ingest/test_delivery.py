"""Delivery guarantees under faults: real `kvbridge run` processes, real brokers, simulated pods.

What is proven, each against a simulator sent-log (every batch the pods published):

* at-least-once: a bridge SIGKILLed at random points and restarted at once loses nothing
  (each stream resumes from its checkpoint with a replay, in the same epoch); duplicates
  are allowed and counted;
* exactly-once: the same with ``--exactly-once``; a read_committed reader sees every event
  exactly once;
* a broker outage of 30 s and a hung (SIGSTOPped) broker: the bridge keeps running, stays
  within a memory bound, and the topic ends complete;
* fencing: a second bridge with the same transactional id stops the first (exit code 3,
  "fenced"), and the topic stays exactly-once;
* SIGTERM: exit 0 within the shutdown timeout, checkpoints written, so a restart with
  idle pods writes no duplicates.

The pods keep a replay buffer larger than anything a test publishes, so whatever a bridge
missed while it was down is still replayable and "0 lost" is the only right answer.
Outage tests start their own :class:`KafkaBroker` (never the session's).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.error import URLError

import pytest
from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition
from e2e_util import REPO, free_port_block, metric_totals, wait_for
from kafka_broker import KafkaBroker

from bridge.consume.checker import TopicChecker, check_topic
from bridge.consume.checkreport import CheckReport
from bridge.consume.reader import TopicReader
from bridge.consume.sentlog import compare_with_sent
from bridge.log.records import Record, RecordCodec, RecordError
from bridge.simulator.model import ModelConfig
from bridge.simulator.pod import PodSpec, SimulatedFleet

pytestmark = pytest.mark.kafka

MEMORY_BOUND_MB = 400  # the bridge's RSS while Kafka hangs (the lead documents this bound)
BUFFER_STEPS = 100_000  # pod replay buffers: larger than anything a test publishes
KILLS = 5
SHUTDOWN_TIMEOUT = 10.0  # passed as --shutdown-timeout where a test checks the exit time
EXIT_SLACK = 5.0  # interpreter exit on top of the shutdown timeout
OUTAGE_SECONDS = 30.0
OUTAGE_MIN_BATCHES = 1000  # published while the broker is down: 10 s of both pods
PAUSE_SECONDS = 15.0
FENCED_EXIT_CODE = 3


# --------------------------------------------------------------------------- pods


# Bigger steps than the default workload: about 6 events and 2 KB of vLLM payload a batch.
BIG_BATCHES = ModelConfig(
    token_budget=4096,
    max_running=16,
    template_tokens=(512, 4096),
    suffix_tokens=(256, 2048),
    capacity=16384,
)


def specs(
    prefix: str, pods: int, rate: float, batches: int, cache: ModelConfig | None = None
) -> list[PodSpec]:
    """``pods`` single-rank pods (names ``<prefix>-<i>``) whose buffers never evict."""
    return [
        PodSpec(
            name=f"{prefix}-{i}",
            release=release,
            rate=rate,
            batches=batches,
            buffer_steps=BUFFER_STEPS,
            seed=i,
            cache=cache or ModelConfig(),
        )
        for i, release in zip(range(pods), ["0.33.0", "0.23.0", "0.9.0"] * pods, strict=False)
    ]


def published(fleet: SimulatedFleet) -> int:
    """Batches the fleet has published so far (all pods and ranks)."""
    return fleet.stats().get("batches", 0)


def replays_served(fleet: SimulatedFleet) -> int:
    return fleet.stats().get("replays", 0)


# --------------------------------------------------------------------------- bridges


class BridgeProc:
    """One `kvbridge run` subprocess; stdout and stderr go to their own files."""

    def __init__(self, args: list[str], workdir: Path, name: str) -> None:
        self.name = name
        self.metrics_port = free_port_block(1)
        self.out_path = workdir / f"{name}.out"
        self.err_path = workdir / f"{name}.err"
        cmd = [sys.executable, "-m", "bridge", "run", *args]
        cmd += ["--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1"]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.p = subprocess.Popen(
                cmd,
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )

    @property
    def pid(self) -> int:
        return self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def output(self) -> str:
        return self.out_path.read_text(errors="replace") + self.stderr()

    def describe(self, lines: int = 40) -> str:
        state = "running" if self.alive() else f"exited with code {self.p.returncode}"
        tail = "\n".join(self.output().splitlines()[-lines:])
        return f"bridge {self.name} (pid {self.pid}) {state}; last output:\n{tail}"

    def assert_alive(self) -> None:
        if not self.alive():
            raise AssertionError(self.describe())

    def metrics(self) -> dict[str, float]:
        """Its /metrics summed over labels; {} while the endpoint is not up yet."""
        try:
            return metric_totals(f"http://127.0.0.1:{self.metrics_port}/metrics")
        except (URLError, ConnectionError, TimeoutError):
            return {}

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed."""
        if self.alive():
            self.p.send_signal(signal.SIGKILL)
        self.p.wait()

    def terminate(self, timeout: float) -> tuple[int | None, float]:
        """SIGTERM and wait up to ``timeout``: (exit code or None if still running, seconds)."""
        t0 = time.monotonic()
        if self.alive():
            self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - t0
        return self.p.returncode, time.monotonic() - t0

    def stop_gracefully(self, timeout: float = SHUTDOWN_TIMEOUT + EXIT_SLACK) -> None:
        """SIGTERM; assert a clean exit (code 0) within ``timeout``."""
        code, took = self.terminate(timeout)
        assert code == 0, f"SIGTERM: exit code {code} after {took:.1f}s; {self.describe()}"

    def cleanup(self) -> None:
        """Whatever state it is in: SIGTERM, SIGKILL if that does not end it, reap."""
        if self.alive():
            code, _ = self.terminate(SHUTDOWN_TIMEOUT + EXIT_SLACK)
            if code is None:
                self.kill()


class Bridges:
    """Starts `kvbridge run` processes with one set of arguments; stops them all on exit."""

    def __init__(
        self, workdir: Path, bootstrap: str, topic: str, fleet: SimulatedFleet, *extra: str
    ) -> None:
        self.workdir = workdir
        self.args = ["--bootstrap-servers", bootstrap, "--topic", topic, *extra]
        for pod in fleet.pods:
            self.args += ["--pod", f"name={pod.name},model={pod.model},pub={pod.pub}"]
            self.args[-1] += f",replay={pod.replay}"
        self.started: list[BridgeProc] = []

    def start(self, *more: str) -> BridgeProc:
        b = BridgeProc([*self.args, *more], self.workdir, f"bridge-{len(self.started)}")
        self.started.append(b)
        return b

    def __enter__(self) -> Bridges:
        return self

    def __exit__(self, *exc: object) -> None:
        for b in self.started:
            b.cleanup()


def wait_progress(bridge: BridgeProc, streams: int, timeout: float = 60.0) -> None:
    """Until ``bridge`` is at work: Kafka acknowledged a record of it, or (with nothing new
    to write) it replayed every stream from its checkpoint."""

    def moved() -> bool:
        bridge.assert_alive()
        m = bridge.metrics()
        replayed = m.get('kvbridge_replays_total{outcome="succeeded"}', 0)
        return m.get("kvbridge_records_out_total", 0) > 0 or replayed >= streams

    wait_for(moved, timeout, f"bridge {bridge.name} to write records or resume its streams")


# --------------------------------------------------------------------------- reading topics


def isolation(committed: bool) -> dict[str, str]:
    return {"isolation.level": "read_committed" if committed else "read_uncommitted"}


def read_raw(
    bootstrap: str, topic: str, committed: bool = False, timeout: float = 60.0
) -> list[Any]:
    """Every message of ``topic`` below the end offsets seen at the start (a snapshot), per
    partition in offset order; empty if the topic does not exist.

    With ``committed`` the ends are the last stable offsets. A partition is done once the
    consumer's position reaches its end: positions step over transaction markers, which
    take offsets no message has, so this ends on transactional topics too, and it does not
    chase a bridge that keeps writing.
    """
    with TopicReader(bootstrap, topic, isolation(committed)) as reader:
        try:
            parts = reader.partitions()
        except RuntimeError:
            return []
        consumer = reader.consumer
        ends = {}
        for p in parts:
            lo, hi = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if hi > lo:
                ends[p] = hi
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        out = []
        remaining = set(ends)
        deadline = time.monotonic() + timeout
        while remaining:
            if time.monotonic() > deadline:
                raise AssertionError(f"reading {topic} took over {timeout}s: {remaining} left")
            for msg in consumer.consume(1000, timeout=0.2):
                err = msg.error()
                if err is not None:
                    if err.fatal():
                        raise KafkaException(err)
                elif msg.offset() < ends[msg.partition()]:
                    out.append(msg)
            positions = consumer.position([TopicPartition(topic, p) for p in remaining])
            remaining -= {tp.partition for tp in positions if tp.offset >= ends[tp.partition]}
    return out


def topic_size(bootstrap: str, topic: str, committed: bool = False) -> int:
    """Offsets in the topic (up to the last stable offset with ``committed``); 0 if none."""
    with TopicReader(bootstrap, topic, isolation(committed)) as reader:
        try:
            parts = reader.partitions()
        except RuntimeError:
            return 0
        total = 0
        for p in parts:
            lo, hi = reader.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            total += hi - lo
        return total


def read_records(bootstrap: str, topic: str, committed: bool = False) -> list[Record]:
    """The topic's records (see :func:`read_raw`); every value must decode."""
    codec = RecordCodec()
    records = []
    for msg in read_raw(bootstrap, topic, committed):
        try:
            records.append(codec.decode(msg.value()))
        except RecordError as exc:
            raise AssertionError(f"{topic} offset {msg.offset()}: undecodable: {exc}") from None
    return records


def check_records(
    records: list[Record], sent: list[dict[str, Any]], allow_duplicates: bool
) -> CheckReport:
    checker = TopicChecker(allow_duplicates, sent)
    for r in records:
        checker.add(r)
    return checker.report()


def wait_checkpoints(
    bootstrap: str, topic: str, pods: list[str], bridge: BridgeProc, committed: bool
) -> None:
    """Until ``topic`` holds a (committed) checkpoint naming every pod.

    Before its first checkpoint a killed bridge has nothing to resume from and rightly opens
    a new epoch on restart, which is not what these tests are about.
    """

    def have_all() -> bool:
        bridge.assert_alive()
        seen = b"\n".join(
            (m.key() or b"") + b" " + (m.value() or b"")
            for m in read_raw(bootstrap, topic, committed)
        )
        return all(p.encode() in seen for p in pods)

    wait_for(have_all, 60, f"checkpoints of {pods} in {topic}", interval=0.3)


def wait_complete(
    bootstrap: str,
    topic: str,
    fleet: SimulatedFleet,
    bridge: BridgeProc,
    committed: bool = False,
    timeout: float = 90.0,
) -> list[Record]:
    """Until the pods are done and the topic holds everything they published (while
    ``bridge`` keeps running); returns the records."""
    wait_for(lambda: (bridge.assert_alive(), fleet.done)[1], timeout, "the pods to finish")
    fleet.check()
    sent = fleet.sent()
    events = sum(len(b["events"]) for b in sent if b["sent"] != "lost")

    def big_enough() -> bool:  # cheap: offsets only (a bound: markers, aborted records count)
        bridge.assert_alive()
        return topic_size(bootstrap, topic, committed) >= events

    wait_for(big_enough, timeout, f"{events} events' worth of offsets in {topic}", interval=0.5)
    last: list[str] = []
    records: list[Record] = []

    def agree() -> bool:
        bridge.assert_alive()
        records[:] = read_records(bootstrap, topic, committed)
        last[:] = compare_with_sent(records, sent)
        return not last

    try:
        wait_for(agree, timeout, "the topic to hold everything published", interval=1.0)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last[:10]}; {bridge.describe(15)}") from None
    return records


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MB (VmRSS from /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def hold(seconds: float, check: Callable[[], None], interval: float = 0.5) -> None:
    """Let ``seconds`` of wall time pass, calling ``check`` every ``interval``."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        check()
        time.sleep(min(interval, left))
    check()


# --------------------------------------------------------------------------- tests


def crash_and_resume(
    tmp_path: Path, bootstrap: str, topic: str, exactly_once: bool
) -> tuple[list[Record], list[dict[str, Any]], str]:
    """3 pods publish 750 batches each over 15 s; the bridge is SIGKILLed at 5 random points
    (after it wrote something) and restarted at once with the same arguments. Returns the
    topic's records (read_committed in exactly-once mode), the sent-log, and a description
    of the run for assertion messages."""
    seed = int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    pods = specs("crash", pods=3, rate=50, batches=750)
    total = sum(p.batches for p in pods)
    targets = sorted(rng.uniform(0.1, 0.8) * total for _ in range(KILLS))
    extra = ["--exactly-once"] if exactly_once else ["--checkpoint-topic", f"{topic}.ckpt"]
    ckpt_topic = f"{topic}.checkpoints" if exactly_once else f"{topic}.ckpt"
    kills: list[int] = []
    with SimulatedFleet(*pods) as fleet, Bridges(tmp_path, bootstrap, topic, fleet, *extra) as br:
        bridge = br.start()
        wait_checkpoints(bootstrap, ckpt_topic, [p.name for p in pods], bridge, exactly_once)
        for target in targets:
            wait_progress(bridge, len(pods))
            wait_for(lambda t=target: published(fleet) >= t, 60, f"{target:.0f} batches")
            kills.append(published(fleet))
            bridge.kill()
            bridge = br.start()
        records = wait_complete(bootstrap, topic, fleet, bridge, committed=exactly_once)
        # The topic may be complete before the last bridge has even installed its SIGTERM
        # handler (Python still starting): SIGTERM it once it is at work.
        wait_progress(bridge, len(pods))
        bridge.stop_gracefully()
        sent = fleet.sent()
    if exactly_once:
        records = read_records(bootstrap, topic, committed=True)
    run = f"seed {seed}: SIGKILLed after {kills} of {total} batches; logs in {tmp_path}"
    return records, sent, run


def test_at_least_once_survives_five_sigkills(kafka_bootstrap, make_topic, tmp_path):
    """Every published batch is in the topic after 5 SIGKILLs; duplicates are allowed."""
    topic = make_topic(partitions=3)
    records, sent, run = crash_and_resume(tmp_path, kafka_bootstrap, topic, exactly_once=False)
    assert compare_with_sent(records, sent) == [], run
    report = check_topic(kafka_bootstrap, topic, allow_duplicates=True, sent=sent)
    summary = f"{report.verdict()}; {report.duplicates} duplicates (allowed); {run}"
    print(summary)
    assert report.ok, f"{summary}\n" + "\n".join(report.details()[:30])
    assert report.lost_batches == 0, summary
    assert report.batches == len(sent), summary
    # Resumed streams keep their epoch: one StreamStarted per stream, ever.
    assert dict(report.markers) == {"StreamStarted": 3}, summary


def test_exactly_once_survives_five_sigkills(kafka_bootstrap, make_topic, tmp_path):
    """With --exactly-once, a read_committed reader sees every event once despite 5 SIGKILLs."""
    topic = make_topic(partitions=3)
    records, sent, run = crash_and_resume(tmp_path, kafka_bootstrap, topic, exactly_once=True)
    report = check_records(records, sent, allow_duplicates=False)
    summary = f"read_committed: {report.verdict()}; {run}"
    print(summary)
    assert report.ok, f"{summary}\n" + "\n".join(report.details()[:30])
    assert report.duplicates == 0 and report.lost_batches == 0, summary
    assert report.batches == len(sent), summary
    assert compare_with_sent(records, sent) == [], summary
    assert dict(report.markers) == {"StreamStarted": 3}, summary


def test_broker_down_for_30s_bridge_keeps_running(tmp_path):
    """The broker is stopped for 30 s mid-stream and started again on the same port: the
    bridge keeps running and the topic ends complete."""
    # 60 s of publishing: the outage starts once the bridge is up, which takes seconds on a
    # loaded machine, and must still overlap OUTAGE_MIN_BATCHES of the stream.
    pods = specs("outage", pods=2, rate=50, batches=3000)
    with (
        KafkaBroker() as broker,  # its own: stopped below
        SimulatedFleet(*pods) as fleet,
        Bridges(tmp_path, broker.bootstrap, "outage", fleet) as br,
    ):
        bridge = br.start()
        wait_checkpoints(
            broker.bootstrap, "outage.checkpoints", [p.name for p in pods], bridge, False
        )
        before = published(fleet)
        broker.stop()
        # The one place where waiting a duration is the point: the broker stays down for
        # OUTAGE_SECONDS of wall time, longer than librdkafka's request timeouts and the
        # bridge's commit/checkpoint intervals, while the pods keep publishing.
        hold(OUTAGE_SECONDS, bridge.assert_alive)
        # On a loaded machine the pods publish slower than their rate: keep the broker down
        # until the stream really went on meanwhile (30 s more at most).
        end = time.monotonic() + 30
        while published(fleet) - before < OUTAGE_MIN_BATCHES and time.monotonic() < end:
            hold(0.5, bridge.assert_alive)
        during = published(fleet) - before
        broker.start()  # same port, same data
        records = wait_complete(broker.bootstrap, "outage", fleet, bridge)
        bridge.stop_gracefully()
        sent = fleet.sent()
        report = check_topic(broker.bootstrap, "outage", allow_duplicates=True, sent=sent)
    summary = f"{report.verdict()}; {during} batches published while the broker was down"
    print(summary)
    assert during >= OUTAGE_MIN_BATCHES, summary  # the outage really overlapped the stream
    assert compare_with_sent(records, sent) == []
    assert report.ok and report.lost_batches == 0, f"{summary}\n" + "\n".join(report.details())
    assert dict(report.markers) == {"StreamStarted": 2}, summary


def test_hung_broker_memory_stays_bounded(tmp_path):
    """The broker hangs (SIGSTOP) for 15 s under load: the bridge's RSS stays below
    MEMORY_BOUND_MB, and once the broker answers again nothing is missing."""
    pods = specs("hung", pods=3, rate=200, batches=4000, cache=BIG_BATCHES)  # 20 s
    with (
        KafkaBroker() as broker,  # its own: paused below
        SimulatedFleet(*pods) as fleet,
        Bridges(tmp_path, broker.bootstrap, "hung", fleet) as br,
    ):
        bridge = br.start()
        wait_checkpoints(
            broker.bootstrap, "hung.checkpoints", [p.name for p in pods], bridge, False
        )
        base = rss_mb(bridge.pid)
        before = published(fleet)
        samples: list[float] = []

        def sample() -> None:
            bridge.assert_alive()
            samples.append(rss_mb(bridge.pid))

        load = int(600 * PAUSE_SECONDS * 0.5)  # batches to publish while Kafka hangs
        broker.pause()  # SIGSTOP: connections stay open, nothing is answered
        try:
            hold(PAUSE_SECONDS, sample)  # sampling every 0.5 s for the whole pause
            # On a loaded machine the pods publish slower than their rate: keep the broker
            # hung (still sampling) until the load really went through, 60 s at most.
            end = time.monotonic() + 60
            while published(fleet) - before < load and time.monotonic() < end:
                hold(0.5, sample)
        finally:
            broker.resume()
        during = published(fleet) - before
        peak = max(samples)
        records = wait_complete(broker.bootstrap, "hung", fleet, bridge, timeout=120)
        bridge.stop_gracefully()
        sent = fleet.sent()
        report = check_topic(broker.bootstrap, "hung", allow_duplicates=True, sent=sent)
    summary = (
        f"RSS {base:.0f} MB before the pause, peak {peak:.0f} MB during it "
        f"({len(samples)} samples, bound {MEMORY_BOUND_MB} MB); {during} batches published "
        f"during the pause; {report.verdict()}"
    )
    print(summary)
    assert during >= load, summary  # real load while Kafka hung
    assert peak < MEMORY_BOUND_MB, summary
    assert compare_with_sent(records, sent) == [], summary
    assert report.ok and report.lost_batches == 0, f"{summary}\n" + "\n".join(report.details())


def test_second_transactional_bridge_fences_the_first(kafka_bootstrap, make_topic, tmp_path):
    """A second bridge with the same transactional id takes over: the first exits with code
    3 saying "fenced", and the topic stays exactly-once for a read_committed reader."""
    topic = make_topic(partitions=3)
    txn = f"fence-{topic}"
    # 30 s of publishing: the first bridge is fenced at its next transaction, so the pods
    # must still publish once the second bridge is up (seconds each on a loaded machine).
    pods = specs("fence", pods=3, rate=50, batches=1500)
    extra = ["--exactly-once", "--transactional-id", txn, "--commit-interval", "50ms"]
    extra += ["--commit-max-events", "500"]
    with (
        SimulatedFleet(*pods) as fleet,
        Bridges(tmp_path, kafka_bootstrap, topic, fleet, *extra) as br,
    ):
        first = br.start()
        names = [p.name for p in pods]
        wait_checkpoints(kafka_bootstrap, f"{topic}.checkpoints", names, first, True)
        wait_progress(first, len(pods))
        second = br.start()

        def first_gone() -> bool:
            second.assert_alive()
            return not first.alive()

        wait_for(first_gone, 60, "the first bridge to be fenced and exit")
        assert first.p.returncode == FENCED_EXIT_CODE, first.describe()
        assert "fenced" in first.stderr().lower(), first.describe()
        records = wait_complete(kafka_bootstrap, topic, fleet, second, committed=True)
        second.stop_gracefully()
        sent = fleet.sent()
    records = read_records(kafka_bootstrap, topic, committed=True)
    report = check_records(records, sent, allow_duplicates=False)
    summary = f"read_committed: {report.verdict()}"
    assert report.ok, f"{summary}\n" + "\n".join(report.details()[:30])
    assert report.duplicates == 0 and report.lost_batches == 0, summary
    assert compare_with_sent(records, sent) == [], summary
    assert dict(report.markers) == {"StreamStarted": 3}, summary


@pytest.mark.parametrize("exactly_once", [False, True], ids=["at-least-once", "exactly-once"])
def test_sigterm_flushes_and_checkpoints(kafka_bootstrap, make_topic, tmp_path, exactly_once):
    """SIGTERM: exit 0 within --shutdown-timeout, checkpoints written; a restart resumes
    without loss, and after an idle restart there is not one duplicate more."""
    topic = make_topic(partitions=3)
    pods = specs("term", pods=3, rate=50, batches=300)  # 6 s
    # No periodic checkpoints in at-least-once mode: a restart can only resume from the
    # checkpoints written at shutdown.
    extra = ["--shutdown-timeout", f"{SHUTDOWN_TIMEOUT:g}s", "--checkpoint-interval", "1h"]
    if exactly_once:
        extra.append("--exactly-once")
    with (
        SimulatedFleet(*pods) as fleet,
        Bridges(tmp_path, kafka_bootstrap, topic, fleet, *extra) as br,
    ):
        # 1. SIGTERM mid-stream: a clean exit within the timeout; the restart resumes.
        bridge = br.start()
        wait_progress(bridge, len(pods))
        wait_for(lambda: published(fleet) >= 300, 30, "a third of the batches")
        bridge.stop_gracefully()
        bridge = br.start()
        wait_complete(kafka_bootstrap, topic, fleet, bridge, committed=exactly_once)
        # 2. Stop and restart with idle pods: the restart's replay brings nothing new.
        bridge.stop_gracefully()
        mid = check_records(
            read_records(kafka_bootstrap, topic, exactly_once), fleet.sent(), allow_duplicates=True
        )
        served = replays_served(fleet)
        bridge = br.start()

        def resumed() -> bool:
            bridge.assert_alive()
            replays = bridge.metrics().get('kvbridge_replays_total{outcome="succeeded"}', 0)
            return replays >= 3 and replays_served(fleet) >= served + 3

        wait_for(resumed, 60, "the restarted bridge to replay each stream from its checkpoint")
        bridge.stop_gracefully()
        sent = fleet.sent()
    records = read_records(kafka_bootstrap, topic, exactly_once)
    report = check_records(records, sent, allow_duplicates=not exactly_once)
    summary = (
        f"{report.verdict()}; {mid.duplicates} duplicates after the SIGTERM mid-stream, "
        f"{report.duplicates - mid.duplicates} after the idle restart"
    )
    print(summary)
    assert report.ok and report.lost_batches == 0, f"{summary}\n" + "\n".join(report.details())
    assert compare_with_sent(records, sent) == [], summary
    assert report.duplicates == mid.duplicates, summary  # checkpoints were written at shutdown
    if exactly_once:
        assert report.duplicates == 0, summary
    assert dict(report.markers) == {"StreamStarted": 3}, summary


UNACKNOWLEDGED_EXIT_CODE = 4


@pytest.mark.parametrize("exactly_once", [False, True], ids=["at-least-once", "exactly-once"])
def test_sigterm_with_the_broker_down_exits_within_the_shutdown_timeout(tmp_path, exactly_once):
    """The broker is killed while the pods publish, then the bridge gets SIGTERM: it exits
    within --shutdown-timeout (plus slack) with code 4 and a log line counting the records
    Kafka never acknowledged. With the broker back, a restarted bridge resumes from the last
    acknowledged (committed) checkpoints: the topic ends complete, nothing lost."""
    # 50 s of publishing: the pods must still publish when the broker is killed, which is
    # once the bridge is up (seconds on a loaded machine), or nothing would wait for Kafka.
    pods = specs("down", pods=2, rate=50, batches=2500)
    extra = ["--shutdown-timeout", f"{SHUTDOWN_TIMEOUT:g}s"]
    if exactly_once:
        extra.append("--exactly-once")
    with (
        KafkaBroker() as broker,  # its own: killed below
        SimulatedFleet(*pods) as fleet,
        Bridges(tmp_path, broker.bootstrap, "down", fleet, *extra) as br,
    ):
        bridge = br.start()
        names = [p.name for p in pods]
        wait_checkpoints(broker.bootstrap, "down.checkpoints", names, bridge, exactly_once)
        broker.kill()

        def stuck() -> bool:  # the bridge holds records Kafka cannot take
            bridge.assert_alive()
            if exactly_once:
                return "commit waiting for Kafka" in bridge.stderr()
            return bridge.metrics().get("kvbridge_producer_queue", 0) > 0

        wait_for(stuck, 60, "records waiting for the killed broker")
        code, took = bridge.terminate(SHUTDOWN_TIMEOUT + EXIT_SLACK)
        assert code == UNACKNOWLEDGED_EXIT_CODE, (
            f"SIGTERM with the broker down: exit code {code} after {took:.1f}s; {bridge.describe()}"
        )
        # e.g. "shutdown: 88 records were not acknowledged ..." or "shutdown: the open
        # transaction (12 records) was not committed ...", then how a restart resumes.
        found = re.search(
            r"shutdown: (?:the open transaction \()?(\d+) records.*next start", bridge.stderr()
        )
        assert found, f"no log line counting the dropped records; {bridge.describe()}"
        dropped = int(found[1])
        assert dropped > 0, found[0]
        broker.start()  # same port, same data
        bridge = br.start()
        records = wait_complete(broker.bootstrap, "down", fleet, bridge, committed=exactly_once)
        bridge.stop_gracefully()
        sent = fleet.sent()
        report = check_topic(broker.bootstrap, "down", allow_duplicates=not exactly_once, sent=sent)
    summary = f"{report.verdict()}; exited after {took:.1f}s with {dropped} records dropped"
    print(summary)
    assert compare_with_sent(records, sent) == [], summary
    assert report.ok and report.lost_batches == 0, f"{summary}\n" + "\n".join(report.details())
    if exactly_once:
        assert report.duplicates == 0, summary
    assert dict(report.markers) == {"StreamStarted": 2}, summary


def test_a_record_kafka_refuses_becomes_events_lost(kafka_bootstrap, make_topic):
    """A record the broker refuses for good is written as EventsLost for its batch, never a hole.

    The bridge sizes records by the topic's max.message.bytes as described at start; lowering
    it while the bridge runs makes the broker refuse records the bridge thought fit."""
    from bridge_util import metric, running_bridge
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

    from bridge.log.markers import EventsLost
    from bridge.ops.config import PodConfig

    topic = make_topic(partitions=1)
    spec = PodSpec(
        name="big", release="0.33.0", rate=100, batches=400, seed=5, wait_for_subscriber=True
    )
    with SimulatedFleet(spec) as fleet:
        pods = [PodConfig("big", "m", fleet.pods[0].pub, fleet.pods[0].replay)]
        # One record per produce request, so the broker judges each record on its own size.
        one_by_one = {"batch.num.messages": "1", "compression.type": "none"}
        with running_bridge(kafka_bootstrap, topic, pods, kafka=one_by_one) as bridge:
            # From now on records over 600 bytes are refused; the markers replacing them fit.
            admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
            res = ConfigResource(ResourceType.TOPIC, topic, {"max.message.bytes": "600"})
            admin.alter_configs([res])[res].result(30)
            fleet.wait_done(timeout=60)
            wait_for(
                lambda: metric(bridge, "kvbridge_produce_errors_total", pod="big") > 0,
                30,
                "a refused record",
            )
            sent = fleet.sent()

            def accounted() -> bool:
                report = check_topic(kafka_bootstrap, topic, sent=sent)
                return report.ok and report

            try:
                report = wait_for(accounted, 60, "every batch delivered or reported lost")
            except AssertionError:
                details = check_topic(kafka_bootstrap, topic, sent=sent).details()
                raise AssertionError("\n".join(details[:15])) from None
    lost = [
        r.event for r in read_records(kafka_bootstrap, topic) if isinstance(r.event, EventsLost)
    ]
    assert lost and all(e.reason.startswith("kafka refused a record") for e in lost)
    assert report.lost_batches == len({e.from_seq for e in lost})
