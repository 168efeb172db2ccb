"""Bridge settings: pods to follow, Kafka, sequencing. From a TOML file, KVBRIDGE_* env vars
and CLI flags (flags win over env, env over the file)."""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


class ConfigError(ValueError):
    """A setting is invalid; the message names it and says what is accepted."""


class KafkaUnreachable(RuntimeError):
    """No Kafka broker answered at the configured address."""

    def __init__(self, bootstrap_servers: str, detail: str) -> None:
        super().__init__(
            f"cannot reach Kafka at {bootstrap_servers} ({detail}): check --bootstrap-servers "
            "(or KVBRIDGE_BOOTSTRAP_SERVERS), that the broker is running and that this host "
            "can connect to that address"
        )


def kafka_unreachable(exc: BaseException) -> bool:
    """Whether a librdkafka error means that no broker could be reached."""
    from confluent_kafka import KafkaError, KafkaException

    if not isinstance(exc, KafkaException) or not exc.args:
        return False
    err = exc.args[0]
    codes = (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE)
    return isinstance(err, KafkaError) and (
        err.code() in codes or (err.code() == KafkaError._TIMED_OUT and "metadata" in err.str())
    )


@dataclass(frozen=True, slots=True)
class PodConfig:
    """One vLLM pod: its PUB endpoint and optional replay ROUTER, for DP rank 0.

    Rank r of a pod with dp_size N uses port + r on both endpoints (vLLM's own rule).
    ``pub=None``: the pod connects to the bridge's ``listen`` socket and is told apart by its
    ``topic`` (llm-d's layout).
    """

    name: str
    model: str
    pub: str | None
    replay: str | None = None
    dp_size: int = 1
    topic: str = ""
    uid: str | None = None  # incarnation (a Kubernetes pod UID): a new uid never resumes

    def pub_endpoint(self, rank: int) -> str | None:
        return None if self.pub is None else offset_port(self.pub, rank)

    def replay_endpoint(self, rank: int) -> str | None:
        return None if self.replay is None else offset_port(self.replay, rank)


def offset_port(endpoint: str, rank: int) -> str:
    """``tcp://host:5557`` -> ``tcp://host:<5557+rank>``."""
    if rank == 0:
        return endpoint
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.port is None:
        raise ConfigError(
            f"endpoint {endpoint!r}: data-parallel ranks > 0 need a tcp://host:port endpoint "
            "(vLLM offsets the port by the rank)"
        )
    host = endpoint[len("tcp://") : endpoint.rindex(":")]
    return f"tcp://{host}:{parts.port + rank}"


