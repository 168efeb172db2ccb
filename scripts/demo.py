"""Demo driver (run by scripts/demo.sh once a broker is up): pods -> bridge -> Kafka -> state."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from bridge.consume.reader import TopicReader

TOPIC = "kv-events"
BATCHES = 300


def kvbridge(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bridge", *args], **kw)


def free_base_port(n: int) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap-servers", required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    a = ap.parse_args()
    work, bootstrap = a.workdir, a.bootstrap_servers
    sent_log, pods_file = work / "sent.jsonl", work / "pods.json"
    print(f"== 3 simulated vLLM pods (0.9.0, 0.23.0, 0.33.0), {BATCHES} batches each, 5% dropped")
    sim = kvbridge(
        "simulate",
        "--pods",
        "3",
        "--name",
        "pod",
        "--release",
        "0.9.0,0.23.0,0.33.0",
        "--base-port",
        str(free_base_port(6)),
        "--rate",
        "60",
        "--batches",
        str(BATCHES),
        "--drop-rate",
        "0.05",
        "--clear-prob",
        "0.005",
        "--sent-log",
        str(sent_log),
        "--endpoints-file",
        str(pods_file),
        stdout=subprocess.DEVNULL,
    )
    bridge = None
    try:
        while not pods_file.exists() or not pods_file.read_text().strip().endswith("]"):
            if sim.poll() is not None:
                raise SystemExit("the simulator exited early")
            time.sleep(0.1)
        pods = json.loads(pods_file.read_text())
        args = ["run", "--bootstrap-servers", bootstrap, "--topic", TOPIC, "--metrics-port", "0"]
        for p in pods:
            args += [
                "--pod",
                f"name={p['name']},model={p['model']},pub={p['pub']},replay={p['replay']}",
            ]
        print("== kvbridge " + " ".join(args))
        bridge_log = open(work / "bridge.log", "w")  # noqa: SIM115
        bridge = kvbridge(*args, stderr=bridge_log)

        def sent() -> list[dict]:
            return [json.loads(x) for x in sent_log.read_text().splitlines() if x.endswith("}")]

        def in_kafka() -> int:
            with TopicReader(bootstrap, TOPIC) as r:
                try:
                    return sum(1 for c in r.read() if c.record.envelope.index >= 0)
                except RuntimeError:  # the bridge has not created the topic yet
                    return 0

        while True:
            batches = sent() if sent_log.exists() else []
            want = sum(len(b["events"]) for b in batches if b["sent"] != "lost")
            have = in_kafka()
            print(
                f"   sent {len(batches):4d}/{3 * BATCHES} batches, {want:5d} events; "
                f"{have:5d} events in Kafka",
                flush=True,
            )
            if len(batches) >= 3 * BATCHES and have >= want:
                break
            if bridge.poll() is not None:
                raise SystemExit(f"the bridge exited; see {work / 'bridge.log'}")
            time.sleep(1.0)
        dropped = Counter(b["pod"] for b in batches if b["sent"] == "dropped")
        bridge.send_signal(signal.SIGTERM)
        bridge.wait(30)
        log = (work / "bridge.log").read_text()
        print(
            f"== live messages dropped by the pods: {dict(dropped)}; bridge replays: "
            f"{log.count('replay from seq')}"
        )
        print("== kvbridge consume --max 3")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bridge",
                "consume",
                "--bootstrap-servers",
                bootstrap,
                "--topic",
                TOPIC,
                "--max",
                "3",
            ],
            check=True,
        )
        print("== kvbridge replay   (the cache state rebuilt from the topic)")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bridge",
                "replay",
                "--bootstrap-servers",
                bootstrap,
                "--topic",
                TOPIC,
            ],
            check=True,
        )
        return 0
    finally:
        for p in (bridge, sim):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(30)


if __name__ == "__main__":
    sys.exit(main())
