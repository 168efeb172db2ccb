"""Schema Registry support: Confluent wire-format framing, registration, reading both framings.

No real Schema Registry can run here (Confluent's server is not on Maven Central or PyPI, and
Apicurio's Central artifacts are incomplete), so:
- the framing is checked against confluent-kafka's own ``AvroSerializer``/``AvroDeserializer``
  backed by the library's ``MockSchemaRegistryClient``;
- the HTTP path (registration, BACKWARD, lookups by id, refusals, an unreachable registry) runs
  the real ``SchemaRegistryClient`` against ``FakeRegistry`` below, a small stand-in serving the
  Schema Registry REST endpoints kvbridge uses; its compatibility rule is a stub (it refuses
  what a test tells it to), so it checks kvbridge's handling, not Avro compatibility itself.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from bridge_util import running_bridge
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from e2e_util import Proc, free_port_block, read_json, read_jsonl, run_cli, wait_for

from bridge.cli.commands import build_parser
from bridge.cli.run import resolve_run_config
from bridge.log.markers import EventsLost, StreamStarted
from bridge.log.records import Envelope, RecordCodec, RecordError, event_to_avro, schema_dir
from bridge.log.registry import (
    RegistryError,
    SchemaRegistry,
    confluent_header,
    reader_codec,
    subject_for,
    writer_codec,
)
from bridge.log.sink import ensure_topic
from bridge.ops.config import PodConfig
from bridge.vllm.events import BlockRemoved, BlockStored

try:  # the library's in-memory mock client (its module moved between releases)
    from confluent_kafka.schema_registry._sync.mock_schema_registry_client import (
        MockSchemaRegistryClient,
    )
except ImportError:
    from confluent_kafka.schema_registry.mock_schema_registry_client import (
        MockSchemaRegistryClient,
    )

SCHEMA = json.loads((schema_dir() / "kv_event.avsc").read_text())
SCHEMA_TEXT = json.dumps(SCHEMA)


class MockClient(MockSchemaRegistryClient):
    """The library's mock, plus the per-subject compatibility it does not keep."""

    def __init__(self) -> None:
        super().__init__({"url": "mock://kvbridge"})
        self.levels: dict[str, str] = {}

    def set_compatibility(self, subject_name: str | None = None, level: str | None = None) -> str:
        self.levels[str(subject_name)] = str(level)
        return str(level)


def sample() -> list[tuple[Envelope, Any]]:
    env = Envelope("pod-a", "llama", 1, 77, 5, 0, 1700000000.25, {"k": b"\x01\x02"})
    stored = BlockStored(
        block_hashes=[b"\x00" * 7 + b"\x01", b"\xab" * 32],
        parent_block_hash=b"\x09" * 8,
        token_ids=list(range(16)),
        block_size=16,
        lora_id=None,
        medium="GPU",
    )
    return [
        (env, stored),
        (Envelope("pod-a", "llama", 1, 77, 5, 1, 1.5), BlockRemoved([b"\x03" * 8], "CPU")),
        (Envelope("pod-b", "m", 0, 9, 0, -1, 2.0), StreamStarted(0, "tcp://10.0.0.5:5557")),
        (Envelope("pod-b", "m", 0, 9, 3, -1, 2.0), EventsLost(1, 2, "evicted")),
    ]


def datum(env: Envelope, event: Any) -> dict[str, Any]:
    return {
        "pod": env.pod,
        "model": env.model,
        "dp_rank": env.dp_rank,
        "epoch": env.epoch,
        "seq": env.seq,
        "index": env.index,
        "ts": env.ts,
        "batch_extra": env.batch_extra,
        "event": event_to_avro(event),
        "part": env.part,
        "parts": env.parts,
    }


# --------------------------------------------------------------------------- framing


def test_header_is_magic_zero_and_big_endian_id() -> None:
    assert confluent_header(1) == b"\x00\x00\x00\x00\x01"
    assert confluent_header(0x01020304) == b"\x00\x01\x02\x03\x04"
    assert subject_for("kv-events") == "kv-events-value"
    with pytest.raises(ValueError):
        confluent_header(1 << 32)


