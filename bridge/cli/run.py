"""`kvbridge run`: its options, the settings they resolve to (flags, env, file, defaults), and
the process around the :class:`~bridge.ingest.runner.Bridge` (signals, shutdown, exit codes)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from bridge.cli.args import (
    add_kafka_args,
    add_listen_args,
    add_log_args,
    duration,
    kv_pairs,
    resolve_listen,
)
from bridge.cli.configcheck import (
    boolean,
    check_file_keys,
    check_kafka_properties,
    convert,
    kafka_value,
    validate,
)
from bridge.ops.config import (
    AIBRIX_ALIASES,
    KAFKA_ENV_PREFIX,
    BridgeConfig,
    ConfigError,
    check_endpoint,
    check_topic_template,
    env_kafka_properties,
    env_settings,
    load_toml,
    parse_duration,
    parse_pod,
    unknown_env,
)

log = logging.getLogger("kvbridge")

UNACKNOWLEDGED_EXIT = 4  # stopped with records Kafka did not acknowledge (checkpoints before them)
SHUTDOWN_GRACE = 10.0  # after --shutdown-timeout: the last resort exits without waiting more


def configure_parser(sub: Any) -> argparse.ArgumentParser:
    """Add `kvbridge run` to the subcommands; returns its parser (`config check` shares it)."""
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

SIGINT/SIGTERM: stop reading, flush Kafka, checkpoint, exit 0 within --shutdown-timeout.
Exit code 4: Kafka did not acknowledge some records in time (e.g. the broker is down); they
were dropped, the checkpoints stay before them and the next start re-reads them.""",
    )
    run.add_argument("--config", metavar="FILE", help="TOML settings file (env KVBRIDGE_CONFIG)")
    add_kafka_args(
        run,
        "topic to write, or a template: kv-events.{model} gives each model its own topic "
        "({model} and {pod} are replaced; characters Kafka refuses become _)",
    )
    run.add_argument(
        "--topic-partitions",
        type=int,
        metavar="N",
        help="partitions of topics the bridge creates at start (6); an existing topic is left "
        "as it is (a warning if it has fewer)",
    )
    run.add_argument(
        "--topic-replication",
        type=int,
        metavar="N",
        help="replication factor of topics the bridge creates (-1 = the broker's "
        "default.replication.factor, the default); at most the number of brokers",
    )
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
    run.add_argument(
        "--metrics-host",
        help="address for /metrics and the health checks: 127.0.0.1 (the default) serves this "
        "host only, 0.0.0.0 every interface (the container image sets KVBRIDGE_METRICS_HOST)",
    )
    run.add_argument(
        "--first-contact",
        choices=["replay", "live"],
        help="on first contact with a stream: replay from seq 0 (default) or start live",
    )
    run.add_argument(
        "--replay-timeout",
        type=duration,
        metavar="DURATION",
        help="silence that fails a replay attempt (2s; alias AIBRIX_ZMQ_REPLAY_TIMEOUT)",
    )
    run.add_argument(
        "--replay-deadline",
        type=duration,
        metavar="DURATION",
        help="longest one replay attempt may take (30s)",
    )
    run.add_argument(
        "--replay-attempts", type=int, help="replay attempts before a range is lost (3)"
    )
    run.add_argument(
        "--max-seq-jump",
        type=int,
        metavar="N",
        help="a live seq more than N beyond the highest known starts a new epoch (a restart "
        "the seq did not show) instead of a replay; raise it above the pods' replay ring "
        "(vLLM's buffer_steps) if that is larger (100000)",
    )
    run.add_argument(
        "--max-held",
        type=int,
        metavar="N",
        help="live batches held per stream while a replay fills the gap before them; more are "
        "dropped, counted (kvbridge_held_dropped_total) and fetched by the replay (10000)",
    )
    run.add_argument(
        "--max-replays",
        type=int,
        metavar="K",
        help="replays in flight across all pods; vLLM serves them on its publishing thread (8)",
    )
    run.add_argument(
        "--reconnect-initial",
        type=duration,
        metavar="DURATION",
        help="first reconnect backoff (1s; alias AIBRIX_ZMQ_RECONNECT_INTERVAL)",
    )
    run.add_argument(
        "--reconnect-max",
        type=duration,
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
        type=duration,
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
        type=duration,
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
        "--repartition",
        action="store_true",
        default=None,
        help="spread the pods over the kv-events topic's current partitions: without it, "
        "each pod stays in the partition it had when partitions are added (the count is "
        "pinned in the checkpoints); with it, a pod whose partition changes starts a new "
        "epoch there (env KVBRIDGE_REPARTITION; see docs/operations.md)",
    )
    g.add_argument(
        "--transactional-id",
        metavar="ID",
        help="transactional id (default kvbridge-<topic>); a second bridge with the "
        "same id fences the first, which exits with code 3",
    )
    g.add_argument(
        "--commit-interval",
        type=duration,
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
        "--max-message-bytes",
        type=int,
        metavar="N",
        help="largest ZeroMQ message accepted from a pod (64 MiB); a larger one is counted "
        "(kvbridge_decode_errors_total kind=oversized_frame), ZeroMQ drops the connection and "
        "the bridge reconnects",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=duration,
        metavar="DURATION",
        help="on SIGTERM, how long to flush, checkpoint and commit (30s)",
    )
    run.add_argument(
        "--idle-probe",
        type=duration,
        metavar="DURATION",
        help="after this long without a message, ask the pod's replay socket once for newer "
        "batches, so a dropped last batch is not missed while the engine is idle (2s; 0 = off)",
    )
    run.add_argument(
        "--silent-warning",
        type=parse_duration,
        metavar="DURATION",
        help="warn (log, kvbridge_stream_silent, /readyz details) about a stream that has "
        "received nothing at all this long after it was opened (30s; 0 = never)",
    )
    run.add_argument(
        "--poll-timeout",
        type=duration,
        metavar="DURATION",
        help="longest the event loop waits between checks (100ms; alias AIBRIX_ZMQ_POLL_TIMEOUT)",
    )
    run.add_argument(
        "--workers",
        type=int,
        metavar="N",
        default=1,
        help="split the pods across N bridge processes on this host (one core each), sharded "
        "like replicas; worker i serves metrics on the metrics port + i (default 1)",
    )
    shard = run.add_argument_group(
        "sharding",
        "split one fleet across N bridge replicas: each follows the pods that rendezvous "
        "hashing of the pod name assigns to it (no overlap; changing N moves ~1/N of the pods)",
    )
    shard.add_argument(
        "--shard-index",
        type=int,
        metavar="I",
        help="this replica's shard, 0..N-1 (env KVBRIDGE_SHARD_INDEX; default 0)",
    )
    shard.add_argument(
        "--shard-count",
        type=int,
        metavar="N",
        help="how many replicas split the fleet (env KVBRIDGE_SHARD_COUNT; default 1)",
    )
    from bridge.cli.discovery import add_discovery_args

    add_discovery_args(run)
    add_listen_args(run)
    add_log_args(run)
    return run


