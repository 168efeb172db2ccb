"""End-to-end runs: simulated vLLM pods -> the bridge (or the naive loop) -> a real broker.

Throughput (:func:`drain_run`) is measured on a backlog, so that neither the pods' speed nor
ZeroMQ's pacing limits it:

1. the program under test (``python -m bridge run`` or ``python -m bench.naive``) starts and
   connects to the pods' ports; the pods (``python -m bridge simulate --rate 0
   --wait-for-subscriber --start-delay S``) bind them;
2. once every SUB is connected, the program is paused (SIGSTOP); the pods then publish their
   batches, which queue up in ZeroMQ (below the 100,000-message high-water marks);
3. once every batch is sent, the program is resumed (SIGCONT) and timed until the topic holds
   every record (the sum of the partitions' high watermarks; with acks=all on one broker a
   record is there once acknowledged). CPU time is the process's utime+stime over the same
   interval (all threads, librdkafka's included), RSS its VmRSS / VmHWM.

The bridge runs with ``--first-contact live`` here: the default first contact asks each pod
for a replay from seq 0, which would make it read the whole backlog twice (replay + live);
the default is used in the latency runs. Everything else is the bridge's default.

Latency (:func:`latency_run`): the bridge with every default; pods publish at a fixed rate
(by default :mod:`bench.feeder`, which sends the simulator's payloads at a fraction of the
simulator's CPU cost; or the simulator itself); a consumer in this process reads every record
and takes receive time minus the record's ``ts`` (the vLLM batch timestamp, set by the pod
when it sends the batch), after a warm-up. The record's Kafka CreateTime (set when the bridge
hands it to the producer) splits that into the bridge's part and Kafka's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import procstat
from bench.kafka import TopicCounter, new_topic
from bench.latency import LatencyConsumer, summarize
from bench.procs import (
    BridgeProc,
    FeederProc,
    NaiveProc,
    Proc,
    SimProc,
    free_port_block,
    wait,
)
from bench.workload import WorkloadConfig, describe, pod_payloads

__all__ = ["RunContext", "drain_run", "latency_run", "workload_mix"]

START_DELAY = 3.0  # seconds pods wait after their subscriber connects: time to pause the target
SIM_MAX_SOCKETS = 1023  # ZeroMQ's default per context (the simulator does not raise it)
SOCKETS_PER_POD = 4
CONNECT_GRACE = 0.5  # after the bridge logs its last TCP connect: ZMTP handshake + subscription
SAMPLE_EVERY = 0.05


@dataclass
class RunContext:
    bootstrap: str
    broker_pid: int | None
    workdir: Path
    workload: WorkloadConfig
    log: Callable[[str], None]


def workload_mix(config: WorkloadConfig) -> dict[str, Any]:
    """What every pod of ``config`` sends (regenerated: the simulator sends these payloads)."""
    d = describe(p for i in range(config.pods) for p in pod_payloads(config, i))
    keys = ("events", "payload_bytes", "events_per_batch", "bytes_per_batch", "share_by_type")
    return {k: d[k] for k in (*keys, "stored_blocks_mean")}


def _endpoints(config: WorkloadConfig) -> list[tuple[str, str, str]]:
    """(name, pub, replay) per pod on a free port block, as `simulate --base-port` lays them."""
    base = free_port_block(2 * config.pods)
    return [
        (name, f"tcp://127.0.0.1:{base + 2 * i}", f"tcp://127.0.0.1:{base + 2 * i + 1}")
        for i, name in enumerate(config.pod_names())
    ]


def _base_port(endpoints: list[tuple[str, str, str]]) -> int:
    return int(endpoints[0][1].rsplit(":", 1)[1])


def _broker_cpu(ctx: RunContext) -> float | None:
    if ctx.broker_pid is None:
        return None
    try:
        return procstat.cpu_seconds(ctx.broker_pid)
    except OSError:
        return None


def _settled_cpu(proc: Proc, quiet: float = 0.01, every: float = 0.2, limit: float = 3.0) -> float:
    """``proc``'s CPU seconds once it used less than ``quiet`` s in ``every`` s (idle)."""
    deadline = time.monotonic() + limit
    last = proc.cpu()
    while time.monotonic() < deadline:
        time.sleep(every)
        now = proc.cpu()
        if now - last < quiet:
            return now
        last = now
    return last


def _stop_all(procs: list[Proc]) -> None:
    for p in reversed(procs):
        try:
            p.stop()
        except Exception as exc:  # keep stopping the others
            print(f"bench: could not stop pid {p.pid}: {exc}")