def test_our_values_read_by_confluent_avro_deserializer() -> None:
    client = MockClient()
    codec = writer_codec("mock://kvbridge", "kv-events", client=client)
    assert client.levels == {"kv-events-value": "BACKWARD"}
    schema_id = client.get_latest_version("kv-events-value").schema_id
    assert codec.header == b"\x00" + schema_id.to_bytes(4, "big")
    deser = AvroDeserializer(client, return_record_name=True)
    ctx = SerializationContext("kv-events", MessageField.VALUE)
    for env, event in sample():
        value = codec.encode(env, event)
        assert value[:5] == codec.header
        got = deser(value, ctx)
        want = datum(env, event)
        name, body = got.pop("event")
        assert name == want["event"][0]
        assert {k: v for k, v in want.items() if k != "event"} == got
        assert all(body[k] == v for k, v in want["event"][1].items())


def test_confluent_avro_serializer_values_read_by_kvbridge() -> None:
    client = MockClient()
    ser = AvroSerializer(client, SCHEMA_TEXT)
    ctx = SerializationContext("kv-events", MessageField.VALUE)
    reader = reader_codec("mock://kvbridge", client=client)
    ours = writer_codec("mock://kvbridge", "kv-events", client=client)
    for env, event in sample():
        value = ser(datum(env, event), ctx)
        assert value[0] == 0  # Confluent framing, written by the library itself
        assert value == ours.encode(env, event)  # byte for byte what the bridge writes
        rec = reader.decode(value)
        assert rec.envelope == env
        assert rec.event == event


def test_reader_takes_both_framings_and_says_what_is_missing() -> None:
    client = MockClient()
    confluent = writer_codec("mock://kvbridge", "kv-events", client=client)
    single = RecordCodec()
    env, event = sample()[0]
    both = reader_codec("mock://kvbridge", client=client)
    for value in (confluent.encode(env, event), single.encode(env, event)):
        assert both.decode(value).event == event
    # No registry configured: single-object still read; a Confluent value says what to pass.
    plain = reader_codec(None)
    assert plain.decode(single.encode(env, event)).event == event
    with pytest.raises(RecordError, match="--schema-registry-url"):
        plain.decode(confluent.encode(env, event))
    # The bridge decodes its own values (acks, refusals) without asking the registry again.
    assert confluent.decode(confluent.encode(env, event)).event == event
    with pytest.raises(RecordError, match="schema id 424242"):
        both.decode(b"\x00" + (424242).to_bytes(4, "big") + b"\x00")
    with pytest.raises(RecordError, match="neither"):
        both.decode(b"\x07garbage")


# --------------------------------------------------------------------------- over HTTP


