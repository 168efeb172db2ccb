"""`kvbridge state-sync` and `kvbridge state`: the kv-state topic kept, and the live state
printed or served (:mod:`bridge.consume.statetopic`, :mod:`bridge.consume.stateserve`)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import Any

from bridge.cli.args import (
    add_kafka_args,
    add_log_args,
    add_state_policy_arg,
    duration,
    kafka_target,
)
from bridge.consume.stateserve import LiveState, StateServer
from bridge.consume.statetopic import DEFAULT_STATE_TOPIC, StateSyncer
from bridge.ops.config import ConfigError, KafkaUnreachable, kafka_unreachable

log = logging.getLogger(__name__)


def configure_sync_parser(sub: Any) -> None:
    """Add `kvbridge state-sync` to the subcommands."""
    p = sub.add_parser(
        "state-sync",
        help="maintain the compacted kv-state topic (snapshot of every pod's cache) from kv-events",
        description="Consume kv-events (read_committed) and keep the compacted state topic equal "
        "to the cache state they build: one record per resident block, per stream, and the "
        "kv-events offsets reflected, written atomically in Kafka transactions. Resumes from "
        "the state topic on restart. See docs/state-topic.md.",
    )
    add_kafka_args(p)
    add_state_policy_arg(p)
    p.add_argument(
        "--state-topic",
        default=DEFAULT_STATE_TOPIC,
        metavar="NAME",
        help="compacted state topic, created if missing (default kv-state)",
    )
    p.add_argument(
        "--transactional-id",
        metavar="ID",
        help="transactional id (default kvbridge-state-sync-<state topic>); run one state-sync "
        "per state topic: a second one with the same id fences the first",
    )
    p.add_argument(
        "--commit-interval",
        type=duration,
        default=0.2,
        metavar="DURATION",
        help="how often a transaction is committed (200ms)",
    )
    p.add_argument(
        "--partition-check-interval",
        type=duration,
        default=30.0,
        metavar="DURATION",
        help="how often to check kv-events for added partitions, which are then read from "
        "their beginning (30s)",
    )
    p.add_argument(
        "--until-caught-up",
        action="store_true",
        help="exit once the end of kv-events seen at start is in the state topic",
    )
    add_log_args(p)


def run_sync(args: argparse.Namespace) -> int:
    """`kvbridge state-sync`: keep the state topic until SIGTERM (or caught up)."""
    bootstrap, topic, overrides = kafka_target(args)
    if args.commit_interval <= 0:
        raise ConfigError("--commit-interval must be > 0")
    if args.partition_check_interval <= 0:
        raise ConfigError("--partition-check-interval must be > 0")
    if args.state_topic == topic:
        raise ConfigError("--state-topic must differ from --topic")
    syncer = StateSyncer(
        bootstrap,
        topic,
        args.state_topic,
        args.transactional_id,
        overrides,
        commit_interval=args.commit_interval,
        partition_check_interval=args.partition_check_interval,
        policy=args.state_policy,
    )
    stop = threading.Event()

    def _stop(signum: int, _frame: Any) -> None:
        log.info("%s: committing and stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        syncer.open()
        syncer.run(stop, until_caught_up=args.until_caught_up)
    finally:
        syncer.close()
    skipped = syncer.undecodable
    log.info(
        "state-sync stopped: %d records consumed, %d undecodable skipped%s, %d transactions, "
        "offsets %s",
        syncer.consumed,
        skipped.count if skipped else 0,
        f" (first: {'; '.join(skipped.samples())})" if skipped and skipped.count else "",
        syncer.commits,
        syncer.sync.offsets,
    )
    return 0


def configure_state_parser(sub: Any) -> None:
    """Add `kvbridge state` to the subcommands."""
    p = sub.add_parser(
        "state",
        help="the live cache state: print it, or serve it over HTTP (--serve)",
        description="Follow kv-events (after loading --state-topic, if given) and keep every "
        "pod's cache state current. With --serve, answer over HTTP: GET /pods, "
        "GET /prefix?hashes=1,2,3[&medium=GPU], POST /prefix, POST /score (a prompt's token "
        "ids), GET /healthz, GET /readyz. "
        "Without it, print the state once caught up, as JSON, and exit.",
    )
    add_kafka_args(p)
    add_state_policy_arg(p)
    p.add_argument(
        "--state-topic",
        nargs="?",
        const=DEFAULT_STATE_TOPIC,
        metavar="NAME",
        help="bootstrap from this compacted state topic (kvbridge state-sync), then tail "
        "kv-events from the offsets it holds (default name kv-state); without it, replay "
        "kv-events from the beginning",
    )
    p.add_argument("--serve", action="store_true", help="serve the state over HTTP")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (8080; 0 = any free port)")
    add_log_args(p)


def run_state(args: argparse.Namespace) -> int:
    """`kvbridge state`: print the state once caught up, or serve it until SIGTERM."""
    bootstrap, topic, overrides = kafka_target(args)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: must be 0..65535")
    if args.state_topic == topic:
        raise ConfigError("--state-topic must differ from --topic (kvbridge state-sync writes it)")
    live = LiveState(bootstrap, topic, args.state_topic, overrides, policy=args.state_policy)
    if not args.serve:
        live.start()
        while not live.ready.wait(0.2):
            if not live.alive:
                break
        live.stop()
        if live.error is not None and kafka_unreachable(live.error):
            raise KafkaUnreachable(bootstrap, live.error.args[0].str())
        if live.error is not None:
            raise RuntimeError(f"reading the state failed: {live.error}")
        json.dump(live.pods(), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    try:
        server = StateServer(live, args.host, args.port)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc}") from exc
    stop = threading.Event()

    def _stop(signum: int, _frame: Any) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    live.start()
    t = threading.Thread(target=server.serve_forever, name="state-http", daemon=True)
    t.start()
    log.info("serving the state of %s on http://%s:%d/", topic, args.host, server.port)
    try:
        while not stop.wait(0.5):
            if not live.alive:
                break
    finally:
        server.shutdown()
        server.server_close()
        live.stop()
    if live.error is not None:
        print(f"kvbridge state: the consumer failed: {live.error}", file=sys.stderr)
        return 1
    return 0
