"""`kvbridge replay` on real parts: simulated vLLM pods with drops, restarts, clears, CPU
offload and lost ranges -> the bridge -> Kafka -> replay, compared with the simulator's own
cache model at the end of the run.

One run is shared by the tests of this module (it takes ~10 s). Replays from the beginning,
and from a snapshot taken at a timestamp (and at per-partition offsets) and then continued,
must all equal the model for every stream that is certain, and be marked uncertain exactly
where the bridge had to write lost ranges.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bridge_util import read_all, running_bridge
from e2e_util import run_cli, wait_for

from bridge.consume.reader import TopicReader
from bridge.consume.sentlog import compare_with_sent
from bridge.log.markers import EventsLost, PublisherRestarted
from bridge.ops.config import PodConfig
from bridge.simulator.model import ModelConfig
from bridge.simulator.pod import PodSpec, SimulatedFleet

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]

# Physical copies (prompts served again) and CPU chunks that overlap: what the default
# policy counts exactly.
CACHE = ModelConfig(
    capacity=48, clear_prob=0.02, cpu_offload_prob=0.3, cpu_capacity=24, repeat_prob=0.3,
    offload_chunk_blocks=3,
)  # fmt: skip
SPECS = [
    # Dropped batches (recovered by replay), clears, a CPU tier.
    PodSpec(name="steady", release="0.33.0", rate=200, batches=120, drop_rate=0.05, seed=1,
            cache=CACHE, wait_for_subscriber=True),
    # The engine restarts twice: each incarnation starts with an empty cache.
    PodSpec(name="restarts", release="0.26.0", rate=200, batches=150, drop_rate=0.05, seed=2,
            restart_at_batches=frozenset({40, 90}), cache=CACHE, wait_for_subscriber=True),
    # Two DP ranks, older release (array events, signed hashes).
    PodSpec(name="dp2", release="0.9.1", dp_size=2, rate=200, batches=80, seed=3,
            wait_for_subscriber=True),
    # Batches lost for good after the last clear: this stream must end up uncertain.
    PodSpec(name="lossy", release="0.23.0", rate=200, batches=80, seed=4,
            lose_seqs=frozenset({50, 51}), wait_for_subscriber=True),
]  # fmt: skip


def model_of(fleet: SimulatedFleet) -> dict[tuple[str, int], dict]:
    out = {}
    for pod in fleet.pods:
        for rank in range(pod.dp_size):
            out[(pod.name, rank)] = {
                (m, g): {"0x" + h.hex() for h in hs}
                for (m, g), hs in fleet.resident(pod.name, rank).items()
            }
    return out


@pytest.fixture(scope="module")
def run(kafka_bootstrap, kafka_admin, tmp_path_factory):
    """The topic after the fleet's run, the simulator's model, and the records written."""
    from kafka_broker import create_topic, topic_name

    topic = create_topic(kafka_admin, topic_name("replay-state"), 3)
    with SimulatedFleet(*SPECS) as fleet:
        pods = [PodConfig(p.name, p.model, p.pub, p.replay, p.dp_size) for p in fleet.pods]
        with running_bridge(kafka_bootstrap, topic, pods):
            fleet.wait_done(timeout=60)
            sent = fleet.sent()
            last: list[str] = []

            def agree() -> bool:
                last[:] = compare_with_sent(read_all(kafka_bootstrap, topic), sent)
                return not last

            try:
                wait_for(agree, 60, "the topic to hold what the pods published", interval=0.5)
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {last[:10]}") from None
        model = model_of(fleet)
    with TopicReader(kafka_bootstrap, topic) as r:
        records = list(r.read())
    return {
        "bootstrap": kafka_bootstrap,
        "topic": topic,
        "model": model,
        "records": records,
        "dir": tmp_path_factory.mktemp("replay"),
    }


def replay(run, *args: str):
    got = run_cli(
        ["replay", "--bootstrap-servers", run["bootstrap"], "--topic", run["topic"], *args]
    )
    assert got.returncode == 0, got.stderr
    return got


def rebuilt(doc: dict) -> dict[tuple[str, int], dict]:
    return {
        (s["pod"], s["dp_rank"]): {
            (t["medium"], t["group_idx"]): set(t["blocks"]) for t in s["tiers"]
        }
        for s in doc["streams"]
    }


def uncertain(doc: dict) -> set[tuple[str, int]]:
    return {(s["pod"], s["dp_rank"]) for s in doc["streams"] if s["uncertain"]}


def check_against_model(run, doc: dict) -> None:
    model, state = run["model"], rebuilt(doc)
    last_epoch: dict[tuple[str, int], int] = {}
    for c in run["records"]:
        key = (c.record.envelope.pod, c.record.envelope.dp_rank)
        last_epoch[key] = max(last_epoch.get(key, 0), c.record.envelope.epoch)
    # Losses in an epoch that a PublisherRestarted closed (its unknown tail, or a gap being
    # replayed when the engine restarted: a timing matter) are reset with it: only losses in
    # a stream's last epoch leave it uncertain.
    lossy = {
        (c.record.envelope.pod, c.record.envelope.dp_rank)
        for c in run["records"]
        if isinstance(c.record.event, EventsLost)
        and not c.record.event.open_ended
        and c.record.envelope.epoch
        == last_epoch[(c.record.envelope.pod, c.record.envelope.dp_rank)]
    }
    assert lossy == {("lossy", 0)}, "the run should lose exactly the lossy pod's batches"
    assert uncertain(doc) == lossy
    assert set(state) == set(model)
    for key in model:
        if key not in lossy:
            assert state[key] == {t: b for t, b in model[key].items() if b}, key
    # The lost batches changed the engine's cache: the uncertain stream really differs.
    assert state[("lossy", 0)] != model[("lossy", 0)]


def test_the_run_has_what_the_state_must_handle(run):
    events = [c.record.event for c in run["records"]]
    names = {type(e).__name__ for e in events}
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared", "EventsLost"} <= names
    assert sum(isinstance(e, PublisherRestarted) for e in events) == 2
    assert any(t[0] == "CPU" for tiers in run["model"].values() for t in tiers if tiers[t])


def test_replay_from_the_beginning_equals_the_model(run):
    doc = json.loads(replay(run, "--json").stdout)
    check_against_model(run, doc)
    got = replay(run, "--progress", "bar")
    summary = got.stdout
    assert "UNCERTAIN (2 batches lost)" in summary
    assert f"100.0%  {len(run['records']):,} records" in got.stderr  # the bar's last state
    assert summary.splitlines()[0].startswith(f"records applied: {len(run['records'])} ")


def test_snapshot_at_a_timestamp_then_continue(run):
    stamps = sorted(c.timestamp_ms for c in run["records"])
    t = stamps[len(stamps) // 2]
    snap: Path = run["dir"] / "at-time.json"
    replay(run, "--to-timestamp", str(t), "--snapshot", str(snap))
    saved = json.loads(snap.read_text())
    assert saved["topic"] == run["topic"]
    # Exactly the records at or before T are in the snapshot's offsets.
    for p, nxt in saved["offsets"].items():
        mine = [c for c in run["records"] if c.partition == int(p)]
        assert all(c.timestamp_ms <= t for c in mine if c.offset < nxt)
        assert all(c.timestamp_ms > t for c in mine if c.offset >= nxt)
    n_before = sum(1 for c in run["records"] if c.timestamp_ms <= t)
    assert 0 < n_before < len(run["records"])
    assert saved["records_applied"] == n_before
    doc = json.loads(replay(run, "--from-snapshot", str(snap), "--json").stdout)
    check_against_model(run, doc)
    assert doc["records_applied"] == len(run["records"])


def test_snapshot_at_offsets_then_continue_and_move_it_on(run):
    ends: dict[int, int] = {}
    for c in run["records"]:
        ends[c.partition] = max(ends.get(c.partition, 0), c.offset + 1)
    cut = ",".join(f"{p}:{n // 3}" for p, n in sorted(ends.items()))
    snap: Path = run["dir"] / "at-offsets.json"
    replay(run, "--to-offset", cut, "--snapshot", str(snap))
    assert json.loads(snap.read_text())["offsets"] == {
        str(p): n // 3 + 1 for p, n in sorted(ends.items())
    }
    replay(run, "--from-snapshot", str(snap), "--snapshot", str(snap))  # moves it to the end
    assert json.loads(snap.read_text())["offsets"] == {str(p): n for p, n in ends.items()}
    doc = json.loads(replay(run, "--from-snapshot", str(snap), "--json").stdout)
    check_against_model(run, doc)


def test_query_pod_filter_and_errors(run):
    model = run["model"]
    tiers = model[("steady", 0)]
    gpu = sorted(next(b for (m, _), b in tiers.items() if m == "GPU" and b))
    query = ",".join(gpu[:1]) + ",0x" + "ff" * 8
    out = replay(run, "--query", query, "--medium", "GPU").stdout.splitlines()
    rows = {tuple(ln.split()[:2]): int(ln.split()[2]) for ln in out[1:]}
    assert rows[("steady", "0")] == 1
    assert "UNCERTAIN" in next(ln for ln in out if ln.startswith("lossy"))
    doc = json.loads(replay(run, "--pod", "dp2", "--json").stdout)
    assert {(s["pod"], s["dp_rank"]) for s in doc["streams"]} == {("dp2", 0), ("dp2", 1)}

    base = ["replay", "--bootstrap-servers", run["bootstrap"]]
    got = run_cli([*base, "--topic", run["topic"], "--to-timestamp", "soon"])
    assert got.returncode == 2 and "--to-timestamp 'soon'" in got.stderr
    got = run_cli([*base, "--topic", run["topic"], "--from-offset", "7:0"])
    assert got.returncode == 1 and "partition 7 does not exist" in got.stderr
    got = run_cli([*base, "--topic", "no-such-topic-here"])
    assert got.returncode == 1 and "not found" in got.stderr
    got = run_cli([*base, "--from-snapshot", str(run["dir"] / "nothing.json")])
    assert got.returncode == 2 and "does not exist" in got.stderr
