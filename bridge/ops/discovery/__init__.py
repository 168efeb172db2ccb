"""Pod discovery: the static list (``--pod``), Kubernetes (list + watch pods by label) and DNS
(a headless service re-resolved periodically). Each source drives the bridge through
:class:`PodTarget`, from its own thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from bridge.ops.config import PodConfig


class PodTarget(Protocol):
    """What discovery needs from the bridge (thread-safe; applied by the bridge's event loop)."""

    def add_pod(self, pod: PodConfig) -> None: ...

    def remove_pod(self, name: str, reason: str) -> None: ...


def owns_filter(target: object) -> Callable[[str], bool]:
    """The bridge's shard filter (``owns(pod_name)``), or accept-all when it has none."""
    owns = getattr(target, "owns", None)
    return owns if callable(owns) else (lambda _name: True)


class DiscoveryMetrics:
    """Prometheus series of a discovery source, on the bridge's registry when it has one.

    ``kvbridge_discovery_pods{source}`` pods followed now; ``kvbridge_discovery_changes_total
    {source,action}`` pods added/removed; ``kvbridge_discovery_skipped_total{source}`` pods not
    followed because of bad input (a bad annotation, no model); ``kvbridge_discovery_errors_total
    {source,kind}`` API/lookup failures (``api``, ``lookup``), relists (``relist``) and pods the
    bridge refused (``apply``).
    """

    def __init__(self, target: object, source: str) -> None:
        from prometheus_client import CollectorRegistry

        self.source = source
        registry = getattr(getattr(target, "metrics", None), "registry", None)
        if not isinstance(registry, CollectorRegistry):
            registry = CollectorRegistry()
        try:
            self._register(registry)
        except ValueError:  # already registered (a second source on one bridge): keep apart
            self._register(CollectorRegistry())

    def _register(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        p, r = "kvbridge_discovery_", registry
        self.registry = registry
        self.pods = Gauge(p + "pods", "Pods followed", ["source"], registry=r)
        self.changes = Counter(
            p + "changes", "Pods added or removed", ["source", "action"], registry=r
        )
        self.skipped = Counter(
            p + "skipped", "Pods not followed: bad input", ["source"], registry=r
        )
        self.errors = Counter(
            p + "errors", "Discovery failures by kind", ["source", "kind"], registry=r
        )

    def changed(self, action: str, followed: int) -> None:
        self.changes.labels(self.source, action).inc()
        self.pods.labels(self.source).set(followed)

    def error(self, kind: str) -> None:
        self.errors.labels(self.source, kind).inc()

    def skip(self) -> None:
        self.skipped.labels(self.source).inc()


DISCOVERY_MODES = ("static", "kubernetes", "dns")

__all__ = ["DISCOVERY_MODES", "DiscoveryMetrics", "PodTarget", "owns_filter"]
