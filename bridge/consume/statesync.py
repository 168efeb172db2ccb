"""The compacted kv-state topic as pure logic: which records a kv-events record implies.

kv-state mirrors a :class:`~bridge.consume.state.CacheState` as one Kafka record per fact, so that
compaction keeps exactly the current state:

- ``["block", pod, rank, medium, group_idx, hash_hex]`` -> ``{"parent": hex|null, "epoch": E}``
  for every resident block, plus ``"copies": n`` where the state counts more than one and
  ``"ck": hex`` (its content key, :mod:`bridge.consume.contentindex`) where the index keyed it; a
  tombstone (null value) when it leaves the cache (BlockRemoved, AllBlocksCleared,
  StreamStarted/PublisherRestarted, PodRemoved).
- ``["stream", pod, rank]`` -> the stream's metadata (model, epoch, last_seq, uncertain,
  lost_batches, tiers, the Kafka timestamp of its last record, and ``"content"``: the block
  sizes scoring walks by); a tombstone on PodRemoved.
- ``["offsets"]`` -> ``{"topic", "partitions": {"<p>": {"next_offset", "counts", "markers"}}}``:
  per kv-events partition, the next offset the state reflects and that partition's share of
  ``CacheState.applied``, ``.duplicates`` and ``.markers``. One record for all partitions,
  written last in every transaction: a loader that stops right after it stops on a
  transaction boundary.

Keys and values are compact JSON. Nothing here does I/O: :class:`StateSync` turns consumed
records into changes, :class:`Pending` coalesces them until they are written in one
transaction, and :func:`load` rebuilds the state from kv-state's records.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from bridge.consume.state import DEFAULT_POLICY, CacheState, StreamState
from bridge.log.markers import EventsLost, PodRemoved
from bridge.log.records import Record
from bridge.vllm.events import BlockRemoved, BlockStored, UnknownEvent

log = logging.getLogger(__name__)

StreamKey = tuple[str, int]
Change = tuple[bytes, bytes | None]  # (key, value); value None = tombstone
_MISSING = object()
_JSON_SCALARS = (bool, int, float, str, type(None))
# CacheState counters kv-state carries (per partition)
COUNTERS = ("applied", "duplicates", "stale")


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def block_key(pod: str, rank: int, medium: str | None, group: int | None, h: bytes) -> bytes:
    return _dump(["block", pod, rank, medium, group, h.hex()])


def stream_key(pod: str, rank: int) -> bytes:
    return _dump(["stream", pod, rank])


OFFSETS_KEY = _dump(["offsets"])


def block_value(
    parent: bytes | None, epoch: int | None, copies: int = 1, ck: bytes | None = None
) -> bytes:
    """A resident block's value; ``ck``: its content key, where the content index has one."""
    value: dict[str, Any] = {"parent": None if parent is None else parent.hex(), "epoch": epoch}
    if copies > 1:
        value["copies"] = copies
    if ck is not None:
        value["ck"] = ck.hex()
    return _dump(value)


def stream_meta(state: CacheState, key: StreamKey, last_ts_ms: int | None) -> dict[str, Any] | None:
    """What kv-state stores about a stream besides its blocks (None if the stream is gone).

    Every scalar field of :class:`StreamState` is kept, so fields added later travel too."""
    st = state.streams.get(key)
    if st is None:
        return None
    meta: dict[str, Any] = {
        f.name: getattr(st, f.name)
        for f in dataclasses.fields(st)
        if f.name != "tiers" and isinstance(getattr(st, f.name), _JSON_SCALARS)
    }
    meta["model"] = state.models.get(key[0])
    # Tiers that exist but are empty (CacheState keeps them) are reproduced too.
    meta["tiers"] = sorted(([m, g] for m, g in st.tiers), key=lambda t: (str(t[0]), str(t[1])))
    meta["last_ts_ms"] = last_ts_ms
    sizes = state.content.sizes_of(key) if state.content is not None else None
    if sizes is not None:
        meta["content"] = sizes
    return meta


