"""The `kvbridge` command line: run, simulate, consume, replay."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from datetime import datetime
from typing import Any

from bridge import __version__
from bridge.cliargs import add_kafka_args, kafka_target, kv_pairs
from bridge.config import (
    BridgeConfig,
    ConfigError,
    check_endpoint,
    env_settings,
    load_toml,
    parse_duration,
    parse_pod,
)
from bridge.logsetup import setup_logging

log = logging.getLogger("kvbridge")

DESCRIPTION = """\
kvbridge follows vLLM engines' KV-cache event streams (ZeroMQ PUB + replay ROUTER), keeps
every (pod, data-parallel rank) stream complete and ordered, and writes each event as an
Avro record to a Kafka topic keyed by pod, so consumers can rebuild each pod's prefix-cache
state from any offset or time.

  kvbridge run --bootstrap-servers localhost:9092 \\
      --pod name=pod-a,model=llama,pub=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558
  kvbridge consume --from-beginning --pod pod-a      # events as JSON lines
  kvbridge replay                                    # rebuilt cache state per pod
  kvbridge simulate --pods 3                         # simulated vLLM pods for trying it out
"""


def _log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbridge",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvbridge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser(
        "run",
        help="follow vLLM pods and write their events to Kafka",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Follow vLLM pods and write every KV-cache event to Kafka.

Settings come from flags, then KVBRIDGE_* environment variables, then --config FILE (TOML),
then defaults. Pods: --pod (repeatable), KVBRIDGE_PODS (specs separated by ';'), or [[pods]]
tables in the file with the same keys. A pod spec:

  name=NAME,model=MODEL,pub=tcp://HOST:5557[,replay=tcp://HOST:5558][,dp=N][,topic=PREFIX]

pub/replay are vLLM's kv-events `endpoint` and `replay_endpoint` as seen from the bridge
(vLLM binds them when they contain '*'). With dp=N, rank r uses port+r on both. Without
replay=, gaps cannot be recovered and are written as EventsLost markers.

SIGINT/SIGTERM: stop reading, flush Kafka, exit 0.""",
    )
    run.add_argument("--config", metavar="FILE", help="TOML settings file")
    add_kafka_args(run)
    run.add_argument("--pod", action="append", default=[], metavar="SPEC", help="a pod to follow")
    run.add_argument(
        "--listen",
        metavar="ENDPOINT",
        help="bind one SUB socket (e.g. tcp://*:5557) that vLLM pods connect to (their endpoint "
        "has no '*'); such pods are given by topic=, without pub=, and told apart by topic. "
        "DP rank r connects to port + r, so the bridge binds port + r for every rank",
    )
    run.add_argument(
        "--metrics-port", type=int, help="Prometheus /metrics port (default 9400; 0 = off)"
    )
    run.add_argument("--metrics-host", help="address for /metrics (default 0.0.0.0)")
    run.add_argument(
        "--first-contact",
        choices=["replay", "live"],
        help="on first contact with a stream: replay from seq 0 (default) or start live",
    )
    run.add_argument(
        "--replay-timeout",
        type=parse_duration,
        metavar="DURATION",
        help="silence that fails a replay attempt (2s; alias AIBRIX_ZMQ_REPLAY_TIMEOUT)",
    )
    run.add_argument(
        "--replay-deadline",
        type=parse_duration,
        metavar="DURATION",
        help="longest one replay attempt may take (30s)",
    )
    run.add_argument(
        "--replay-attempts", type=int, help="replay attempts before a range is lost (3)"
    )
    run.add_argument(
        "--max-replays",
        type=int,
        metavar="K",
        help="replays in flight across all pods; vLLM serves them on its publishing thread (8)",
    )
    run.add_argument(
        "--reconnect-initial",
        type=parse_duration,
        metavar="DURATION",
        help="first reconnect backoff (1s; alias AIBRIX_ZMQ_RECONNECT_INTERVAL)",
    )
    run.add_argument(
        "--reconnect-max",
        type=parse_duration,
        metavar="DURATION",
        help="largest reconnect backoff (30s)",
    )
    run.add_argument(
        "--reconnect-factor",
        type=float,
        metavar="X",
        help="backoff growth per failed reconnect (2.0); jitter takes 0-50%% off",
    )
    run.add_argument(
        "--silence-timeout",
        type=parse_duration,
        metavar="DURATION",
        help="reconnect a stream after this long without a message (0 = never, the default: "
        "idle engines are legitimately silent; heartbeats catch dead peers)",
    )
    g = run.add_argument_group("delivery")
    g.add_argument(
        "--checkpoint-topic",
        metavar="NAME",
        help="compacted topic of per-stream checkpoints (default <topic>.checkpoints); a "
        "restarted bridge resumes each stream from it with a replay",
    )
    g.add_argument(
        "--checkpoint-interval",
        type=parse_duration,
        metavar="DURATION",
        help="how often acknowledged positions are checkpointed (1s)",
    )
    g.add_argument(
        "--exactly-once",
        action="store_true",
        default=None,
        help="write events and checkpoints in Kafka transactions: a read_committed consumer "
        "sees every event exactly once across bridge crashes",
    )
    g.add_argument(
        "--transactional-id",
        metavar="ID",
        help="transactional id (default kvbridge-<topic>); a second bridge with the "
        "same id fences the first, which exits with code 3",
    )
    g.add_argument(
        "--commit-interval",
        type=parse_duration,
        metavar="DURATION",
        help="exactly-once: commit at least this often (100ms)",
    )
    g.add_argument(
        "--commit-max-events",
        type=int,
        metavar="N",
        help="exactly-once: commit after this many records (10000)",
    )
    g.add_argument(
        "--rcvhwm",
        type=int,
        metavar="N",
        help="batches ZeroMQ may queue per stream while Kafka is slow (10000); beyond it vLLM "
        "drops and the bridge recovers by replay. Part of the memory bound (see README)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=parse_duration,
        metavar="DURATION",
        help="on SIGTERM, how long to flush, checkpoint and commit (30s)",
    )
    run.add_argument(
        "--idle-probe",
        type=parse_duration,
        metavar="DURATION",
        help="after this long without a message, ask the pod's replay socket once for newer "
        "batches, so a dropped last batch is not missed while the engine is idle (2s; 0 = off)",
    )
    run.add_argument(
        "--poll-timeout",
        type=parse_duration,
        metavar="DURATION",
        help="longest the event loop waits between checks (100ms; alias AIBRIX_ZMQ_POLL_TIMEOUT)",
    )
    _log_args(run)

    from bridge.simulator.cli import configure_parser as configure_simulate

    sim = sub.add_parser(
        "simulate",
        help="run simulated vLLM pods (PUB + replay ROUTER) for demos and tests",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_simulate(sim)

    from bridge.checker import configure_parser as configure_check

    configure_check(
        sub.add_parser("check", help="verify the topic: contiguity, duplicates, markers")
    )

    for name, helptext in (
        ("consume", "print the topic's records as JSON lines"),
        ("replay", "rebuild per-pod cache state from the topic and print it"),
    ):
        p = sub.add_parser(name, help=helptext, description=helptext)
        add_kafka_args(p)
        where = p.add_mutually_exclusive_group()
        where.add_argument(
            "--from-beginning", action="store_true", help="start at the beginning (default)"
        )
        where.add_argument(
            "--from-end", action="store_true", help="start at the end (with --follow)"
        )
        where.add_argument(
            "--from-offset", type=int, metavar="N", help="start at offset N of --partition"
        )
        where.add_argument(
            "--from-timestamp",
            metavar="TIME",
            help="start at the first record at/after TIME (ISO 8601, or ms since the epoch)",
        )
        p.add_argument("--partition", type=int, help="partition for --from-offset")
        p.add_argument(
            "--to-offset", type=int, metavar="N", help="stop after offset N (per partition)"
        )
        p.add_argument("--pod", action="append", default=[], help="only these pods (repeatable)")
        p.add_argument("--follow", action="store_true", help="keep reading new records")
        _log_args(p)
        if name == "consume":
            p.add_argument(
                "--type",
                action="append",
                default=[],
                metavar="TYPE",
                help="only these event/marker types, e.g. BlockStored, EventsLost (repeatable)",
            )
            p.add_argument("--max", type=int, metavar="N", help="stop after N records")
        else:
            p.add_argument(
                "--json", action="store_true", help="print the full state (every block) as JSON"
            )
            p.add_argument(
                "--query",
                metavar="HASHES",
                help="a request's block hashes in order, comma-separated (decimal 64-bit keys as "
                "vLLM sends them, or hex digests/keys with 0x); prints the longest cached prefix "
                "per pod and rank",
            )
            p.add_argument("--medium", help="with --query: only this tier, e.g. GPU")
    return parser


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{value!r} is not a boolean")


def resolve_run_config(
    args: argparse.Namespace, environ: dict[str, str] | None = None
) -> BridgeConfig:
    """Flags win over KVBRIDGE_* env vars, which win over the TOML file."""
    file: dict[str, Any] = load_toml(args.config) if args.config else {}
    env = env_settings(environ)
    cfg = BridgeConfig()

    def pick(name: str, conv: type = str) -> Any:
        flag = getattr(args, name, None)
        if flag is not None:
            return flag
        for source, value in (
            ("env KVBRIDGE_" + name.upper(), env.get(name)),
            ("file", file.get(name)),
        ):
            if value is not None:
                try:
                    return conv(value)
                except (TypeError, ValueError) as exc:
                    what = (
                        "a duration (2.5, 100ms, 5s)" if conv is parse_duration else conv.__name__
                    )
                    raise ConfigError(f"{source} {name}={value!r}: expected {what}") from exc
        return getattr(cfg, name)

    cfg.bootstrap_servers = pick("bootstrap_servers")
    cfg.topic = pick("topic")
    cfg.metrics_port = pick("metrics_port", int)
    cfg.metrics_host = pick("metrics_host")
    cfg.first_contact = pick("first_contact")
    if cfg.first_contact not in ("replay", "live"):
        raise ConfigError(f"first_contact={cfg.first_contact!r}: accepted values are replay, live")
    cfg.replay_timeout = pick("replay_timeout", parse_duration)
    cfg.replay_deadline = pick("replay_deadline", parse_duration)
    cfg.replay_attempts = pick("replay_attempts", int)
    cfg.max_replays = pick("max_replays", int)
    cfg.reconnect_initial = pick("reconnect_initial", parse_duration)
    cfg.reconnect_max = pick("reconnect_max", parse_duration)
    cfg.reconnect_factor = pick("reconnect_factor", float)
    cfg.silence_timeout = pick("silence_timeout", parse_duration)
    cfg.idle_probe = pick("idle_probe", parse_duration)
    cfg.checkpoint_topic = pick("checkpoint_topic")
    cfg.checkpoint_interval = pick("checkpoint_interval", parse_duration)
    cfg.exactly_once = pick("exactly_once", _boolean)
    cfg.transactional_id = pick("transactional_id")
    cfg.commit_interval = pick("commit_interval", parse_duration)
    cfg.commit_max_events = pick("commit_max_events", int)
    cfg.shutdown_timeout = pick("shutdown_timeout", parse_duration)
    cfg.rcvhwm = pick("rcvhwm", int)
    if cfg.rcvhwm < 1:
        raise ConfigError(f"rcvhwm={cfg.rcvhwm}: must be >= 1")
    if cfg.commit_max_events < 1 or cfg.commit_interval <= 0 or cfg.checkpoint_interval <= 0:
        raise ConfigError("commit_max_events, commit_interval, checkpoint_interval must be > 0")
    cfg.poll_timeout = pick("poll_timeout", parse_duration)
    for name in ("replay_attempts", "max_replays"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name}={getattr(cfg, name)}: must be >= 1")
    if cfg.reconnect_factor < 1.0:
        raise ConfigError(f"reconnect_factor={cfg.reconnect_factor}: must be >= 1.0")
    if min(cfg.replay_timeout, cfg.replay_deadline, cfg.poll_timeout, cfg.reconnect_initial) <= 0:
        raise ConfigError(
            "replay_timeout, replay_deadline, poll_timeout and reconnect_initial must be > 0"
        )
    if args.pod:
        specs: list[Any] = list(args.pod)
    elif env.get("pods"):
        specs = [s for s in env["pods"].split(";") if s.strip()]
    else:
        specs = list(file.get("pods", []))
    cfg.pods = [parse_pod(s) for s in specs]
    cfg.listen = pick("listen")
    if cfg.listen is not None:
        check_endpoint("listen", cfg.listen)
    listeners = [p for p in cfg.pods if p.pub is None]
    if listeners and cfg.listen is None:
        raise ConfigError(
            f"pod {listeners[0].name} has no pub= endpoint: give --listen tcp://*:PORT for pods "
            "that connect to the bridge, or pub=tcp://HOST:PORT for pods the bridge connects to"
        )
    topics = [p.topic for p in listeners]
    if len(set(topics)) != len(topics) or "" in topics:
        raise ConfigError(
            "pods on the --listen socket are told apart by topic: each needs its own non-empty "
            "topic= (vLLM's kv-events-config topic, e.g. kv@pod-a@llama)"
        )
    names = [p.name for p in cfg.pods]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"pod names must be unique; repeated: {', '.join(dupes)}")
    cfg.kafka = {str(k): str(v) for k, v in file.get("kafka", {}).items()}
    cfg.kafka.update(kv_pairs(args.kafka_property, "--kafka-property"))
    return cfg


