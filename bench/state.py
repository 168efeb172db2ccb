"""Benchmark of the consumer side: replaying a kv-events topic into :class:`CacheState`.

    python -m bench.state [--events 1000000] [--bootstrap HOST:PORT]

1. Writes a topic of N realistic records: the simulator's prefix-cache model for a fleet of
   pods (bench/workload.py: ~80% BlockRemoved, ~20% BlockStored of ~5 blocks, a clear per
   ~1,000 steps), decoded by the bridge's decoder and encoded by its RecordCodec exactly as
   the bridge writes them (one StreamStarted marker per pod first), keyed by pod.
2. Reads it back three ways and times each: read + decode only (TopicReader), read + decode
   + apply (CacheState), and the apply calls alone (records/s applied).
3. Measures memory per resident block with tracemalloc: a CacheState filled with a known
   number of blocks (vLLM's default 8-byte integer hashes, and 32-byte digests), stored in
   batches with parent links as vLLM does, per stream.

Prints a table and writes JSON to bench/results/state-<UTC timestamp>.json (and --out FILE).
Without --bootstrap a private single-node broker is started (tests/kafka_broker.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
import tracemalloc
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from bench.kafka import broker, new_topic
from bench.workload import WorkloadConfig, pod_payloads
from bridge.consume.reader import TopicReader
from bridge.consume.state import CacheState
from bridge.log.markers import StreamStarted
from bridge.log.records import Envelope, Record, RecordCodec
from bridge.vllm.decoder import decode_batch
from bridge.vllm.events import BlockStored

RESULTS_DIR = Path(__file__).resolve().parent / "results"
EPOCH = 1_767_225_600_000


def produce_topic(bootstrap: str, topic: str, events: int, pods: int, seed: int) -> dict[str, Any]:
    """Write ``events`` records (markers included) round-robin over ``pods`` pods."""
    config = WorkloadConfig(pods=pods, batches_per_pod=10**9, seed=seed)
    names = config.pod_names()
    streams = [pod_payloads(config, i) for i in range(pods)]
    seqs = [0] * pods
    codec = RecordCodec()
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "compression.type": "lz4",
            "enable.idempotence": True,
            "queue.buffering.max.messages": 1_000_000,
        }
    )
    n = 0
    value_bytes = 0
    by_type: dict[str, int] = {}
    t0 = time.perf_counter()

    def send(pod: str, value: bytes) -> None:
        nonlocal n, value_bytes
        while True:
            try:
                producer.produce(topic, value, key=pod)
                break
            except BufferError:
                producer.poll(0.1)
        n += 1
        value_bytes += len(value)
        if n % 10_000 == 0:
            producer.poll(0)

    for pod in names[: min(pods, events)]:
        env = Envelope(pod, config.model, 0, EPOCH, 0, -1, 0.0)
        send(pod, codec.encode(env, StreamStarted(0, f"tcp://{pod}:5557")))
        by_type["StreamStarted"] = by_type.get("StreamStarted", 0) + 1
    i = 0
    while n < events:
        batch = decode_batch(next(streams[i]))
        for index, ev in enumerate(batch.events):
            if n >= events:
                break
            env = Envelope(names[i], config.model, 0, EPOCH, seqs[i], index, batch.ts)
            send(names[i], codec.encode(env, ev))
            by_type[type(ev).__name__] = by_type.get(type(ev).__name__, 0) + 1
        seqs[i] += 1
        i = (i + 1) % pods
    left = producer.flush(120)
    if left:
        raise RuntimeError(f"{left} records not acknowledged by the broker")
    return {
        "records": n,
        "value_bytes_mean": round(value_bytes / max(n, 1), 1),
        "by_type": dict(sorted(by_type.items())),
        "produce_s": round(time.perf_counter() - t0, 2),
    }


def time_read(bootstrap: str, topic: str) -> dict[str, Any]:
    """Read + decode every record, nothing else."""
    t0 = time.perf_counter()
    n = 0
    with TopicReader(bootstrap, topic) as reader:
        for _ in reader.read():
            n += 1
    dt = time.perf_counter() - t0
    return {"records": n, "seconds": round(dt, 3), "records_per_s": round(n / dt)}


def time_replay(bootstrap: str, topic: str) -> tuple[dict[str, Any], CacheState]:
    """Read + decode + apply, timing the apply calls on their own too."""
    state = CacheState()
    apply = state.apply
    clock = time.perf_counter
    t0 = clock()
    in_apply = 0.0
    n = 0
    with TopicReader(bootstrap, topic) as reader:
        for cr in reader.read():
            a = clock()
            apply(cr.record)
            in_apply += clock() - a
            n += 1
    dt = clock() - t0
    return {
        "records": n,
        "seconds": round(dt, 3),
        "records_per_s": round(n / dt),
        "apply_seconds": round(in_apply, 3),
        "applied_per_s": round(n / in_apply) if in_apply else None,
        "resident_blocks": state.resident_blocks(),
        "streams": len(state.streams),
    }, state


def memory_per_block(blocks: int, hash_bytes: int, streams: int = 16, seed: int = 0) -> dict:
    """tracemalloc bytes held by a CacheState with ``blocks`` resident blocks (divided)."""
    rng = random.Random(seed)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    state = CacheState()
    per_stream = blocks // streams
    for s in range(streams):
        parent = None
        seq = 0
        left = per_stream
        while left:
            k = min(left, rng.randint(1, 9))
            hashes = [rng.randbytes(hash_bytes) for _ in range(k)]
            ev = BlockStored(hashes, parent, [], 16, medium="GPU", group_idx=0)
            state.apply(Record(Envelope(f"pod-{s}", "m", 0, 1, seq, 0, 0.0), ev))
            # A decoded record's parent is its own bytes object, as here.
            parent = bytes(bytearray(hashes[-1])) if rng.random() < 0.7 else None
            seq += 1
            left -= k
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    n = state.resident_blocks()
    return {
        "hash_bytes": hash_bytes,
        "resident_blocks": n,
        "traced_bytes": used,
        "bytes_per_block": round(used / n, 1),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.state",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--events", type=int, default=1_000_000, help="records in the topic (1M)")
    p.add_argument("--pods", type=int, default=16, help="pods writing them (16)")
    p.add_argument("--partitions", type=int, default=6, help="topic partitions (6)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--memory-blocks",
        type=int,
        default=500_000,
        help="resident blocks for the memory measurement (500k)",
    )
    p.add_argument("--bootstrap", metavar="HOST:PORT", help="use this broker (default: start one)")
    p.add_argument("--results-dir", default=str(RESULTS_DIR), help="where the JSON goes")
    p.add_argument("--out", metavar="FILE", help="also write the JSON results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.events < 1 or args.pods < 1 or args.memory_blocks < 16:
        print("--events and --pods must be >= 1, --memory-blocks >= 16", file=sys.stderr)
        return 2
    started = datetime.now(UTC)
    out: dict[str, Any] = {
        "bench": "state",
        "started": started.isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": {"cpus": _cpus(), "platform": platform.platform()},
        "events": args.events,
        "pods": args.pods,
        "partitions": args.partitions,
    }
    with broker(args.bootstrap) as b:
        topic = new_topic(b.bootstrap, "state", args.partitions)
        print(f"writing {args.events:,} records to {topic} ...", file=sys.stderr)
        out["topic"] = produce_topic(b.bootstrap, topic, args.events, args.pods, args.seed)
        print("reading (decode only) ...", file=sys.stderr)
        out["read_decode"] = time_read(b.bootstrap, topic)
        print("replaying into CacheState ...", file=sys.stderr)
        out["replay"], state = time_replay(b.bootstrap, topic)
        keys = [0] * 32
        t0 = time.perf_counter()
        for _ in range(1000):
            state.prefix_match(keys)
        out["replay"]["prefix_query_us"] = round((time.perf_counter() - t0) * 1000, 2)
        del state
    print("memory per resident block ...", file=sys.stderr)
    out["memory"] = [
        memory_per_block(args.memory_blocks, 8, seed=args.seed),
        memory_per_block(args.memory_blocks, 32, seed=args.seed),
    ]
    print(render(out))
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"state-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    text = json.dumps(out, indent=2) + "\n"
    path.write_text(text)
    if args.out:
        Path(args.out).write_text(text)
    print(f"\nresults: {path}" + (f" and {args.out}" if args.out else ""))
    return 0


def render(r: dict[str, Any]) -> str:
    rd, rp = r["read_decode"], r["replay"]
    lines = [
        f"kv-events replay into CacheState: {r['topic']['records']:,} records, {r['pods']} pods, "
        f"{r['partitions']} partitions, {r['topic']['value_bytes_mean']} B/value "
        f"({', '.join(f'{k}={v:,}' for k, v in r['topic']['by_type'].items())})",
        "",
        f"{'measure':<34} {'value':>14}",
        f"{'read + decode (records/s)':<34} {rd['records_per_s']:>14,}",
        f"{'read + decode + apply (records/s)':<34} {rp['records_per_s']:>14,}",
        f"{'apply alone (records/s)':<34} {rp['applied_per_s'] or 0:>14,}",
        f"{'resident blocks at the end':<34} {rp['resident_blocks']:>14,}",
        f"{'prefix query, 32 keys (us)':<34} {rp['prefix_query_us']:>14}",
    ]
    for m in r["memory"]:
        label = f"memory/block, {m['hash_bytes']}-byte hashes (B)"
        lines.append(f"{label:<34} {m['bytes_per_block']:>14}")
    lines.append(
        f"  (tracemalloc, {r['memory'][0]['resident_blocks']:,} resident blocks, 16 streams)"
    )
    return "\n".join(lines)


def _cpus() -> int:
    import os

    return os.cpu_count() or 1


if __name__ == "__main__":
    sys.exit(main())
