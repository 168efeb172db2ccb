"""Rate-limited pods for the latency runs: the simulator's payloads, cheap to send.

``kvbridge simulate`` steps a prefix-cache model and writes a JSON sent-log line for every
batch, which costs about as much CPU per event as the bridge itself: on a small machine the
simulated pods cannot reach 90% of the bridge's maximum next to it. This feeder sends the
same payloads (:func:`bench.workload.pod_payloads`, generated before the clock starts, a pool
of at most ``--pool`` batches per pod used round-robin), each stamped with the current time
(the batch ``ts``, float64 at a fixed offset), behind the same sockets as vLLM: per pod a PUB
(an XPUB, to see the subscription arrive: same wire) and a replay ROUTER with vLLM's replay
semantics (buffer of the last 10,000 batches, one request served between two sends).

``python -m bench.feeder --workload-json '{...}' --base-port P --rate R`` prints ``READY``
once every pod has a subscriber (then starts), ``DONE <json>`` once every batch is sent, and
keeps serving replays until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import struct
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import zmq

from bench.workload import WorkloadConfig, pod_payloads
from bridge.vllm.framing import (
    FrameError,
    live_frames,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
)
from bridge.vllm.releases import Release

_TS = struct.Struct(">d")
BUFFER_STEPS = 10_000  # vLLM's default replay buffer


def stamp(payload: bytes, ts: float) -> bytes:
    """``payload`` with its batch timestamp replaced (envelope ``[ts, events, ...]``)."""
    if payload[1] != 0xCB:  # array header, then float64 ts: what encode_batch always writes
        raise ValueError("payload does not start with [float64 ts, ...]")
    return payload[:2] + _TS.pack(ts) + payload[10:]


@dataclass
class FeederPod:
    name: str
    release: Release
    pool: list[tuple[bytes, int]]  # (payload, events)
    pub: zmq.Socket
    router: zmq.Socket
    next_seq: int = 0
    events: int = 0
    buffer: deque[tuple[int, bytes]] = field(default_factory=lambda: deque(maxlen=BUFFER_STEPS))

    def send_next(self, topic: bytes) -> None:
        payload, n = self.pool[self.next_seq % len(self.pool)]
        payload = stamp(payload, time.time())
        self.pub.send_multipart(live_frames(topic, self.next_seq, payload))
        self.buffer.append((self.next_seq, payload))
        self.next_seq += 1
        self.events += n

    def serve_replay(self, topic: bytes) -> None:
        frames = self.router.recv_multipart()
        try:
            identity, start = parse_replay_request(frames)
        except FrameError:
            return  # as vLLM: an invalid request gets no reply
        for seq, payload in list(self.buffer):
            if seq >= start:
                frames = replay_reply_frames(self.release, topic, seq, payload)
                self.router.send_multipart([identity, *frames])
        self.router.send_multipart([identity, *replay_end_frames(self.release)])


def run(config: WorkloadConfig, base_port: int, rate: float, pool_size: int, topic: bytes) -> int:
    stop = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    pool_config = replace(config, batches_per_pod=min(pool_size, config.batches_per_pod))
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 2 * config.pods + 64)  # an XPUB and a ROUTER per pod
    poller = zmq.Poller()
    pods: list[FeederPod] = []
    routers: dict[zmq.Socket, FeederPod] = {}
    for i, name in enumerate(config.pod_names()):
        pool = [
            (p, len(msgpack.unpackb(p, raw=False, strict_map_key=False)[1]))
            for p in pod_payloads(pool_config, i)
        ]
        pub = ctx.socket(zmq.XPUB)
        pub.sndhwm = 100_000
        pub.linger = 0
        pub.bind(f"tcp://127.0.0.1:{base_port + 2 * i}")
        router = ctx.socket(zmq.ROUTER)
        router.linger = 0
        router.bind(f"tcp://127.0.0.1:{base_port + 2 * i + 1}")
        pod = FeederPod(name, config.release_of(i), pool, pub, router)
        pods.append(pod)
        routers[router] = pod
        poller.register(router, zmq.POLLIN)
    subscribed: set[str] = set()
    while len(subscribed) < len(pods) and not stop:
        for pod in pods:
            while pod.pub.poll(0):
                if pod.pub.recv()[:1] == b"\x01":
                    subscribed.add(pod.name)
        for sock, _ in poller.poll(20):
            routers[sock].serve_replay(topic)
    print("READY", flush=True)

    total = config.batches_per_pod * len(pods)
    period = 1.0 / (rate * len(pods)) if rate > 0 else 0.0
    sent = 0
    t0 = next_due = time.monotonic()
    while not stop:
        now = time.monotonic()
        burst = 0
        # Everything due is sent now (stamped now), then at least 1 ms of waiting: no spinning.
        while sent < total and now >= next_due and burst < 1000:
            pods[sent % len(pods)].send_next(topic)
            sent += 1
            burst += 1
            next_due += period
            if sent == total:
                summary = {
                    "batches": sent,
                    "events": sum(p.events for p in pods),
                    "seconds": round(time.monotonic() - t0, 3),
                }
                print("DONE " + json.dumps(summary), flush=True)
        if sent >= total:
            wait_ms = 100
        elif period:
            wait_ms = max(1, math.ceil((next_due - time.monotonic()) * 1000))
        else:
            wait_ms = 0
        for sock, _ in poller.poll(wait_ms):
            routers[sock].serve_replay(topic)
    for pod in pods:
        pod.pub.close(linger=0)
        pod.router.close(linger=0)
    ctx.term()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.feeder", description=__doc__.split("\n")[0])
    p.add_argument("--workload-json", required=True, help="WorkloadConfig fields as JSON")
    p.add_argument("--base-port", type=int, required=True, help="pod i: PUB base+2i, ROUTER +1")
    p.add_argument("--rate", type=float, required=True, help="batches/s per pod (0: no limit)")
    p.add_argument("--pool", type=int, default=500, help="distinct batches per pod (500)")
    p.add_argument("--topic", default="kv-events")
    args = p.parse_args(argv)
    raw = json.loads(args.workload_json)
    raw["releases"] = tuple(raw["releases"])
    return run(WorkloadConfig(**raw), args.base_port, args.rate, args.pool, args.topic.encode())


if __name__ == "__main__":
    sys.exit(main())
