"""Helpers for the packaging tests (compose file, Kubernetes manifests, monitoring config):
which ``KVBRIDGE_*`` variables ``kvbridge run`` really reads, and which metrics it exports."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

from bridge.cli.commands import build_parser
from bridge.cli.run import resolve_run_config
from bridge.ops.config import BridgeConfig, parse_duration
from bridge.ops.metrics import BridgeMetrics

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "KVBRIDGE_"


def run_parser() -> argparse.ArgumentParser:
    """The ``kvbridge run`` subcommand's parser."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def run_flags() -> set[str]:
    """Setting names of ``kvbridge run``'s long options (``--shard-index`` -> ``shard_index``)."""
    return {
        opt[2:].replace("-", "_")
        for action in run_parser()._actions
        for opt in action.option_strings
        if opt.startswith("--")
    }


def check_settings(env: dict[str, str], toml_keys: set[str] = frozenset()) -> list[str]:
    """Problems with ``KVBRIDGE_*`` names and TOML keys: each must be a ``kvbridge run`` flag
    and a :class:`BridgeConfig` field (``pods`` is the pod list, given by ``--pod``)."""
    fields = {f.name for f in dataclasses.fields(BridgeConfig)}
    flags = run_flags() | {"pods"}
    problems = []
    names = [(f"env {k}", k[len(PREFIX) :].lower()) for k in env if k.startswith(PREFIX)]
    names += [(f"TOML key {k}", k) for k in toml_keys if k != "kafka"]
    for where, name in names:
        if where.startswith("env") and name.startswith("kafka_"):
            continue  # KVBRIDGE_KAFKA_<NAME>: a librdkafka property (README, "Configuration")
        if name not in flags or name not in fields:
            problems.append(f"{where}: kvbridge run has no setting {name!r}")
    return problems


def assert_env_reaches_config(cfg: BridgeConfig, env: dict[str, str]) -> None:
    """Every ``KVBRIDGE_*`` value in ``env`` is what the resolved configuration holds."""
    for key, value in env.items():
        if not key.startswith(PREFIX):
            continue
        name = key[len(PREFIX) :].lower()
        if name.startswith("kafka_"):
            prop = name[len("kafka_") :].replace("_", ".")
            assert cfg.kafka.get(prop) == value, f"{key}: librdkafka {prop} is {cfg.kafka}"
            continue
        got = getattr(cfg, name)
        if name == "pods":
            specs = [s for s in value.split(";") if s.strip()]
            assert len(got) == len(specs), (key, got)
        elif isinstance(got, bool):
            assert got == (value.lower() in ("1", "true", "yes", "on")), (key, got)
        elif isinstance(got, float):
            assert got == parse_duration(value), (key, got)
        else:
            assert str(got) == value, f"{key}={value!r} but the bridge resolved {name}={got!r}"


def resolve(argv: list[str], env: dict[str, str]) -> BridgeConfig:
    """The configuration ``kvbridge <argv>`` resolves with exactly ``env`` as its environment."""
    args = build_parser().parse_args(argv)
    assert args.command == "run", argv
    return resolve_run_config(args, environ=env)


_SUFFIXES = {"_total": ("counter",), "_bucket": ("histogram",), "_count": ("histogram", "summary")}
_SUFFIXES["_sum"] = ("histogram", "summary")


def exported_families() -> dict[str, str]:
    """Metric family name -> type, from a fresh :class:`BridgeMetrics` registry."""
    return {m.name: m.type for m in BridgeMetrics().registry.collect()}


def unknown_metrics(names: set[str]) -> list[str]:
    """The sample names in ``names`` that no family of the bridge's registry exports."""
    families = exported_families()
    bad = []
    for name in sorted(names):
        if families.get(name) in ("gauge", "info", "stateset", "unknown"):
            continue
        ok = any(
            name.endswith(suffix) and families.get(name[: -len(suffix)]) in types
            for suffix, types in _SUFFIXES.items()
        )
        if not ok:
            bad.append(name)
    return bad


METRIC_NAME = re.compile(r"\bkvbridge_[a-zA-Z0-9_]+")


def metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


def walk(node: Any) -> Any:
    """Every dict nested anywhere in ``node`` (JSON-like data)."""
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)