class FakeRegistry:
    """The Schema Registry REST endpoints kvbridge uses, in memory (see the module docstring)."""

    def __init__(self) -> None:
        self.schemas: dict[int, str] = {}
        self.subjects: dict[str, list[int]] = {}
        self.config: dict[str, str] = {}
        self.refuse: set[str] = set()  # subjects whose next new schema is "incompatible"
        self.requests: list[str] = []
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, code: int, body: dict[str, Any]) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _body(self) -> dict[str, Any]:
                return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

            def do_PUT(self) -> None:  # noqa: N802
                registry.requests.append(f"PUT {self.path}")
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[0] == "config" and len(parts) == 2:
                    registry.config[parts[1]] = self._body()["compatibility"]
                    return self._reply(200, {"compatibility": registry.config[parts[1]]})
                self._reply(404, {"error_code": 404, "message": "not found"})

            def do_POST(self) -> None:  # noqa: N802
                registry.requests.append(f"POST {self.path}")
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[0] != "subjects" or parts[2:] != ["versions"]:
                    return self._reply(404, {"error_code": 404, "message": "not found"})
                subject, text = parts[1], self._body()["schema"]
                versions = registry.subjects.setdefault(subject, [])
                for sid in versions:
                    if registry.schemas[sid] == text:
                        return self._reply(200, {"id": sid})
                if versions and subject in registry.refuse:
                    msg = "Schema being registered is incompatible with an earlier schema"
                    return self._reply(409, {"error_code": 409, "message": msg})
                sid = next((i for i, t in registry.schemas.items() if t == text), None)
                if sid is None:
                    sid = len(registry.schemas) + 1
                    registry.schemas[sid] = text
                versions.append(sid)
                self._reply(200, {"id": sid})

            def do_GET(self) -> None:  # noqa: N802
                registry.requests.append(f"GET {self.path}")
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:2] == ["schemas", "ids"] and int(parts[2]) in registry.schemas:
                    return self._reply(200, {"schema": registry.schemas[int(parts[2])]})
                self._reply(404, {"error_code": 40403, "message": "Schema not found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_registry() -> Iterator[FakeRegistry]:
    reg = FakeRegistry()
    yield reg
    reg.close()


def test_registers_subject_with_backward_over_http(fake_registry: FakeRegistry) -> None:
    codec = writer_codec(fake_registry.url, "orders")
    assert fake_registry.config == {"orders-value": "BACKWARD"}
    assert fake_registry.subjects == {"orders-value": [1]}
    assert codec.header == confluent_header(1)
    # Idempotent: a restart registers the same schema and gets the same id.
    assert writer_codec(fake_registry.url, "orders").header == codec.header
    assert fake_registry.subjects == {"orders-value": [1]}
    # A reader fetches the writer schema by id once, then uses its cache.
    reader = reader_codec(fake_registry.url)
    env, event = sample()[0]
    for _ in range(3):
        assert reader.decode(codec.encode(env, event)).event == event
    assert fake_registry.requests.count("GET /schemas/ids/1") == 1
    # The real client's own deserializer agrees on the framing over HTTP too.
    client = SchemaRegistryClient({"url": fake_registry.url})
    got = AvroDeserializer(client)(codec.encode(env, event), None)
    assert got["pod"] == env.pod and got["seq"] == env.seq


def test_incompatible_schema_is_refused_with_a_clear_error(fake_registry: FakeRegistry) -> None:
    writer_codec(fake_registry.url, "orders")
    fake_registry.refuse.add("orders-value")
    changed = copy.deepcopy(SCHEMA)
    changed["fields"] = [f for f in changed["fields"] if f["name"] != "ts"]
    with pytest.raises(RegistryError) as info:
        SchemaRegistry(fake_registry.url).register("orders", changed)
    msg = str(info.value)
    assert "orders-value" in msg and "BACKWARD" in msg and "incompatible" in msg
    assert "new topic" in msg


def test_unreachable_registry_says_what_to_check() -> None:
    port = free_port_block(1)  # nothing listens there
    with pytest.raises(RegistryError, match="unreachable.*--schema-registry-url"):
        writer_codec(f"http://127.0.0.1:{port}", "orders")
    with pytest.raises(RegistryError, match="Unrecognized properties"):
        SchemaRegistry("http://127.0.0.1:1", {"no.such.property": "x"})
    # A reader counts the record as unreadable (RecordError) instead of failing.
    reader = reader_codec(f"http://127.0.0.1:{port}", {"max.retries": "0"})
    with pytest.raises(RecordError, match="unreachable"):
        reader.decode(confluent_header(1) + b"\x00")


def test_failed_lookup_is_not_retried_for_every_record(fake_registry: FakeRegistry) -> None:
    reader = reader_codec(fake_registry.url)
    for _ in range(3):
        with pytest.raises(RecordError, match="schema id 99"):
            reader.decode(confluent_header(99) + b"\x00")
    assert fake_registry.requests.count("GET /schemas/ids/99") == 1


def test_settings_from_flag_env_and_file(tmp_path: Any) -> None:
    f = tmp_path / "kv.toml"
    f.write_text(
        'schema_registry_url = "http://file:8081"\n'
        '[schema_registry]\n"basic.auth.user.info" = "u:p"\n'
    )
    pod = ["--pod", "name=a,model=m,pub=tcp://127.0.0.1:5557"]

    def cfg(argv: list[str], env: dict[str, str]) -> Any:
        return resolve_run_config(build_parser().parse_args(["run", *pod, *argv]), env)

    assert cfg([], {}).schema_registry_url is None
    c = cfg(["--config", str(f)], {})
    assert c.schema_registry_url == "http://file:8081"
    assert c.schema_registry == {"basic.auth.user.info": "u:p"}
    env = {"KVBRIDGE_SCHEMA_REGISTRY_URL": "http://env:8081"}
    assert cfg(["--config", str(f)], env).schema_registry_url == "http://env:8081"
    c = cfg(
        [
            "--config",
            str(f),
            "--schema-registry-url",
            "http://flag:8081",
            "--schema-registry-property",
            "basic.auth.user.info=x:y",
        ],
        env,
    )
    assert c.schema_registry_url == "http://flag:8081"
    assert c.schema_registry == {"basic.auth.user.info": "x:y"}
    for sub in ("consume", "replay", "check"):
        args = build_parser().parse_args([sub, "--schema-registry-url", "http://r:8081"])
        assert args.schema_registry_url == "http://r:8081"


# --------------------------------------------------------------------------- end to end


def raw_values(bootstrap: str, topic: str) -> list[bytes]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "raw", "enable.auto.commit": False})
    try:
        _, hi = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        c.assign([TopicPartition(topic, 0, 0)])
        out: list[bytes] = []
        while len(out) < hi:
            msg = c.poll(5)
            assert msg is not None, "records missing"
            if msg.error() is None:
                out.append(msg.value())
        return out
    finally:
        c.close()


