"""`kvbridge state --serve`: the live state over HTTP, on a real broker and real sockets.

Records are written to kv-events with the bridge's own codec; the server follows the topic
(in-process, or as a `kvbridge` subprocess bootstrapping from kv-state) and its answers are
compared with the state a replay of the same records builds.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from bridge_util import read_all
from confluent_kafka import Producer
from e2e_util import Proc, free_port_block, run_cli, wait_for

from bridge.consume.state import CacheState
from bridge.consume.stateserve import (
    BadRequest,
    LiveState,
    StateServer,
    parse_hash,
    parse_prefix_body,
    parse_prefix_query,
    pods_view,
    prefix_view,
)
from bridge.log.markers import EventsLost, StreamStarted
from bridge.log.records import Envelope, Record, RecordCodec
from bridge.vllm.events import BlockRemoved, BlockStored, key64

H = [bytes([0xA0 + i]) * 8 for i in range(6)]
K = [key64(h) for h in H]
DIGEST = bytes(range(32))  # a 32-byte hash; its 64-bit key is its last 8 bytes
AGE_S = 300  # the records' Kafka timestamps lie this far in the past


# --- pure: parsing --------------------------------------------------------------------------


def test_hashes_are_parsed_as_vllm_keys():
    assert parse_hash(5) == 5
    assert parse_hash("18446744073709551615") == (1 << 64) - 1
    assert parse_hash(-1) == (1 << 64) - 1  # signed int64, as vLLM < 0.10.2 sends
    assert parse_hash("0xff") == 255
    assert parse_hash("0x" + DIGEST.hex()) == key64(DIGEST)
    assert parse_prefix_query("hashes=1,2&hashes=3&medium=GPU") == ([1, 2, 3], "GPU")
    assert parse_prefix_body(b'{"hashes": [1, "0x02"], "medium": null}') == ([1, 2], None)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("", "no block hashes given"),
        ("hashes=", "no block hashes given"),
        ("hashes=1,abc", "'abc' is not a block hash"),
        ("hashes=0x", "is not a block hash"),
        ("hashes=18446744073709551616", "out of the 64-bit range"),
        ("hashes=1&medium=", "medium: give one non-empty value"),
        ("hashes=1&foo=2", "unknown parameter(s) ['foo']"),
    ],
)
def test_bad_queries_say_what_is_wrong(query, message):
    with pytest.raises(BadRequest) as exc:
        parse_prefix_query(query)
    assert message in str(exc.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{", "body is not JSON"),
        (b"[1, 2]", "body must be a JSON object"),
        (b'{"hashes": "1,2"}', '"hashes" must be a list'),
        (b'{"hashes": [1.5]}', "is not a block hash"),
        (b'{"hashes": [true]}', "is not a block hash"),
        (b'{"hashes": [1], "medium": 3}', '"medium" must be a non-empty string'),
        (b'{"hashes": [1], "tier": "GPU"}', "unknown field(s) ['tier']"),
    ],
)
def test_bad_bodies_say_what_is_wrong(body, message):
    with pytest.raises(BadRequest) as exc:
        parse_prefix_body(body)
    assert message in str(exc.value)


def test_prefix_ranking_longest_first_certain_before_uncertain():
    state = CacheState()
    codec_records = [
        (Envelope("b", "m", 0, 1, 0, 0, 0.0), BlockStored(H[:2], None, [], 16)),
        (Envelope("a", "m", 0, 1, 0, 0, 0.0), BlockStored(H[:1], None, [], 16)),
        (Envelope("c", "m", 0, 1, 0, 0, 0.0), BlockStored(H[:2], None, [], 16)),
        (Envelope("b", "m", 0, 1, 1, -1, 0.0), EventsLost(1, 1, "test")),
    ]
    for env, ev in codec_records:
        state.apply(Record(env, ev))
    doc = prefix_view(state, {("a", 0): 1000}, K[:3], None, 3500)
    assert [(r["pod"], r["prefix_blocks"], r["uncertain"]) for r in doc["matches"]] == [
        ("c", 2, False),
        ("b", 2, True),
        ("a", 1, False),
    ]
    assert doc["matches"][2]["staleness_s"] == 2.5 and doc["matches"][0]["staleness_s"] is None


def test_pods_counts_what_score_can_and_cannot_see():
    state = CacheState()
    toks = list(range(8))
    stored = [
        BlockStored(H[:2], None, toks, 4),  # keyed: 2 blocks
        BlockStored(H[2:4], None, toks[:7], 4),  # 7 tokens for 2 blocks of 4: misaligned
        BlockStored(H[4:5], H[2], toks[:4], 4),  # its parent has no key: unchained
    ]
    for seq, ev in enumerate(stored):
        state.apply(Record(Envelope("a", "m", 0, 1, seq, 0, 0.0), ev))
    doc = pods_view(state, {}, 0)
    assert doc["content_index"] == {
        "indexed_blocks": 2,
        "not_indexed": {"misaligned": 2, "unchained": 1},
    }
    assert "content_index" not in pods_view(CacheState(content=False), {}, 0)


# --- on a broker ----------------------------------------------------------------------------


class Writer:
    """Writes kv-events records the way the bridge does (Avro, key = pod)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.topic = topic
        self.codec = RecordCodec()
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
        self.seq: dict[tuple[str, int], int] = {}

    def send(self, pod: str, rank: int, event: Any, marker: bool = False, age_s: float = 0):
        seq = self.seq.get((pod, rank), 0)
        if not marker:
            self.seq[(pod, rank)] = seq + 1
        env = Envelope(pod, f"model-{pod}", rank, 7, seq, -1 if marker else 0, time.time())
        ts = int((time.time() - age_s) * 1000)
        self.producer.produce(self.topic, self.codec.encode(env, event), pod.encode(), timestamp=ts)

    def flush(self) -> None:
        assert self.producer.flush(30) == 0


