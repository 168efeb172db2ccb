"""Confluent Schema Registry: register the record schema and frame values in its wire format.

With a registry configured, values are ``00`` (magic byte), the schema id (4 bytes, big-endian),
then the same Avro binary body as the single-object encoding. The bridge registers
``schemas/kv_event.avsc`` under the subject ``<topic>-value`` with BACKWARD compatibility and
writes the returned id; readers fetch writer schemas by id (cached). Everything goes through
confluent-kafka's ``schema_registry`` client.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from fastavro.schema import parse_schema

from bridge.log.records import RecordCodec, RecordError, schema_dir

log = logging.getLogger(__name__)

CONFLUENT_MAGIC = 0
COMPATIBILITY = "BACKWARD"
DEFAULT_TIMEOUT = 10.0  # seconds per HTTP request (the client's own default is none)
RETRY_AFTER = 10.0  # a failed lookup of a schema id is not tried again for this long
# Client properties that the confluent client only takes as numbers (flags give strings).
_NUMERIC = {
    "timeout": float,
    "cache.capacity": int,
    "cache.latest.ttl.sec": float,
    "max.retries": int,
    "retries.wait.ms": int,
    "retries.max.wait.ms": int,
}


class RegistryError(RuntimeError):
    """The schema registry cannot be used; the message says why and what to do."""


def subject_for(topic: str) -> str:
    """The subject of a topic's values (TopicNameStrategy): ``<topic>-value``."""
    return f"{topic}-value"


def confluent_header(schema_id: int) -> bytes:
    """The 5-byte Confluent wire-format prefix: magic byte 0, schema id (4 bytes, big-endian)."""
    if not 0 <= schema_id < 1 << 32:
        raise ValueError(f"schema id {schema_id} does not fit in 4 bytes")
    return bytes([CONFLUENT_MAGIC]) + schema_id.to_bytes(4, "big")


def client_conf(url: str, properties: dict[str, str] | None = None) -> dict[str, Any]:
    """The confluent client's configuration from a URL and ``--schema-registry-property``s."""
    conf: dict[str, Any] = {"url": url, "timeout": DEFAULT_TIMEOUT}
    for key, value in (properties or {}).items():
        conv = _NUMERIC.get(key)
        if conv is not None and isinstance(value, str):
            try:
                conf[key] = conv(value)
            except ValueError:
                raise RegistryError(
                    f"--schema-registry-property {key}={value!r}: expected a number"
                ) from None
        else:
            conf[key] = value
    return conf