def drain_run(
    ctx: RunContext,
    target: str,
    pods: int,
    batches_per_pod: int,
    tag: str,
    known_mix: dict[str, Any] | None = None,
    workers: int = 1,
) -> dict[str, Any]:
    """Time ``target`` ("bridge" or "naive") draining ``pods`` x ``batches_per_pod`` batches
    (the bridge with ``--workers workers`` when > 1: CPU and memory of every worker)."""
    if target not in ("bridge", "naive"):
        raise ValueError(f"unknown target {target!r}")
    config = replace(ctx.workload, pods=pods, batches_per_pod=batches_per_pod)
    topic = new_topic(ctx.bootstrap, tag)
    endpoints = _endpoints(config)
    counter = TopicCounter(ctx.bootstrap, topic)
    procs: list[Proc] = []
    started = time.monotonic()
    result: dict[str, Any] = {
        "target": target,
        "pods": pods,
        "batches_per_pod": batches_per_pod,
        "topic": topic,
    }
    if target == "bridge" and workers > 1:
        result["workers"] = workers
    try:
        # The simulator's ZeroMQ context allows 1,023 sockets; a pod uses a PUB, a replay
        # ROUTER and, waiting for its subscriber, a monitor pair: 4. Bigger fleets get only
        # the PUB (replay is not used by these runs) and a fixed start delay.
        lean = pods * SOCKETS_PER_POD > SIM_MAX_SOCKETS
        delay = START_DELAY + (2.0 if lean else 0.0)
        if lean:
            endpoints = [(name, pub, "") for name, pub, _ in endpoints]
            result["note"] = (
                f"{pods} pods exceed the simulator's ZeroMQ socket limit with replay sockets: "
                "the pods have no replay endpoint and start after a fixed delay"
            )
        tgt: BridgeProc | NaiveProc
        if target == "bridge":
            tgt = BridgeProc(
                ctx.bootstrap,
                topic,
                endpoints,
                ctx.workdir,
                tag,
                extra=["--first-contact", "live"],
                workers=workers,
            )
            procs.append(tgt)
            tgt.wait_running()
        else:
            pubs = [(name, pub) for name, pub, _ in endpoints]
            tgt = NaiveProc(ctx.bootstrap, topic, pubs, batches_per_pod, ctx.workdir, tag)
            procs.append(tgt)
        sim_args = [*config.sim_args(), "--base-port", str(_base_port(endpoints)), "--rate", "0"]
        if lean:
            sim_args += ["--no-replay", "--start-delay", str(delay)]
        else:
            sim_args += ["--wait-for-subscriber", "--start-delay", str(delay)]
        sim = SimProc(sim_args, ctx.workdir, tag)
        procs.append(sim)

        connect_timeout = 60 + pods / 10
        if isinstance(tgt, BridgeProc):
            b = tgt

            def connected() -> bool:
                b.check_alive("the bridge")
                sim.check_alive("the simulated pods")
                return b.connected() >= pods

            wait(connected, connect_timeout, f"the bridge to connect to {pods} pods", 0.05)
            time.sleep(CONNECT_GRACE)
        else:
            wait(tgt.ready, connect_timeout, f"the naive loop to connect to {pods} pods", 0.05)
        tgt.pause()
        paused_at = time.monotonic()

        # While the pods fill the backlog: what they send (same generator, same seeds).
        mix = known_mix or workload_mix(config)
        payload_bytes = mix["payload_bytes"]
        total = pods * batches_per_pod

        def filled() -> bool:
            sim.check_alive("the simulated pods")
            return sim.sent_batches() >= total

        wait(filled, 120 + total / 500, f"the pods to send {total} batches", 0.1)
        fill_seconds = time.monotonic() - paused_at
        sent_events = sim.sent_events()
        before = counter.wait_stable(quiet=0.2)
        result.update(
            batches=total,
            events_sent=sent_events,
            payload_bytes=payload_bytes,
            workload_matches_simulator=sent_events == mix["events"],
            mix={k: v for k, v in mix.items() if k not in ("events", "payload_bytes")},
            records_before_resume=before,
            backlog_fill_seconds=round(fill_seconds, 2),
        )

        # The drain.
        broker0, sim0 = _broker_cpu(ctx), sim.cpu()
        busy0, self0 = procstat.machine_busy_seconds(), procstat.self_cpu_seconds()
        rss_idle = tgt.memory().get("rss", 0)  # before the backlog reaches its queues
        cpu0 = tgt.cpu()
        t0 = time.perf_counter()
        tgt.resume()
        samples = [(t0, before, cpu0)]
        metrics: dict[str, float] = {}
        complete = False
        last_change = time.monotonic()
        # The bridge writes a StreamStarted marker per stream before its first event.
        expect = sent_events + (pods if target == "bridge" else 0)
        while True:
            time.sleep(SAMPLE_EVERY)
            w = counter.total()
            samples.append((time.perf_counter(), w, tgt.cpu()))
            if w != samples[-2][1]:
                last_change = time.monotonic()
            if w >= expect:
                if isinstance(tgt, BridgeProc):
                    metrics = tgt.metrics()
                    done_in = metrics.get("kvbridge_events_in_total", 0.0)
                    markers = metrics.get("kvbridge_markers_total", 0.0)
                    expect = int(done_in + markers)
                    if done_in >= sent_events and w >= expect:
                        complete = True
                        break
                else:
                    complete = True
                    break
            if time.monotonic() - last_change > 20:
                break  # stalled: report what arrived
            tgt.check_alive(target)
        busy1, self1, t1 = (
            procstat.machine_busy_seconds(),
            procstat.self_cpu_seconds(),
            time.perf_counter(),
        )
        sim_at_end, broker_at_end = sim.cpu(), _broker_cpu(ctx)
        final = samples[-1][1]
        t_end, _, cpu_at_ack = next(s for s in samples if s[1] == final)
        # Work left after the last acknowledgement (delivery callbacks, metrics) is part of the
        # cost per event: take the CPU time once it stops rising.
        cpu_end = _settled_cpu(tgt)
        broker1, sim1 = _broker_cpu(ctx), sim.cpu()
        mem = tgt.memory()
        seconds = t_end - t0
        records = final - before
        if isinstance(tgt, BridgeProc):
            metrics = tgt.metrics()
            markers = int(metrics.get("kvbridge_markers_total", 0))
            events = records - markers
            result["bridge_metrics"] = {
                k: v
                for k, v in sorted(metrics.items())
                if k.split("{")[0]
                in (
                    "kvbridge_events_in_total",
                    "kvbridge_records_out_total",
                    "kvbridge_markers_total",
                    "kvbridge_gaps_total",
                    "kvbridge_replays_total",
                    "kvbridge_duplicate_batches_total",
                    "kvbridge_batches_lost_total",
                    "kvbridge_produce_errors_total",
                )
            }
        else:
            summary = wait(tgt.summary, 60, "the naive loop's summary")
            events = records
            result["naive_summary"] = summary
        cpu = cpu_end - cpu0
        result.update(
            complete=complete and events == sent_events,
            events=events,
            records=records,
            seconds=round(seconds, 4),
            events_per_s=round(events / seconds, 1) if seconds > 0 else None,
            mb_per_s=round(payload_bytes * events / max(1, sent_events) / seconds / 1e6, 3)
            if seconds > 0
            else None,
            cpu_seconds=round(cpu, 3),
            cpu_us_per_event=round(cpu / events * 1e6, 2) if events else None,
            cpu_seconds_until_last_ack=round(cpu_at_ack - cpu0, 3),
            cores=round((cpu_at_ack - cpu0) / seconds, 2) if seconds > 0 else None,
            rss_idle_mb=round(rss_idle / 1e6, 1),
            rss_mb=round(mem.get("rss", 0) / 1e6, 1),
            peak_rss_mb=round(mem.get("peak_rss", 0) / 1e6, 1),
            sim_cpu_seconds_during_drain=round(sim1 - sim0, 3),
        )
        if broker0 is not None and broker1 is not None:
            result["broker_cpu_seconds_during_drain"] = round(broker1 - broker0, 3)
        # Everything else the machine did meanwhile (other programs: noise), in cores.
        ours = samples[-1][2] - cpu0 + (sim_at_end - sim0) + (self1 - self0)
        if broker0 is not None and broker_at_end is not None:
            ours += broker_at_end - broker0
        result["machine_busy_cores"] = round((busy1 - busy0) / (t1 - t0), 2)
        result["other_cores"] = round(max(0.0, busy1 - busy0 - ours) / (t1 - t0), 2)
        if before:
            result["note_before_resume"] = (
                f"{before} records were written before the pause: the pods started before the "
                "target was paused; events/s is computed on the rest"
            )
        result["wall_seconds"] = round(time.monotonic() - started, 1)
        return result
    finally:
        _stop_all(procs)
        counter.close()


