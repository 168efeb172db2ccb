"""`python -m bench`: the benchmark suite's command line and the order of its runs."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import report
from bench.ceiling import run_ceiling
from bench.workload import WorkloadConfig, describe, generate
from bridge.vllm.releases import Release

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PARTS = ("ceiling", "peers", "naive", "scaling", "workers", "latency")
LOCAL_PARTS = frozenset({"ceiling", "peers"})  # need no broker
WORKERS_PODS = 32  # pods of the --workers runs: rendezvous hashing splits 32 pods 17/15
MIN_BATCHES_PER_POD = 60  # each pod's cache reaches its steady state (see bench/workload.py)

DESCRIPTION = """\
Measure kvbridge: how many vLLM KV-cache events per second it turns into acknowledged Kafka
records, at what CPU and memory cost, with what end-to-end latency, next to two references
measured in the same run on the same payloads:

  ceiling  the bridge's per-event work alone (decode msgpack + encode Avro), in one
           process: no sockets, no Kafka: an upper bound for the bridge's event loop.
  naive    the obvious loop (SUB recv -> msgpack -> dicts -> fastavro -> Producer.produce
           with default settings), without sequencing, replay, markers or metrics.
  peers    AIBrix's and llm-d's Go decoders (bench/gopeers, needs Go) next to kvbridge's
           decoder, on one CPU, on the same payloads (skipped with a note without Go).
  bridge   simulated vLLM pods (`python -m bridge simulate`) -> `python -m bridge run` ->
           a real Kafka broker, measured from outside via /proc.

Throughput runs pause the program under test (SIGSTOP) while the pods queue a backlog in
ZeroMQ, then resume it and time until the topic holds every record, so the pods' own speed
does not limit the result. Latency runs rate-limit the pods to 25%, 50% and 90% of the
bridge's measured maximum and time each record from vLLM's batch timestamp to a consumer.
Scaling: 1, 16 and 128 pods (and 512 in the full run, if the time budget allows).
Workers: 32 pods drained by `kvbridge run` with --workers 1, then --workers 2 (pods
sharded across the worker processes).

