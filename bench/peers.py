"""The peer column: other routers' Go decoders next to kvbridge's, on the same payloads.

``bench/gopeers/`` is a small Go program that imports, as modules pinned in its go.mod and
go.sum, AIBrix's ``kvcache.DecodeEventBatch`` and llm-d's
``engineadapter.VLLMAdapter.ParseMessage``, plus a floor: the msgpack library both use
(``vmihailenco/msgpack/v5``) decoding to ``interface{}``. This module writes the bench's
payloads to files, builds that program once (cached outside the source tree), and runs it
and kvbridge's own ``decode_batch`` (and decode + Avro encode, and ``msgpack.unpackb`` alone)
in interleaved rounds, pinned to one CPU. Without a ``go`` command the part is skipped with a
note.

Payload file format (little-endian)::

    file    = magic count payload*
    magic   = b"KVBPAYL1"                  8 bytes
    count   = uint32                       number of payloads
    payload = uint32 length, then length bytes (one vLLM msgpack batch)

Nothing follows the last payload.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgpack

from bench.procstat import machine_busy_seconds
from bridge.log import avro as avro_encode
from bridge.log.records import RecordCodec
from bridge.vllm.decoder import decode_batch

__all__ = [
    "GO_DIR",
    "MAGIC",
    "PRIMARY",
    "build",
    "read_payloads",
    "run_peers",
    "write_payloads",
]

GO_DIR = Path(__file__).resolve().parent / "gopeers"
MAGIC = b"KVBPAYL1"
_LEN = struct.Struct("<I")
PRIMARY = "0.23.0 array, int hashes"  # the workload every peer accepts
BUILD_TIMEOUT = 1800.0  # the first build compiles Kubernetes client packages: minutes
RUN_TIMEOUT = 600.0
GO_DECODERS = ("aibrix", "llm-d", "msgpack")
# (key, label) of every decoder in the tables, Go's first.
DECODERS = (
    ("aibrix", "AIBrix DecodeEventBatch (Go)"),
    ("llm-d", "llm-d VLLMAdapter.ParseMessage (Go)"),
    ("msgpack", "Go msgpack/v5 -> interface{} (floor)"),
    ("kvbridge_decode", "kvbridge decode_batch"),
    ("kvbridge_decode_encode", "kvbridge decode + Avro encode"),
    ("python_unpackb", "Python msgpack.unpackb (floor)"),
)

_POD, _MODEL, _EPOCH = "pod-0", "bench-model", 1_767_225_600_000


# --------------------------------------------------------------------------- payload files


def write_payloads(path: Path, payloads: Sequence[bytes]) -> None:
    """Write ``payloads`` in the payload file format (module docstring)."""
    with path.open("wb") as f:
        f.write(MAGIC + _LEN.pack(len(payloads)))
        for p in payloads:
            f.write(_LEN.pack(len(p)))
            f.write(p)


def read_payloads(path: Path) -> list[bytes]:
    """Read a payload file; ValueError if it is not one, or is truncated or too long."""
    data = path.read_bytes()
    if data[: len(MAGIC)] != MAGIC or len(data) < len(MAGIC) + 4:
        raise ValueError(f"{path}: not a payload file (bad magic)")
    (count,) = _LEN.unpack_from(data, len(MAGIC))
    pos = len(MAGIC) + 4
    out = []
    for i in range(count):
        if len(data) - pos < 4:
            raise ValueError(f"{path}: truncated at payload {i} of {count}")
        (n,) = _LEN.unpack_from(data, pos)
        pos += 4
        if len(data) - pos < n:
            raise ValueError(f"{path}: truncated in payload {i} of {count}")
        out.append(data[pos : pos + n])
        pos += n
    if pos != len(data):
        raise ValueError(f"{path}: {len(data) - pos} bytes after the last payload")
    return out


# --------------------------------------------------------------------------- the Go program


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvbridge-bench"


def build(go: str, log: Callable[[str], None] = print) -> tuple[Path, dict[str, Any]]:
    """The gopeers binary, built with ``go`` unless a build of the same sources and Go exists.

    Cached in ``$XDG_CACHE_HOME/kvbridge-bench/`` (``~/.cache``) under a digest of the Go
    version and of bench/gopeers' files. Returns the binary and what the build took.
    """
    version = subprocess.run(
        [go, "version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    digest = hashlib.sha256(version.encode())
    for f in sorted(GO_DIR.iterdir()):
        if f.is_file():
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
    binary = _cache_dir() / f"gopeers-{digest.hexdigest()[:16]}"
    info: dict[str, Any] = {"go_version": version, "binary": str(binary)}
    if binary.exists():
        info["build_seconds"] = 0.0
        info["cached"] = True
        return binary, info
    binary.parent.mkdir(parents=True, exist_ok=True)
    log(
        f"peers: building bench/gopeers with {version} (the first build downloads the modules "
        "and compiles Kubernetes client packages: minutes)"
    )
    env = dict(os.environ, GOFLAGS="-mod=readonly -buildvcs=false")
    tmp = binary.with_name(binary.name + f".tmp{os.getpid()}")
    t0 = time.monotonic()
    proc = subprocess.run(
        [go, "build", "-o", str(tmp), "."],
        cwd=GO_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
    )
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"go build failed: {proc.stderr.strip()[-1500:]}")
    tmp.replace(binary)
    info["build_seconds"] = round(time.monotonic() - t0, 1)
    info["cached"] = False
    return binary, info


def _run_go(binary: Path, files: Sequence[Path]) -> dict[str, Any]:
    env = dict(os.environ, GOMAXPROCS="1")
    proc = subprocess.run(
        [str(binary), *map(str, files)],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"gopeers failed ({proc.returncode}): {proc.stderr.strip()[-1500:]}")
    return json.loads(proc.stdout)


# --------------------------------------------------------------------------- kvbridge's side


def _timed(per_payload: Callable[[bytes], int], payloads: Sequence[bytes]) -> dict[str, Any]:
    for p in payloads[:200]:  # warm-up, as the Go program does
        per_payload(p)
    t0, cpu0 = time.perf_counter(), time.process_time()
    events = 0
    for p in payloads:
        events += per_payload(p)
    return {
        "batches": len(payloads),
        "ok_batches": len(payloads),
        "failed_batches": 0,
        "events": events,
        "cpu_seconds": time.process_time() - cpu0,
        "wall_seconds": time.perf_counter() - t0,
    }


def _python_side(payloads: Sequence[bytes]) -> dict[str, dict[str, Any]]:
    """kvbridge's decode, decode + encode (the ceiling's calls), and msgpack alone."""
    codec = RecordCodec()
    avro_encode.prepare()
    encode = codec.encode_batch

    def decode(p: bytes) -> int:
        return len(decode_batch(p).events)

    def decode_encode(p: bytes) -> int:
        b = decode_batch(p)
        return len(encode(_POD, _MODEL, 0, _EPOCH, 0, b.ts, b.extra, b.events))

    def unpack(p: bytes) -> int:
        return len(msgpack.unpackb(p, raw=False, strict_map_key=False, use_list=True)[1])

    return {
        "kvbridge_decode": _timed(decode, payloads),
        "kvbridge_decode_encode": _timed(decode_encode, payloads),
        "python_unpackb": _timed(unpack, payloads),
    }


# --------------------------------------------------------------------------- the part


def _pin() -> tuple[int | None, set[int] | None]:
    """Pin this process (and so its children) to one CPU: (that CPU, the previous set)."""
    if not hasattr(os, "sched_setaffinity"):
        return None, None
    before = os.sched_getaffinity(0)
    cpu = max(before)
    os.sched_setaffinity(0, {cpu})
    return cpu, before


def _busy(cpu: int | None) -> tuple[float, float, float, float]:
    """(machine busy s, CPU ``cpu`` busy s, this process's and its children's CPU s, time)."""
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    cpu_busy = machine_busy_seconds(cpu) if cpu is not None else 0.0
    return machine_busy_seconds(), cpu_busy, own, time.monotonic()


def _summary(runs: list[dict[str, Any]], expected_events: int) -> dict[str, Any]:
    """Median (and spread) over the rounds of one decoder on one workload."""
    last = runs[-1]
    out: dict[str, Any] = {
        k: last[k] for k in ("batches", "ok_batches", "failed_batches", "events")
    }
    out["accepts_all"] = last["failed_batches"] == 0
    out["events_agree"] = out["accepts_all"] and last["events"] == expected_events
    if last.get("first_error"):
        out["first_error"] = last["first_error"]
    out["cpu_seconds"] = round(statistics.median(r["cpu_seconds"] for r in runs), 4)
    if out["accepts_all"] and last["events"]:  # per event only when every batch decoded
        per_ev = [r["cpu_seconds"] / r["events"] * 1e6 for r in runs]
        rates = [r["events"] / r["wall_seconds"] for r in runs if r["wall_seconds"] > 0]
        out["cpu_us_per_event"] = round(statistics.median(per_ev), 3)
        out["cpu_us_per_event_min"] = round(min(per_ev), 3)
        out["cpu_us_per_event_max"] = round(max(per_ev), 3)
        out["events_per_s"] = round(statistics.median(rates), 1) if rates else None
        out["cpu_us_per_event_rounds"] = [round(x, 3) for x in per_ev]
    return out


def run_peers(
    workloads: Iterable[tuple[str, str, list[bytes]]],
    rounds: int,
    go: str | None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The peers part's JSON section (keys: bench/report.py), or {"skipped": why}.

    ``workloads``: (label, description, payloads). Each round runs the Go program once on
    every workload file and kvbridge's side on the same payloads in this process, Go first in
    even rounds and last in odd ones; the process is pinned to one CPU meanwhile.
    """
    if go is None:
        return {
            "skipped": "no `go` command on PATH: install Go >= 1.24 "
            "to time the AIBrix and llm-d decoders (bench/README.md, 'Peers')"
        }
    binary, build_info = build(go, log)
    workloads = list(workloads)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    go_doc: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvbridge-peers-") as tmp:
        files = []
        for i, (_, _, payloads) in enumerate(workloads):
            files.append(Path(tmp) / f"workload-{i}.bin")
            write_payloads(files[-1], payloads)
        by_file = {str(f): label for f, (label, _, _) in zip(files, workloads, strict=True)}
        cpu, before = _pin()
        busy0, cpu_busy0, own0, t0 = _busy(cpu)
        try:
            for r in range(rounds):
                for side in ("go", "python") if r % 2 == 0 else ("python", "go"):
                    if side == "go":
                        go_doc = _run_go(binary, files)
                        for res in go_doc["results"]:
                            key = (res["decoder"], by_file[res["file"]])
                            runs.setdefault(key, []).append(res)
                    else:
                        for label, _, payloads in workloads:
                            for name, res in _python_side(payloads).items():
                                runs.setdefault((name, label), []).append(res)
                log(f"peers: round {r + 1}/{rounds} done")
        finally:
            if before is not None:
                os.sched_setaffinity(0, before)
        busy1, cpu_busy1, own1, t1 = _busy(cpu)
    results = []
    for label, _, _ in workloads:
        expected = runs[("kvbridge_decode", label)][-1]["events"]
        for key, name in DECODERS:
            if (key, label) in runs:
                entry = {"workload": label, "decoder": key, "name": name}
                entry.update(_summary(runs[(key, label)], expected))
                results.append(entry)
    return {
        "rounds": rounds,
        "pinned_cpu": cpu,
        "seconds": round(t1 - t0, 1),
        # CPU that anything but this process and its children used meanwhile: machine-wide
        # (in cores), and on the pinned CPU (its share of that CPU's time).
        "other_cores": round(max(0.0, busy1 - busy0 - (own1 - own0)) / (t1 - t0), 2),
        "pinned_cpu_other_share": None
        if cpu is None
        else round(max(0.0, cpu_busy1 - cpu_busy0 - (own1 - own0)) / (t1 - t0), 2),
        "go": {
            "version": go_doc.get("go"),
            "gomaxprocs": go_doc.get("gomaxprocs"),
            "modules": go_doc.get("modules", {}),
            "decoders": go_doc.get("decoders", {}),
            **build_info,
        },
        "workloads": [
            {
                "label": label,
                "description": description,
                "batches": len(payloads),
                "events": runs[("kvbridge_decode", label)][-1]["events"],
            }
            for label, description, payloads in workloads
        ],
        "primary": PRIMARY,
        "results": results,
    }


def find_go(explicit: str | None = None) -> str | None:
    """The go command: ``explicit`` if given (must exist), else ``go`` on PATH, else None."""
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise FileNotFoundError(f"--go {explicit}: no such command")
        return found
    return shutil.which("go")