class StateSync:
    """A CacheState kept in step with the kv-events it consumed, and the kv-state records
    each consumed record implies. Pure: the caller consumes and produces."""

    def __init__(
        self, events_topic: str, state: CacheState | None = None, policy: str | None = None
    ) -> None:
        self.events_topic = events_topic
        self.state = state if state is not None else CacheState(policy or DEFAULT_POLICY)
        self.offsets: dict[int, int] = {}  # next kv-events offset per partition
        # Per partition: its share of the state's counters (applied, duplicates) and markers.
        self.counts: dict[int, Counter[str]] = {}
        self.markers: dict[int, Counter[str]] = {}
        self.last_ts_ms: dict[StreamKey, int] = {}

    def _snapshot(self, keys: list[StreamKey]) -> dict[bytes, bytes]:
        out = {}
        content = self.state.content
        for pod, rank in keys:
            st = self.state.streams.get((pod, rank))
            if st is None:
                continue
            for (medium, group), blocks in st.tiers.items():
                copies = st.copies.get((medium, group)) or {}
                held = content.held((pod, rank), (medium, group)) if content is not None else None
                for h, parent in blocks.items():
                    out[block_key(pod, rank, medium, group, h)] = block_value(
                        parent, st.epoch, copies.get(h, 1), held.get(h) if held else None
                    )
        return out

    def apply(self, partition: int, offset: int, timestamp_ms: int, rec: Record) -> list[Change]:
        """Apply one consumed kv-events record; returns the kv-state changes it implies
        (blocks and stream metadata; the offsets record comes from :meth:`offsets_record`)."""
        env, ev = rec.envelope, rec.event
        key = (env.pod, env.dp_rank)
        state = self.state
        changes: list[Change] = []
        content = state.content
        # A pod now serving another model loses its content keys: diffed as a whole stream.
        remodel = content is not None and content.model_of(key) not in (None, env.model)
        if isinstance(ev, BlockStored | BlockRemoved) and not remodel:
            tier_key = (ev.medium, ev.group_idx)
            st = state.streams.get(key)
            epoch = st.epoch if st is not None else None
            held = content.held(key, tier_key) if content is not None else None
            before = {h: _block_fact(st, tier_key, h, held) for h in ev.block_hashes}
            # The last part of a split BlockStored keys the earlier parts' blocks too.
            parts = (
                content.pending_of(key)
                if content is not None
                and type(ev) is BlockStored
                and env.parts > 1
                and env.part == env.parts - 1
                else []
            )
            self._apply(partition, rec)
            st = state.streams[key]
            held = content.held(key, tier_key) if content is not None else None
            for h, old in before.items():
                new = _block_fact(st, tier_key, h, held)
                if new is _MISSING:
                    if old is not _MISSING:
                        changes.append((block_key(*key, *tier_key, h), None))
                elif old is _MISSING or old != new or st.epoch != epoch:
                    value = block_value(new[0], st.epoch, new[1], new[2])
                    changes.append((block_key(*key, *tier_key, h), value))
            for t, part in parts:
                held = content.held(key, t) if content is not None else None
                for h in part.block_hashes:
                    new = _block_fact(st, t, h, held)
                    if new is not _MISSING and new[2] is not None:
                        value = block_value(new[0], st.epoch, new[1], new[2])
                        changes.append((block_key(*key, *t, h), value))
            affected = [key]
        elif isinstance(ev, EventsLost | UnknownEvent):
            self._apply(partition, rec)  # no block changes
            affected = [key]
        else:
            # Clears, restarts, PodRemoved: rare; diff the whole stream (the pod's streams).
            if isinstance(ev, PodRemoved):
                affected = sorted({key} | {k for k in state.streams if k[0] == env.pod})
            else:
                affected = [key]
            before_blocks = self._snapshot(affected)
            self._apply(partition, rec)
            after_blocks = self._snapshot(affected)
            for k in before_blocks.keys() - after_blocks.keys():
                changes.append((k, None))
            for k, v in after_blocks.items():
                if before_blocks.get(k) != v:
                    changes.append((k, v))
        self.offsets[partition] = offset + 1
        if key in state.streams:
            self.last_ts_ms[key] = timestamp_ms
        for k in affected:
            if k not in state.streams:
                self.last_ts_ms.pop(k, None)
            meta = stream_meta(state, k, self.last_ts_ms.get(k))
            changes.append((stream_key(*k), None if meta is None else _dump(meta)))
        return changes

    def _apply(self, partition: int, rec: Record) -> None:
        state = self.state
        before = [getattr(state, name, 0) for name in COUNTERS]
        markers = Counter(state.markers) if rec.envelope.index < 0 else None
        state.apply(rec)
        counts = self.counts.setdefault(partition, Counter())
        for name, old in zip(COUNTERS, before, strict=True):
            delta = getattr(state, name, 0) - old
            if delta:
                counts[name] += delta
        if markers is not None:
            delta = Counter(state.markers)
            delta.subtract(markers)
            mine = self.markers.setdefault(partition, Counter())
            for name, n in delta.items():
                if n:
                    mine[name] += n

    def add_partitions(self, partitions: Iterable[int]) -> list[int]:
        """Start tracking kv-events partitions added while running, at offset 0: nothing of
        them is applied yet. Returns those that were new (the others keep their offsets)."""
        new = sorted({p for p in partitions if p not in self.offsets})
        for p in new:
            self.offsets[p] = 0
        return new

    def offsets_record(self) -> Change:
        """The offsets record: every partition's next offset and counters. Written last in
        each transaction, after the changes of the records consumed up to those offsets."""
        parts = {
            str(p): {
                "next_offset": n,
                "counts": dict(sorted(self.counts.get(p, Counter()).items())),
                "markers": dict(sorted(self.markers.get(p, Counter()).items())),
            }
            for p, n in sorted(self.offsets.items())
        }
        doc = {"topic": self.events_topic, "policy": self.state.policy, "partitions": parts}
        return OFFSETS_KEY, _dump(doc)