def latency_run(
    ctx: RunContext,
    pods: int,
    fraction: float,
    max_events_per_s: float,
    events_per_batch: float,
    seconds: float,
    warmup: float,
    tag: str,
    source: str = "feeder",
) -> dict[str, Any]:
    """Pods at ``fraction`` of ``max_events_per_s`` for ``seconds``: ts -> consumer latency.

    ``source``: "feeder" (:mod:`bench.feeder`, the simulator's payloads re-stamped, cheap to
    send) or "sim" (`kvbridge simulate` itself, whose own CPU use may keep it below the rate).
    """
    if source not in ("feeder", "sim"):
        raise ValueError(f"unknown pod source {source!r}")
    target_eps = fraction * max_events_per_s
    rate = target_eps / events_per_batch / pods  # batches/s per pod
    batches = max(1, math.ceil(rate * seconds))
    config = replace(ctx.workload, pods=pods, batches_per_pod=batches)
    topic = new_topic(ctx.bootstrap, tag)
    endpoints = _endpoints(config)
    base = _base_port(endpoints)
    procs: list[Proc] = []
    consumer: LatencyConsumer | None = None
    result: dict[str, Any] = {
        "pods": pods,
        "load": fraction,
        "source": source,
        "target_events_per_s": round(target_eps, 1),
        "rate_per_pod": round(rate, 3),
        "batches_per_pod": batches,
        "topic": topic,
    }
    try:
        bridge = BridgeProc(ctx.bootstrap, topic, endpoints, ctx.workdir, tag)
        procs.append(bridge)
        bridge.wait_running()
        consumer = LatencyConsumer(ctx.bootstrap, topic)
        pods_proc: SimProc | FeederProc
        if source == "sim":
            sim_args = [*config.sim_args(), "--base-port", str(base), "--rate", f"{rate:.6g}"]
            pods_proc = SimProc(sim_args, ctx.workdir, tag)
            procs.append(pods_proc)
        else:
            wl = {**asdict(config), "releases": list(config.releases)}
            pods_proc = FeederProc(wl, base, rate, ctx.workdir, tag)
            procs.append(pods_proc)
            wait(pods_proc.ready, 60 + pods / 5, "the feeder's pods to get their subscribers")
        t_start = time.time()
        window_start = t_start + warmup
        latencies: list[float] = []
        to_kafka: list[float] = []  # ts -> the producer's CreateTime: the bridge's part
        received = 0
        first_ts = last_ts = 0.0
        cpu0: dict[str, float] | None = None
        cpu1: dict[str, float] | None = None

        def snapshot(now: float) -> dict[str, float]:
            snap = {
                "t": now,
                "bridge": bridge.cpu(),
                "pods": pods_proc.cpu(),
                "busy": procstat.machine_busy_seconds(),
                "self": procstat.self_cpu_seconds(),
            }
            broker = _broker_cpu(ctx)
            if broker is not None:
                snap["broker"] = broker
            return snap

        sent_events: int | None = None
        done_at = 0.0
        while True:
            for now, created, head in consumer.poll(0.05):
                received += 1
                if head.ts >= window_start:
                    latencies.append(now - head.ts)
                    to_kafka.append(created - head.ts)
                    first_ts = head.ts if not first_ts else min(first_ts, head.ts)
                    last_ts = max(last_ts, head.ts)
            now = time.time()
            if cpu0 is None and now >= window_start:
                cpu0 = snapshot(now)
            if sent_events is None:
                pods_proc.check_alive("the pods")
                bridge.check_alive("the bridge")
                sent_events = _all_sent(pods_proc, pods * batches)
                if sent_events is not None:
                    cpu1 = snapshot(now)
                    done_at = time.monotonic()
            elif received >= sent_events or time.monotonic() - done_at > 30:
                break
        window = last_ts - first_ts
        result.update(summarize(latencies))
        result.update(summarize(to_kafka, "to_producer_"))
        result.update(
            events_sent=sent_events,
            events_received=received,
            complete=received == sent_events,
            window_seconds=round(window, 2),
            achieved_events_per_s=round(len(latencies) / window, 1) if window > 0 else None,
        )
        if cpu0 is not None and cpu1 is not None and cpu1["t"] > cpu0["t"]:
            used = {k: cpu1[k] - cpu0[k] for k in cpu0 if k in cpu1}
            wall = used.pop("t")
            busy = used.pop("busy")
            for name in ("bridge", "pods", "broker"):
                if name in used:
                    result[f"{name}_cores"] = round(used[name] / wall, 2)
            result["machine_busy_cores"] = round(busy / wall, 2)
            result["other_cores"] = round(max(0.0, busy - sum(used.values())) / wall, 2)
        return result
    finally:
        if consumer is not None:
            consumer.close()
        _stop_all(procs)


def _all_sent(pods: SimProc | FeederProc, batches: int) -> int | None:
    """Events sent once every batch is out, else None."""
    if isinstance(pods, SimProc):
        return pods.sent_events() if pods.sent_batches() >= batches else None
    done = pods.done()
    return None if done is None else int(done["events"])
