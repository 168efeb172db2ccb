"""Kubernetes pod discovery, sans I/O: list results and watch events in, pods to add/remove out.

:class:`PodTracker` is fed what the API server returns (a ``PodList`` as a dict and watch events
``{"type": ..., "object": {...}}``) and decides which pods the bridge follows. It keeps the
resourceVersion to resume the watch from, asks for a relist on ``410 Gone`` (or any watch
``ERROR``), and treats the pod UID as the incarnation: the same name with a new UID is removed
and added again, so a recreated pod never continues an old stream.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bridge.ops.config import PodConfig

DEFAULT_LABEL_SELECTOR = "model.aibrix.ai/kv-events-enabled=true"
DEFAULT_MODEL_LABEL = "model.aibrix.ai/name"
MODEL_ANNOTATION = "kvbridge.io/model"
PUB_PORT_ANNOTATION = "kvbridge.io/pub-port"
REPLAY_PORT_ANNOTATION = "kvbridge.io/replay-port"
DP_SIZE_ANNOTATION = "kvbridge.io/dp-size"
DEFAULT_PUB_PORT = 5557
DEFAULT_REPLAY_PORT = 5558
HTTP_GONE = 410


@dataclass(frozen=True, slots=True)
class K8sSettings:
    """What selects a pod and how its endpoints are derived."""

    namespace: str = "default"
    label_selector: str = DEFAULT_LABEL_SELECTOR
    model_label: str = DEFAULT_MODEL_LABEL
    pub_port: int = DEFAULT_PUB_PORT
    replay_port: int = DEFAULT_REPLAY_PORT
    dp_size: int = 1


@dataclass(frozen=True, slots=True)
class Add:
    """Follow this pod (a new pod, or a new incarnation of a name)."""

    pod: PodConfig


@dataclass(frozen=True, slots=True)
class Remove:
    """Stop following the pod with this name; the bridge writes a PodRemoved marker."""

    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class Skip:
    """A pod matching the selector is not followed (emitted when the reason changes).

    ``bad`` is True for input the operator should fix (a bad annotation, no model); pods that
    are merely not Running yet or terminating have ``bad=False``.
    """

    name: str
    reason: str
    bad: bool


@dataclass(frozen=True, slots=True)
class Relist:
    """The watch cannot continue: list again (``gone``: the resourceVersion expired, 410)."""

    reason: str
    gone: bool


Action = Add | Remove | Skip | Relist


class NotFollowed(Exception):
    """Why a pod is not followed; ``bad`` marks input an operator should fix."""

    def __init__(self, reason: str, bad: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.bad = bad


def _port(annotations: Mapping[str, Any], key: str, default: int, allow_none: bool) -> int | None:
    raw = annotations.get(key)
    if raw is None:
        return default
    text = str(raw).strip().lower()
    if allow_none and text in ("none", "0", "off"):
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        accepted = "a port 1-65535" + (" or none" if allow_none else "")
        raise NotFollowed(f"annotation {key}={raw!r}: expected {accepted}", bad=True)
    return value


def pod_config(obj: Any, settings: K8sSettings) -> PodConfig:
    """The :class:`PodConfig` for a pod object, or :class:`NotFollowed` saying why not."""
    if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
        raise NotFollowed("not a pod object (no metadata)", bad=True)
    meta = obj["metadata"]
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise NotFollowed("pod without metadata.name", bad=True)
    if meta.get("deletionTimestamp"):
        raise NotFollowed("terminating (deletionTimestamp set)")
    status = obj.get("status") if isinstance(obj.get("status"), dict) else {}
    phase = status.get("phase")
    if phase != "Running":
        raise NotFollowed(f"phase {phase or 'unknown'}, not Running")
    ip = status.get("podIP")
    if not ip:
        raise NotFollowed("Running but no pod IP yet")
    try:
        addr = ipaddress.ip_address(str(ip))
    except ValueError:
        raise NotFollowed(f"status.podIP {ip!r} is not an IP address", bad=True) from None
    host = f"[{addr}]" if addr.version == 6 else str(addr)
    labels = meta.get("labels") if isinstance(meta.get("labels"), dict) else {}
    annotations = meta.get("annotations") if isinstance(meta.get("annotations"), dict) else {}
    model = (
        labels.get(settings.model_label)
        or annotations.get(MODEL_ANNOTATION)
        or annotations.get(settings.model_label)
    )
    if not model:
        raise NotFollowed(
            f"no model: set label {settings.model_label} or annotation {MODEL_ANNOTATION}",
            bad=True,
        )
    pub_port = _port(annotations, PUB_PORT_ANNOTATION, settings.pub_port, allow_none=False)
    replay_port = _port(annotations, REPLAY_PORT_ANNOTATION, settings.replay_port, allow_none=True)
    raw_dp = annotations.get(DP_SIZE_ANNOTATION, settings.dp_size)
    try:
        dp_size = int(str(raw_dp).strip())
    except ValueError:
        dp_size = 0
    if not 1 <= dp_size <= 1024:
        raise NotFollowed(
            f"annotation {DP_SIZE_ANNOTATION}={raw_dp!r}: expected a whole number 1-1024", bad=True
        )
    assert pub_port is not None
    if pub_port + dp_size - 1 > 65535 or (
        replay_port is not None and replay_port + dp_size - 1 > 65535
    ):
        raise NotFollowed(f"ports + dp-size {dp_size} run past 65535", bad=True)
    if replay_port is not None and abs(replay_port - pub_port) < dp_size:
        raise NotFollowed(
            f"pub port {pub_port} and replay port {replay_port} overlap for dp-size {dp_size}: "
            "rank r uses port + r on both (keep them at least dp-size apart)",
            bad=True,
        )
    uid = meta.get("uid")
    return PodConfig(
        name=name,
        model=str(model),
        pub=f"tcp://{host}:{pub_port}",
        replay=None if replay_port is None else f"tcp://{host}:{replay_port}",
        dp_size=dp_size,
        uid=str(uid) if uid else None,
    )


def _name_of(obj: Any) -> str:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) and name else "?"


def _uid_of(obj: Any) -> str | None:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    uid = meta.get("uid") if isinstance(meta, dict) else None
    return str(uid) if uid else None


def _rv_of(obj: Any) -> str | None:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return str(rv) if rv else None


@dataclass
class PodTracker:
    """The set of followed pods, kept in step with the API server's list and watch.

    ``owns(name)`` is the shard filter: pods another bridge replica owns are never added.
    """

    settings: K8sSettings = field(default_factory=K8sSettings)
    owns: Callable[[str], bool] = lambda _name: True
    active: dict[str, PodConfig] = field(default_factory=dict)
    resource_version: str | None = None
    skipped: dict[str, str] = field(default_factory=dict)  # name -> reason last reported

    def on_list(self, pod_list: Any) -> list[Action]:
        """A full ``PodList``: bring ``active`` to exactly the eligible pods in it."""
        if not isinstance(pod_list, dict) or not isinstance(pod_list.get("items"), list):
            return [Relist("list response is not a PodList", gone=False)]
        actions: list[Action] = []
        desired: dict[str, PodConfig] = {}
        seen: set[str] = set()
        for obj in pod_list["items"]:
            name = _name_of(obj)
            seen.add(name)
            pod = self._evaluate(obj, actions)
            if pod is not None:
                desired[pod.name] = pod
        for name in sorted(self.active):
            if name not in desired:
                gone = "no longer listed" if name not in seen else "no longer eligible"
                actions.append(self._remove(name, f"{gone} (relist)"))
        for name in sorted(desired):
            actions.extend(self._want(desired[name]))
        self.skipped = {n: r for n, r in self.skipped.items() if n in seen}
        self.resource_version = _rv_of(pod_list) or self.resource_version
        return actions

    def on_event(self, event: Any) -> list[Action]:
        """One watch event (``ADDED``, ``MODIFIED``, ``DELETED``, ``BOOKMARK``, ``ERROR``)."""
        if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
            return [Relist(f"malformed watch event {str(event)[:200]!r}", gone=False)]
        kind, obj = event.get("type"), event["object"]
        if kind == "ERROR":
            code = obj.get("code")
            msg = f"watch error {code} {obj.get('reason', '')}: {obj.get('message', '')}".strip()
            if code == HTTP_GONE:
                self.resource_version = None
            return [Relist(msg, gone=code == HTTP_GONE)]
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            return [Relist(f"unknown watch event type {kind!r}", gone=False)]
        self.resource_version = _rv_of(obj) or self.resource_version
        if kind == "BOOKMARK":
            return []
        actions: list[Action] = []
        name = _name_of(obj)
        if kind == "DELETED":
            self.skipped.pop(name, None)
            current = self.active.get(name)
            # A DELETED for an older incarnation must not remove the newer one.
            if current is not None and (current.uid is None or current.uid == _uid_of(obj)):
                actions.append(self._remove(name, "pod deleted"))
            return actions
        pod = self._evaluate(obj, actions)
        if pod is not None:
            actions.extend(self._want(pod))
        elif name in self.active:
            current = self.active[name]
            uid = _uid_of(obj)
            reason = self.skipped.get(name, "not eligible")
            if current.uid is not None and uid is not None and current.uid != uid:
                reason = f"recreated with uid {uid}; {reason}"
            actions.append(self._remove(name, reason))
        return actions

    # -- internals -----------------------------------------------------------------------------
    def _evaluate(self, obj: Any, actions: list[Action]) -> PodConfig | None:
        """The pod's config if it should be followed by this shard; reports changed skips."""
        name = _name_of(obj)
        try:
            pod = pod_config(obj, self.settings)
        except NotFollowed as exc:
            if self.skipped.get(name) != exc.reason:
                self.skipped[name] = exc.reason
                actions.append(Skip(name, exc.reason, exc.bad))
            return None
        if not self.owns(pod.name):
            self.skipped[name] = "owned by another shard"
            return None
        self.skipped.pop(name, None)
        return pod

    def _want(self, pod: PodConfig) -> list[Action]:
        current = self.active.get(pod.name)
        if current == pod:
            return []
        actions: list[Action] = []
        if current is not None:
            if current.uid != pod.uid:
                why = f"recreated (uid {current.uid} -> {pod.uid})"
            else:
                why = "endpoints changed"
            actions.append(self._remove(pod.name, why))
        self.active[pod.name] = pod
        actions.append(Add(pod))
        return actions

    def _remove(self, name: str, reason: str) -> Remove:
        del self.active[name]
        return Remove(name, reason)


__all__ = [
    "Action",
    "Add",
    "K8sSettings",
    "NotFollowed",
    "PodTracker",
    "Relist",
    "Remove",
    "Skip",
    "pod_config",
]