def write_fleet(w: Writer) -> None:
    for pod, rank in (("pod-a", 0), ("pod-a", 1), ("pod-b", 0)):
        w.send(pod, rank, StreamStarted(0, "tcp://x"), marker=True, age_s=AGE_S)
    w.send("pod-a", 0, BlockStored(H[:4], None, [], 16, medium="GPU"), age_s=AGE_S)
    w.send("pod-a", 0, BlockStored([H[4]], None, [], 16, medium="CPU"), age_s=AGE_S)
    w.send("pod-a", 1, BlockStored(H[:1], None, [], 16, medium="GPU"), age_s=AGE_S)
    w.send("pod-b", 0, BlockStored([*H[:2], DIGEST], None, [], 16, medium="CPU"), age_s=AGE_S)
    w.send("pod-b", 0, EventsLost(9, 10, "test"), marker=True, age_s=AGE_S)
    w.flush()


def http(port: int, path: str, body: bytes | None = None) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def expected_pods(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    state = CacheState()
    for r in read_all(bootstrap, topic):
        state.apply(r)
    return state.summary()["streams"]


def strip(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in p.items() if k not in ("staleness_s", "last_record_ms")} for p in pods
    ]


@pytest.fixture
def served(kafka_bootstrap, make_topic):
    topic = make_topic(partitions=2)
    w = Writer(kafka_bootstrap, topic)
    write_fleet(w)
    live = LiveState(kafka_bootstrap, topic)
    server = StateServer(live, "127.0.0.1", 0)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    live.start()
    t.start()
    try:
        yield w, live, server.port
    finally:
        server.shutdown()
        server.server_close()
        live.stop()
        assert live.error is None


@pytest.mark.kafka
def test_pods_and_prefix_answer_from_the_live_state(served, kafka_bootstrap):
    w, live, port = served
    wait_for(lambda: http(port, "/readyz")[0] == 200, 30, "the server to be ready")
    assert http(port, "/healthz") == (200, {"status": "ok"})

    status, doc = http(port, "/pods")
    assert status == 200 and doc["ready"] is True
    assert strip(doc["pods"]) == expected_pods(kafka_bootstrap, w.topic)
    by = {(p["pod"], p["dp_rank"]): p for p in doc["pods"]}
    assert by[("pod-a", 0)]["blocks_by_medium"] == {"GPU": 4, "CPU": 1}
    assert by[("pod-b", 0)]["uncertain"] is True and by[("pod-a", 0)]["uncertain"] is False
    assert by[("pod-a", 0)]["last_seq"] == 1 and by[("pod-a", 0)]["epoch"] == 7
    for p in doc["pods"]:  # seconds since the stream's last record (timestamped AGE_S ago)
        assert AGE_S - 5 <= p["staleness_s"] <= AGE_S + 120, p

    query = ",".join(str(k) for k in [*K[:3], key64(DIGEST)])
    status, doc = http(port, f"/prefix?hashes={query}")
    assert status == 200 and doc["query_blocks"] == 4
    ranked = [(m["pod"], m["dp_rank"], m["prefix_blocks"]) for m in doc["matches"]]
    assert ranked == [("pod-a", 0, 3), ("pod-b", 0, 2), ("pod-a", 1, 1)]
    status, doc = http(port, f"/prefix?hashes={query}&medium=CPU")
    ranked = [(m["pod"], m["dp_rank"], m["prefix_blocks"]) for m in doc["matches"]]
    assert ranked == [("pod-b", 0, 2), ("pod-a", 0, 0), ("pod-a", 1, 0)]
    body = json.dumps({"hashes": ["0x" + h.hex() for h in H[:2]], "medium": "GPU"}).encode()
    status, doc = http(port, "/prefix", body)
    assert status == 200
    assert [(m["pod"], m["prefix_blocks"]) for m in doc["matches"]][:2] == [
        ("pod-a", 2),
        ("pod-a", 1),
    ]

    # The state follows the topic: a remove shortens pod-a's prefix, fresh records are not stale.
    w.send("pod-a", 0, BlockRemoved([H[1]], medium="GPU"))
    w.flush()

    def pod_a_prefix() -> int:
        _, doc = http(port, f"/prefix?hashes={query}")
        return next(m["prefix_blocks"] for m in doc["matches"] if m["pod"] == "pod-a")

    wait_for(lambda: pod_a_prefix() == 1, 30, "the remove to be applied")
    _, doc = http(port, "/pods")
    assert strip(doc["pods"]) == expected_pods(kafka_bootstrap, w.topic)
    by = {(p["pod"], p["dp_rank"]): p for p in doc["pods"]}
    assert by[("pod-a", 0)]["staleness_s"] < AGE_S - 5


