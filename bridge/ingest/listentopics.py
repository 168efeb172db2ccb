"""Pods discovered from the topic frame on the ``--listen`` socket (llm-d's centralized layout).

Pure code, no sockets: parsing llm-d's topic ``kv@<pod-id>@<model>``, the replay endpoint a
template gives a discovered pod, and the decision what to do with a message whose topic matches
no stream yet (:func:`decide`). The I/O glue is :class:`bridge.ingest.listener.ListenDiscovery`.

Topic format: the frame is UTF-8, starts with ``kv@``, and is split at the first two ``@``
only: ``kv@10.0.0.5@org/model@v2`` is pod ``10.0.0.5``, model ``org/model@v2``. llm-d sets the
pod id to the pod IP; it may not contain ``@``, the model may. Both must be non-empty, at most
:data:`MAX_FIELD` characters, and free of whitespace and control characters (the pod id becomes
the Kafka key and a metrics label).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from bridge.ops.config import ConfigError, PodConfig, check_endpoint

PREFIX = "kv"
MAX_FIELD = 253  # a DNS name's length; pod ids are IPs or pod names
_BAD_CHARS = re.compile(r"[\s\x00-\x1f\x7f]")
_HOST_CHARS = re.compile(r"[A-Za-z0-9._:-]+")  # what a pod id may hold to go into an endpoint


@dataclass(frozen=True, slots=True)
class ListenTopic:
    """A parsed topic frame: the pod id and the model."""

    pod: str
    model: str


def parse_topic(topic: bytes) -> ListenTopic | None:
    """``b"kv@pod-a@llama"`` -> ListenTopic("pod-a", "llama"); None if it is not that shape."""
    try:
        text = topic.decode("utf-8")
    except UnicodeDecodeError:
        return None
    parts = text.split("@", 2)
    if len(parts) != 3 or parts[0] != PREFIX:
        return None
    _, pod, model = parts
    for value in (pod, model):
        if not value or len(value) > MAX_FIELD or _BAD_CHARS.search(value):
            return None
    return ListenTopic(pod, model)


def check_replay_template(template: str) -> None:
    """``tcp://{pod}:5558``: a tcp endpoint with the ``{pod}`` placeholder and a port."""
    if "{pod}" not in template:
        raise ConfigError(
            f"listen_replay={template!r}: needs the {{pod}} placeholder, replaced by the pod id "
            "of the topic (llm-d sets it to the pod IP), e.g. tcp://{pod}:5558"
        )
    if not template.startswith("tcp://"):
        raise ConfigError(
            f"listen_replay={template!r}: must be a tcp:// endpoint such as tcp://{{pod}}:5558 "
            "(rank r uses port + r)"
        )
    try:
        check_endpoint("listen_replay", template.replace("{pod}", "10.0.0.5"))
    except ConfigError:
        raise ConfigError(
            f"listen_replay={template!r}: expected tcp://{{pod}}:PORT, e.g. tcp://{{pod}}:5558"
        ) from None
    if template.count("{") != 1 or template.count("}") != 1:
        raise ConfigError(f"listen_replay={template!r}: {{pod}} is the only placeholder")


def replay_endpoint(template: str | None, pod: str) -> str | None:
    """The replay endpoint of discovered pod ``pod`` (rank 0), or None: no template, or a pod
    id that is not a host name or IP address (then the pod is followed without replay).
    An IPv6 pod id is bracketed (``tcp://[fd00::1]:5558``)."""
    if template is None or not _HOST_CHARS.fullmatch(pod):
        return None
    host = f"[{pod}]" if ":" in pod and "[{pod}]" not in template else pod
    return template.replace("{pod}", host)


# -- what to do with a message whose topic no stream takes --------------------------------------


@dataclass(frozen=True, slots=True)
class Follow:
    """Follow ``pod`` (new, or a discovered pod with more ranks than before)."""

    pod: PodConfig


@dataclass(frozen=True, slots=True)
class Refuse:
    """Drop the message; ``kind`` is the counter label (``unknown_topic``, ``too_many_pods``,
    ``name_taken``), ``why`` the log text."""

    kind: str
    why: str


@dataclass(frozen=True, slots=True)
class NotOwned:
    """Another shard owns this pod: ignore the message (not an error)."""

    pod: str


Decision = Follow | Refuse | NotOwned


def decide(
    topic: bytes,
    rank: int,
    followed: dict[str, PodConfig],
    discovered: set[str],
    owns: bool | None,
    max_pods: int,
    replay_template: str | None,
) -> Decision:
    """A message on listener ``rank`` whose topic matches no stream on that listener.

    ``followed``: every pod followed, by name; ``discovered``: the names among them that were
    discovered; ``owns``: whether this shard owns the topic's pod (None if it does not parse).
    A discovered pod seen on a higher rank grows to ``rank + 1`` ranks (vLLM's ranks 0..N-1
    all exist when rank N-1 does); its other ranks are kept as they are.
    """
    parsed = parse_topic(topic)
    if parsed is None:
        return Refuse("unknown_topic", "matches no configured pod and is not kv@<pod>@<model>")
    old = followed.get(parsed.pod)
    if old is not None and parsed.pod not in discovered:
        return Refuse(
            "name_taken",
            f"names pod {parsed.pod!r}, which is configured with another topic or endpoint",
        )
    if old is not None:
        if old.model != parsed.model:
            return Refuse(
                "name_taken",
                f"names pod {parsed.pod!r}, discovered before with model {old.model!r}",
            )
        if rank < old.dp_size:  # cannot happen: that rank's route exists
            return Refuse("unknown_topic", "matches a stream that is not routed")
        return Follow(replace(old, dp_size=rank + 1))
    if owns is False:
        return NotOwned(parsed.pod)
    if len(discovered) >= max_pods:
        return Refuse(
            "too_many_pods",
            f"would be discovered pod number {len(discovered) + 1}, over listen_max_pods "
            f"({max_pods})",
        )
    return Follow(
        PodConfig(
            name=parsed.pod,
            model=parsed.model,
            pub=None,
            replay=replay_endpoint(replay_template, parsed.pod),
            dp_size=rank + 1,
            topic=topic.decode("utf-8"),
        )
    )


__all__ = [
    "Decision",
    "Follow",
    "ListenTopic",
    "NotOwned",
    "Refuse",
    "check_replay_template",
    "decide",
    "parse_topic",
    "replay_endpoint",
]