def check_endpoint(setting: str, endpoint: str, bind: bool = False) -> None:
    """A ZeroMQ endpoint the bridge connects to (or binds, with ``bind``)."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(
            f"{setting}={endpoint!r}: expected a ZeroMQ endpoint such as tcp://10.0.0.5:5557"
        )
    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://") :].rpartition(":")[0]
        if not bind and host == "*":
            port = endpoint.rpartition(":")[2]
            raise ConfigError(
                f"{setting}={endpoint!r} is a bind address (vLLM binds its endpoint when it "
                f"contains '*'); give the address the bridge connects to, with the pod's host "
                f"or IP, e.g. tcp://10.0.0.5:{port} (pods that connect to the bridge instead: "
                f"--listen tcp://*:{port} and topic= in place of pub=)"
            )
        if any(c.isspace() for c in host):
            raise ConfigError(f"{setting}={endpoint!r}: the host contains whitespace")
        try:
            port = urlsplit(endpoint).port
        except ValueError:
            port = None
        if port is None:
            raise ConfigError(
                f"{setting}={endpoint!r}: a tcp endpoint needs a port (tcp://host:5557)"
            )


_POD_KEYS = {"name", "model", "pub", "replay", "dp", "dp_size", "topic"}


def parse_pod(spec: str | dict[str, Any], notes: list[str] | None = None) -> PodConfig:
    """A pod from ``name=a,model=m,pub=tcp://h:5557,replay=tcp://h:5558,dp=2`` or a TOML table.

    ``notes`` (if given) receives warnings about a pod that works but is likely not what was
    meant (no model=, data-parallel ranks whose ports collide)."""
    if isinstance(spec, str):
        items: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise ConfigError(
                    f"--pod {spec!r}: {part!r} is not key=value; expected "
                    "name=NAME,model=MODEL,pub=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,dp=N]"
                )
            key = key.strip()
            same = {"dp", "dp_size"} if key in ("dp", "dp_size") else {key}
            if same & set(items):
                raise ConfigError(f"--pod {spec!r}: {key}= is given twice; give each key once")
            items[key] = value.strip()
    else:
        items = dict(spec)
    unknown = set(items) - _POD_KEYS
    if unknown:
        raise ConfigError(
            f"pod {items.get('name', spec)!r}: unknown key(s) {sorted(unknown)}; "
            f"accepted: {sorted(_POD_KEYS)}"
        )
    if not items.get("name"):
        raise ConfigError(f"pod {spec!r}: name= is required")
    if not items.get("pub") and not items.get("topic"):
        raise ConfigError(
            f"pod {spec!r}: pub= is required (or topic= for a pod that connects to the bridge's "
            "--listen socket)"
        )
    dp = items.get("dp_size", items.get("dp", 1))
    try:
        dp_size = int(dp)
    except (TypeError, ValueError):
        dp_size = 0
    if dp_size < 1:
        raise ConfigError(f"pod {items['name']!r}: dp={dp!r} must be a whole number >= 1")
    pod = PodConfig(
        name=str(items["name"]),
        model=str(items.get("model") or "unknown"),
        pub=str(items["pub"]) if items.get("pub") else None,
        replay=str(items["replay"]) if items.get("replay") else None,
        dp_size=dp_size,
        topic=str(items.get("topic", "")),
    )
    if pod.pub:
        check_endpoint(f"pod {pod.name} pub", pod.pub)
    if pod.replay:
        check_endpoint(f"pod {pod.name} replay", pod.replay)
    for rank in range(dp_size):
        pod.pub_endpoint(rank)
        pod.replay_endpoint(rank)
    if notes is not None:
        if not items.get("model"):
            notes.append(
                f"pod {pod.name}: no model= given, so its records say model 'unknown'; add "
                "model=<the name vLLM serves>"
            )
        notes.extend(_dp_port_collisions(pod))
    return pod


def _dp_port_collisions(pod: PodConfig) -> list[str]:
    """Rank r uses port + r on both endpoints: with the PUB and replay ports closer than
    dp_size on one host, one rank's PUB is another rank's replay port."""
    if pod.dp_size < 2 or pod.pub is None or pod.replay is None:
        return []
    pub, replay = urlsplit(pod.pub), urlsplit(pod.replay)
    if pub.scheme != "tcp" or pub.hostname != replay.hostname:
        return []
    assert pub.port is not None and replay.port is not None
    if abs(replay.port - pub.port) >= pod.dp_size:
        return []
    low, high = sorted((pub.port, replay.port))
    what = "PUB" if high == pub.port else "replay"
    return [
        f"pod {pod.name}: with dp={pod.dp_size}, rank {high - low}'s "
        f"{'replay' if what == 'PUB' else 'PUB'} port {high} is rank 0's {what} port "
        f"(rank r uses port + r on both endpoints); keep the replay port >= PUB port + "
        f"{pod.dp_size}, e.g. replay=tcp://{pub.hostname}:{pub.port + pod.dp_size}, and "
        "vLLM's replay_endpoint to match"
    ]


_TOPIC_FIELDS = {"model", "pod"}
_TOPIC_ILLEGAL = re.compile(r"[^A-Za-z0-9._-]")


def check_topic_template(template: str) -> None:
    """``kv-events``, ``kv-events.{model}``, ``kv.{model}.{pod}``: only those placeholders."""
    import string

    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise ConfigError(f"topic={template!r}: {exc} (use {{model}} or {{pod}})") from None
    bad = fields - _TOPIC_FIELDS
    if bad:
        raise ConfigError(
            f"topic={template!r}: unknown placeholder(s) {sorted(bad)}; "
            "accepted: {model}, {pod}"
        )
    sample = render_topic(template, "m", "p")
    if not sample or _TOPIC_ILLEGAL.search(sample) or len(sample) > 249:
        raise ConfigError(
            f"topic={template!r}: a Kafka topic name is 1-249 characters of A-Z a-z 0-9 . _ -"
        )


def render_topic(template: str, model: str, pod: str) -> str:
    """The topic of one pod; characters Kafka refuses in the model or pod name become ``_``
    (``meta-llama/Llama-3-8B`` -> ``meta-llama_Llama-3-8B``)."""
    if "{" not in template:
        return template
    clean = {"model": _TOPIC_ILLEGAL.sub("_", model), "pod": _TOPIC_ILLEGAL.sub("_", pod)}
    return template.format(**clean)[:249]


def topic_base(template: str) -> str:
    """The template's fixed leading part (``kv-events.{model}`` -> ``kv-events``), for the
    names derived from it (checkpoint topic, transactional id)."""
    return template.split("{", 1)[0].rstrip("._-") or "kvbridge"


@dataclass(slots=True)
class BridgeConfig:
    bootstrap_servers: str = "localhost:9092"
    topic: str = "kv-events"
    topic_partitions: int = 6  # for topics the bridge creates (existing ones are left alone)
    topic_replication: int = -1  # -1: the broker's default.replication.factor
    pods: list[PodConfig] = field(default_factory=list)
    listen: str | None = None  # one SUB the bridge binds; pods without pub= connect to it
    # follow pods named by kv@<pod>@<model> topics on the listen socket (llm-d), at most
    # listen_max_pods of them; listen_replay ("tcp://{pod}:5558") gives them replay endpoints
    listen_discover: bool = False
    listen_replay: str | None = None
    listen_max_pods: int = 1024
    listen_ranks: int = 1  # listen sockets bound: port..port+N-1 for DP ranks 0..N-1
    metrics_port: int = 9400  # 0 disables the HTTP endpoint
    metrics_host: str = "127.0.0.1"  # this host only; the container image sets 0.0.0.0
    first_contact: str = "replay"
    replay_timeout: float = 2.0
    replay_deadline: float = 30.0
    replay_attempts: int = 3
    # A live seq this far beyond anything known is a restart, not a gap (sequencer.py); raise
    # it with the pods' replay ring (vLLM's buffer_steps, 10,000 by default)
    max_seq_jump: int = 100_000
    max_held: int = 10_000  # live batches held per stream while its replay runs
    reconnect_initial: float = 1.0
    reconnect_max: float = 30.0
    reconnect_factor: float = 2.0
    silence_timeout: float = 0.0  # reconnect after this long without a message; 0 = off
    idle_probe: float = 2.0  # ask for newer batches after this long idle; 0 = off
    silent_warning: float = 30.0  # report a stream that heard nothing this long; 0 = never
    poll_timeout: float = 0.1  # longest the event loop sleeps
    max_replays: int = 8  # replays in flight across all pods (vLLM serves them inline)
    checkpoint_topic: str | None = None  # default "<topic>.checkpoints"
    checkpoint_interval: float = 1.0
    exactly_once: bool = False
    # adopt the topics' current partition counts at start (bridge/log/partitioning.py)
    repartition: bool = False
    transactional_id: str | None = None  # default "kvbridge-<topic>"
    commit_interval: float = 0.1
    commit_max_events: int = 10_000
    commit_timeout: float = 60.0
    shutdown_timeout: float = 30.0
    rcvhwm: int = 10_000  # batches ZeroMQ may queue per stream while Kafka is slow
    max_message_bytes: int = 64 * 1024 * 1024
    kafka: dict[str, str] = field(default_factory=dict)  # librdkafka properties passed through
    # Confluent Schema Registry (docs/schema-registry.md): None = Avro single-object framing
    schema_registry_url: str | None = None
    schema_registry: dict[str, str] = field(default_factory=dict)  # its client's properties
    shard_index: int = 0  # this replica's shard (rendezvous hashing of pod names)
    shard_count: int = 1
    # pod discovery (docs/discovery.md): static = the pods above only
    discovery: str = "static"  # static | kubernetes | dns
    k8s_namespace: str | None = None  # None: the in-cluster namespace, else "default"
    k8s_label_selector: str = "model.aibrix.ai/kv-events-enabled=true"
    k8s_model_label: str = "model.aibrix.ai/name"  # else annotation kvbridge.io/model
    k8s_kubeconfig: str | None = None  # None: in-cluster config, else ~/.kube/config
    dns_name: str | None = None  # a headless service, re-resolved every dns_interval
    dns_model: str = "unknown"
    dns_interval: float = 10.0
    dns_pub_port: int = 5557
    dns_replay_port: int = 5558  # 0: no replay endpoint

    def topic_for(self, pod: PodConfig) -> str:
        return render_topic(self.topic, pod.model, pod.name)


# AIBrix's documented (never implemented) variables, accepted as aliases; KVBRIDGE_* wins.
AIBRIX_ALIASES = {
    "AIBRIX_ZMQ_POLL_TIMEOUT": "poll_timeout",
    "AIBRIX_ZMQ_REPLAY_TIMEOUT": "replay_timeout",
    "AIBRIX_ZMQ_RECONNECT_INTERVAL": "reconnect_initial",
}

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_duration(text: str | float | int) -> float:
    """Seconds from ``2.5`` (seconds) or a Go duration such as ``100ms``, ``5s``, ``1m30s``."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a duration: use seconds (2.5) or units (100ms, 5s)")
    if isinstance(text, int | float):
        value = float(text)
    else:
        t = text.strip()
        try:
            value = float(t)
        except ValueError:
            if t.startswith("-") and _DURATION.findall(t[1:]):
                raise ValueError(
                    f"{text!r}: a duration cannot be negative (give e.g. 5s)"
                ) from None
            parts = _DURATION.findall(t)
            if not parts or "".join(a + b for a, b in parts) != t:
                raise ValueError(
                    f"{text!r} is not a duration: use seconds (2.5) or units (100ms, 5s, 1m30s)"
                ) from None
            value = sum(float(n) * _UNITS[u] for n, u in parts)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a duration: use seconds (2.5) or units (100ms, 5s)")
    if value < 0:
        raise ValueError(f"{text!r}: a duration cannot be negative")
    return value


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc


def env_settings(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``KVBRIDGE_BOOTSTRAP_SERVERS=x`` -> ``{"bootstrap_servers": "x"}``."""
    environ = os.environ if environ is None else environ
    prefix = "KVBRIDGE_"
    out = {AIBRIX_ALIASES[k]: v for k, v in environ.items() if k in AIBRIX_ALIASES}
    out.update({k[len(prefix) :].lower(): v for k, v in environ.items() if k.startswith(prefix)})
    return out


# -- librdkafka properties -------------------------------------------------------------------

KAFKA_ENV_PREFIX = "KVBRIDGE_KAFKA_"


def env_kafka_properties(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``KVBRIDGE_KAFKA_SASL_MECHANISM=PLAIN`` -> ``{"sasl.mechanism": "PLAIN"}``."""
    environ = os.environ if environ is None else environ
    n = len(KAFKA_ENV_PREFIX)
    return {
        k[n:].lower().replace("_", "."): v
        for k, v in environ.items()
        if k.startswith(KAFKA_ENV_PREFIX) and len(k) > n
    }


# Producer-only librdkafka properties (global and topic scope): not given to the AdminClient
# and the checkpoint consumer, which get every other property (security, networking, client.id).
PRODUCER_ONLY = frozenset(
    {
        "acks",
        "request.required.acks",
        "enable.idempotence",
        "enable.gapless.guarantee",
        "partitioner",
        "message.timeout.ms",
        "delivery.timeout.ms",
        "request.timeout.ms",
        "linger.ms",
        "queue.buffering.max.ms",
        "queue.buffering.max.messages",
        "queue.buffering.max.kbytes",
        "queue.buffering.backpressure.threshold",
        "compression.type",
        "compression.codec",
        "compression.level",
        "batch.num.messages",
        "batch.size",
        "retries",
        "message.send.max.retries",
        "transactional.id",
        "transaction.timeout.ms",
        "queuing.strategy",
        "produce.offset.report",
        "delivery.report.only.error",
        "sticky.partitioning.linger.ms",
        "message.copy.max.bytes",
    }
)


def shared_kafka_properties(kafka: dict[str, str]) -> dict[str, str]:
    """The properties that also apply to the AdminClient and consumers (all but producer-only)."""
    return {k: v for k, v in kafka.items() if k not in PRODUCER_ONLY}


_SECRET_PARTS = (
    "password",
    "secret",
    "token",
    "jaas",
    "ssl.key",
    "credential",
    "private",
    "user.info",  # schema registry basic.auth.user.info = USER:PASSWORD
)
_SECRET_NAMES = {"sasl.oauthbearer.config", "ssl.keystore.location"}
MASK = "****"


def is_secret(name: str) -> bool:
    """Whether a librdkafka property holds a secret (masked when a configuration is printed)."""
    n = name.lower()
    return n in _SECRET_NAMES or any(part in n for part in _SECRET_PARTS)


# Variables Kubernetes injects for a Service named "kvbridge" (service links); not settings.
_K8S_SERVICE_ENV = re.compile(r"KVBRIDGE_(SERVICE_HOST|SERVICE_PORT\w*|PORT(_\d+_\w+)?)$")


def unknown_env(environ: dict[str, str], known: set[str]) -> list[str]:
    """``KVBRIDGE_*`` variables that set nothing (typos), ignoring Kubernetes service links."""
    out = []
    for k in environ:
        if not k.startswith("KVBRIDGE_") or k.startswith(KAFKA_ENV_PREFIX):
            continue
        if _K8S_SERVICE_ENV.match(k) or k.startswith("KVBRIDGE_TEST_"):
            continue
        if k[len("KVBRIDGE_") :].lower() not in known:
            out.append(k)
    return sorted(out)