Without --bootstrap a private single-node broker is started (tests/kafka_broker.py, needs
Java 17; the first use downloads Kafka's jars with Maven) and stopped at the end.
Results: a table on stdout, JSON in bench/results/<UTC timestamp>.json (and --out FILE).
No number is asserted anywhere: read them next to each other, on the same machine.
What each number means: bench/README.md.

  python -m bench --quick                  # ~1-2 minutes
  python -m bench                          # full run, <= ~10 minutes on 2 cores
  python -m bench --only ceiling           # seconds, no broker
  python -m bench --only peers --quick     # the Go peers (first use: builds for minutes)
  python -m bench --bootstrap localhost:9092 --skip latency --out /tmp/bench.json
"""


@dataclass(frozen=True)
class Plan:
    mode: str
    drain_batches: int  # batches per throughput run, all pods together
    warmup_batches: int
    ceiling_batches: int  # per single-release ceiling variant
    pods: tuple[int, ...]  # scaling
    optional_pods: tuple[int, ...]  # run last, only if the time budget allows
    ref_pods: int  # naive, latency and the ratios use this pod count
    latency_seconds: float
    latency_warmup: float
    loads: tuple[float, ...]
    budget: float  # seconds

    repeats: int  # runs of the bridge and the naive loop at ref_pods, interleaved; median kept
    peer_rounds: int  # interleaved rounds of the peers part (Go, then kvbridge, alternating)

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            mode="quick",
            drain_batches=8_000,
            warmup_batches=2_000,
            ceiling_batches=5_000,
            pods=(1, 16, 128),
            optional_pods=(),
            ref_pods=16,
            latency_seconds=6.0,
            latency_warmup=2.0,
            loads=(0.25, 0.5, 0.9),
            budget=150,
            repeats=1,
            peer_rounds=3,
        )

    @classmethod
    def full(cls) -> Plan:
        return cls(
            mode="full",
            drain_batches=30_000,
            warmup_batches=4_000,
            ceiling_batches=10_000,
            pods=(1, 16, 128),
            optional_pods=(512,),
            ref_pods=16,
            latency_seconds=15.0,
            latency_warmup=3.0,
            loads=(0.25, 0.5, 0.9),
            budget=600,
            repeats=3,
            peer_rounds=5,
        )


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers such as 1,16,128") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers >= 1")
    return values


def _float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected fractions such as 0.25,0.5") from None
    if not values or not all(0 < v <= 1.5 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected fractions in (0, 1.5]")
    return values


def _parts(text: str) -> frozenset[str]:
    parts = frozenset(x.strip() for x in text.split(",") if x.strip())
    unknown = parts - set(PARTS)
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: parts are {', '.join(PARTS)}")
    return parts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("what to run")
    g.add_argument("--quick", action="store_true", help="small sizes: about 1-2 minutes")
    g.add_argument(
        "--only", type=_parts, metavar="PARTS", help=f"only these parts ({','.join(PARTS)})"
    )
    g.add_argument("--skip", type=_parts, metavar="PARTS", help="every part but these")
    g.add_argument(
        "--pods",
        type=_int_list,
        metavar="N,N,...",
        help="pod counts of the scaling runs (default 1,16,128; the full run adds 512 if the "
        "time budget allows)",
    )
    g.add_argument(
        "--ref-pods",
        type=int,
        metavar="N",
        help="pod count of the naive, latency and ratio runs (default 16)",
    )
    g.add_argument(
        "--batches",
        type=int,
        metavar="N",
        help="vLLM batches per throughput run, all pods together (default 8000 quick, 30000 "
        "full; ~6.7 events each)",
    )
    g.add_argument(
        "--ceiling-batches",
        type=int,
        metavar="N",
        help="batches per single-release ceiling variant (default 5000 quick, 10000 full)",
    )
    g.add_argument(
        "--repeat",
        type=int,
        metavar="N",
        help="runs of the bridge and the naive loop at --ref-pods, interleaved; the median "
        "is reported and used for the ratios and latency loads (default 1 quick, 3 full)",
    )
    g.add_argument(
        "--loads",
        type=_float_list,
        metavar="F,F,...",
        help="latency loads as fractions of the measured maximum (default 0.25,0.5,0.9)",
    )
    g.add_argument(
        "--latency-seconds",
        type=float,
        metavar="S",
        help="pod sending time per latency load (default 6 quick, 15 full)",
    )
    g.add_argument(
        "--budget",
        type=float,
        metavar="S",
        help="time budget in seconds; optional runs (512 pods) are skipped if they would "
        "exceed it (default 150 quick, 600 full)",
    )
    g.add_argument(
        "--latency-pods",
        choices=["feeder", "sim"],
        default="feeder",
        help="pods of the latency runs: 'feeder' sends the simulator's payloads re-stamped "
        "(bench/feeder.py; cheap, so it reaches 90%% load on a small machine), 'sim' runs "
        "`kvbridge simulate` itself (may fall short of the rate) (default feeder)",
    )
    g = p.add_argument_group("workload")
    g.add_argument(
        "--hash-mode",
        choices=["int", "bytes"],
        help="hashes of the end-to-end pods: vLLM's default 64-bit ints, or raw 32-byte "
        "digests (default int; the ceiling always measures both)",
    )
    g.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    g.add_argument(
        "--peer-rounds",
        type=int,
        metavar="N",
        help="interleaved rounds of the peers part; medians are reported (default 3 quick, 5 full)",
    )
    g.add_argument(
        "--go",
        metavar="CMD",
        help="the go command of the peers part (default: `go` on PATH; without one the part "
        "is skipped with a note)",
    )
    g = p.add_argument_group("environment and output")
    g.add_argument(
        "--bootstrap",
        metavar="HOST:PORT",
        help="use this Kafka broker instead of starting a private one (topics named "
        "t-bench-* are created on it)",
    )
    g.add_argument(
        "--broker-jit",
        choices=["full", "c1"],
        default="c1",
        help="JIT of the private broker's JVM: 'c1' (the tests' fast start: little compiling "
        "while we measure, lower peak) or 'full' (the JVM default: C2 compiles for minutes "
        "on the same 2 cores, better once warm) (default c1)",
    )
    g.add_argument("--out", metavar="FILE", help="also write the JSON results here")
    g.add_argument(
        "--results-dir",
        metavar="DIR",
        default=str(RESULTS_DIR),
        help="where <UTC timestamp>.json goes (default bench/results)",
    )
    g.add_argument(
        "--keep-workdir",
        action="store_true",
        help="keep the directory with the child processes' logs and sent-logs",
    )
    return p


def _plan(args: argparse.Namespace) -> Plan:
    plan = Plan.quick() if args.quick else Plan.full()
    changes: dict[str, Any] = {}
    if args.pods:
        changes.update(pods=args.pods, optional_pods=())
    if args.ref_pods:
        changes["ref_pods"] = args.ref_pods
    if args.batches:
        changes["drain_batches"] = args.batches
    if args.ceiling_batches:
        changes["ceiling_batches"] = args.ceiling_batches
    if args.loads:
        changes["loads"] = args.loads
    if args.latency_seconds:
        changes["latency_seconds"] = args.latency_seconds
    if args.repeat:
        changes["repeats"] = args.repeat
    if args.peer_rounds:
        changes["peer_rounds"] = args.peer_rounds
    if args.budget:
        changes["budget"] = args.budget
    return replace(plan, **changes)


class Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def log(self, message: str) -> None:
        print(f"[{self.elapsed():5.0f}s] {message}", file=sys.stderr, flush=True)


Variant = tuple[str, str, list[bytes], bool]  # label, description, payloads, same as e2e


def _variants(plan: Plan, ref: WorkloadConfig, ref_payloads: list[bytes]) -> list[Variant]:
    """The e2e mix and the three single-release workloads of the ceiling and the peers."""
    variants: list[Variant] = [
        (
            f"e2e mix, {ref.pods} pods",
            f"the payloads of the {ref.pods}-pod throughput runs ({ref.label()})",
            ref_payloads,
            True,
        )
    ]
    for release, mode in (("0.33.0", "int"), ("0.33.0", "bytes"), ("0.23.0", "int")):
        config = replace(
            ref, pods=1, batches_per_pod=plan.ceiling_batches, releases=(release,), hash_mode=mode
        )
        form = "map" if Release.parse(release).map_events else "array"
        hashes = "32-byte hashes" if mode == "bytes" else "int hashes"
        variants.append((f"{release} {form}, {hashes}", config.label(), generate(config), False))
    return variants


def _ceiling(doc: dict[str, Any], variants: list[Variant], clock: Clock) -> None:
    for label, description, payloads, same in variants:
        result = run_ceiling(payloads, label, description)
        result["same_payloads_as_e2e"] = same
        doc["ceiling"].append(result)
        clock.log(
            f"ceiling {label}: {result['events_per_s']:,.0f} events/s, "
            f"{result['cpu_us_per_event']} µs CPU/event"
        )


def _peers(
    variants: list[Variant], plan: Plan, args: argparse.Namespace, clock: Clock
) -> dict[str, Any]:
    from bench.peers import PRIMARY, find_go, run_peers

    order = sorted(variants, key=lambda v: v[0] != PRIMARY)  # the primary workload first
    result = run_peers(
        [(label, desc, payloads) for label, desc, payloads, _ in order],
        plan.peer_rounds,
        find_go(args.go),
        clock.log,
    )
    for r in result.get("results", []):
        if r["workload"] == PRIMARY:
            clock.log(
                f"peers {PRIMARY}: {r['name']}: {r.get('cpu_us_per_event', '-')} µs CPU/event"
            )
    return result


def _guarded(what: str, clock: Clock, fn: Any, *a: Any, **kw: Any) -> dict[str, Any]:
    try:
        return fn(*a, **kw)
    except Exception as exc:
        clock.log(f"{what} FAILED: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def _drain_summary(r: dict[str, Any]) -> str:
    if "error" in r:
        return "failed"
    if not r.get("events_per_s"):
        return f"nothing arrived ({r.get('events', 0)} events): INCOMPLETE"
    return (
        f"{r['events']:,} events in {r['seconds']:.2f}s = {r['events_per_s']:,.0f} events/s, "
        f"{r['cpu_us_per_event']} µs CPU/event, RSS {r['rss_mb']} MB"
        + ("" if r["complete"] else " (INCOMPLETE)")
    )


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median events/s (the lower middle one of an even count), carrying every
    run's events/s and CPU per event under "repeats"; the first failure if none succeeded."""
    ok = sorted((r for r in runs if "events_per_s" in r), key=lambda r: r["events_per_s"])
    if not ok:
        return runs[0]
    chosen = dict(ok[(len(ok) - 1) // 2])
    if len(runs) > 1:
        chosen["repeats"] = [
            {k: r.get(k) for k in ("events_per_s", "cpu_us_per_event", "other_cores", "error")}
            for r in runs
        ]
    return chosen


def _e2e(
    doc: dict[str, Any],
    plan: Plan,
    parts: frozenset[str],
    ref: WorkloadConfig,
    ref_mix: dict[str, Any],
    args: argparse.Namespace,
    clock: Clock,
    workdir: Path,
) -> None:
    from bench.e2e import RunContext, drain_run, latency_run
    from bench.kafka import broker

    scaling: list[dict[str, Any]] = doc["bridge"]["scaling"]
    with broker(args.bootstrap, jit=args.broker_jit) as b:
        clock.log(f"Kafka at {b.bootstrap}" + (" (started here)" if b.started_here else ""))
        ctx = RunContext(b.bootstrap, b.pid, workdir, ref, clock.log)
        per_pod = max(1, plan.drain_batches // plan.ref_pods)

        def drain(target: str, pods: int, batches: int, tag: str, **kw: Any) -> dict[str, Any]:
            clock.log(f"{target}, {pods} pods, {batches * pods:,} batches: start")
            r = _guarded(
                f"{target} {pods} pods", clock, drain_run, ctx, target, pods, batches, tag, **kw
            )
            r.setdefault("pods", pods)
            r.setdefault("target", target)
            clock.log(f"{target}, {pods} pods: {_drain_summary(r)}")
            return r

        warm = max(1, plan.warmup_batches // plan.ref_pods)
        doc["bridge"]["warmup"] = drain("bridge", plan.ref_pods, warm, "warmup")
        bridge_runs, naive_runs = [], []
        for i in range(plan.repeats):  # interleaved, so that slow phases hit both alike
            tag = f"bridge-{plan.ref_pods}-{i}"
            bridge_runs.append(drain("bridge", plan.ref_pods, per_pod, tag, known_mix=ref_mix))
            if "naive" in parts:
                tag = f"naive-{plan.ref_pods}-{i}"
                naive_runs.append(drain("naive", plan.ref_pods, per_pod, tag, known_mix=ref_mix))
        ref_run = median_run(bridge_runs)
        scaling.append(ref_run)
        doc["naive"] = median_run(naive_runs) if naive_runs else {"skipped": "not selected"}
        if "scaling" in parts:
            for pods in plan.pods:
                if pods != plan.ref_pods:
                    batches = max(MIN_BATCHES_PER_POD, plan.drain_batches // pods)
                    scaling.append(drain("bridge", pods, batches, f"bridge-{pods}"))
        if "workers" in parts:
            # The same fleet drained by one bridge process, then by --workers N (N <= cores).
            top = max(1, min(2, os.cpu_count() or 1))
            batches = max(MIN_BATCHES_PER_POD, plan.drain_batches // WORKERS_PODS)
            for n in sorted({1, top}):
                r = drain("bridge", WORKERS_PODS, batches, f"workers-{n}", workers=n)
                r["workers"] = n
                doc["bridge"].setdefault("workers", []).append(r)
        if "latency" in parts:
            if "error" in ref_run or not ref_run.get("events_per_s"):
                doc["bridge"]["latency"].append(
                    {"skipped": "no maximum throughput measured (the reference run failed)"}
                )
            else:
                max_eps = ref_run["events_per_s"]
                per_batch = ref_mix["events_per_batch"]
                for load in plan.loads:
                    clock.log(f"latency at {load:.0%} of {max_eps:,.0f} events/s: start")
                    r = _guarded(
                        f"latency {load:.0%}",
                        clock,
                        latency_run,
                        ctx,
                        plan.ref_pods,
                        load,
                        max_eps,
                        per_batch,
                        plan.latency_seconds,
                        plan.latency_warmup,
                        f"latency-{int(load * 100)}",
                        source=args.latency_pods,
                    )
                    r.setdefault("load", load)
                    doc["bridge"]["latency"].append(r)
                    if "error" not in r:
                        clock.log(
                            f"latency at {load:.0%}: {r['achieved_events_per_s']} events/s, "
                            f"p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, p99.9 {r['p999_ms']} ms"
                        )
        if "scaling" in parts:
            for pods in plan.optional_pods:
                biggest = max(
                    (r for r in scaling if "seconds" in r), key=lambda r: r["pods"], default=None
                )
                estimate = (
                    60.0 if biggest is None else 25.0 + 2.0 * biggest.get("wall_seconds", 30.0)
                )
                left = plan.budget - clock.elapsed()
                if estimate > left:
                    why = (
                        f"skipped: would exceed the time budget ({left:.0f}s left of "
                        f"{plan.budget:.0f}s, ~{estimate:.0f}s needed)"
                    )
                    scaling.append({"target": "bridge", "pods": pods, "skipped": why})
                    doc["notes"].append(f"{pods} pods {why}")
                    clock.log(f"bridge, {pods} pods: {why}")
                    continue
                batches = max(MIN_BATCHES_PER_POD, plan.drain_batches // pods)
                scaling.append(drain("bridge", pods, batches, f"bridge-{pods}"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = _plan(args)
    parts = frozenset(PARTS)
    if args.only:
        parts = args.only
    if args.skip:
        parts = parts - args.skip
    clock = Clock()
    started = datetime.now(UTC)
    doc: dict[str, Any] = {
        "bench": {
            "schema_version": report.SCHEMA_VERSION,
            "mode": plan.mode,
            "started": started.isoformat(timespec="seconds"),
            "command": " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])]),
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(terse=True),
            "python": platform.python_version(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        },
        "settings": {**asdict(plan), "parts": sorted(parts), "seed": args.seed},
        "workload": {},
        "ceiling": [],
        "peers": {"skipped": "not selected"},
        "naive": {"skipped": "not selected"},
        "bridge": {"scaling": [], "latency": []},
        "ratios": [],
        "notes": [
            f"{os.cpu_count()} CPUs shared by the simulated pods, the program under test, the "
            "broker and this process (and anything else running): single runs are noisy; "
            "compare numbers of the same run, not across machines.",
        ],
    }
    ref = WorkloadConfig(
        pods=plan.ref_pods,
        batches_per_pod=max(1, plan.drain_batches // plan.ref_pods),
        hash_mode=args.hash_mode,
        seed=args.seed,
    )
    clock.log(f"generating the workload: {ref.pods} pods x {ref.batches_per_pod} batches")
    ref_payloads = generate(ref)
    doc["workload"] = {"label": ref.label(), "config": asdict(ref), **describe(ref_payloads)}
    ref_mix = {
        k: doc["workload"][k]
        for k in ("events", "payload_bytes", "events_per_batch", "bytes_per_batch")
        + ("share_by_type", "stored_blocks_mean")
    }
    variants = _variants(plan, ref, ref_payloads) if parts & LOCAL_PARTS else []
    del ref_payloads
    if "ceiling" in parts:
        _ceiling(doc, variants, clock)
    if "peers" in parts:
        doc["peers"] = _guarded("peers", clock, _peers, variants, plan, args, clock)
        if "skipped" in doc["peers"]:
            clock.log(f"peers skipped: {doc['peers']['skipped']}")
            doc["notes"].append(f"peers skipped: {doc['peers']['skipped']}")
    del variants
    if parts - LOCAL_PARTS:
        doc["notes"] += [
            "Throughput runs: the bridge runs with --first-contact live (otherwise it would read "
            "the whole backlog twice, replay + live); latency runs use every default.",
            "naive: librdkafka's default producer settings (no idempotence, no compression); "
            "the bridge: idempotent, acks=all, lz4, linger 5 ms. CPU includes all threads.",
        ]
        workdir = Path(tempfile.mkdtemp(prefix="kvbridge-bench-"))
        try:
            _e2e(doc, plan, parts, ref, ref_mix, args, clock, workdir)
        finally:
            if args.keep_workdir:
                clock.log(f"logs kept in {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    doc["ratios"] = report.compute_ratios(doc, plan.ref_pods)
    finished = datetime.now(UTC)
    doc["bench"]["finished"] = finished.isoformat(timespec="seconds")
    doc["bench"]["seconds"] = round(clock.elapsed(), 1)
    doc["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    problems = report.validate(doc)
    if problems:  # a bug in this suite: say so, still save what was measured
        doc["notes"].append("report problems: " + "; ".join(problems))
    path = Path(args.results_dir) / f"{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    report.save(doc, path)
    if args.out:
        report.save(doc, Path(args.out))
    print(report.render(doc))
    print(f"\nresults: {path}" + (f" and {args.out}" if args.out else ""))
    return 1 if problems else 0
