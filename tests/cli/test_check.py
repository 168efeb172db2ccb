"""`kvbridge check`: its options, its output on a real topic, and its progress."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

import pytest
from checker_util import E1, produce, scenario

from bridge.cli.check import configure_parser, run
from bridge.ops.config import ConfigError


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvbridge check")
    configure_parser(p)
    return p.parse_args(argv)


def test_parser_options():
    a = parse([])
    assert (a.bootstrap_servers, a.topic, a.kafka_property, a.pod) == (None, None, [], [])
    assert not a.allow_duplicates and not a.verbose and a.expect_sent is None
    assert a.progress == "auto"
    a = parse(
        ["--bootstrap-servers", "k:9", "--topic", "t", "--kafka-property", "a=b",
         "--kafka-property", "c=d", "--allow-duplicates", "--pod", "x", "--pod", "y",
         "--expect-sent", "s.jsonl", "-v"]
    )  # fmt: skip
    assert (a.bootstrap_servers, a.topic, a.kafka_property) == ("k:9", "t", ["a=b", "c=d"])
    assert a.allow_duplicates and a.verbose and a.pod == ["x", "y"] and a.expect_sent == "s.jsonl"


def test_bad_kafka_property_is_a_config_error():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        run(parse(["--kafka-property", "nokey"]))


@pytest.fixture
def sound_topic(kafka_bootstrap: str, make_topic) -> Iterator[tuple[str, str, list[dict]]]:
    topic = make_topic(partitions=2)
    recs, sent = scenario()
    produce(kafka_bootstrap, topic, recs)
    yield kafka_bootstrap, topic, sent


def test_run_on_a_sound_topic(sound_topic, tmp_path, capsys, monkeypatch):
    bootstrap, topic, sent = sound_topic
    path = tmp_path / "sent.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in sent))
    monkeypatch.setenv("KVBRIDGE_BOOTSTRAP_SERVERS", bootstrap)
    monkeypatch.setenv("KVBRIDGE_TOPIC", topic)
    assert run(parse(["--expect-sent", str(path), "-v"])) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "OK: 2 streams, 15 events in 8 batches, 1 lost, 0 duplicates, markers EventsLost=1, "
        "PublisherRestarted=1, StreamStarted=2"
    )
    assert out[1:] == [f"  a rank 0 epoch {E1}: lost seq 3: not in replay buffer"]
    # --pod filters both the topic and the sent-log.
    assert run(parse(["--pod", "a", "--expect-sent", str(path)])) == 0
    assert capsys.readouterr().out.startswith("OK: 2 streams")
    assert run(parse(["--pod", "nobody"])) == 0
    assert capsys.readouterr().out.startswith("OK: 0 streams, 0 events")


def test_run_on_a_topic_with_a_hole_and_an_undecodable_record(kafka_bootstrap, make_topic, capsys):
    topic = make_topic()
    recs = [r for r in scenario()[0] if r.envelope.seq != 1 or r.envelope.epoch != E1]
    produce(kafka_bootstrap, topic, recs, garbage=1)
    code = run(parse(["--bootstrap-servers", kafka_bootstrap, "--topic", topic, "-v"]))
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert out[0].startswith("FAIL: 1 hole (1 batch), 1 undecodable record (2 streams")
    assert f"  a rank 0 epoch {E1}: hole: seq 1 neither delivered nor reported lost" in out
    assert "  1 record could not be decoded (skipped)" in out


def test_progress_bar_ends_at_100_percent_on_stderr_and_off_is_silent(sound_topic, capsys):
    bootstrap, topic, _ = sound_topic
    n = len(scenario()[0])
    argv = ["--bootstrap-servers", bootstrap, "--topic", topic, "--progress"]
    assert run(parse(argv + ["bar"])) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("OK: 2 streams")  # stdout holds the verdict only
    assert captured.err.startswith("\r[" + "#" * 30 + "] 100.0%")
    assert f"  {n} records  " in captured.err and captured.err.endswith("\n")
    assert run(parse(argv + ["off"])) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("OK: 2 streams") and captured.err == ""
    with pytest.raises(SystemExit):
        parse(["--progress", "sometimes"])
