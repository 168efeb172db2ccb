"""`kvbridge state --serve`: the live cache state over HTTP, for a router to call.

One consumer thread follows kv-events (optionally after bootstrapping from the kv-state
topic) and applies every record to a :class:`~bridge.consume.state.CacheState` under a lock; HTTP
handler threads answer from it under the same lock:

- ``GET /pods``: per (pod, rank): blocks per medium, epoch, last seq, uncertain, staleness
- ``GET /prefix?hashes=1,2,3[&medium=GPU]``, ``POST /prefix`` ``{"hashes": [...]}``: the
  longest cached prefix per (pod, rank), ranked
- ``POST /score`` ``{"model", "token_ids", "lora_name"?, "media"?, "cache_salt"?, "pods"?,
  "limit"?, "group"?}``: per (pod, rank), the prompt's leading tokens resident per tier, by
  content (:mod:`bridge.consume.score`; no engine hash needed); grouped by equal counts with "group"
- ``GET /healthz`` (the consumer runs; with the count and first partition:offset of records
  skipped as undecodable), ``GET /readyz`` (caught up with the end of kv-events seen at start)
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgspec

from bridge.consume.reader import Undecodable
from bridge.consume.score import ScoreError, ScoreRequest, parse_body, score_groups
from bridge.consume.score import score as score_rows
from bridge.consume.state import DEFAULT_POLICY, CacheState
from bridge.consume.statesync import PartitionWatch
from bridge.consume.statetopic import EventTail, load_state
from bridge.ops.config import kafka_unreachable
from bridge.vllm.events import parse_hash_text

log = logging.getLogger(__name__)

MAX_BODY = 16 * 1024 * 1024  # a 1M-token prompt as JSON
MAX_HASHES = 100_000
StreamKey = tuple[str, int]


class BadRequest(ValueError):
    """Input a client must fix; answered with 400 and the message."""


# --- pure: parsing and views ----------------------------------------------------------------


def parse_hash(value: Any) -> int:
    """One block hash as vLLM's 64-bit key: an int (signed or unsigned 64-bit), a decimal
    string, or hex with 0x (a key, or a digest whose last 8 bytes are the key)."""
    if isinstance(value, bool):
        raise BadRequest(f"{value!r} is not a block hash")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        try:
            return parse_hash_text(value)
        except ValueError as exc:
            raise BadRequest(
                f"{exc}: give 64-bit keys as decimal (as vLLM sends them) or hashes as 0x hex "
                "(as kvbridge consume prints them)"
            ) from None
    else:
        raise BadRequest(f"{value!r} is not a block hash: give integers or strings")
    if not -(1 << 63) <= n < (1 << 64):
        raise BadRequest(f"{value!r} is out of the 64-bit range")
    return n % (1 << 64)


def parse_hashes(values: list[Any]) -> list[int]:
    if not values:
        raise BadRequest("no block hashes given: hashes=1,2,3 (in request order)")
    if len(values) > MAX_HASHES:
        raise BadRequest(f"{len(values)} hashes: at most {MAX_HASHES} per query")
    return [parse_hash(v) for v in values]


def parse_prefix_query(query: str) -> tuple[list[int], str | None]:
    """``hashes=1,2,3[&medium=GPU]`` (hashes may repeat) -> (keys, medium)."""
    params = parse_qs(query, keep_blank_values=True)
    unknown = set(params) - {"hashes", "medium"}
    if unknown:
        raise BadRequest(f"unknown parameter(s) {sorted(unknown)}; accepted: hashes, medium")
    values = [p for v in params.get("hashes", []) for p in v.split(",") if p.strip()]
    medium = _medium(params.get("medium"))
    return parse_hashes(values), medium


def _medium(values: list[str] | None) -> str | None:
    if not values:
        return None
    if len(values) > 1 or not values[0].strip():
        raise BadRequest("medium: give one non-empty value, e.g. medium=GPU")
    return values[0].strip()


def parse_prefix_body(body: bytes) -> tuple[list[int], str | None]:
    """``{"hashes": [...], "medium": "GPU"|null}`` -> (keys, medium)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadRequest('body must be a JSON object: {"hashes": [1, 2, 3]}')
    unknown = set(doc) - {"hashes", "medium"}
    if unknown:
        raise BadRequest(f"unknown field(s) {sorted(unknown)}; accepted: hashes, medium")
    hashes = doc.get("hashes")
    if not isinstance(hashes, list):
        raise BadRequest('"hashes" must be a list of block hashes, in request order')
    medium = doc.get("medium")
    if medium is not None and (not isinstance(medium, str) or not medium.strip()):
        raise BadRequest('"medium" must be a non-empty string, e.g. "GPU", or null')
    return parse_hashes(hashes), medium


