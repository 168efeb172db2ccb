"""`kvbridge run --workers N`: the fleet split across N bridge processes on this host.

One Python process is bound to one core; with N workers each child is an ordinary
``kvbridge run`` with ``--shard-index``/``--shard-count`` set (rendezvous hashing, see
bridge/ops/sharding.py), its own metrics port (base + i) and, through the shard, its own
transactional id. The parent only supervises: it forwards SIGINT/SIGTERM, and if a child
exits with an error it stops the others and exits with that child's code: nothing is
restarted silently (the orchestrator restarts the whole unit).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)

# Flags the parent sets per child; removed from the argv passed through.
_OWNED = ("--workers", "--shard-index", "--shard-count", "--metrics-port")


def strip_flags(argv: Sequence[str], flags: Sequence[str] = _OWNED) -> list[str]:
    """``argv`` without ``flags`` and their values (``--flag V`` or ``--flag=V``)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def child_argv(
    argv: Sequence[str],
    worker: int,
    workers: int,
    shard_index: int,
    shard_count: int,
    metrics_port: int,
) -> list[str]:
    """The ``kvbridge run`` arguments of worker ``worker``: replica shard ``shard_index`` of
    ``shard_count`` is split again into ``workers`` shards, so replicas x workers never overlap.
    """
    args = strip_flags(argv)
    index = shard_index * workers + worker
    args += ["--shard-index", str(index), "--shard-count", str(shard_count * workers)]
    args += ["--metrics-port", str(metrics_port + worker if metrics_port else 0)]
    return args


def supervise(
    argv: Sequence[str], workers: int, shard_index: int, shard_count: int, metrics_port: int
) -> int:
    """Run the children until they stop; returns the exit code for the parent."""
    procs: list[subprocess.Popen[bytes]] = []
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for w in range(workers):
            args = child_argv(argv, w, workers, shard_index, shard_count, metrics_port)
            procs.append(subprocess.Popen([sys.executable, "-m", "bridge", *args]))
            log.info(
                "worker %d: pid %d, shard %s of %d%s",
                w,
                procs[-1].pid,
                args[args.index("--shard-index") + 1],
                shard_count * workers,
                f", metrics port {metrics_port + w}" if metrics_port else "",
            )
        code = 0
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed and not stopping:
                p = failed[0]
                code = p.returncode
                log.error(
                    "worker pid %d exited with code %d; stopping the other workers",
                    p.pid,
                    code,
                )
                stopping = True
                for q in procs:
                    if q.poll() is None:
                        q.terminate()
            time.sleep(0.2)
        if code == 0:
            code = next((p.returncode for p in procs if p.returncode), 0)
            if code and not stopping:
                log.error("a worker exited with code %d", code)
        return code if code >= 0 else 128 - code
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for s, h in old.items():
            signal.signal(s, h)