def cmd_run(args: argparse.Namespace) -> int:
    from bridge.runner import Bridge
    from bridge.sink import Fenced

    cfg = resolve_run_config(args)
    if not cfg.pods:
        raise ConfigError(
            "no pods to follow: give --pod name=NAME,model=MODEL,pub=tcp://HOST:5557,"
            "replay=tcp://HOST:5558 (repeatable), KVBRIDGE_PODS, or [[pods]] in --config"
        )
    bridge = Bridge(cfg)
    if cfg.metrics_port:
        bridge.metrics.serve(cfg.metrics_port, cfg.metrics_host)
        log.info("metrics on http://%s:%d/metrics", cfg.metrics_host, cfg.metrics_port)

    def _stop(signum: int, _frame: Any) -> None:
        log.info("%s: stopping (flushing Kafka)", signal.Signals(signum).name)
        bridge.stop.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        bridge.open()
    except Exception:
        bridge.close()
        raise
    log.info(
        "bridge running: %d pods, %d streams -> topic %s at %s",
        len(cfg.pods),
        len(bridge.streams),
        cfg.topic,
        cfg.bootstrap_servers,
    )
    try:
        bridge.run()
    except Fenced as exc:
        print(f"kvbridge run: {exc}", file=sys.stderr)
        return 3
    log.info("stopped")
    return 0


