"""`kvbridge check --expect-sent` while the simulator is still publishing: the topic runs
ahead of the sent-log that was read; the comparison goes up to the sent-log's end, says what
it left out, and still finds real differences."""

from __future__ import annotations

import json

import pytest
from bridge_util import read_all, running_bridge
from e2e_util import run_cli, wait_for

from bridge.consume.sentlog import SentComparer
from bridge.ops.config import PodConfig
from bridge.simulator.pod import PodSpec, SimulatedFleet

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]


def test_check_against_a_sent_log_of_a_running_simulator(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic()
    spec = PodSpec(
        name="live", release="0.33.0", rate=100, batches=0, seed=8, wait_for_subscriber=True
    )  # fmt: skip  (batches=0: forever)
    log = tmp_path / "sent.jsonl"
    with SimulatedFleet(spec) as fleet:
        p = fleet.pods[0]
        with running_bridge(kafka_bootstrap, topic, [PodConfig(p.name, p.model, p.pub, p.replay)]):
            fleet.wait_sent(40, timeout=30)
            sent = fleet.sent()
            log.write_text("".join(json.dumps(r) + "\n" for r in sent))
            last = max(r["seq"] for r in sent)

            def ahead() -> bool:
                return any(r.envelope.seq > last + 5 for r in read_all(kafka_bootstrap, topic))

            wait_for(ahead, 30, "the topic to run ahead of the sent-log")
            got = run_cli(
                ["check", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                 "--expect-sent", str(log)]
            )  # fmt: skip
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.startswith("OK:"), got.stdout
    assert "past the sent-log's end" in got.stdout and "still running" in got.stdout


def test_the_tail_rule_still_finds_real_differences():
    def entry(inc: int, seq: int) -> dict:
        return {"pod": "p", "dp_rank": 0, "incarnation": inc, "seq": seq, "sent": "live",
                "events": []}  # fmt: skip

    # Incarnation 0 ended (incarnation 1 was logged): a topic batch past its last logged seq
    # is a real difference; past incarnation 1's end it is the live tail.
    cmp = SentComparer([entry(0, 0), entry(0, 1), entry(1, 0)])
    assert cmp._sent_end(("p", 0), 0) > 10**18
    assert cmp._sent_end(("p", 0), 1) == 0
    assert cmp._sent_end(("p", 0), 2) == -1


def test_check_against_your_own_capture_of_payloads(kafka_bootstrap, make_topic, tmp_path):
    """The documented capture form: one JSON line per published batch with its payload hex
    (what a user can record from a real engine with a plain SUB socket)."""
    import zmq
    from test_bad_input import HostilePod, valid

    from bridge.vllm.framing import live_frames

    topic = make_topic()
    ctx = zmq.Context()
    pub = HostilePod(ctx)
    capture = tmp_path / "capture.jsonl"
    lines = [{"pod": "cap", "dp_rank": 0, "seq": s, "payload": valid(s).hex()} for s in range(5)]
    try:
        with running_bridge(kafka_bootstrap, topic, [PodConfig("cap", "m", pub.endpoint)]):
            pub.wait_subscribed()
            for line in lines:
                pub.send(live_frames(b"", line["seq"], bytes.fromhex(line["payload"])))
            wait_for(
                lambda: sum(r.envelope.index >= 0 for r in read_all(kafka_bootstrap, topic)) == 5,
                30,
                "5 events",
            )
    finally:
        pub.sock.close(linger=0)
        ctx.term()
    args = ["check", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--expect-sent"]
    capture.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = run_cli([*args, str(capture)])
    assert got.returncode == 0 and got.stdout.startswith("OK:"), got.stdout + got.stderr
    lines[2]["payload"] = valid(99).hex()  # not what was published at seq 2
    capture.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = run_cli([*args, str(capture), "-v"])
    assert got.returncode == 1 and "seq 2 index 0: BlockStored differs" in got.stdout, got.stdout