def test_bridge_writes_confluent_framing_and_consume_reads_it(
    kafka_bootstrap: str, fake_registry: FakeRegistry, tmp_path: Any
) -> None:
    topic = f"sr-{tmp_path.name[-12:]}".replace("_", "-")
    ensure_topic(kafka_bootstrap, topic, partitions=1)
    sent_log, endpoints = tmp_path / "sent.jsonl", tmp_path / "endpoints.json"
    base = free_port_block(2)
    args = f"simulate --pods 1 --name pod --base-port {base} --rate 200 --batches 20 --seed 3"
    args += f" --sent-log {sent_log} --endpoints-file {endpoints}"
    sim = Proc(args.split(), tmp_path / "sim.log")
    try:
        p = wait_for(lambda: read_json(endpoints), 30, "simulator endpoints")[0]
        pod = PodConfig(p["name"], p["model"], p["pub"], p["replay"])
        with running_bridge(
            kafka_bootstrap, topic, [pod], schema_registry_url=fake_registry.url
        ) as bridge:
            wait_for(lambda: len(read_jsonl(sent_log)) >= 20, 60, "simulator to finish")
            n_events = sum(len(b.get("events", [])) for b in read_jsonl(sent_log))
            assert n_events > 0
            want = n_events + 1  # and the StreamStarted marker
            wait_for(
                lambda: len(raw_values(kafka_bootstrap, topic)) >= want, 60, "records in Kafka"
            )
            assert bridge.codec.header == confluent_header(1)
    finally:
        sim.stop()
    assert fake_registry.config == {f"{topic}-value": "BACKWARD"}
    assert fake_registry.subjects == {f"{topic}-value": [1]}
    values = raw_values(kafka_bootstrap, topic)
    assert values and all(v[:5] == confluent_header(1) for v in values)

    common = ["--bootstrap-servers", kafka_bootstrap, "--topic", topic]
    res = run_cli(["consume", *common, "--schema-registry-url", fake_registry.url])
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(lines) == len(values)
    assert sum(line["index"] >= 0 for line in lines) == n_events
    assert lines[0]["type"] == "StreamStarted"
    res = run_cli(["check", *common, "--schema-registry-url", fake_registry.url])
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("OK"), res.stdout

    # Without the registry URL the records are skipped with a message saying what to pass.
    res = run_cli(["consume", *common])
    assert res.stdout.strip() == ""
    assert "--schema-registry-url" in res.stderr


def test_topic_template_registers_a_subject_per_topic(
    kafka_bootstrap: str, fake_registry: FakeRegistry, tmp_path: Any
) -> None:
    base = f"srt-{tmp_path.name[-10:]}".replace("_", "-")
    pods = [
        PodConfig("a", "llama", "tcp://127.0.0.1:1"),
        PodConfig("b", "qwen", "tcp://127.0.0.1:2"),
    ]
    with running_bridge(
        kafka_bootstrap, base + ".{model}", pods, schema_registry_url=fake_registry.url
    ) as bridge:
        assert bridge.codec.header == confluent_header(1)
    assert fake_registry.subjects == {
        f"{base}-value": [1],
        f"{base}.llama-value": [1],
        f"{base}.qwen-value": [1],
    }
    assert all(fake_registry.config[s] == "BACKWARD" for s in fake_registry.subjects)
