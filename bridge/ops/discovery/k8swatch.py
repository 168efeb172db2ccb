"""Kubernetes pod discovery, the I/O part: a thread that lists and watches pods with the official
``kubernetes`` client and applies :class:`~bridge.ops.discovery.k8s.PodTracker`'s decisions to the
bridge (``add_pod`` / ``remove_pod``).

List, then watch from the list's resourceVersion (with bookmarks); a watch that ends by its
timeout is resumed from the last resourceVersion seen; ``410 Gone`` relists at once; any other
failure relists after a backoff. The thread never blocks the bridge's event loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bridge.ops.config import ConfigError
from bridge.ops.discovery import DiscoveryMetrics, PodTarget, owns_filter
from bridge.ops.discovery.k8s import Add, K8sSettings, PodTracker, Relist, Remove, Skip

log = logging.getLogger(__name__)

NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def default_namespace(path: str = NAMESPACE_FILE) -> str:
    """The namespace this process runs in (from its service account), else ``default``."""
    try:
        return Path(path).read_text().strip() or "default"
    except OSError:
        return "default"


def make_core_api(kubeconfig: str | None = None) -> Any:
    """A ``CoreV1Api``: from ``kubeconfig`` if given, else in-cluster, else ``~/.kube/config``."""
    try:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException
    except ImportError as exc:
        raise ConfigError(
            "discovery=kubernetes needs the kubernetes client: pip install 'kvbridge[k8s]'"
        ) from exc
    cfg = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            try:
                config.load_incluster_config(client_configuration=cfg)
            except ConfigException:
                config.load_kube_config(client_configuration=cfg)
    except (ConfigException, OSError) as exc:
        where = kubeconfig or "in-cluster service account, then ~/.kube/config"
        raise ConfigError(
            f"k8s_kubeconfig: no usable Kubernetes configuration ({where}): {exc}; run inside a "
            "cluster with a service account or give --k8s-kubeconfig PATH"
        ) from exc
    return client.CoreV1Api(client.ApiClient(cfg))


def _lines(resp: Any) -> Iterator[bytes]:
    """Newline-delimited JSON from a streaming urllib3 response."""
    buf = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buf += chunk if isinstance(chunk, bytes) else chunk.encode()
        *lines, buf = buf.split(b"\n")
        yield from (line for line in lines if line.strip())
    if buf.strip():
        yield buf


class KubernetesDiscovery:
    """Lists and watches pods in one namespace and keeps the bridge's pod set in step."""

    def __init__(
        self,
        bridge: PodTarget,
        settings: K8sSettings,
        api: Any,
        watch_timeout: int = 300,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
    ) -> None:
        self.bridge = bridge
        self.settings = settings
        self.api = api
        self.tracker = PodTracker(settings, owns=owns_filter(bridge))
        self.watch_timeout = watch_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.stats: Counter[str] = Counter()
        self.metrics = DiscoveryMetrics(bridge, "kubernetes")
        self.synced = threading.Event()  # set after the first successful list
        self._stop = threading.Event()
        self._resp: Any = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="k8s-discovery", daemon=True)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        log.info(
            "kubernetes discovery: namespace %s, selector %s, model label %s",
            self.settings.namespace,
            self.settings.label_selector,
            self.settings.model_label,
        )
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end (safe from a signal handler); interrupts a blocked watch."""
        self._stop.set()
        with self._lock:
            resp = self._resp
        if resp is not None:
            # urllib3 >= 2.3: unblocks a read in another thread (else the read timeout ends it)
            with contextlib.suppress(Exception):
                resp.shutdown()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = self.backoff_initial
        quick_relist = True  # one immediate relist after 410; repeated trouble backs off
        while not self._stop.is_set():
            try:
                if self.tracker.resource_version is None or not self.synced.is_set():
                    self._list()
                started = time.monotonic()
                relist = self._watch()
                if relist is None:
                    if time.monotonic() - started >= 1.0:
                        backoff, quick_relist = self.backoff_initial, True
                        continue  # the watch timed out normally: resume from the last version
                    # A watch that ends at once (a proxy cutting it?): resume after a pause.
                    log.debug("watch ended at once; resuming in %.1fs", backoff)
                else:
                    self.stats["relists"] += 1
                    self.metrics.error("relist")
                    self.tracker.resource_version = None
                    if relist.gone and quick_relist:
                        log.info("watch expired (%s); listing again", relist.reason)
                        quick_relist = False
                        continue
                    log.warning("watch failed (%s); listing again in %.1fs", relist.reason, backoff)
            except Exception as exc:  # noqa: BLE001 - the API server or network: retry
                self.stats["errors"] += 1
                self.metrics.error("api")
                self.tracker.resource_version = None
                if getattr(exc, "status", None) == 410 and quick_relist:
                    log.info("resourceVersion expired (410); listing again")
                    quick_relist = False
                    continue
                text = str(exc).strip()
                log.warning(
                    "kubernetes API error (%s: %s); retrying in %.1fs",
                    type(exc).__name__,
                    text.splitlines()[0][:300] if text else "",
                    backoff,
                )
            if self._stop.wait(backoff):
                return
            backoff = min(self.backoff_max, backoff * 2)

    def _list(self) -> None:
        s = self.settings
        resp = self.api.list_namespaced_pod(
            s.namespace,
            label_selector=s.label_selector,
            _preload_content=False,
            _request_timeout=(10, 60),
        )
        try:
            body = json.loads(resp.data)
        finally:
            resp.release_conn()
        self.stats["lists"] += 1
        actions = self.tracker.on_list(body)
        bad = next((a for a in actions if isinstance(a, Relist)), None)
        if bad is not None:
            raise ValueError(f"unexpected list response: {bad.reason}")
        self._apply(actions)
        self.synced.set()
        log.info(
            "listed pods: following %d (resourceVersion %s)",
            len(self.tracker.active),
            self.tracker.resource_version,
        )

    def _watch(self) -> Relist | None:
        """One watch request; returns why to relist, or None when it simply ended."""
        s = self.settings
        resp = self.api.list_namespaced_pod(
            s.namespace,
            label_selector=s.label_selector,
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=self.tracker.resource_version,
            timeout_seconds=self.watch_timeout,
            _preload_content=False,
            _request_timeout=(10, self.watch_timeout + 30),
        )
        self.stats["watches"] += 1
        with self._lock:
            self._resp = resp
        try:
            if self._stop.is_set():
                return None
            for line in _lines(resp):
                try:
                    event = json.loads(line)
                except ValueError:
                    self.stats["bad_events"] += 1
                    return Relist(f"watch line is not JSON: {line[:200]!r}", gone=False)
                self.stats["events"] += 1
                actions = self.tracker.on_event(event)
                relist = next((a for a in actions if isinstance(a, Relist)), None)
                self._apply(actions)
                if relist is not None:
                    return relist
                if self._stop.is_set():
                    return None
            return None
        except Exception:
            if self._stop.is_set():
                return None  # the stop() shutdown interrupted the read
            raise
        finally:
            with self._lock:
                self._resp = None
            resp.close()  # an unfinished stream must not go back to the pool
            resp.release_conn()

    def _apply(self, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Add):
                self.stats["added"] += 1
                self.metrics.changed("added", len(self.tracker.active))
                log.info(
                    "discovered pod %s (uid %s, model %s): pub %s, replay %s, dp %d",
                    a.pod.name,
                    a.pod.uid,
                    a.pod.model,
                    a.pod.pub,
                    a.pod.replay or "none",
                    a.pod.dp_size,
                )
                try:
                    self.bridge.add_pod(a.pod)
                except Exception:  # noqa: BLE001 - one pod's trouble never stops discovery
                    self.stats["apply_errors"] += 1
                    self.metrics.error("apply")
                    log.exception(
                        "could not add pod %s; retried when it changes or at the next relist",
                        a.pod.name,
                    )
                    if self.tracker.active.get(a.pod.name) == a.pod:
                        del self.tracker.active[a.pod.name]
                        self.metrics.pods.labels("kubernetes").set(len(self.tracker.active))
            elif isinstance(a, Remove):
                self.stats["removed"] += 1
                self.metrics.changed("removed", len(self.tracker.active))
                log.info("pod %s gone: %s", a.name, a.reason)
                try:
                    self.bridge.remove_pod(a.name, a.reason)
                except Exception:  # noqa: BLE001
                    self.stats["apply_errors"] += 1
                    self.metrics.error("apply")
                    log.exception("could not remove pod %s", a.name)
            elif isinstance(a, Skip):
                if a.bad:
                    self.stats["bad_pods"] += 1
                    self.metrics.skip()
                    log.warning("pod %s is not followed: %s", a.name, a.reason)
                else:
                    log.debug("pod %s is not followed yet: %s", a.name, a.reason)


__all__ = ["KubernetesDiscovery", "default_namespace", "make_core_api"]