@pytest.mark.kafka
def test_bad_requests_get_400_with_a_message(served):
    _, _, port = served
    for path, body, status, message in [
        ("/prefix", None, 400, "no block hashes given"),
        ("/prefix?hashes=1,zz", None, 400, "'zz' is not a block hash"),
        ("/prefix?hashes=1&tier=GPU", None, 400, "unknown parameter(s) ['tier']"),
        ("/pods?pod=a", None, 400, "/pods takes no parameters"),
        ("/prefix", b"{not json", 400, "body is not JSON"),
        ("/prefix", b'{"hashes": 5}', 400, '"hashes" must be a list'),
        ("/prefix?hashes=1", b'{"hashes": [1]}', 400, "in the JSON body"),
        ("/pods", b"{}", 405, "answers GET only"),
        ("/nowhere", None, 404, "no such path '/nowhere'"),
    ]:
        got, doc = http(port, path, body)
        assert got == status, (path, doc)
        assert message in doc["error"], (path, doc)


@pytest.mark.kafka
def test_cli_serves_after_bootstrapping_from_the_state_topic(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=2)
    state_topic = f"{topic}-state"
    w = Writer(kafka_bootstrap, topic)
    write_fleet(w)
    sync = run_cli(
        ["state-sync", "--bootstrap-servers", kafka_bootstrap, "--topic", topic]
        + ["--state-topic", state_topic, "--until-caught-up"]
    )
    assert sync.returncode == 0, sync.stderr
    w.send("pod-b", 0, BlockRemoved([H[0]], medium="CPU"))  # after the snapshot
    w.flush()
    # Without --serve: the state once caught up, printed as JSON.
    once = run_cli(
        ["state", "--bootstrap-servers", kafka_bootstrap, "--topic", topic]
        + ["--state-topic", state_topic]
    )
    assert once.returncode == 0, once.stderr
    assert strip(json.loads(once.stdout)["pods"]) == expected_pods(kafka_bootstrap, topic)
    assert f"loaded {state_topic}: 3 streams" in once.stderr

    port = free_port_block(1)
    args = f"state --serve --port {port} --bootstrap-servers {kafka_bootstrap} --topic {topic}"
    proc = Proc([*args.split(), "--state-topic", state_topic], tmp_path / "serve.log")
    try:

        def ready() -> bool:
            assert proc.alive(), proc.output()
            try:
                return http(port, "/readyz")[0] == 200
            except OSError:
                return False

        wait_for(ready, 60, "kvbridge state --serve to be ready")
        assert f"loaded {state_topic}: 3 streams" in proc.output()
        _, doc = http(port, "/pods")
        assert strip(doc["pods"]) == expected_pods(kafka_bootstrap, topic)
        by = {(p["pod"], p["dp_rank"]): p for p in doc["pods"]}
        assert by[("pod-b", 0)]["blocks"] == 2  # snapshot (3) + the remove tailed after it
        # Staleness survives the bootstrap: it comes from kv-state's stream records.
        assert by[("pod-a", 1)]["staleness_s"] >= AGE_S - 5
        _, doc = http(port, f"/prefix?hashes={K[0]},{K[1]}")
        assert doc["matches"][0] == {
            "pod": "pod-a",
            "dp_rank": 0,
            "model": "model-pod-a",
            "prefix_blocks": 2,
            "uncertain": False,
            "staleness_s": doc["matches"][0]["staleness_s"],
        }
    finally:
        code = proc.stop()
    assert code == 0, proc.output()


@pytest.mark.kafka
def test_partitions_added_while_serving_are_read_from_their_beginning(
    kafka_bootstrap, kafka_admin, make_topic
):
    from test_statesync_partitions import add_partitions, pod_in, produce

    topic = make_topic(partitions=1)
    first = pod_in(0, 1)
    produce(kafka_bootstrap, topic, first, range(6))
    live = LiveState(kafka_bootstrap, topic, partition_check_interval=0.2)
    live.start()
    try:
        wait_for(live.ready.is_set, 30, "the state to catch up")
        add_partitions(kafka_admin, topic, 2)
        late = pod_in(1, 2)
        assert produce(kafka_bootstrap, topic, late, range(4)) == {1}  # the new partition

        def both() -> bool:
            with live.lock:
                return {k[0] for k in live.state.streams} == {first, late}

        wait_for(both, 30, "the pod of the added partition in the served state")
        with live.lock:
            served = strip(pods_view(live.state, live.last_ts_ms, 0)["pods"])
        assert served == strip(expected_pods(kafka_bootstrap, topic))
    finally:
        live.stop()
    assert live.error is None
