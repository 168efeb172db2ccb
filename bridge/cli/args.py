"""Command-line pieces shared by the subcommands: Kafka connection options and their values."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

from bridge.log.records import RecordCodec
from bridge.ops.config import (
    BridgeConfig,
    ConfigError,
    env_kafka_properties,
    env_settings,
    parse_duration,
)

# A value that starts with "-" but is a number, a relative time or a duration (-10m, -1h30m,
# -5s, -2.5): argparse takes it for the option's argument, as it does for -5 out of the box.
_NEGATIVE_VALUE = re.compile(r"^-(\d+(\.\d*)?|\.\d+)([a-zµ]+((\d+(\.\d*)?|\.\d+)[a-zµ]+)*)?$")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that reads ``--from-timestamp -10m`` and ``--replay-timeout -5s`` as
    an option with its value (plain argparse only does so for negative numbers such as -5)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_VALUE


def duration(text: str) -> float:
    """argparse type of a duration flag: seconds from 2.5 or 100ms/5s/1m30s, with the reason
    in argparse's error when the value is not one."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"])


def add_state_policy_arg(p: argparse.ArgumentParser) -> None:
    """``--state-policy``: how the cache-state model counts repeated stores of a hash."""
    import os

    from bridge.consume.state import DEFAULT_POLICY, POLICIES

    p.add_argument(
        "--state-policy",
        choices=POLICIES,
        default=os.environ.get("KVBRIDGE_STATE_POLICY") or None,
        help="how a BlockStored of a hash already resident counts: count (a new copy; every "
        "remove drops one; exact for vLLM's physical copies and offload chunks), set (stores "
        "idempotent, the first remove evicts), hits (count, but a store of resident hashes "
        "from the start of a sequence is a re-announced prefix hit, vLLM 0.26+ "
        "kv_cache_report_mode=full); remaining_copy_counts on a remove always wins (env "
        f"KVBRIDGE_STATE_POLICY; default {DEFAULT_POLICY}, or a snapshot's own; see "
        "docs/consumers.md)",
    )


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


def add_listen_args(run: argparse.ArgumentParser) -> None:
    """``--listen-discover`` and its settings (pods that connect to the ``--listen`` socket)."""
    g = run.add_argument_group(
        "pods that connect (--listen)",
        "llm-d's centralized layout: every vLLM pod connects its PUB to the --listen socket and "
        "names itself in the topic kv@<pod-id>@<model>",
    )
    g.add_argument(
        "--listen-discover",
        action="store_true",
        default=None,
        help="follow every pod whose topic is kv@<pod-id>@<model> (split at the first two '@': "
        "the model may contain '@') without a --pod for it; the pod is named by its pod id and "
        "gets the DP rank of the listen port it arrived on (env KVBRIDGE_LISTEN_DISCOVER)",
    )
    g.add_argument(
        "--listen-replay",
        metavar="TEMPLATE",
        help="replay endpoint of discovered pods, {pod} replaced by the pod id (llm-d: the pod "
        "IP), e.g. tcp://{pod}:5558; rank r uses port + r. Without it gaps of discovered pods "
        "are written as EventsLost (env KVBRIDGE_LISTEN_REPLAY)",
    )
    g.add_argument(
        "--listen-max-pods",
        type=int,
        metavar="N",
        help="most pods followed by discovery; messages of further pods are dropped and counted "
        "as kvbridge_decode_errors_total{pod=listener,kind=too_many_pods} (default 1024)",
    )
    g.add_argument(
        "--listen-ranks",
        type=int,
        metavar="N",
        help="data-parallel ranks to listen for: binds port..port+N-1 (default 1, or the "
        "largest dp= of the --pod specs with topic=)",
    )


def resolve_listen(cfg: BridgeConfig, pick: Callable[..., Any], workers: int = 1) -> None:
    """Fill ``cfg``'s listen-discovery settings with ``pick(name, conv)`` (flag > env > file);
    after ``listen`` and the shard settings are resolved (``workers``: run's --workers)."""
    from bridge.cli.configcheck import boolean
    from bridge.ingest.listentopics import check_replay_template

    cfg.listen_discover = pick("listen_discover", boolean)
    cfg.listen_replay = pick("listen_replay")
    cfg.listen_max_pods = pick("listen_max_pods", int)
    cfg.listen_ranks = pick("listen_ranks", int)
    if cfg.listen_max_pods < 1:
        raise ConfigError(f"listen_max_pods={cfg.listen_max_pods}: must be a whole number >= 1")
    if cfg.listen_ranks < 1:
        raise ConfigError(f"listen_ranks={cfg.listen_ranks}: must be a whole number >= 1")
    if cfg.listen_replay is not None:
        check_replay_template(cfg.listen_replay)
    if not cfg.listen_discover:
        return
    if cfg.listen is None:
        raise ConfigError(
            "listen_discover needs a listen socket: give --listen tcp://*:5557 (the address "
            "the vLLM pods' kv-events endpoint connects to)"
        )
    if cfg.shard_count > 1 or workers > 1:
        split = f"--workers {workers}" if workers > 1 else f"shard_count={cfg.shard_count}"
        raise ConfigError(
            f"listen_discover with {split}: a vLLM pod connects its PUB "
            "to one address, so a replica receives the pods that connected to it, not the ones "
            "its shard owns; run one bridge (shard_count 1, --workers 1) per listen address"
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
    from bridge.log.registry import reader_codec

    url = getattr(args, "schema_registry_url", None) or env_settings().get("schema_registry_url")
    props = kv_pairs(getattr(args, "schema_registry_property", []), "--schema-registry-property")
    return reader_codec(url, props)
