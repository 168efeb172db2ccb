"""`kvbridge run --workers N`: children sharded without overlap, supervised by the parent."""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest
from bridge_util import read_all
from e2e_util import Proc, wait_for

from bridge.consume.checker import check_topic
from bridge.log.markers import StreamStarted
from bridge.ops.workers import child_argv, strip_flags
from bridge.simulator.pod import PodSpec, SimulatedFleet


def test_strip_flags_both_spellings():
    argv = ["run", "--workers", "2", "--topic=t", "--shard-index=1", "--metrics-port", "9", "-x"]
    assert strip_flags(argv) == ["run", "--topic=t", "-x"]


def test_child_argv_nests_replica_shards():
    argv = ["run", "--workers", "2", "--shard-index", "1", "--shard-count", "3"]
    a = child_argv(argv, worker=1, workers=2, shard_index=1, shard_count=3, metrics_port=9400)
    assert a == ["run", "--shard-index", "3", "--shard-count", "6", "--metrics-port", "9401"]
    # every (replica, worker) pair gets a distinct shard of replicas*workers
    seen = {child_argv([], w, 2, r, 3, 0)[1] for r in range(3) for w in range(2)}
    assert seen == {str(i) for i in range(6)}


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


@pytest.mark.kafka
def test_two_workers_split_the_fleet(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=3)
    specs = [PodSpec(name=f"w{i}", rate=100, batches=60, seed=i) for i in range(6)]
    with SimulatedFleet(*specs) as fleet:
        args = ["run", "--bootstrap-servers", kafka_bootstrap, "--topic", topic]
        args += ["--workers", "2", "--metrics-port", "0"]
        for p in fleet.pods:
            args += ["--pod", f"name={p.name},model={p.model},pub={p.pub},replay={p.replay}"]
        proc = Proc(args, tmp_path / "bridge.log")
        try:
            kids = wait_for(
                lambda: len(children(proc.p.pid)) == 2 and children(proc.p.pid),
                30,
                "two worker processes",
            )
            fleet.wait_done(timeout=60)
            want = sum(len(b["events"]) for b in fleet.sent())
            wait_for(
                lambda: (
                    sum(r.envelope.index >= 0 for r in read_all(kafka_bootstrap, topic)) >= want
                ),
                60,
                "every event in the topic",
            )
            # A worker that dies takes the unit down with its code: nothing restarts silently.
            os.kill(kids[0], signal.SIGKILL)
            wait_for(lambda: not proc.alive(), 30, "the parent to stop")
            assert proc.p.returncode != 0, proc.output()
            assert "exited with code" in proc.output()
            wait_for(
                lambda: not any(os.path.exists(f"/proc/{k}") for k in kids[1:]),
                10,
                "the other worker to stop",
            )
        finally:
            proc.stop()
    recs = read_all(kafka_bootstrap, topic)
    starts = Counter(r.envelope.pod for r in recs if isinstance(r.event, StreamStarted))
    assert starts == Counter({p.name: 1 for p in fleet.pods})
    report = check_topic(kafka_bootstrap, topic, sent=fleet.sent())
    assert report.ok and report.duplicates == 0, report.details()


@pytest.mark.kafka
def test_workers_stop_cleanly_on_sigterm(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic()
    with SimulatedFleet(PodSpec(name="t0", rate=50, batches=0)) as fleet:
        (p,) = fleet.pods
        args = ["run", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--workers", "2"]
        args += ["--metrics-port", "0", "--pod", f"name=t0,model=m,pub={p.pub}"]
        proc = Proc(args, tmp_path / "bridge.log")
        try:
            wait_for(lambda: len(children(proc.p.pid)) == 2, 30, "two worker processes")
            wait_for(lambda: read_all(kafka_bootstrap, topic), 90, "records")
        finally:
            code = proc.stop()
            print(proc.log_path.read_text(errors="replace"))
        assert code == 0