def _masked(url: str) -> str:
    """The URL without credentials, for messages."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        rest = rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"


def _is_http_error(exc: BaseException) -> bool:
    return type(exc).__name__ == "SchemaRegistryError"


@dataclass(frozen=True, slots=True)
class Registration:
    """Where the record schema was registered, and the value prefix that names it."""

    subject: str
    schema_id: int
    header: bytes


class SchemaRegistry:
    """A Confluent-compatible schema registry, reached through confluent-kafka's client.

    ``client``: an already built ``SchemaRegistryClient`` (e.g. in tests); otherwise one is
    built from ``url`` and ``properties`` (any of the client's properties, such as
    ``basic.auth.user.info``).
    """

    def __init__(
        self, url: str, properties: dict[str, str] | None = None, client: Any = None
    ) -> None:
        self.url = url
        if client is None:
            try:
                from confluent_kafka.schema_registry import SchemaRegistryClient
            except ImportError as exc:  # the [schemaregistry] extras are missing
                raise RegistryError(
                    f"the schema registry client cannot be loaded ({exc}); install "
                    '"confluent-kafka[avro,schemaregistry]" (pip install kvbridge does)'
                ) from exc
            try:
                client = SchemaRegistryClient(client_conf(url, properties))
            except (TypeError, ValueError) as exc:
                raise RegistryError(
                    f"schema registry {_masked(url)}: {exc} (check --schema-registry-url and "
                    "--schema-registry-property)"
                ) from exc
        self.client = client
        self._schemas: dict[int, Any] = {}
        self._failed: dict[int, tuple[float, str]] = {}  # id -> (when, why): not retried at once
        self._lock = threading.Lock()

    def _where(self) -> str:
        return f"schema registry {_masked(self.url)}"

    def _fail(self, doing: str, exc: Exception) -> RegistryError:
        if _is_http_error(exc):
            status = getattr(exc, "http_status_code", None)
            hint = ""
            if status in (401, 403):
                hint = (
                    "; give credentials with --schema-registry-property "
                    "basic.auth.user.info=USER:PASSWORD"
                )
            return RegistryError(f"{self._where()} refused to {doing}: {exc}{hint}")
        return RegistryError(
            f"{self._where()} is unreachable ({type(exc).__name__}: {exc}) while trying to "
            f"{doing}; check --schema-registry-url (KVBRIDGE_SCHEMA_REGISTRY_URL) and that "
            "the registry is running"
        )

    def register(self, topic: str, schema: dict[str, Any] | str) -> Registration:
        """Set BACKWARD compatibility on ``<topic>-value`` and register ``schema`` there.

        Idempotent: registering the same schema again returns the same id. A schema that the
        subject's compatibility rule refuses raises ``RegistryError`` saying so.
        """
        from confluent_kafka.schema_registry import Schema

        text = schema if isinstance(schema, str) else json.dumps(schema)
        subject = subject_for(topic)
        try:
            self.client.set_compatibility(subject_name=subject, level=COMPATIBILITY)
        except Exception as exc:
            raise self._fail(
                f"set {COMPATIBILITY} compatibility on subject {subject!r}", exc
            ) from exc
        try:
            schema_id = self.client.register_schema(subject, Schema(text, "AVRO"))
        except Exception as exc:
            if _is_http_error(exc) and getattr(exc, "http_status_code", None) == 409:
                raise RegistryError(
                    f"{self._where()} refused the record schema for subject {subject!r}: it is "
                    f"not {COMPATIBILITY} compatible with the versions registered there ({exc}). "
                    "Records already in the topic could not be read with it: write to a new "
                    "topic, or remove the subject's versions if the topic is new"
                ) from exc
            raise self._fail(f"register the record schema under subject {subject!r}", exc) from exc
        with self._lock:
            self._schemas[schema_id] = parse_schema(json.loads(text))
        log.info(
            "schema registry: subject %s (%s), schema id %d", subject, COMPATIBILITY, schema_id
        )
        return Registration(subject, schema_id, confluent_header(schema_id))

    def writer_schema(self, schema_id: int) -> Any:
        """The parsed writer schema with this id (fetched once, then cached).

        Raises ``RecordError`` so that a reader counts and skips the record.
        """
        with self._lock:
            cached = self._schemas.get(schema_id)
            failed = self._failed.get(schema_id)
        if cached is not None:
            return cached
        if failed is not None and time.monotonic() - failed[0] < RETRY_AFTER:
            raise RecordError(failed[1])  # a registry that is down costs one try per id and 10 s
        try:
            found = self.client.get_schema(schema_id)
        except Exception as exc:
            why = str(self._fail(f"return schema id {schema_id}", exc))
            with self._lock:
                self._failed[schema_id] = (time.monotonic(), why)
            raise RecordError(why) from exc
        if (found.schema_type or "AVRO") != "AVRO":
            raise RecordError(
                f"schema id {schema_id} in {self._where()} is {found.schema_type}, not Avro"
            )
        try:
            parsed = parse_schema(json.loads(found.schema_str))
        except Exception as exc:
            raise RecordError(f"schema id {schema_id} is not a valid Avro schema: {exc}") from exc
        with self._lock:
            self._schemas[schema_id] = parsed
        return parsed


def writer_codec(
    url: str, topic: str, properties: dict[str, str] | None = None, client: Any = None
) -> RecordCodec:
    """A codec that writes the Confluent wire format, the schema registered for ``topic``."""
    registry = SchemaRegistry(url, properties, client)
    schema = json.loads((schema_dir() / "kv_event.avsc").read_text())
    reg = registry.register(topic, schema)
    codec = RecordCodec(header=reg.header)
    codec.registry = registry
    return codec


def reader_codec(
    url: str | None, properties: dict[str, str] | None = None, client: Any = None
) -> RecordCodec:
    """A codec that reads both framings; Confluent ids are looked up in the registry at ``url``."""
    codec = RecordCodec()
    if url:
        codec.registry = SchemaRegistry(url, properties, client)
    return codec
