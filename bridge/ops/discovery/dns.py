"""DNS discovery: a headless Kubernetes service (or any name with one A/AAAA record per pod)
re-resolved every few seconds; each address is a pod, named after its IP.

:class:`DnsTracker` is the pure part (resolved address sets in, pods to add/remove out);
:class:`DnsDiscovery` is the thread that resolves with ``socket.getaddrinfo``.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from bridge.ops.config import PodConfig
from bridge.ops.discovery import DiscoveryMetrics, PodTarget, owns_filter
from bridge.ops.discovery.k8s import Add, Remove

log = logging.getLogger(__name__)

Resolver = Callable[[str], set[str]]


@dataclass(frozen=True, slots=True)
class DnsSettings:
    name: str
    model: str = "unknown"
    pub_port: int = 5557
    replay_port: int | None = 5558  # None: no replay endpoint
    dp_size: int = 1
    interval: float = 10.0


def diff(current: Iterable[str], resolved: Iterable[str]) -> tuple[list[str], list[str]]:
    """(added, removed) addresses, each sorted."""
    cur, new = set(current), set(resolved)
    return sorted(new - cur), sorted(cur - new)


def pod_for(address: str, settings: DnsSettings) -> PodConfig:
    """The pod behind one resolved address (IPv6 hosts are bracketed in the endpoints)."""
    ip = ipaddress.ip_address(address)
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    return PodConfig(
        name=str(ip),
        model=settings.model,
        pub=f"tcp://{host}:{settings.pub_port}",
        replay=None if settings.replay_port is None else f"tcp://{host}:{settings.replay_port}",
        dp_size=settings.dp_size,
    )


@dataclass
class DnsTracker:
    """The addresses followed; ``on_resolved`` turns a new resolution into adds and removes."""

    settings: DnsSettings
    owns: Callable[[str], bool] = lambda _name: True
    active: set[str] = field(default_factory=set)

    def on_resolved(self, addresses: Iterable[str]) -> list[Add | Remove]:
        valid: set[str] = set()
        for a in addresses:
            try:
                name = str(ipaddress.ip_address(a.split("%", 1)[0]))
            except ValueError:
                continue  # not an address (the resolver's output is trusted to be addresses)
            if self.owns(name):
                valid.add(name)
        added, removed = diff(self.active, valid)
        actions: list[Add | Remove] = [
            Remove(a, f"no longer in DNS {self.settings.name}") for a in removed
        ]
        actions += [Add(pod_for(a, self.settings)) for a in added]
        self.active = valid
        return actions


def resolve(name: str) -> set[str]:
    """Every address ``name`` resolves to; no records (NXDOMAIN / no data) is the empty set."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        no_data = getattr(socket, "EAI_NODATA", None)
        if exc.errno in (socket.EAI_NONAME, no_data):
            return set()  # a headless service with no ready pods has no records
        raise
    return {str(info[4][0]) for info in infos}


class DnsDiscovery:
    """Re-resolves ``settings.name`` every ``settings.interval`` seconds and updates the bridge.

    A failed lookup (other than "no such name") keeps the current pods and is retried next time.
    """

    def __init__(
        self, bridge: PodTarget, settings: DnsSettings, resolver: Resolver = resolve
    ) -> None:
        self.bridge = bridge
        self.settings = settings
        self.resolver = resolver
        self.tracker = DnsTracker(settings, owns=owns_filter(bridge))
        self.stats: Counter[str] = Counter()
        self.metrics = DiscoveryMetrics(bridge, "dns")
        self.resolved = threading.Event()  # set after the first successful resolution
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dns-discovery", daemon=True)

    def start(self) -> None:
        log.info(
            "dns discovery: %s every %.1fs (pub port %d, replay port %s, model %s)",
            self.settings.name,
            self.settings.interval,
            self.settings.pub_port,
            self.settings.replay_port or "none",
            self.settings.model,
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def poll_once(self) -> None:
        """Resolve once and apply the difference."""
        try:
            addresses = self.resolver(self.settings.name)
        except Exception as exc:  # noqa: BLE001 - DNS trouble: keep the pods, try again later
            self.stats["errors"] += 1
            self.metrics.error("lookup")
            log.warning(
                "dns lookup of %s failed (%s); keeping current pods", self.settings.name, exc
            )
            return
        self.stats["lookups"] += 1
        for a in self.tracker.on_resolved(addresses):
            try:
                if isinstance(a, Add):
                    self.stats["added"] += 1
                    self.metrics.changed("added", len(self.tracker.active))
                    log.info("dns: new pod %s (pub %s)", a.pod.name, a.pod.pub)
                    self.bridge.add_pod(a.pod)
                else:
                    self.stats["removed"] += 1
                    self.metrics.changed("removed", len(self.tracker.active))
                    log.info("dns: pod %s gone (%s)", a.name, a.reason)
                    self.bridge.remove_pod(a.name, a.reason)
            except Exception:  # noqa: BLE001 - one pod's trouble never stops discovery
                self.stats["apply_errors"] += 1
                self.metrics.error("apply")
                log.exception("could not apply %s", a)
        self.resolved.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            if self._stop.wait(self.settings.interval):
                return


__all__ = ["DnsDiscovery", "DnsSettings", "DnsTracker", "diff", "pod_for", "resolve"]