def _parse_time(text: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise ConfigError(
            f"--from-timestamp {text!r}: expected ISO 8601 (2026-12-02T16:00:00Z) or ms since epoch"
        ) from exc
    if dt.tzinfo is None:
        raise ConfigError(f"--from-timestamp {text!r}: add a timezone, e.g. Z or +00:00")
    return int(dt.timestamp() * 1000)


def _reader_args(args: argparse.Namespace) -> tuple[Any, Any]:
    from bridge.consumer import StartAt, TopicReader

    bootstrap, topic, overrides = kafka_target(args)
    if args.from_offset is not None:
        if args.partition is None:
            raise ConfigError("--from-offset needs --partition (offsets are per partition)")
        start = StartAt("offset", offset=args.from_offset, partition=args.partition)
    elif args.from_timestamp:
        start = StartAt("timestamp", timestamp_ms=_parse_time(args.from_timestamp))
    elif args.from_end:
        start = StartAt("end")
    else:
        start = StartAt("beginning")
    reader = TopicReader(bootstrap, topic, overrides)
    return reader, start


def cmd_consume(args: argparse.Namespace) -> int:
    from bridge.jsonview import event_to_json

    reader, start = _reader_args(args)
    pods, types = set(args.pod), set(args.type)
    n = 0
    out = sys.stdout
    with reader:
        for cr in reader.read(start, follow=args.follow, to_offset=args.to_offset):
            env, ev = cr.record.envelope, cr.record.event
            name = type(ev).__name__
            if (pods and env.pod not in pods) or (types and name not in types):
                continue
            line = {
                "partition": cr.partition,
                "offset": cr.offset,
                "timestamp": cr.timestamp_ms,
                "pod": env.pod,
                "model": env.model,
                "dp_rank": env.dp_rank,
                "epoch": env.epoch,
                "seq": env.seq,
                "index": env.index,
                "ts": env.ts,
                "type": name,
                "event": event_to_json(ev),
            }
            if env.batch_extra:
                line["batch_extra"] = {k: v.hex() for k, v in env.batch_extra.items()}
            out.write(json.dumps(line) + "\n")
            n += 1
            if args.max is not None and n >= args.max:
                break
        out.flush()
        if reader.skipped:
            log.warning("%d records could not be read and were skipped", reader.skipped)
    return 0


def parse_query(text: str) -> list[int]:
    """Block hashes as vLLM's 64-bit keys: decimal ints, or hex (0x...) of a key or a digest
    (a digest's key is its last 8 bytes, as in vLLM's integer mode)."""
    keys = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            if part.lower().startswith("0x"):
                raw = bytes.fromhex(part[2:].rjust(16, "0") if len(part) <= 18 else part[2:])
                keys.append(int.from_bytes(raw[-8:], "big"))
            else:
                keys.append(int(part) % (1 << 64))
        except ValueError:
            raise ConfigError(
                f"--query: {part!r} is not a block hash; give decimal keys (as vLLM sends them) "
                "or hex with 0x, separated by commas"
            ) from None
    if not keys:
        raise ConfigError("--query needs at least one block hash")
    return keys


def cmd_replay(args: argparse.Namespace) -> int:
    from bridge.state import CacheState

    reader, start = _reader_args(args)
    pods = set(args.pod)
    state = CacheState()
    with reader:
        for cr in reader.read(start, follow=args.follow, to_offset=args.to_offset):
            if pods and cr.record.envelope.pod not in pods:
                continue
            state.apply(cr.record)
    if args.query is not None:
        keys = parse_query(args.query)
        matches = state.prefix_match(keys, args.medium)
        ranked = sorted(matches.items(), key=lambda kv: (-kv[1], kv[0]))
        print(f"{'pod':<20} {'rank':>4} {'prefix':>7} of {len(keys)} blocks")
        for (pod, rank), n in ranked:
            print(f"{pod:<20} {rank:>4} {n:>7}")
        return 0
    if args.json:
        json.dump(state.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    s = state.summary()
    print(f"records applied: {s['records_applied']}   markers: {s['markers'] or 'none'}")
    print(f"{'pod':<20} {'rank':>4} {'epoch':>14} {'last_seq':>9} {'blocks':>8}  by medium / notes")
    for e in s["streams"]:
        notes = ", ".join(f"{k}={v}" for k, v in e["blocks_by_medium"].items())
        if e["uncertain"]:
            notes += f"  UNCERTAIN ({e['lost_batches']} batches lost)"
        last = "-" if e["last_seq"] is None else e["last_seq"]
        row = f"{e['pod']:<20} {e['dp_rank']:>4} {e['epoch']!s:>14} {last!s:>9} {e['blocks']:>8}"
        print(f"{row}  {notes}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(getattr(args, "log_level", "info"), getattr(args, "log_format", "text"))
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "simulate":
            from bridge.simulator.cli import run as run_simulate

            return run_simulate(args)
        if args.command == "consume":
            return cmd_consume(args)
        if args.command == "check":
            from bridge.checker import run as run_check

            return run_check(args)
        if args.command == "replay":
            return cmd_replay(args)
    except ConfigError as exc:
        print(f"kvbridge {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:
        print(f"kvbridge {args.command}: {exc}", file=sys.stderr)
        return 1
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
