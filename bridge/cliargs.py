"""Command-line pieces shared by the subcommands: Kafka connection options and their values."""

from __future__ import annotations

import argparse

from bridge.config import ConfigError, env_kafka_properties, env_settings
from bridge.records import RecordCodec


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
        help="any librdkafka property, e.g. security.protocol=SASL_SSL (repeatable; env "
        "KVBRIDGE_KAFKA_<NAME> with _ for ., e.g. KVBRIDGE_KAFKA_SASL_MECHANISM=PLAIN)",
    )
    p.add_argument(
        "--schema-registry-url",
        metavar="URL",
        help="Confluent Schema Registry: values in its wire format, schema registered as "
        "<topic>-value (env KVBRIDGE_SCHEMA_REGISTRY_URL; default: none, Avro single-object)",
    )
    p.add_argument(
        "--schema-registry-property",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a schema registry client property, e.g. basic.auth.user.info=USER:PASSWORD "
        "(repeatable)",
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
    """(bootstrap, topic, librdkafka overrides): flags, then KVBRIDGE_* env, then defaults.
    librdkafka properties: ``--kafka-property`` over ``KVBRIDGE_KAFKA_*`` variables."""
    env = env_settings()
    bootstrap = args.bootstrap_servers or env.get("bootstrap_servers") or "localhost:9092"
    topic = args.topic or env.get("topic") or "kv-events"
    return bootstrap, topic, {**env_kafka_properties(), **kv_pairs(args.kafka_property)}


def record_codec(args: argparse.Namespace) -> RecordCodec:
    """The codec readers use: both framings; Confluent schema ids looked up in the registry
    given by ``--schema-registry-url`` (or KVBRIDGE_SCHEMA_REGISTRY_URL), if any."""
    from bridge.registry import reader_codec

    url = getattr(args, "schema_registry_url", None) or env_settings().get("schema_registry_url")
    props = kv_pairs(getattr(args, "schema_registry_property", []), "--schema-registry-property")
    return reader_codec(url, props)