def resolve_run_config(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    sources: dict[str, str] | None = None,
    notes: list[str] | None = None,
    for_run: bool = False,
) -> BridgeConfig:
    """Flags win over KVBRIDGE_* env vars, which win over the TOML file, then the defaults.

    ``sources`` (if given) receives where each setting came from (``flag``, ``env NAME``,
    ``file PATH``, ``default``; librdkafka properties as ``kafka.<name>``); ``notes`` receives
    warnings that do not stop the bridge (e.g. a KVBRIDGE_* variable that sets nothing).
    ``for_run``: also what `run` needs to start (pods to follow, --workers), so that `run` and
    `config check` refuse the same settings. One ConfigError lists every problem found."""
    environ = os.environ if environ is None else environ
    if not args.config and environ.get("KVBRIDGE_CONFIG"):
        args.config = environ["KVBRIDGE_CONFIG"]
    file: dict[str, Any] = load_toml(args.config) if args.config else {}
    file_source = f"file {args.config}"
    if args.config:
        check_file_keys(file, args.config)  # the tables' shapes; unknown keys at the end
    env = env_settings(dict(environ))
    cfg = BridgeConfig()
    sources = {} if sources is None else sources
    problems: list[str] = []

    def collect(check: Callable[[], Any]) -> Any:
        """``check()``, or None with its ConfigError noted: every problem is reported."""
        try:
            return check()
        except ConfigError as exc:
            problems.append(str(exc))
            return None

    def env_source(name: str) -> str:
        var = "KVBRIDGE_" + name.upper()
        if var not in environ:
            var = next((a for a, n in AIBRIX_ALIASES.items() if n == name and a in environ), var)
        return "env " + var

    def pick(name: str, conv: Callable[[Any], Any] = str) -> Any:
        flag = getattr(args, name, None)
        if flag is not None:
            sources[name] = "flag"
            return flag
        for source, value in ((env_source(name), env.get(name)), (file_source, file.get(name))):
            if value is not None:
                sources[name] = source
                try:
                    return convert(name, source, value, conv)
                except ConfigError as exc:
                    problems.append(str(exc))
                    return getattr(cfg, name)
        sources[name] = "default"
        return getattr(cfg, name)

    cfg.bootstrap_servers = pick("bootstrap_servers")
    cfg.topic = pick("topic")
    cfg.topic_partitions = pick("topic_partitions", int)
    cfg.topic_replication = pick("topic_replication", int)
    cfg.metrics_port = pick("metrics_port", int)
    cfg.metrics_host = pick("metrics_host")
    cfg.first_contact = pick("first_contact")
    cfg.replay_timeout = pick("replay_timeout", parse_duration)
    cfg.replay_deadline = pick("replay_deadline", parse_duration)
    cfg.replay_attempts = pick("replay_attempts", int)
    cfg.max_seq_jump = pick("max_seq_jump", int)
    cfg.max_held = pick("max_held", int)
    cfg.max_replays = pick("max_replays", int)
    cfg.reconnect_initial = pick("reconnect_initial", parse_duration)
    cfg.reconnect_max = pick("reconnect_max", parse_duration)
    cfg.reconnect_factor = pick("reconnect_factor", float)
    cfg.silence_timeout = pick("silence_timeout", parse_duration)
    cfg.idle_probe = pick("idle_probe", parse_duration)
    cfg.silent_warning = pick("silent_warning", parse_duration)
    cfg.checkpoint_topic = pick("checkpoint_topic")
    cfg.checkpoint_interval = pick("checkpoint_interval", parse_duration)
    cfg.exactly_once = pick("exactly_once", boolean)
    cfg.repartition = pick("repartition", boolean)
    cfg.transactional_id = pick("transactional_id")
    cfg.commit_interval = pick("commit_interval", parse_duration)
    cfg.commit_max_events = pick("commit_max_events", int)
    cfg.shutdown_timeout = pick("shutdown_timeout", parse_duration)
    cfg.rcvhwm = pick("rcvhwm", int)
    cfg.max_message_bytes = pick("max_message_bytes", int)
    cfg.poll_timeout = pick("poll_timeout", parse_duration)
    problems += validate(cfg, sources)
    if args.pod:
        specs: list[Any] = list(args.pod)
        sources["pods"] = "flag"
    elif env.get("pods"):
        specs = [s for s in env["pods"].split(";") if s.strip()]
        sources["pods"] = "env KVBRIDGE_PODS"
    else:
        specs = list(file.get("pods", []))
        sources["pods"] = file_source if specs else "default"
    pod_notes: list[str] = []
    parsed = [collect(lambda spec=spec: parse_pod(spec, pod_notes)) for spec in specs]
    cfg.pods = [p for p in parsed if p is not None]
    cfg.listen = pick("listen")
    if cfg.listen is not None:
        collect(lambda: check_endpoint("listen", cfg.listen, bind=True))
    listeners = [p for p in cfg.pods if p.pub is None]
    if listeners and cfg.listen is None:
        problems.append(
            f"pod {listeners[0].name} has no pub= endpoint: give --listen tcp://*:PORT for pods "
            "that connect to the bridge, or pub=tcp://HOST:PORT for pods the bridge connects to"
        )
    topics = [p.topic for p in listeners]
    if len(set(topics)) != len(topics) or "" in topics:
        problems.append(
            "pods on the --listen socket are told apart by topic: each needs its own non-empty "
            "topic= (vLLM's kv-events-config topic, e.g. kv@pod-a@llama)"
        )
    names = [p.name for p in cfg.pods]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"pod names must be unique; repeated: {', '.join(dupes)}")
    collect(lambda: check_topic_template(cfg.topic))
    cfg.shard_count = pick("shard_count", int)
    cfg.shard_index = pick("shard_index", int)
    if cfg.shard_count < 1 or not 0 <= cfg.shard_index < cfg.shard_count:
        problems.append(
            f"shard_index={cfg.shard_index}, shard_count={cfg.shard_count}: the count must be "
            ">= 1 and the index in 0..count-1 (a StatefulSet's pod ordinal, with count = replicas)"
        )
    workers = getattr(args, "workers", 1)
    if workers < 1:
        problems.append(f"--workers {workers}: must be a whole number >= 1")
    from bridge.cli.discovery import resolve_discovery

    collect(lambda: resolve_discovery(cfg, pick))
    collect(lambda: resolve_listen(cfg, pick, workers))
    if for_run and not specs and cfg.discovery == "static" and not cfg.listen_discover:
        problems.append(
            "no pods to follow: give --pod name=NAME,model=MODEL,pub=tcp://HOST:5557,"
            "replay=tcp://HOST:5558 (repeatable), KVBRIDGE_PODS, or [[pods]] in --config, "
            "or --discovery kubernetes|dns, or --listen with --listen-discover"
        )
    flag_props = collect(lambda: kv_pairs(args.kafka_property, "--kafka-property"))
    layers = (
        (file_source, {str(k): kafka_value(v) for k, v in file.get("kafka", {}).items()}),
        ("env", env_kafka_properties(dict(environ))),
        ("flag", flag_props or {}),
    )
    cfg.schema_registry_url = pick("schema_registry_url")
    cfg.schema_registry = {str(k): str(v) for k, v in file.get("schema_registry", {}).items()}
    if "schema_registry" in file:
        sources["schema_registry"] = file_source  # a [schema_registry] table of client properties
    sr_flags = (
        collect(
            lambda: kv_pairs(
                getattr(args, "schema_registry_property", []), "--schema-registry-property"
            )
        )
        or {}
    )
    cfg.schema_registry.update(sr_flags)
    sources.update({f"schema_registry.{k}": "flag" for k in sr_flags})
    cfg.kafka = {}
    for where, props in layers:
        for k, v in props.items():
            cfg.kafka[k] = v
            env_var = KAFKA_ENV_PREFIX + k.upper().replace(".", "_")
            sources["kafka." + k] = "env " + env_var if where == "env" else where
    if args.config:
        collect(lambda: check_file_keys(file, args.config, set(sources)))
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(
            f"{len(problems)} problems in the settings:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    unknown = unknown_env(dict(environ), {f.name for f in fields(BridgeConfig)} | {"config"})
    for note in [
        *pod_notes,
        *(f"{var} is not a kvbridge setting and is ignored (a typo?)" for var in unknown),
    ]:
        log.warning("%s", note)
        if notes is not None:
            notes.append(note)
    return cfg


def run(args: argparse.Namespace) -> int:
    """`kvbridge run`: 0 when stopped cleanly, 3 when fenced, 4 with unacknowledged records."""
    from bridge.ingest.runner import Bridge
    from bridge.log.sink import Fenced

    sources: dict[str, str] = {}
    cfg = resolve_run_config(args, sources=sources, for_run=True)
    for warning in check_kafka_properties(cfg.kafka, sources, cfg.exactly_once):
        log.warning("librdkafka: %s", warning)
    if args.workers > 1:
        from bridge.ops.workers import supervise

        return supervise(
            args.argv, args.workers, cfg.shard_index, cfg.shard_count, cfg.metrics_port
        )
    bridge = Bridge(cfg)
    if cfg.metrics_port:
        from bridge.ops.health import HealthServer

        http = HealthServer(
            bridge.metrics.registry, bridge.probes.liveness, bridge.probes.readiness
        )
        http.start(cfg.metrics_port, cfg.metrics_host)
        log.info(
            "metrics and health on http://%s:%d (/metrics, /healthz, /readyz)",
            cfg.metrics_host,
            cfg.metrics_port,
        )

    def _stop(signum: int, _frame: Any) -> None:
        log.info("%s: stopping (flushing Kafka)", signal.Signals(signum).name)
        if discovery is not None:
            discovery.stop()  # no pods added or removed while the bridge closes
        if not bridge.stop.is_set():
            last_resort = threading.Timer(cfg.shutdown_timeout + SHUTDOWN_GRACE, _give_up)
            last_resort.daemon = True
            last_resort.start()
        bridge.stop.set()

    def _give_up() -> None:
        """Shutdown is bounded even if something blocks that should not (a full producer
        queue with Kafka down, a library call): checkpoints are only ever written for
        acknowledged batches, so exiting here loses nothing a restart cannot re-read."""
        log.error(
            "shutdown did not finish within --shutdown-timeout (%gs) + %gs; exiting now "
            "(exit code %d): unacknowledged records are dropped, the checkpoints stay at the "
            "last acknowledged batch and the next start re-reads the rest",
            cfg.shutdown_timeout,
            SHUTDOWN_GRACE,
            UNACKNOWLEDGED_EXIT,
        )
        logging.shutdown()
        os._exit(UNACKNOWLEDGED_EXIT)

    discovery: Any = None

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
    from bridge.cli.discovery import start_discovery

    try:
        discovery = start_discovery(bridge, cfg)  # after open(), stopped before close()
    except Exception:
        bridge.close()
        raise
    try:
        bridge.run()
    except Fenced as exc:
        print(f"kvbridge run: {exc}", file=sys.stderr)
        return 3
    finally:
        if discovery is not None:
            discovery.stop()
            discovery.join(10)
    if bridge.unacknowledged:
        log.info("stopped with %d records not acknowledged (exit code 4)", bridge.unacknowledged)
        return UNACKNOWLEDGED_EXIT
    log.info("stopped")
    return 0
