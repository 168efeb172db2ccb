"""Command-line pieces shared by the subcommands: Kafka connection options and their values."""

from __future__ import annotations

import argparse

from bridge.config import ConfigError, env_settings


def add_kafka_args(p: argparse.ArgumentParser, topic_help: str = "topic of the events") -> None:
    p.add_argument(
        "--bootstrap-servers",
        metavar="HOST:PORT",
        help="Kafka bootstrap servers (env KVBRIDGE_BOOTSTRAP_SERVERS; default localhost:9092)",
    )
    p.add_argument("--topic", help=f"{topic_help} (env KVBRIDGE_TOPIC; default kv-events)")
    p.add_argument(
        "--kafka-property",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any librdkafka property, e.g. security.protocol=SASL_SSL (repeatable)",
    )


def kv_pairs(items: list[str], what: str = "--kafka-property") -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise ConfigError(f"{what} {item!r}: expected KEY=VALUE")
        out[k.strip()] = v.strip()
    return out


def kafka_target(args: argparse.Namespace) -> tuple[str, str, dict[str, str]]:
    """(bootstrap, topic, librdkafka overrides): flags, then KVBRIDGE_* env, then defaults."""
    env = env_settings()
    bootstrap = args.bootstrap_servers or env.get("bootstrap_servers") or "localhost:9092"
    topic = args.topic or env.get("topic") or "kv-events"
    return bootstrap, topic, kv_pairs(args.kafka_property)
