"""The naive baseline: the obvious loop a router team would write first.

One SUB socket per pod; for each message: ``msgpack.unpackb`` the batch, build one dict per
event for the same Avro schema the bridge writes, ``fastavro.schemaless_writer`` it, and
``Producer.produce`` it keyed by pod, with librdkafka's default settings; ``flush()`` at the
end. What it leaves out is what makes the bridge a bridge: no sequence checking, no replay,
no restart detection, no markers, unknown fields dropped, no idempotent producer, no
metrics, no backpressure beyond retrying a full local queue.

Run by the benchmark as ``python -m bench.naive --bootstrap-servers HOST:PORT --topic T
--pods-file pods.json --batches N``: it prints ``READY`` once every SUB is connected, stops
after every pod's batch ``N - 1``, flushes, prints a JSON summary line and waits for EOF on
stdin before exiting (so its /proc entry can still be read).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from typing import Any

import msgpack
import zmq
from confluent_kafka import Producer
from fastavro import parse_schema, schemaless_writer

from bridge.log.records import RecordCodec, schema_dir

NS = "io.kvbridge.v1."
STORED = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
]
REMOVED = ["block_hashes", "medium", "group_idx", "locality", "ownership"]
MASK64 = (1 << 64) - 1


def to_hash(h: int | bytes) -> bytes:
    return (h & MASK64).to_bytes(8, "big") if isinstance(h, int) else h


def event_datum(ev: Any) -> tuple[str, dict[str, Any]]:
    """The Avro union branch for one msgpack event (array or map form)."""
    if isinstance(ev, dict):
        tag, fields = ev["type"], ev
    else:
        tag = ev[0]
        names = STORED if tag == "BlockStored" else REMOVED
        fields = dict(zip(names, ev[1:], strict=False))
    if tag == "BlockStored":
        d = {name: fields.get(name) for name in STORED}
        d["block_hashes"] = [to_hash(h) for h in d["block_hashes"]]
        if d["parent_block_hash"] is not None:
            d["parent_block_hash"] = to_hash(d["parent_block_hash"])
        if d["extra_keys"] is not None:
            d["extra_keys"] = [None if k is None else msgpack.packb(k) for k in d["extra_keys"]]
        return NS + "BlockStored", d
    if tag == "BlockRemoved":
        d = {name: fields.get(name) for name in REMOVED}
        d["block_hashes"] = [to_hash(h) for h in d["block_hashes"]]
        return NS + "BlockRemoved", d
    return NS + "AllBlocksCleared", {}


def run(bootstrap: str, topic: str, pods: list[dict[str, str]], batches: int) -> dict[str, Any]:
    schema = parse_schema(json.loads((schema_dir() / "kv_event.avsc").read_text()))
    header = RecordCodec().header  # same single-object header, so records read back the same
    producer = Producer({"bootstrap.servers": bootstrap})
    failed = 0

    def on_delivery(err: Any, msg: Any) -> None:
        nonlocal failed
        if err is not None:
            failed += 1

    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 4 * len(pods) + 64)  # a SUB and a monitor pair per pod
    poller = zmq.Poller()
    socks: dict[zmq.Socket, tuple[str, bytes]] = {}
    monitors = []
    for pod in pods:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitors.append(sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
        sub.connect(pod["pub"])
        socks[sub] = (pod["name"], pod["name"].encode())
        poller.register(sub, zmq.POLLIN)
    for mon in monitors:  # set-up, not part of the loop: wait until every SUB is connected
        mon.recv_multipart()
    for sub in socks:
        sub.disable_monitor()
    for mon in monitors:
        mon.close(linger=0)
    print("READY", flush=True)

    epoch = int(time.time() * 1000)
    last = {name: -1 for name, _ in socks.values()}
    pending = len(last)
    received = events = 0
    t_first = 0.0
    while pending:
        for sock, _ in poller.poll(100):
            _topic, seq_frame, payload = sock.recv_multipart()
            if not received:
                t_first = time.time()
            received += 1
            name, key = socks[sock]
            seq = int.from_bytes(seq_frame, "big")
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            ts, evs = batch[0], batch[1]
            dp_rank = batch[2] if len(batch) > 2 else 0
            for index, ev in enumerate(evs):
                datum = {
                    "pod": name,
                    "model": "bench-model",
                    "dp_rank": dp_rank,
                    "epoch": epoch,
                    "seq": seq,
                    "index": index,
                    "ts": ts,
                    "batch_extra": {},
                    "event": event_datum(ev),
                }
                buf = io.BytesIO()
                buf.write(header)
                schemaless_writer(buf, schema, datum)
                while True:
                    try:
                        producer.produce(topic, buf.getvalue(), key, on_delivery=on_delivery)
                        break
                    except BufferError:  # local queue full: wait for deliveries
                        producer.poll(0.1)
                events += 1
            producer.poll(0)
            if seq == batches - 1 and last[name] < seq:
                pending -= 1
            last[name] = max(last[name], seq)
    left = producer.flush(60)
    t_done = time.time()
    for sock in socks:
        sock.close(linger=0)
    ctx.term()
    return {
        "batches": received,
        "events": events,
        "not_delivered": left + failed,
        "t_first": t_first,
        "t_done": t_done,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.naive", description=__doc__.split("\n")[0])
    p.add_argument("--bootstrap-servers", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--pods-file", required=True, help="JSON list of {name, pub}")
    p.add_argument("--batches", type=int, required=True, help="batches per pod (seq 0..N-1)")
    args = p.parse_args(argv)
    with open(args.pods_file, encoding="utf-8") as f:
        pods = json.load(f)
    summary = run(args.bootstrap_servers, args.topic, pods, args.batches)
    print(json.dumps(summary), flush=True)
    sys.stdin.read()  # the harness reads /proc, then closes our stdin
    return 0


if __name__ == "__main__":
    sys.exit(main())
