"""Checking run settings, and `kvbridge config check`: the effective configuration, where each
value came from (flag, env, file, default), secrets masked.

Pure code except :func:`check_kafka_properties`, which asks librdkafka itself (by creating a
client that is closed at once, without contacting Kafka) whether it accepts the properties.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from bridge.ops.config import (
    MASK,
    BridgeConfig,
    ConfigError,
    PodConfig,
    is_secret,
    parse_duration,
    shared_kafka_properties,
)

# Top-level TOML tables that are read directly, not through a single setting.
FILE_TABLES = {"pods", "kafka", "discovery"}

_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")


def boolean(value: Any) -> bool:
    """``true/false``, ``1/0``, ``yes/no``, ``on/off`` (any case)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean")


def _describe(conv: Callable[[Any], Any]) -> str:
    if conv is parse_duration:
        return "a duration: seconds (2.5) or units (100ms, 5s, 1m30s)"
    if conv is boolean:
        return "a boolean: true or false (also 1/0, yes/no, on/off)"
    return {str: "a string", int: "a whole number", float: "a number"}.get(
        conv, getattr(conv, "__name__", "a value")
    )


def convert(name: str, source: str, value: Any, conv: Callable[[Any], Any]) -> Any:
    """``value`` of setting ``name`` from ``source`` (env strings or TOML values) as ``conv``."""
    ok = True
    if conv is str:
        ok = isinstance(value, str)
    elif isinstance(value, bool) and conv is not boolean:
        ok = False
    elif conv is int and isinstance(value, float):
        ok = value.is_integer()
    elif isinstance(value, list | dict):
        ok = False
    if ok:
        try:
            return conv(value.strip() if isinstance(value, str) and conv is not str else value)
        except (TypeError, ValueError):
            pass
    raise ConfigError(f"{name}={value!r} (from {source}): expected {_describe(conv)}")


def _bootstrap_ok(servers: str) -> bool:
    entries = [e.strip() for e in servers.split(",")]
    if not entries or any(not e for e in entries):
        return False
    for entry in entries:
        hostport = entry.split("://", 1)[-1]
        host, sep, port = hostport.rpartition(":")
        if not sep:
            host, port = hostport, "9092"
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return False
    return True


def validate(cfg: BridgeConfig, sources: dict[str, str]) -> list[str]:
    """Every invalid setting, each naming it, where it came from and what is accepted."""
    problems: list[str] = []

    def fail(name: str, accepted: str) -> None:
        where = sources.get(name, "default")
        value = getattr(cfg, name)
        problems.append(f"{name}={value!r} (from {where}): {accepted}")

    if not _bootstrap_ok(cfg.bootstrap_servers):
        fail("bootstrap_servers", "expected HOST:PORT[,HOST:PORT...], e.g. kafka:9092")
    if cfg.topic_partitions < 1:
        fail("topic_partitions", "must be a whole number >= 1")
    if cfg.topic_replication != -1 and not 1 <= cfg.topic_replication <= 32767:
        fail("topic_replication", "must be -1 (the broker's default) or a whole number >= 1")
    if cfg.checkpoint_topic is not None and (
        not _TOPIC_NAME.fullmatch(cfg.checkpoint_topic) or cfg.checkpoint_topic in (".", "..")
    ):
        fail("checkpoint_topic", "a Kafka topic name is 1-249 characters of A-Z a-z 0-9 . _ -")
    if not 0 <= cfg.metrics_port <= 65535:
        fail("metrics_port", "must be a port number 1-65535, or 0 to turn the endpoint off")
    if not cfg.metrics_host.strip():
        fail("metrics_host", "an address to listen on, e.g. 0.0.0.0 or 127.0.0.1")
    if cfg.first_contact not in ("replay", "live"):
        fail("first_contact", "accepted values are replay, live")
    for name in (
        "replay_timeout",
        "replay_deadline",
        "poll_timeout",
        "reconnect_initial",
        "checkpoint_interval",
        "commit_interval",
        "shutdown_timeout",
    ):
        if getattr(cfg, name) <= 0:
            fail(name, "must be a duration > 0, e.g. 2s or 100ms")
    for name in ("silence_timeout", "idle_probe", "silent_warning"):
        if getattr(cfg, name) < 0:
            fail(name, "must be a duration >= 0 (0 turns it off), e.g. 30s")
    if cfg.reconnect_max < cfg.reconnect_initial:
        fail("reconnect_max", f"must be >= reconnect_initial ({cfg.reconnect_initial}s)")
    if cfg.reconnect_factor < 1.0:
        fail("reconnect_factor", "must be a number >= 1.0 (1.0 = constant backoff)")
    for name in (
        "replay_attempts",
        "max_seq_jump",
        "max_held",
        "max_replays",
        "commit_max_events",
        "rcvhwm",
    ):
        if getattr(cfg, name) < 1:
            fail(name, "must be a whole number >= 1")
    if cfg.transactional_id is not None and not cfg.transactional_id.strip():
        fail("transactional_id", "must not be empty (leave it unset for kvbridge-<topic>)")
    return problems