def _staleness(last_ts_ms: dict[StreamKey, int], key: StreamKey, now_ms: int) -> float | None:
    ts = last_ts_ms.get(key)
    return None if ts is None else round(max(0, now_ms - ts) / 1000.0, 3)


def pods_view(state: CacheState, last_ts_ms: dict[StreamKey, int], now_ms: int) -> dict[str, Any]:
    """The /pods document: the state's summary per stream, with its staleness (seconds since
    the Kafka timestamp of the stream's last record); and the content index's counts of
    blocks /score sees and of those it does not, by reason (docs/consumers.md)."""
    s = state.summary()
    for e in s["streams"]:
        key = (e["pod"], e["dp_rank"])
        e["last_record_ms"] = last_ts_ms.get(key)
        e["staleness_s"] = _staleness(last_ts_ms, key, now_ms)
    doc = {
        "records_applied": s["records_applied"],
        "markers": s["markers"],
        "pods": s["streams"],
    }
    if state.content is not None:  # what /score can see, and what it cannot (by reason)
        doc["content_index"] = {
            "indexed_blocks": state.content.indexed_blocks(),
            "not_indexed": dict(sorted(state.content.skipped.items())),
        }
    return doc


def prefix_view(
    state: CacheState,
    last_ts_ms: dict[StreamKey, int],
    keys: list[int],
    medium: str | None,
    now_ms: int,
) -> dict[str, Any]:
    """The /prefix document: per stream, how many leading blocks of ``keys`` it holds,
    longest first (certain streams before uncertain ones at equal length)."""
    matches = state.prefix_match(keys, medium)
    rows = []
    for (pod, rank), n in matches.items():
        st = state.streams.get((pod, rank))
        rows.append(
            {
                "pod": pod,
                "dp_rank": rank,
                "model": state.models.get(pod),
                "prefix_blocks": n,
                "uncertain": bool(st.uncertain) if st is not None else False,
                "staleness_s": _staleness(last_ts_ms, (pod, rank), now_ms),
            }
        )
    rows.sort(key=lambda r: (-r["prefix_blocks"], r["uncertain"], r["pod"], r["dp_rank"]))
    return {"query_blocks": len(keys), "medium": medium, "matches": rows}


_JSON_DECODER = msgspec.json.Decoder()


def loads(body: bytes) -> Any:
    """``json.loads(body)``, faster for what msgspec takes (where it decodes, it gives the same
    objects); what it refuses (NaN, lone surrogates, a BOM, bad JSON) goes to ``json.loads``,
    which decodes it or says what is wrong."""
    try:
        return _JSON_DECODER.decode(body)
    except msgspec.DecodeError:
        return json.loads(body)


def parse_score_body(body: bytes) -> ScoreRequest:
    try:
        doc = loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    try:
        return parse_body(doc, body)
    except ScoreError as exc:
        raise BadRequest(str(exc)) from None


def score_view(
    state: CacheState, last_ts_ms: dict[StreamKey, int], req: ScoreRequest, now_ms: int
) -> dict[str, Any]:
    """The /score document: :func:`bridge.consume.score.score`'s rows, with each stream's staleness
    (or :func:`bridge.consume.score.score_groups`'s groups, with the largest of their streams')."""
    try:
        rows = score_groups(state, req) if req.group else score_rows(state, req)
    except ScoreError as exc:
        raise BadRequest(str(exc)) from None
    get = last_ts_ms.get
    if req.group:
        for g in rows:
            known = [ts for ts in map(get, g["streams"]) if type(ts) is int]
            g["staleness_s"] = round(max(0, now_ms - min(known)) / 1000.0, 3) if known else None
        return {"model": req.model, "query_tokens": req.n_tokens, "groups": rows}
    for r in rows:  # _staleness inlined: ms (an int) / 1000.0 is already at 3 places
        ts = get((r["pod"], r["dp_rank"]))
        if ts is None:
            r["staleness_s"] = None
        elif type(ts) is int and -(1 << 42) < now_ms - ts < 1 << 42:  # within 139 years
            r["staleness_s"] = max(0, now_ms - ts) / 1000.0
        else:
            r["staleness_s"] = _staleness(last_ts_ms, (r["pod"], r["dp_rank"]), now_ms)
    return {"model": req.model, "query_tokens": req.n_tokens, "pods": rows}


