"""End to end on real parts: simulated pods -> `kvbridge run` -> Kafka -> consume and replay."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest
from e2e_util import (
    Proc,
    free_port_block,
    metric_totals,
    read_json,
    read_jsonl,
    run_cli,
    wait_for,
)

from bridge.consume.reader import TopicReader
from bridge.log.sink import ensure_topic

RELEASES = ["0.9.0", "0.23.0", "0.33.0"]
BATCHES = 120


def expected_records(sent: list[dict]) -> dict[tuple[str, int], list[tuple[int, int, dict]]]:
    """Per (pod, rank): (seq, index, event) of everything published (live or only buffered)."""
    out: dict[tuple[str, int], list] = defaultdict(list)
    for b in sorted(sent, key=lambda b: (b["pod"], b["dp_rank"], b["seq"])):
        if b["sent"] == "lost":
            continue
        for i, ev in enumerate(b["events"]):
            out[(b["pod"], b["dp_rank"])].append((b["seq"], i, ev))
    return out


def reference_state(sent: list[dict]) -> dict[tuple[str, int], dict[tuple, set[str]]]:
    """Resident hashes per stream and (medium, group_idx), applying the sent events naively:
    every store a copy, every remove one copy less (vLLM's physical copies)."""
    state: dict[tuple[str, int], dict[tuple, Counter[str]]] = defaultdict(
        lambda: defaultdict(Counter)
    )
    for b in sorted(sent, key=lambda b: (b["pod"], b["dp_rank"], b["seq"])):
        tiers = state[(b["pod"], b["dp_rank"])]
        for ev in b["events"]:
            if ev["type"] == "BlockStored":
                tiers[(ev["medium"], ev["group_idx"])].update(ev["block_hashes"])
            elif ev["type"] == "BlockRemoved":
                tier = tiers[(ev["medium"], ev["group_idx"])]
                tier.subtract(h for h in ev["block_hashes"] if tier[h] > 0)
            elif ev["type"] == "AllBlocksCleared":
                tiers.clear()
    return {
        k: {t: {h for h, n in v.items() if n > 0} for t, v in tiers.items() if +v}
        for k, tiers in state.items()
    }


@pytest.mark.kafka
@pytest.mark.parametrize("drop_rate", [0.0, 0.05], ids=["clean", "5pct-dropped"])
def test_pods_to_kafka_and_back(kafka_bootstrap, tmp_path, drop_rate):
    topic = f"e2e-{int(drop_rate * 100)}-{tmp_path.name[-12:]}".replace("_", "-")
    ensure_topic(kafka_bootstrap, topic, partitions=3)
    base = free_port_block(6)
    sent_log, endpoints = tmp_path / "sent.jsonl", tmp_path / "endpoints.json"
    sim_state = tmp_path / "sim-state.json"
    sim_state = tmp_path / "sim-state.json"
    sim_args = f"simulate --pods 3 --name pod --release {','.join(RELEASES)} --base-port {base}"
    sim_args += f" --rate 100 --batches {BATCHES} --drop-rate {drop_rate} --clear-prob 0.01"
    sim_args += f" --seed 7 --sent-log {sent_log} --endpoints-file {endpoints}"
    sim_args += f" --state-file {sim_state}"
    sim = Proc(sim_args.split(), tmp_path / "sim.log")
    bridge = None
    try:
        pods = wait_for(lambda: read_json(endpoints), 30, "simulator endpoints")
        specs = [
            f"name={p['name']},model={p['model']},pub={p['pub']},replay={p['replay']}" for p in pods
        ]
        metrics_port = free_port_block(1)
        args = f"run --bootstrap-servers {kafka_bootstrap} --topic {topic}".split()
        args += ["--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"]
        for s in specs:
            args += ["--pod", s]
        bridge = Proc(args, tmp_path / "bridge.log")

        wait_for(lambda: len(read_jsonl(sent_log)) >= 3 * BATCHES, 60, "simulator to finish")
        sent = read_jsonl(sent_log)
        want = expected_records(sent)
        n_events = sum(len(v) for v in want.values())
        assert n_events > 3 * BATCHES  # a real workload, not a trivial one
        if drop_rate:
            assert sum(b["sent"] == "dropped" for b in sent) > 0

        def count() -> int:
            with TopicReader(kafka_bootstrap, topic) as r:
                return sum(1 for c in r.read() if c.record.envelope.index >= 0)

        wait_for(lambda: count() >= n_events, 90, f"{n_events} events in Kafka", interval=1.0)

        # The metrics tell the same story as the topic.
        def scrape() -> dict[str, float]:
            return metric_totals(f"http://127.0.0.1:{metrics_port}/metrics")

        m = wait_for(
            lambda: (m := scrape())["kvbridge_records_out_total"] >= n_events + 3 and m,
            30,
            "records_out to count every record",
        )
        assert m["kvbridge_events_in_total"] == n_events
        assert m["kvbridge_records_out_total"] == n_events + 3  # + one StreamStarted per pod
        assert m.get("kvbridge_decode_errors_total", 0) == 0
        assert m.get("kvbridge_produce_errors_total", 0) == 0
        assert m.get("kvbridge_batches_lost_total", 0) == 0
        # Every batch's lag from its vLLM timestamp to Kafka's acknowledgement was observed.
        assert m["kvbridge_e2e_lag_seconds_count"] == len([b for b in sent if b["events"]])
        if drop_rate:
            # Dropped batches only come back by replay: after a live gap, or (a bridge slower
            # to start than the pods, on a loaded machine) by the first contact's replay.
            ok = 'kvbridge_replays_total{outcome="succeeded"}'
            wait_for(lambda: scrape().get(ok, 0) >= 1, 10, "a successful replay")
        assert bridge.stop() == 0, bridge.output()

        check = run_cli(
            [
                "check",
                "--bootstrap-servers",
                kafka_bootstrap,
                "--topic",
                topic,
                "--expect-sent",
                str(sent_log),
            ]
        )
        assert check.returncode == 0, check.stdout + check.stderr
        assert check.stdout.startswith("OK: 3 streams"), check.stdout
        assert ", 0 lost, 0 duplicates" in check.stdout

        got = run_cli(["consume", "--bootstrap-servers", kafka_bootstrap, "--topic", topic])
        assert got.returncode == 0, got.stderr
        lines = [json.loads(x) for x in got.stdout.splitlines()]
        streams: dict[tuple[str, int], list] = defaultdict(list)
        markers: dict[tuple[str, int], list] = defaultdict(list)
        for ln in lines:
            key = (ln["pod"], ln["dp_rank"])
            if ln["index"] < 0:
                markers[key].append(ln["type"])
            else:
                streams[key].append((ln["seq"], ln["index"], ln["event"]))
        assert set(streams) == set(want)
        for key, events in want.items():
            # Exactly what the simulator sent, every field and hash byte, in order, once.
            assert streams[key] == events, f"stream {key} differs"
            assert markers[key] == ["StreamStarted"], f"{key}: {markers[key]}"
        epochs = {(ln["pod"], ln["dp_rank"], ln["epoch"]) for ln in lines}
        assert len(epochs) == len(want)

        got = run_cli(
            ["replay", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--json"]
        )
        assert got.returncode == 0, got.stderr
        state = json.loads(got.stdout)
        rebuilt = {
            (s["pod"], s["dp_rank"]): {
                (t["medium"], t["group_idx"]): set(t["blocks"]) for t in s["tiers"]
            }
            for s in state["streams"]
        }
        assert rebuilt == reference_state(sent)
        # A router's question: the longest cached prefix per pod, from vLLM's 64-bit keys.
        (pod, rank), tiers = next((k, t) for k, t in sorted(rebuilt.items()) if t)
        resident = sorted(next(iter(tiers.values())))
        query = ",".join([*resident[:2], "0x" + "ff" * 8])  # as replay printed them
        got = run_cli(
            ["replay", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--query", query]
        )
        assert got.returncode == 0, got.stderr
        rows = {tuple(ln.split()[:2]): int(ln.split()[2]) for ln in got.stdout.splitlines()[1:]}
        assert rows[(pod, str(rank))] == min(2, len(resident))
        # ... and equals the simulator's own cache model.
        assert sim.stop() == 0, sim.output()
        model = {
            (s["pod"], s["dp_rank"]): {
                (t["medium"], t["group_idx"]): set(t["blocks"]) for t in s["tiers"]
            }
            for s in json.loads(sim_state.read_text())
        }
        assert rebuilt == {k: v for k, v in model.items() if v}
        assert all(not s["uncertain"] for s in state["streams"])
    finally:
        if bridge is not None:
            bridge.stop()
        sim.stop()