@dataclass
class Pending:
    """Changes not yet written, coalesced by key (last write wins), in first-write order."""

    changes: dict[bytes, bytes | None] = field(default_factory=dict)
    partitions: set[int] = field(default_factory=set)  # kv-events partitions advanced

    def add(self, partition: int, changes: Iterable[Change]) -> None:
        self.partitions.add(partition)
        for k, v in changes:
            self.changes[k] = v

    def __len__(self) -> int:
        return len(self.changes)

    def records(self, sync: StateSync) -> list[Change]:
        """Everything to write in one transaction: the changes, then the offsets record."""
        return [*self.changes.items(), sync.offsets_record()]

    def clear(self) -> None:
        self.changes.clear()
        self.partitions.clear()


@dataclass
class PartitionWatch:
    """When to look at kv-events' partitions again, and which of them are new.

    Kafka only ever adds partitions. A check that cannot get metadata (``None``), or that
    sees fewer partitions than known (metadata of a broker that has not heard of the new
    ones yet), changes nothing: the next check, one ``interval`` later, tries again."""

    interval: float  # seconds between checks
    known: set[int]  # partitions being read
    next_check: float = 0.0  # monotonic time of the next check
    failures: int = 0  # checks in a row without metadata

    def due(self, now: float) -> bool:
        return now >= self.next_check

    def checked(self, now: float, partitions: Iterable[int] | None) -> list[int]:
        """Record a check made at ``now`` that saw ``partitions`` (None: metadata was not
        available); returns the partitions not known before, sorted, and now known."""
        self.next_check = now + self.interval
        if partitions is None:
            self.failures += 1
            return []
        self.failures = 0
        new = sorted(set(partitions) - self.known)
        self.known.update(new)
        return new


class StateTopicError(ValueError):
    """kv-state holds something a loader cannot use (e.g. offsets of another topic)."""


def _block_fact(
    st: StreamState | None, tier_key: Any, h: bytes, held: dict[bytes, bytes] | None
) -> Any:
    """(parent, copies, content key or None) of a resident block, or _MISSING; ``held``: the
    tier's content keys (:meth:`ContentIndex.held`)."""
    tier = st.tiers.get(tier_key) if st is not None else None
    if not tier or h not in tier:
        return _MISSING
    return tier[h], st.copies_of(tier_key, h), held.get(h) if held else None  # type: ignore[union-attr]