def check_file_keys(file: dict[str, Any], path: str, settings: set[str] | None = None) -> None:
    """The tables' shapes; with ``settings`` (every setting resolved), also unknown top-level
    keys, which are typos: refused, listing the accepted ones."""
    if settings is not None:
        settings = {s for s in settings if "." not in s}  # not table entries
        unknown = sorted(set(file) - settings - FILE_TABLES)
        if unknown:
            accepted = ", ".join(sorted(settings | FILE_TABLES))
            raise ConfigError(
                f"config file {path}: unknown setting(s) {', '.join(unknown)}; accepted: {accepted}"
            )
    if "pods" in file and not (
        isinstance(file["pods"], list) and all(isinstance(p, dict) for p in file["pods"])
    ):
        raise ConfigError(
            f"config file {path}: pods must be [[pods]] tables (name, model, pub, replay, dp)"
        )
    kafka = file.get("kafka", {})
    if not isinstance(kafka, dict) or any(isinstance(v, dict | list) for v in kafka.values()):
        raise ConfigError(
            f"config file {path}: [kafka] must be a table of librdkafka properties, e.g. "
            f'"security.protocol" = "SASL_SSL" (quote dotted names)'
        )


def kafka_value(value: Any) -> str:
    """A TOML value as librdkafka wants it (booleans lowercase)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# -- librdkafka ------------------------------------------------------------------------------


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _blame(message: str, kafka: dict[str, str], sources: dict[str, str]) -> str:
    """Which of the given properties a librdkafka error is about (by name or value)."""
    named = [
        k
        for k, v in kafka.items()
        if k in message or (len(v) > 1 and not is_secret(k) and v in message)
    ]
    names = named or sorted(kafka)
    return ", ".join(f"{k} (from {sources.get('kafka.' + k, 'default')})" for k in names)


def check_kafka_properties(
    kafka: dict[str, str], sources: dict[str, str] | None = None, transactional: bool = False
) -> list[str]:
    """Create (and close) the producer and a consumer with these properties, as the bridge
    will; ConfigError if librdkafka refuses them. Returns librdkafka's configuration warnings.
    Kafka is not contacted (no bootstrap servers are given)."""
    from confluent_kafka import Consumer, KafkaException, Producer

    from bridge.log.sink import PRODUCER_DEFAULTS

    sources = sources or {}
    sink = _Collect()
    logger = logging.getLogger("kvbridge.configcheck.librdkafka")
    logger.propagate = False
    logger.handlers[:] = [sink]
    logger.setLevel(logging.DEBUG)
    kafka = {k: v for k, v in kafka.items() if k != "bootstrap.servers"}  # the setting wins
    producer = {**PRODUCER_DEFAULTS, **kafka}
    if transactional:
        producer["transactional.id"] = "kvbridge-config-check"
        producer.pop("message.timeout.ms", None)
    consumer = {"group.id": "kvbridge-config-check", **shared_kafka_properties(kafka)}
    clients: list[tuple[str, Callable[[dict[str, Any]], Any], dict[str, Any]]] = [
        ("producer", Producer, producer),
        ("consumer", Consumer, consumer),
    ]
    for what, make, conf in clients:
        try:
            client = make({**conf, "logger": logger})
        except KafkaException as exc:
            msg = exc.args[0].str() if exc.args else str(exc)
            raise ConfigError(
                f"librdkafka refused the Kafka client settings for the {what}: {msg}. "
                f"Given: {_blame(msg, kafka, sources) or 'no properties'}. Properties are "
                "librdkafka's (see its CONFIGURATION.md), e.g. security.protocol=SASL_SSL, "
                "sasl.mechanism=PLAIN|SCRAM-SHA-256|SCRAM-SHA-512|OAUTHBEARER|GSSAPI"
            ) from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"Kafka client settings for the {what}: {exc}") from None
        client.close()
    warnings = []
    for line in sink.lines:
        if "bootstrap.servers" in line and "No `bootstrap.servers`" in line:
            continue
        text = re.sub(r"^\w+ \[[^\]]*\] \[thrd:[^\]]*\]: ", "", line)
        if text not in warnings:
            warnings.append(text)
    return warnings


# -- printing the effective configuration -----------------------------------------------------


def _pod_table(p: PodConfig) -> dict[str, Any]:
    d: dict[str, Any] = {"name": p.name, "model": p.model}
    for key in ("pub", "replay", "topic"):
        if getattr(p, key):
            d[key] = getattr(p, key)
    if p.dp_size != 1:
        d["dp"] = p.dp_size
    return d


def effective(cfg: BridgeConfig, sources: dict[str, str]) -> dict[str, Any]:
    """``{setting: {"value": v, "source": s}}``; property tables (``kafka``, ...) as
    ``{table: {property: {"value": v, "source": s}}}``, secrets masked."""
    out: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {}
    for f in fields(cfg):
        name = f.name
        value = getattr(cfg, name)
        if name == "pods":
            continue
        if isinstance(value, dict):
            tables[name] = {
                k: {
                    "value": MASK if is_secret(k) else v,
                    "source": sources.get(f"{name}.{k}", sources.get(name, "default")),
                }
                for k, v in sorted(value.items())
            }
        elif name in sources:  # only settings the configuration is resolved into
            out[name] = {"value": value, "source": sources[name]}
    out["pods"] = {
        "value": [_pod_table(p) for p in cfg.pods],
        "source": sources.get("pods", "default"),
    }
    out.update(tables)
    return out


def _is_table(item: dict[str, Any]) -> bool:
    return set(item) != {"value", "source"}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v), ensure_ascii=False)  # a JSON string is a valid TOML basic string


def render_toml(eff: dict[str, Any]) -> str:
    """TOML that ``--config`` reads back; sources and unset settings as comments."""
    lines = ["# effective kvbridge configuration (secrets masked)"]
    for name, item in eff.items():
        if name == "pods" or _is_table(item):
            continue
        v, src = item["value"], item["source"]
        if v is None:
            lines.append(f"# {name} is not set  # {src}")
        else:
            lines.append(f"{name} = {_toml_value(v)}  # {src}")
    pods = eff["pods"]
    for pod in pods["value"]:
        lines += ["", f"[[pods]]  # {pods['source']}"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in pod.items()]
    for name, item in eff.items():
        if name != "pods" and _is_table(item) and item:
            lines += ["", f"[{name}]"]
            for k, prop in item.items():
                value = _toml_value(prop["value"])
                lines.append(f"{json.dumps(k)} = {value}  # {prop['source']}")
    return "\n".join(lines) + "\n"


def render_json(eff: dict[str, Any]) -> str:
    return json.dumps(eff, indent=2, default=str) + "\n"


def run_config_check(args: Any, resolve: Callable[..., BridgeConfig], out: Any = None) -> int:
    """`kvbridge config check`: resolve exactly as `run` does, validate, print; 0 if valid
    (ConfigError otherwise, which the command line turns into exit code 2)."""
    import sys

    out = out or sys.stdout
    sources: dict[str, str] = {}
    notes: list[str] = []
    cfg = resolve(args, sources=sources, notes=notes, for_run=True)
    notes += [
        f"librdkafka: {w}" for w in check_kafka_properties(cfg.kafka, sources, cfg.exactly_once)
    ]
    eff = effective(cfg, sources)
    if args.format == "json":
        out.write(render_json({"valid": True, "warnings": notes, "settings": eff}))
    else:
        out.write(render_toml(eff))
        for note in notes:
            out.write(f"# warning: {note}\n")
    return 0


def configure_parser(sub: Any, run: argparse.ArgumentParser) -> None:
    """Add `kvbridge config check`, which takes every option of ``run``."""
    config = sub.add_parser("config", help="check the run configuration")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check_config = config_sub.add_parser(
        "check",
        parents=[run],
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="validate and print the effective configuration of `run` with the same options",
        description="Resolve the settings exactly as `kvbridge run` does (flags, then KVBRIDGE_* "
        "environment variables, then --config FILE, then defaults), validate them (librdkafka "
        "properties included; Kafka is not contacted) and print the effective configuration, "
        "with where each value came from and secrets masked. Exit 0 if valid, 2 if not.",
    )
    check_config.add_argument(
        "--format", choices=["toml", "json"], default="toml", help="output format (toml)"
    )
