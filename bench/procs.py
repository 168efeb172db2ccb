"""Child processes of a run: simulated pods, the bridge, the naive loop; free ports.

Each child's output goes to a log file in the run's work directory; its pid is used for
/proc accounting and for pausing it (SIGSTOP/SIGCONT) while a backlog builds up.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.request import urlopen

from bench import procstat
from bridge.ops import localrun

REPO = Path(__file__).resolve().parent.parent

__all__ = [
    "BridgeProc",
    "FeederProc",
    "NaiveProc",
    "Proc",
    "SimProc",
    "free_port",
    "free_port_block",
    "wait",
]


free_port = localrun.free_port
free_port_block = localrun.free_port_block
wait = localrun.wait_until


class Proc(localrun.ChildProc):
    """A child process with its output in ``log_path``; CPU and memory from /proc."""

    def __init__(self, argv: list[str], log_path: Path, stdin: int | None = None) -> None:
        super().__init__(argv, log_path, cwd=REPO, stdin=stdin)

    def check_alive(self, what: str) -> None:
        if self.p.poll() is not None:
            raise RuntimeError(
                f"{what} exited with code {self.p.returncode}; last output:\n{self.tail()}"
            )

    def cpu(self) -> float:
        return procstat.cpu_seconds(self.pid)

    def memory(self) -> dict[str, int]:
        return procstat.memory_bytes(self.pid)


class SimProc(Proc):
    """`python -m bridge simulate` with a sent-log: counts the batches sent so far."""

    def __init__(self, args: list[str], workdir: Path, tag: str) -> None:
        self.sent_log = workdir / f"{tag}-sent.jsonl"
        argv = [sys.executable, "-m", "bridge", "simulate", *args, "--sent-log", str(self.sent_log)]
        super().__init__(argv, workdir / f"{tag}-sim.log")
        self._fh: Any = None
        self._lines = 0

    def sent_batches(self) -> int:
        """Batches in the sent-log so far (one JSON line each), read incrementally."""
        if self._fh is None:
            try:
                self._fh = open(self.sent_log, "rb")  # noqa: SIM115 (closed in stop())
            except FileNotFoundError:
                return 0
        self._lines += self._fh.read().count(b"\n")
        return self._lines

    def sent_events(self) -> int:
        """Events in the sent-log: one ``{"type":"`` per event in its compact JSON lines."""
        with open(self.sent_log, "rb") as f:
            return f.read().count(b'{"type":"')

    def stop(self, timeout: float = 30.0) -> int:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        return super().stop(timeout)


class BridgeProc(Proc):
    """`python -m bridge run` following ``pods`` (name, pub, replay), /metrics on a free port."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        pods: list[tuple[str, str, str | None]],
        workdir: Path,
        tag: str,
        model: str = "bench-model",
        extra: list[str] | None = None,
        workers: int = 1,
    ) -> None:
        config = workdir / f"{tag}-bridge.toml"
        lines = []
        for name, pub, replay in pods:
            lines += ["[[pods]]", f"name = {json.dumps(name)}", f"model = {json.dumps(model)}"]
            lines.append(f"pub = {json.dumps(pub)}")
            if replay:
                lines.append(f"replay = {json.dumps(replay)}")
        config.write_text("\n".join(lines) + "\n")
        # --workers N: the parent supervises N children (worker i: metrics port base + i).
        self.workers = workers
        self.metrics_port = free_port() if workers == 1 else free_port_block(workers)
        self.pods = len(pods)
        argv = [sys.executable, "-m", "bridge", "run", "--config", str(config)]
        argv += ["--bootstrap-servers", bootstrap, "--topic", topic]
        argv += ["--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1"]
        argv += ["--log-level", "info", *(extra or [])]
        if workers > 1:
            argv += ["--workers", str(workers)]
        super().__init__(argv, workdir / f"{tag}-bridge.log")

    def pids(self) -> list[int]:
        """The bridge's process and, with --workers, its worker processes."""
        if self.workers == 1:
            return [self.pid]
        try:
            with open(f"/proc/{self.pid}/task/{self.pid}/children", encoding="ascii") as f:
                children = [int(x) for x in f.read().split()]
        except OSError:
            children = []
        return [self.pid, *children]

    def cpu(self) -> float:
        total = 0.0
        for pid in self.pids():
            with contextlib.suppress(OSError):  # a worker that already exited
                total += procstat.cpu_seconds(pid)
        return total

    def memory(self) -> dict[str, int]:
        out = {"rss": 0, "peak_rss": 0}
        for pid in self.pids():
            with contextlib.suppress(OSError):
                for k, v in procstat.memory_bytes(pid).items():
                    out[k] += v
        return out

    def pause(self) -> None:
        for pid in reversed(self.pids()):
            os.kill(pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        for pid in self.pids():
            os.kill(pid, signal.SIGCONT)
        self._paused = False

    def wait_running(self, timeout: float = 60.0) -> None:
        """Until the bridge (every worker) opened its streams ("bridge running" log lines)."""

        def running() -> bool:
            self.check_alive("the bridge")
            if self.output().count("bridge running") < self.workers:
                return False
            return len(self.pids()) == self.workers + (self.workers > 1)

        wait(running, timeout, "the bridge to open its streams", 0.1)

    def connected(self) -> int:
        """Streams whose SUB socket connected (the bridge logs each connection)."""
        return self.output().count(": connected to ")

    def metrics(self) -> dict[str, float]:
        """Prometheus samples summed over pods, plus ``name{label="value"}`` for type/outcome."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for port in range(self.metrics_port, self.metrics_port + self.workers):
            text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
            for family in text_string_to_metric_families(text.decode()):
                for s in family.samples:
                    if s.name.endswith("_created") or not s.name.startswith("kvbridge_"):
                        continue
                    out[s.name] = out.get(s.name, 0.0) + s.value
                    for label in ("type", "outcome", "reason", "source"):
                        if label in s.labels:
                            key = f'{s.name}{{{label}="{s.labels[label]}"}}'
                            out[key] = out.get(key, 0.0) + s.value
        return out


class NaiveProc(Proc):
    """`python -m bench.naive`: prints READY once subscribed, a JSON summary when done."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        pods: list[tuple[str, str]],
        batches_per_pod: int,
        workdir: Path,
        tag: str,
    ) -> None:
        pods_file = workdir / f"{tag}-naive-pods.json"
        pods_file.write_text(json.dumps([{"name": n, "pub": p} for n, p in pods]))
        argv = [sys.executable, "-m", "bench.naive", "--bootstrap-servers", bootstrap]
        argv += ["--topic", topic, "--pods-file", str(pods_file)]
        argv += ["--batches", str(batches_per_pod)]
        # stdin stays open: the naive loop waits for EOF before exiting, so that its /proc
        # entry (CPU time, peak RSS) can still be read once it is done.
        super().__init__(argv, workdir / f"{tag}-naive.log", stdin=subprocess.PIPE)

    def ready(self) -> bool:
        self.check_alive("the naive loop")
        return "READY" in self.output()

    def summary(self) -> dict[str, Any] | None:
        for line in self.output().splitlines():
            if line.startswith("{"):
                return json.loads(line)
        return None

    def stop(self, timeout: float = 30.0) -> int:
        if self.p.stdin is not None and not self.p.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.p.stdin.close()
        return super().stop(timeout)


class FeederProc(Proc):
    """`python -m bench.feeder`: READY once every pod has a subscriber, DONE <json> when sent."""

    def __init__(
        self, workload: dict[str, Any], base_port: int, rate: float, workdir: Path, tag: str
    ) -> None:
        argv = [sys.executable, "-m", "bench.feeder", "--workload-json", json.dumps(workload)]
        argv += ["--base-port", str(base_port), "--rate", f"{rate:.6g}"]
        super().__init__(argv, workdir / f"{tag}-feeder.log")

    def ready(self) -> bool:
        self.check_alive("the feeder")
        return "READY" in self.output()

    def done(self) -> dict[str, Any] | None:
        for line in self.output().splitlines():
            if line.startswith("DONE "):
                return json.loads(line[5:])
        return None
