"""A real single-node Kafka broker for tests, on free 127.0.0.1 ports in a temporary directory.

The broker is ``scripts/kafka-local.sh run`` (which exec's the JVM), started as a child of
this process, so its pid is the JVM's and it can be stopped, paused and killed precisely::

    with KafkaBroker() as broker:
        produce_to(broker.bootstrap)
        broker.pause()      # SIGSTOP: connections hang, requests time out
        broker.resume()     # SIGCONT
        broker.restart()    # graceful stop, then start on the same ports and data
        broker.kill()       # SIGKILL: a crash; start() recovers from the same data

When started from the main thread the JVM also gets SIGKILL if this process dies without
cleaning up (Linux ``PR_SET_PDEATHSIG``), so a killed test run leaves no broker behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "kafka-local.sh"
READY_LINE = b"Kafka Server started"
ERROR_LINE = re.compile(r" (ERROR|FATAL) |^Error|^Caused by:|^[\w.$]+(Exception|Error)(:|$)")
# C1-only JIT: the broker starts in about half the time (2-3 s instead of 4-6 s on 2 cores),
# at a peak throughput that is ample for tests. Pass java_opts="" for the full JIT.
FAST_START_JAVA_OPTS = "-XX:TieredStopAtLevel=1"


class BrokerError(RuntimeError):
    """The broker could not be started or did not become ready (the log tail is included)."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that are free on 127.0.0.1 right now."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_until(
    condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05
) -> Any:
    """Poll ``condition`` until it returns something truthy; TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _pdeathsig_setter() -> Callable[[], None] | None:
    """A preexec_fn asking the kernel to SIGKILL the child when its parent thread dies."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def setter() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGKILL))

    return setter


_SET_PDEATHSIG = _pdeathsig_setter()


class KafkaBroker:
    """One KRaft broker+controller JVM; see the module docstring."""

    def __init__(
        self,
        workdir: str | Path | None = None,
        *,
        port: int | None = None,
        heap: str = "512m",
        java_opts: str = FAST_START_JAVA_OPTS,
        start_timeout: float = 90.0,
        keep_workdir: bool = False,
    ) -> None:
        self._owns_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvbridge-kafka-"))
        self.keep_workdir = keep_workdir
        self.data_dir = self.workdir / "data"
        self.log_path = self.workdir / "logs" / "server.log"
        ports = free_ports(2)
        self.port = port or ports[0]
        self.controller_port = ports[1]
        self.heap = heap
        self.java_opts = java_opts
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        """The ``bootstrap.servers`` value for clients."""
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The JVM's pid while it runs (paused or not), else None."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    def start(self) -> KafkaBroker:
        """Start (formatting the data dir the first time) and wait until clients are served."""
        if self.pid is not None:
            raise BrokerError(f"broker already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["bash", str(SCRIPT), "run", "--port", str(self.port)]
        cmd += ["--controller-port", str(self.controller_port), "--heap", self.heap]
        cmd += ["--data-dir", str(self.data_dir), "--log-dir", str(self.log_path.parent)]
        on_main = threading.current_thread() is threading.main_thread()
        with open(self.log_path, "ab") as log:
            offset = log.tell()
            self._proc = subprocess.Popen(
                cmd,
                env=dict(os.environ, KAFKA_LOCAL_JAVA_OPTS=self.java_opts),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # terminal signals (ctrl-C) reach pytest, not the JVM
                preexec_fn=_SET_PDEATHSIG if on_main else None,
            )
        try:
            self._wait_ready(offset)
        except BaseException:
            self.stop(timeout=10)
            raise
        return self

    def _wait_ready(self, offset: int) -> None:
        deadline = time.monotonic() + self.start_timeout
        admin: AdminClient | None = None
        while True:
            proc = self._proc
            assert proc is not None
            if proc.poll() is not None:
                what = f"Kafka broker exited with code {proc.returncode} during startup"
                raise self._failure(what, offset)
            if READY_LINE in self._log_bytes(offset):
                admin = admin or AdminClient({"bootstrap.servers": self.bootstrap})
                with contextlib.suppress(KafkaException):
                    if admin.list_topics(timeout=2).brokers:
                        return
            if time.monotonic() >= deadline:
                raise self._failure(
                    f"Kafka broker not ready after {self.start_timeout:.0f}s", offset
                )
            time.sleep(0.1)

    def _log_bytes(self, offset: int) -> bytes:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return b""

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the broker log (empty if there is none yet)."""
        text = self._log_bytes(0).decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    def _failure(self, what: str, offset: int) -> BrokerError:
        """``what`` went wrong, with the errors logged since ``offset`` and the log's tail."""
        lines = self._log_bytes(offset).decode("utf-8", "replace").splitlines()
        errors = [line for line in lines if ERROR_LINE.search(line)][-10:]
        excerpt = "errors logged:\n" + "\n".join(errors) + "\n" if errors else ""
        return BrokerError(f"{what}; {excerpt}last lines of {self.log_path}:\n{self.log_tail(30)}")

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful stop: SIGTERM (and SIGCONT, in case it is paused), SIGKILL after ``timeout``."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            # The whole process group: before the exec that is the script and its formatter.
            _signal_group(proc.pid, signal.SIGTERM)
            _signal_group(proc.pid, signal.SIGCONT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        self._proc = None

    def kill(self) -> None:
        """Crash the broker (SIGKILL) and reap it; the data dir stays for a later start()."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        self.stop()

    def restart(self) -> None:
        """Stop gracefully and start again on the same ports with the same data."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """SIGSTOP the JVM: it keeps its sockets but answers nothing until resume()."""
        pid = self._require_pid()
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: _proc_state(pid) in ("T", "t"), 10, f"pid {pid} to stop")

    def resume(self) -> None:
        """SIGCONT the JVM paused by pause()."""
        pid = self._require_pid()
        os.kill(pid, signal.SIGCONT)
        wait_until(lambda: _proc_state(pid) not in ("T", "t"), 10, f"pid {pid} to continue")

    def _require_pid(self) -> int:
        pid = self.pid
        if pid is None:
            raise BrokerError("the broker is not running")
        return pid

    def close(self) -> None:
        """Stop, and remove the working directory if this object created it."""
        self.stop()
        if self._owns_workdir and not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> KafkaBroker:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"KafkaBroker(bootstrap={self.bootstrap!r}, pid={self.pid}, dir={str(self.workdir)!r})"
        )


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _proc_state(pid: int) -> str:
    """The one-letter state of ``pid`` from /proc (R, S, T, Z, ...), '' if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


def create_topic(
    admin: AdminClient,
    name: str,
    partitions: int = 1,
    config: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> str:
    """Create ``name`` and wait until every partition has a leader."""
    topic = NewTopic(name, num_partitions=partitions, replication_factor=1, config=config or {})
    admin.create_topics([topic], operation_timeout=timeout)[name].result(timeout=timeout)

    def ready() -> bool:
        md = admin.list_topics(topic=name, timeout=timeout).topics.get(name)
        if md is None or md.error is not None or len(md.partitions) != partitions:
            return False
        return all(p.leader >= 0 and p.error is None for p in md.partitions.values())

    wait_until(ready, timeout, f"leaders for all {partitions} partitions of {name}")
    return name


def topic_name(hint: str) -> str:
    """A unique, legal topic name that mentions ``hint`` (e.g. the test's name)."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", hint).strip("-")[:60] or "topic"
    return f"t-{slug}-{os.urandom(4).hex()}"