# --- the consumer thread --------------------------------------------------------------------


class LiveState:
    """A CacheState kept current from kv-events by one thread; readers take ``lock``."""

    def __init__(
        self,
        bootstrap: str,
        events_topic: str = "kv-events",
        state_topic: str | None = None,
        overrides: dict[str, Any] | None = None,
        partition_check_interval: float = 30.0,
        policy: str | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.events_topic = events_topic
        self.policy = policy
        # kv-events partitions added while serving are read from their beginning this often
        self.partition_check_interval = partition_check_interval
        self.state_topic = state_topic
        self.overrides = dict(overrides or {})
        self.lock = threading.Lock()
        self.state = CacheState(policy or DEFAULT_POLICY)
        self.last_ts_ms: dict[StreamKey, int] = {}
        self.ready = threading.Event()
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.lag: dict[int, int] | None = None
        self.loaded_offsets: dict[int, int] = {}
        self.consumed = 0
        self.undecodable: Undecodable | None = None  # the tail's: records it skipped
        self._thread = threading.Thread(target=self._run, name="state-consumer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self.stop_event.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            offsets: dict[int, int] = {}
            if self.state_topic:
                sync = load_state(
                    self.bootstrap, self.state_topic, self.events_topic, self.overrides, self.policy
                )
                with self.lock:
                    self.state, self.last_ts_ms = sync.state, dict(sync.last_ts_ms)
                offsets = self.loaded_offsets = dict(sync.offsets)
                log.info(
                    "loaded %s: %d streams, kv-events offsets %s",
                    self.state_topic,
                    len(sync.state.streams),
                    offsets,
                )
            tail = EventTail(self.bootstrap, self.events_topic, offsets, self.overrides)
            self.undecodable = tail.undecodable
            interval = self.partition_check_interval
            watch = PartitionWatch(interval, set(tail.partitions), time.monotonic() + interval)
            try:
                while not self.stop_event.is_set():
                    if watch.due(time.monotonic()):
                        ids = tail.partition_ids()
                        new = tail.add_partitions(watch.checked(time.monotonic(), ids))
                        if new:
                            log.info(
                                "%s has new partitions %s: reading them from their beginning",
                                self.events_topic,
                                new,
                            )
                    got = tail.poll(0.2)
                    if got:
                        with self.lock:
                            for tr in got:
                                if tr.record is None:
                                    continue
                                env = tr.record.envelope
                                self.state.apply(tr.record)
                                key = (env.pod, env.dp_rank)
                                if key in self.state.streams:
                                    self.last_ts_ms[key] = tr.timestamp_ms
                                else:  # PodRemoved
                                    for k in [k for k in self.last_ts_ms if k[0] == env.pod]:
                                        del self.last_ts_ms[k]
                        self.consumed += len(got)
                    if not self.ready.is_set():
                        self.lag = tail.lag()
                        if not any(self.lag.values()):
                            log.info("caught up with %s: ready", self.events_topic)
                            # What is loaded lives on: keep it out of the cyclic GC's
                            # full collections, which pause queries.
                            gc.collect()
                            gc.freeze()
                            self.ready.set()
            finally:
                tail.close()
        except BaseException as exc:  # reported by /healthz and the CLI
            self.error = exc
            if kafka_unreachable(exc):
                log.debug("state consumer failed", exc_info=True)  # the CLI says it in one line
            else:
                log.exception("state consumer failed")

    def skipped(self) -> dict[str, Any]:
        """The kv-events records skipped as undecodable: how many, where the first are."""
        u = self.undecodable
        return {"count": u.count if u else 0, "first": u.samples() if u else []}

    def pods(self) -> dict[str, Any]:
        now = int(time.time() * 1000)
        with self.lock:
            doc = pods_view(self.state, self.last_ts_ms, now)
        doc["ready"] = self.ready.is_set()
        return doc

    def score(self, req: ScoreRequest) -> dict[str, Any]:
        now = int(time.time() * 1000)
        with self.lock:
            doc = score_view(self.state, self.last_ts_ms, req, now)
        doc["ready"] = self.ready.is_set()
        return doc

    def prefix(self, keys: list[int], medium: str | None) -> dict[str, Any]:
        now = int(time.time() * 1000)
        with self.lock:
            doc = prefix_view(self.state, self.last_ts_ms, keys, medium, now)
        doc["ready"] = self.ready.is_set()
        return doc


# --- HTTP -----------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    server: StateServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, doc: dict[str, Any], fast: bool = False) -> None:
        """``fast``: msgspec encodes (the /score answer: 5x faster than json.dumps; the same
        JSON values, without the blanks)."""
        body = msgspec.json.encode(doc) if fast else json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": message, "status": status})

    def do_GET(self) -> None:  # noqa: N802 (stdlib name)
        live = self.server.live
        url = urlsplit(self.path)
        try:
            if url.path == "/healthz":
                if live.error is not None or not live.alive:
                    why = repr(live.error) if live.error else "consumer thread stopped"
                    self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"status": "failed", "error": why})
                else:
                    doc: dict[str, Any] = {"status": "ok"}
                    skipped = live.skipped()
                    if skipped["count"]:  # records skipped: the consumer goes on, but say so
                        doc["undecodable"] = skipped
                    self._send(HTTPStatus.OK, doc)
            elif url.path == "/readyz":
                ready = live.ready.is_set()
                doc = {
                    "ready": ready,
                    "lag": live.lag,
                    "records_consumed": live.consumed,
                    "records_undecodable": live.skipped()["count"],
                }
                self._send(HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE, doc)
            elif url.path == "/pods":
                if url.query:
                    raise BadRequest("/pods takes no parameters")
                self._send(HTTPStatus.OK, live.pods())
            elif url.path == "/score":
                self._error(HTTPStatus.METHOD_NOT_ALLOWED, "/score answers POST only (JSON body)")
            elif url.path == "/prefix":
                keys, medium = parse_prefix_query(url.query)
                self._send(HTTPStatus.OK, live.prefix(keys, medium))
            else:
                self._not_found(url.path)
        except BadRequest as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
        except Exception as exc:  # a bug: say so instead of dropping the connection
            log.exception("GET %s failed", self.path)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {exc!r}")

    def do_POST(self) -> None:  # noqa: N802 (stdlib name)
        url = urlsplit(self.path)
        if url.path not in ("/prefix", "/score"):
            self.close_connection = True  # the body is not read
            if url.path in ("/pods", "/healthz", "/readyz"):
                self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"{url.path} answers GET only")
            else:
                self._not_found(url.path)
            return
        length = self.headers.get("Content-Length")
        try:
            n = int(length) if length is not None else -1
        except ValueError:
            n = -1
        if n < 0:
            self.close_connection = True
            self._error(HTTPStatus.LENGTH_REQUIRED, f"POST {url.path} needs a Content-Length")
            return
        if n > MAX_BODY:
            self.close_connection = True
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY} bytes")
            return
        body = self.rfile.read(n)
        try:
            if url.query:
                raise BadRequest(f"POST {url.path} takes its input in the JSON body, not the URL")
            if url.path == "/score":
                doc = self.server.live.score(parse_score_body(body))
            else:
                keys, medium = parse_prefix_body(body)
                doc = self.server.live.prefix(keys, medium)
        except BadRequest as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
            return
        except Exception as exc:  # a bug: say so instead of dropping the connection
            log.exception("POST %s failed", self.path)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {exc!r}")
            return
        self._send(HTTPStatus.OK, doc, fast=url.path == "/score")

    def _not_found(self, path: str) -> None:
        self._error(
            HTTPStatus.NOT_FOUND,
            f"no such path {path!r}; try /pods, /prefix?hashes=..., POST /score, /healthz, /readyz",
        )


class StateServer(ThreadingHTTPServer):
    """ThreadingHTTPServer answering from a :class:`LiveState` (port 0 = a free port)."""

    daemon_threads = True

    def __init__(self, live: LiveState, host: str = "127.0.0.1", port: int = 8080) -> None:
        self.live = live
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        return self.server_address[1]