def load(
    records: Iterable[Change],
    events_topic: str,
    on_skip: Callable[[bytes | None, str], None] | None = None,
    policy: str | None = None,
) -> tuple[StateSync, int]:
    """Rebuild a :class:`StateSync` from kv-state's records in log order (compacted or not).

    ``policy``: the state policy to continue with (None: the one kv-state was built with).
    Returns it and the number of unreadable records (skipped; each is passed to ``on_skip``
    as (key, reason), else logged). Raises StateTopicError if the offsets record belongs to
    a different events topic, or was built with another policy."""

    def skip(raw_key: bytes | None, why: str) -> None:
        if on_skip is not None:
            on_skip(raw_key, why)
        else:
            log.warning("kv-state record %r unreadable (%s); skipped", (raw_key or b"")[:200], why)

    latest: dict[bytes | None, bytes] = {}
    for k, v in records:
        if v is None:
            latest.pop(k, None)
        else:
            latest[k] = v
    offsets_doc = latest.get(OFFSETS_KEY)
    saved = None
    if offsets_doc is not None:
        try:
            saved = json.loads(offsets_doc).get("policy")
        except (ValueError, AttributeError):
            saved = None
    if policy is not None and saved is not None and saved != policy:
        raise StateTopicError(
            f"the state topic was built with --state-policy {saved}, not {policy}: run with "
            f"{saved}, or rebuild it (a new --state-topic) with {policy}"
        )
    # Before policies existed kv-state held no copies: continue it with the default.
    sync = StateSync(events_topic, policy=policy or saved or DEFAULT_POLICY)
    state = sync.state
    skipped = 0
    blocks: list[tuple[list[Any], dict[str, Any], bytes | None]] = []
    names = {f.name for f in dataclasses.fields(StreamState)} - {"tiers"}
    for raw_key, raw_value in latest.items():
        try:
            key = json.loads(raw_key)
            value = json.loads(raw_value)
            kind = key[0]
            if kind == "block":
                _, pod, rank, medium, group, h = key
                where = [str(pod), int(rank), medium, group, bytes.fromhex(h)]
                blocks.append((where, value, raw_key))
            elif kind == "stream":
                sk = (str(key[1]), int(key[2]))
                st = StreamState(**{n: v for n, v in value.items() if n in names})
                for m, g in value.get("tiers", []):  # tiers CacheState holds, even empty ones
                    st.tiers[(m, g)] = {}
                state.streams[sk] = st
                if value.get("model") is not None:
                    state.models[sk[0]] = value["model"]
                if value.get("last_ts_ms") is not None:
                    sync.last_ts_ms[sk] = int(value["last_ts_ms"])
                if state.content is not None and value.get("model") is not None:
                    state.content.load_sizes(sk, value["model"], value.get("content"))
            elif kind == "offsets":
                if value["topic"] != events_topic:
                    raise StateTopicError(
                        f"the state topic reflects events topic {value['topic']!r}, not "
                        f"{events_topic!r}; give the matching --topic or another --state-topic"
                    )
                for p, d in value["partitions"].items():
                    p = int(p)
                    sync.offsets[p] = int(d["next_offset"])
                    sync.counts[p] = Counter({str(k): int(v) for k, v in d["counts"].items()})
                    sync.markers[p] = Counter({str(k): int(v) for k, v in d["markers"].items()})
            else:
                raise ValueError(f"unknown record kind {kind!r}")
        except StateTopicError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            skipped += 1  # not written by state-sync (another producer's bytes, a null key)
            skip(raw_key, f"{type(exc).__name__}: {exc}")
    for (pod, rank, medium, group, h), value, raw in blocks:
        try:
            parent = None if value["parent"] is None else bytes.fromhex(value["parent"])
            copies = int(value.get("copies", 1))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            skipped += 1
            skip(raw, f"block {h.hex()}: {type(exc).__name__}: {exc}")
            continue
        st = state.streams.get((pod, rank))
        if st is None:
            st = state.streams[(pod, rank)] = StreamState()
        st.store((medium, group), [h], parent)
        if copies > 1:
            st.set_copies((medium, group), h, copies)
        if state.content is not None:
            model = state.models.get(pod)
            state.content.load_key((pod, rank), model, (medium, group), h, value.get("ck"))
    state.streams = dict(sorted(state.streams.items()))
    for name in COUNTERS:
        if hasattr(state, name):
            setattr(state, name, sum(c[name] for c in sync.counts.values()))
    total: Counter[str] = Counter()
    for c in sync.markers.values():
        total.update(c)
    state.markers = total
    return sync, skipped
