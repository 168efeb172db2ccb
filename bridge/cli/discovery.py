"""Discovery settings for ``kvbridge run``: flags, resolution/validation, and starting the
chosen source after the bridge opened."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any, Protocol

from bridge.cli.args import duration
from bridge.ops.config import BridgeConfig, ConfigError, parse_duration
from bridge.ops.discovery import DISCOVERY_MODES


class Discovery(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


def add_discovery_args(run: argparse.ArgumentParser) -> None:
    g = run.add_argument_group(
        "pod discovery",
        "follow pods found in Kubernetes or DNS, besides any --pod (see docs/discovery.md)",
    )
    g.add_argument(
        "--discovery",
        metavar="static|kubernetes|dns",
        help="static (only --pod, the default), kubernetes (watch pods by label), or dns "
        "(re-resolve a headless service)",
    )
    g.add_argument(
        "--k8s-namespace", metavar="NS", help="namespace to watch (default: the bridge's own)"
    )
    g.add_argument(
        "--k8s-label-selector",
        metavar="SELECTOR",
        help="pods to follow (default model.aibrix.ai/kv-events-enabled=true)",
    )
    g.add_argument(
        "--k8s-model-label",
        metavar="LABEL",
        help="label holding the model name (default model.aibrix.ai/name; else annotation "
        "kvbridge.io/model)",
    )
    g.add_argument(
        "--k8s-kubeconfig",
        metavar="PATH",
        help="kubeconfig file (default: in-cluster service account, else ~/.kube/config)",
    )
    g.add_argument("--dns-name", metavar="NAME", help="headless service name to resolve")
    g.add_argument("--dns-model", metavar="MODEL", help="model of the pods found by DNS")
    g.add_argument(
        "--dns-interval",
        type=duration,
        metavar="DURATION",
        help="how often the name is resolved again (10s)",
    )
    g.add_argument("--dns-pub-port", type=int, metavar="PORT", help="vLLM PUB port (5557)")
    g.add_argument(
        "--dns-replay-port", type=int, metavar="PORT", help="vLLM replay port (5558; 0 = none)"
    )


def resolve_discovery(cfg: BridgeConfig, pick: Callable[..., Any]) -> None:
    """Fill ``cfg``'s discovery settings with ``pick(name, conv)`` (flag > env > file)."""
    cfg.discovery = str(pick("discovery")).strip().lower()
    if cfg.discovery not in DISCOVERY_MODES:
        raise ConfigError(
            f"discovery={cfg.discovery!r}: accepted values are {', '.join(DISCOVERY_MODES)}"
        )
    cfg.k8s_namespace = pick("k8s_namespace")
    cfg.k8s_label_selector = pick("k8s_label_selector")
    cfg.k8s_model_label = pick("k8s_model_label")
    cfg.k8s_kubeconfig = pick("k8s_kubeconfig")
    cfg.dns_name = pick("dns_name")
    cfg.dns_model = pick("dns_model")
    cfg.dns_interval = pick("dns_interval", parse_duration)
    cfg.dns_pub_port = pick("dns_pub_port", int)
    cfg.dns_replay_port = pick("dns_replay_port", int)
    if cfg.discovery == "kubernetes":
        if not cfg.k8s_model_label:
            raise ConfigError("k8s_model_label: must not be empty (e.g. model.aibrix.ai/name)")
        if cfg.k8s_kubeconfig and not os.path.isfile(cfg.k8s_kubeconfig):
            raise ConfigError(
                f"k8s_kubeconfig={cfg.k8s_kubeconfig!r}: no such file; give a kubeconfig path "
                "or leave it unset for the in-cluster service account"
            )
    if cfg.discovery == "dns":
        if not cfg.dns_name:
            raise ConfigError(
                "discovery=dns needs dns_name (--dns-name / KVBRIDGE_DNS_NAME), e.g. "
                "vllm-headless.default.svc.cluster.local"
            )
        if cfg.dns_interval <= 0:
            raise ConfigError(f"dns_interval={cfg.dns_interval}: must be > 0")
    if not 1 <= cfg.dns_pub_port <= 65535:
        raise ConfigError(f"dns_pub_port={cfg.dns_pub_port}: accepted values are 1-65535")
    if cfg.dns_replay_port == cfg.dns_pub_port:
        raise ConfigError(
            f"dns_replay_port={cfg.dns_replay_port}: must differ from dns_pub_port "
            "(vLLM's replay ROUTER and PUB socket are separate ports)"
        )
    if not 0 <= cfg.dns_replay_port <= 65535:
        raise ConfigError(
            f"dns_replay_port={cfg.dns_replay_port}: accepted values are 1-65535, or 0 for none"
        )


def start_discovery(bridge: Any, cfg: BridgeConfig) -> Discovery | None:
    """Start the configured discovery thread (None for ``static``)."""
    if cfg.discovery == "kubernetes":
        from bridge.ops.discovery.k8s import K8sSettings
        from bridge.ops.discovery.k8swatch import (
            KubernetesDiscovery,
            default_namespace,
            make_core_api,
        )

        settings = K8sSettings(
            namespace=cfg.k8s_namespace or default_namespace(),
            label_selector=cfg.k8s_label_selector,
            model_label=cfg.k8s_model_label,
        )
        d: Discovery = KubernetesDiscovery(bridge, settings, make_core_api(cfg.k8s_kubeconfig))
    elif cfg.discovery == "dns":
        from bridge.ops.discovery.dns import DnsDiscovery, DnsSettings

        assert cfg.dns_name
        d = DnsDiscovery(
            bridge,
            DnsSettings(
                name=cfg.dns_name,
                model=cfg.dns_model,
                pub_port=cfg.dns_pub_port,
                replay_port=cfg.dns_replay_port or None,
                interval=cfg.dns_interval,
            ),
        )
    else:
        return None
    d.start()
    return d


__all__ = ["add_discovery_args", "resolve_discovery", "start_discovery"]
