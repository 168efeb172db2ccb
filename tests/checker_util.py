"""Records and sent-logs for the topic checker's tests (tests/consume/test_checker.py, and
`kvbridge check` in tests/cli/test_check.py)."""

from __future__ import annotations

import json

from bridge.log.markers import EventsLost, PodRemoved, PublisherRestarted, StreamStarted
from bridge.log.records import Envelope, Record
from bridge.vllm.events import BlockStored
from bridge.vllm.jsonview import event_to_json

E1, E2, E3 = 1_767_225_600_000, 1_767_225_600_001, 1_767_225_600_002


def env(pod: str, rank: int, epoch: int, seq: int, index: int) -> Envelope:
    return Envelope(pod, "llama", rank, epoch, seq, index, 1_767_225_600.0 + seq)


def stored(seq: int, index: int, tokens: int = 4) -> BlockStored:
    h = (seq * 1000 + index).to_bytes(8, "big")
    return BlockStored([h], None, list(range(seq, seq + tokens)), tokens, medium="GPU")


def batch(pod: str, rank: int, epoch: int, seq: int, n: int = 2) -> list[Record]:
    return [Record(env(pod, rank, epoch, seq, i), stored(seq, i)) for i in range(n)]


def batches(pod: str, rank: int, epoch: int, seqs: range | list[int], n: int = 2) -> list[Record]:
    return [r for s in seqs for r in batch(pod, rank, epoch, s, n)]


def started(pod: str, rank: int, epoch: int, next_seq: int = 0) -> Record:
    ep = f"tcp://{pod}:{5557 + rank}"
    return Record(env(pod, rank, epoch, next_seq, -1), StreamStarted(next_seq, ep))


def restarted(
    pod: str, rank: int, epoch: int, old: int, last: int | None, first: int = 0
) -> Record:
    return Record(env(pod, rank, epoch, first, -1), PublisherRestarted(old, last, first))


def lost(pod: str, rank: int, epoch: int, lo: int, hi: int, reason: str = "replay timed out"):
    return Record(env(pod, rank, epoch, lo, -1), EventsLost(lo, hi, reason))


def removed(pod: str, rank: int, epoch: int) -> Record:
    return Record(env(pod, rank, epoch, 0, -1), PodRemoved("pod deleted"))


def sent_entry(pod, rank, inc, seq, how="live", n=2) -> dict:
    events = [json.loads(json.dumps(event_to_json(stored(seq, i)))) for i in range(n)]
    return {
        "pod": pod,
        "model": "llama",
        "dp_rank": rank,
        "incarnation": inc,
        "seq": seq,
        "ts": 1.0,
        "sent": how,
        "release": "0.33.0",
        "events": events,
    }


def scenario() -> tuple[list[Record], list[dict]]:
    """Two incarnations: seq 2 dropped (replayed), seq 3 lost by vLLM, then a restart."""
    sent = [sent_entry("a", 0, 0, s) for s in range(2)]
    sent += [sent_entry("a", 0, 0, 2, "dropped"), sent_entry("a", 0, 0, 3, "lost")]
    sent += [sent_entry("a", 0, 0, 4)] + [sent_entry("a", 0, 1, s) for s in range(3)]
    sent += [sent_entry("a", 1, 0, 0, n=1)]
    recs = [started("a", 0, E1), started("a", 1, E1)] + batches("a", 0, E1, range(3))
    recs += [lost("a", 0, E1, 3, 3, "not in replay buffer")] + batches("a", 0, E1, [4])
    recs += batches("a", 1, E1, [0], n=1)
    recs += [restarted("a", 0, E2, E1, 4)] + batches("a", 0, E2, range(3))
    return recs, sent


def produce(bootstrap: str, topic: str, records: list[Record], garbage: int = 0) -> None:
    from confluent_kafka import Producer

    from bridge.log.records import RecordCodec

    codec = RecordCodec()
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for r in records:
        p.produce(topic, codec.encode(r.envelope, r.event), key=r.envelope.pod.encode())
    for _ in range(garbage):
        p.produce(topic, b"not avro", key=b"a")
    assert p.flush(30) == 0
