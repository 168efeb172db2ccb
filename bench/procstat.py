"""CPU time and memory of another process, from /proc (Linux; no psutil).

CPU time is the process's ``utime + stime`` (all its threads: ZeroMQ I/O threads and
librdkafka's threads included), in seconds.
"""

from __future__ import annotations

import os

__all__ = ["cpu_seconds", "machine_busy_seconds", "memory_bytes", "self_cpu_seconds"]

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by ``pid`` (every thread)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        stat = f.read()
    # Fields after "(comm)": state is field 3, utime 14, stime 15 (1-based, man proc(5)).
    rest = stat.rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / _TICKS


def memory_bytes(pid: int) -> dict[str, int]:
    """``{"rss": VmRSS, "peak_rss": VmHWM}`` of ``pid`` in bytes."""
    out = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out["rss" if key == "VmRSS" else "peak_rss"] = int(value.split()[0]) * 1024
    return out


def self_cpu_seconds() -> float:
    """This process's CPU seconds (all threads), for the same accounting as :func:`cpu_seconds`."""
    t = os.times()
    return t.user + t.system


def machine_busy_seconds(cpu: int | None = None) -> float:
    """CPU seconds all CPUs (or CPU ``cpu`` alone) spent on anything but idle and iowait since
    boot (/proc/stat)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = f.readline().split()
        if cpu is not None:
            fields = next(line.split() for line in f if line.startswith(f"cpu{cpu} "))
    # cpu user nice system idle iowait irq softirq steal (guest time is counted in user)
    values = [int(x) for x in fields[1:9]]
    return (sum(values) - values[3] - values[4]) / _TICKS
