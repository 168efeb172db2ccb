"""Per-pod prefix-cache state rebuilt from kv-events records (pure: no I/O but snapshot files).

State is kept per stream (pod, dp_rank) and, inside it, per (medium, group_idx): the
resident block hashes, each with the parent hash BlockStored gave for it. Rules:

* BlockStored of a resident hash is another *copy* of it under the default policy
  ``"count"`` (vLLM keeps one physical block per copy and emits a store for each, and the
  OffloadingConnector's chunk mode stores a block once per chunk); ``"set"`` makes stores
  idempotent (the behaviour before copies were counted); ``"hits"`` counts copies but
  takes a store whose hashes are all resident and which starts a sequence (no parent) as
  a re-announced prefix hit (vLLM 0.26+, ``kv_cache_report_mode="full"``). See
  docs/vllm-cache-semantics.md for which policy the wire of each release needs;
* BlockRemoved drops one copy; the hash leaves the tier with its last copy (``"set"``:
  with the first remove). A remove that carries ``remaining_copy_counts`` (vllm#48933) is
  the engine's own count and overrides the policy. A remove of a hash that is not
  resident is a no-op (vLLM emits such removes);
* AllBlocksCleared empties every tier of the stream;
* StreamStarted and PublisherRestarted drop the stream's state (a new incarnation, or a
  bridge that starts following from scratch: the records that follow rebuild it);
* EventsLost marks the stream *uncertain*: what the lost batches did is unknown. A later
  AllBlocksCleared, or a restart marker, makes it certain again;
* PodRemoved forgets every stream of the pod;
* an event record at or before the stream's last applied (epoch, seq, index, part) is a
  duplicate (at-least-once delivery, or an overlap after a snapshot) and is skipped. The
  parts of a BlockStored split over several records (``bridge.log.split``) are BlockStored
  events of their own, applied in turn;
* a record of an epoch lower than the stream's current one is *stale* (after
  ``--repartition`` a reader far behind can read a moved pod's new epoch before the old
  partition's records of its old one) and is skipped and counted in ``stale``.

Copies are counted per tier only where there is more than one: ``StreamState.copies``
holds ``{tier: {hash: n}}`` for n >= 2, a resident hash without an entry has one copy.

Prefix queries use vLLM's 64-bit keys (:func:`bridge.vllm.events.key64`) and cost O(len(keys))
per stream and tier, whatever the number of resident blocks. An 8-byte hash (vLLM's default
integer mode) is its own key: the tier dict answers directly, at no extra memory. Longer
hashes (raw digests) are also counted, per medium, in ``StreamState.index``: their last 8
bytes -> how many resident blocks of that medium have that key.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.consume.contentindex import ContentIndex
from bridge.log.markers import EventsLost, PodRemoved, PublisherRestarted, StreamStarted
from bridge.log.records import Record
from bridge.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, copy_counts, hash_text

Tier = tuple[str | None, int | None]  # (medium, group_idx)
SNAPSHOT_FORMAT = "kvbridge-state-snapshot"
# 2: copy counts ([hash, parent, copies]) and the policy; 3: content keys ([hash, parent,
# copies, key]) and each stream's block sizes ("content"). 1 and 2 still load (unkeyed).
SNAPSHOT_VERSION = 3
SNAPSHOT_VERSIONS = (1, 2, 3)
POLICIES = ("count", "set", "hits")
DEFAULT_POLICY = "count"


class SnapshotError(RuntimeError):
    """A snapshot file that cannot be read."""


@dataclass(slots=True)
class StreamState:
    """One (pod, dp_rank): its resident blocks per tier, position and certainty."""

    epoch: int | None = None
    last_seq: int | None = None
    uncertain: bool = False
    lost_batches: int = 0
    tiers: dict[Tier, dict[bytes, bytes | None]] = field(default_factory=dict)
    # medium -> {last 8 bytes of a resident hash longer than 8 bytes: how many resident
    # blocks of that medium (all groups) have that key}. 8-byte hashes are their own keys
    # and are looked up in the tiers themselves. Maintained by store/remove/clear.
    index: dict[str | None, dict[bytes, int]] = field(default_factory=dict)
    # tier -> {hash: copies} for resident hashes with more than one copy (see module doc)
    copies: dict[Tier, dict[bytes, int]] = field(default_factory=dict)
    last_index: int = -1  # index of the last applied event within batch last_seq
    last_part: int = 0  # part of that event (a BlockStored split over records), 0 if whole
    cleared_at: int = -1  # seq of the last AllBlocksCleared in this epoch
    lost_to: int = -1  # highest seq reported lost in this epoch

    def blocks(self) -> int:
        return sum(len(t) for t in self.tiers.values())

    def copies_of(self, tier_key: Tier, h: bytes) -> int:
        """How many copies of ``h`` the tier holds (0 if it is not resident)."""
        tier = self.tiers.get(tier_key)
        if not tier or h not in tier:
            return 0
        extra = self.copies.get(tier_key)
        return extra.get(h, 1) if extra else 1

    def reset(self) -> None:
        """Forget the blocks and the position (a new incarnation or a fresh start)."""
        self.tiers.clear()
        self.index.clear()
        self.copies.clear()
        self.uncertain = False
        self.last_seq = None
        self.last_index = -1
        self.last_part = 0
        self.cleared_at = -1
        self.lost_to = -1

    def store(
        self, tier_key: Tier, hashes: list[bytes], parent: bytes | None, policy: str = "set"
    ) -> None:
        """Blocks entered the tier (one BlockStored); ``policy`` as in :class:`CacheState`."""
        tier = self.tiers.get(tier_key)
        if tier is None:
            tier = self.tiers[tier_key] = {}
        count = policy != "set"
        if policy == "hits" and parent is None and all(h in tier for h in hashes):
            count = False  # the shape of a re-announced prefix hit: no new copies
        for h in hashes:
            if h in tier:
                if count:
                    extra = self.copies.get(tier_key)
                    if extra is None:
                        extra = self.copies[tier_key] = {}
                    extra[h] = extra.get(h, 1) + 1
            elif len(h) != 8:
                idx = self.index.get(tier_key[0])
                if idx is None:
                    idx = self.index[tier_key[0]] = {}
                k = _key8(h)
                idx[k] = idx.get(k, 0) + 1
            tier[h] = parent
            parent = h

    def set_copies(self, tier_key: Tier, h: bytes, n: int, parent: bytes | None = None) -> None:
        """Make ``h`` resident with exactly ``n`` copies (0: not resident)."""
        tier = self.tiers.get(tier_key)
        if n <= 0:
            if tier and h in tier:
                self._drop(tier_key, tier, h)
            return
        if tier is None or h not in tier:
            self.store(tier_key, [h], parent)
        extra = self.copies.get(tier_key)
        if n == 1:
            if extra and extra.pop(h, None) is not None and not extra:
                del self.copies[tier_key]
        else:
            if extra is None:
                extra = self.copies[tier_key] = {}
            extra[h] = n

    def remove(
        self,
        tier_key: Tier,
        hashes: list[bytes],
        policy: str = "set",
        remaining: list[int] | None = None,
    ) -> None:
        """Blocks left the tier (one BlockRemoved). ``remaining``: the engine's count of copies
        left per hash (``remaining_copy_counts``), which overrides the policy."""
        if remaining is not None and len(remaining) == len(hashes):
            for h, n in zip(hashes, remaining, strict=True):
                self.set_copies(tier_key, h, n)
            return
        tier = self.tiers.get(tier_key)
        if not tier:
            return
        extra = self.copies.get(tier_key)
        for h in hashes:
            if h in tier:
                n = extra.get(h, 1) if extra and policy != "set" else 1
                if n > 2:
                    extra[h] = n - 1  # type: ignore[index]
                elif n == 2:
                    del extra[h]  # type: ignore[union-attr]
                    if not extra:
                        del self.copies[tier_key]
                else:
                    self._drop(tier_key, tier, h)

    def _drop(self, tier_key: Tier, tier: dict[bytes, bytes | None], h: bytes) -> None:
        del tier[h]
        extra = self.copies.get(tier_key)
        if extra and extra.pop(h, None) is not None and not extra:
            del self.copies[tier_key]
        if len(h) != 8:
            idx = self.index[tier_key[0]]
            k = _key8(h)
            n = idx[k] - 1
            if n:
                idx[k] = n
            else:
                del idx[k]

    def clear(self) -> None:
        self.tiers.clear()
        self.index.clear()
        self.copies.clear()


class CacheState:
    """Every stream's state; feed it records in topic order with :meth:`apply`.

    ``policy``: how a BlockStored of a resident hash counts, one of :data:`POLICIES`
    (module doc). ``content``: keep the content index that :meth:`score` answers from
    (False: residency by engine hash only, a little faster to apply)."""

    def __init__(self, policy: str = DEFAULT_POLICY, content: bool = True) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown state policy {policy!r}; one of {', '.join(POLICIES)}")
        self.policy = policy
        self.streams: dict[tuple[str, int], StreamState] = {}
        self.models: dict[str, str] = {}
        self.applied = 0
        self.duplicates = 0
        self.stale = 0
        self.markers: Counter[str] = Counter()
        # Resident blocks by content key, for scoring prompts by token ids (consume.contentindex)
        self.content: ContentIndex | None = ContentIndex() if content else None

    def apply(self, rec: Record) -> None:
        env, ev = rec.envelope, rec.event
        key = (env.pod, env.dp_rank)
        st = self.streams.get(key)
        if st is None:
            st = self.streams[key] = StreamState()
        if st.epoch is not None and env.epoch < st.epoch:
            self.stale += 1  # an older incarnation read after a newer one (repartition)
            return
        if self.models.get(env.pod) != env.model:
            self.models[env.pod] = env.model
        if env.index >= 0:
            if (
                st.epoch == env.epoch
                and st.last_seq is not None
                and (env.seq, env.index, env.part) <= (st.last_seq, st.last_index, st.last_part)
            ):
                self.duplicates += 1
                return
            self.applied += 1
            if type(ev) is BlockStored:
                tier_key = (ev.medium, ev.group_idx)
                st.store(tier_key, ev.block_hashes, ev.parent_block_hash, self.policy)
                if self.content is not None:
                    self.content.stored(key, env.model, st.tiers, tier_key, ev, env.part, env.parts)
            elif type(ev) is BlockRemoved:
                tier_key = (ev.medium, ev.group_idx)
                st.remove(tier_key, ev.block_hashes, self.policy, copy_counts(ev))
                if self.content is not None:
                    self.content.removed(key, st.tiers.get(tier_key), tier_key, ev.block_hashes)
            elif type(ev) is AllBlocksCleared:
                st.clear()
                if self.content is not None:
                    self.content.cleared(key)
                st.cleared_at = env.seq
                if st.lost_to < env.seq:
                    st.uncertain = False
            st.epoch = env.epoch
            st.last_seq = env.seq
            st.last_index = env.index
            st.last_part = env.part
            return
        self.applied += 1
        self.markers[type(ev).__name__] += 1
        if isinstance(ev, StreamStarted | PublisherRestarted):
            st.reset()
            if self.content is not None:
                self.content.forget_stream(key)
            st.epoch = env.epoch
            # Following from a later seq than 0 (first contact "live"): what the earlier
            # batches stored is unknown.
            if isinstance(ev, StreamStarted) and ev.next_seq > 0:
                st.uncertain = True
        elif isinstance(ev, EventsLost):
            if not ev.open_ended:  # an epoch's unknown tail is no count of batches
                st.lost_batches += ev.to_seq - ev.from_seq + 1
            if st.epoch != env.epoch:
                st.epoch = env.epoch
            # A loss entirely before a later clear (in this epoch) changed nothing that is left.
            if ev.to_seq >= st.cleared_at:
                st.uncertain = True
                st.lost_to = max(st.lost_to, ev.to_seq)
        elif isinstance(ev, PodRemoved):
            for k in [k for k in self.streams if k[0] == env.pod]:
                del self.streams[k]
            if self.content is not None:
                self.content.forget_pod(env.pod)

    def resident(self, pod: str, dp_rank: int) -> dict[Tier, set[bytes]]:
        """The resident hashes of one stream per tier (empty tiers left out)."""
        st = self.streams.get((pod, dp_rank))
        if st is None:
            return {}
        return {t: set(blocks) for t, blocks in st.tiers.items() if blocks}

    def prefix_match(
        self, keys: list[int], medium: str | None = None
    ) -> dict[tuple[str, int], int]:
        """For a request's block hashes in order (as vLLM's 64-bit keys), how many leading
        blocks each stream holds: what a KV-aware router asks. ``medium`` limits the tiers
        (e.g. "GPU"); None counts a block resident in any tier. O(len(keys)) per stream."""
        raw = [(k % (1 << 64)).to_bytes(8, "big") for k in keys]
        out = {}
        for key, st in self.streams.items():
            # Every dict that can hold a key: the tiers (8-byte hashes are keys themselves)
            # and the index of longer hashes, of the medium asked for.
            found = [t for (m, _), t in st.tiers.items() if t and (medium is None or m == medium)]
            found += [i for m, i in st.index.items() if i and (medium is None or m == medium)]
            n = 0
            if len(found) == 1:
                only = found[0]
                for k in raw:
                    if k not in only:
                        break
                    n += 1
            elif found:
                for k in raw:
                    if not any(k in d for d in found):
                        break
                    n += 1
            out[key] = n
        return out

    def score(
        self,
        model: str,
        token_ids: list[int],
        lora_name: str | None = None,
        media: list[dict[str, Any]] | None = None,
        pods: list[str] | None = None,
        cache_salt: str | None = None,
        lora_id: int | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """For a prompt's token ids, per (pod, dp_rank) of ``model``: the leading tokens
        resident per tier and in any tier, and whether the stream is certain -- computed from
        the blocks' contents, independent of vLLM's hash (:mod:`bridge.consume.score`). ``media``:
        the prompt's multimodal inputs ``{"identifier", "offset", "length"}``; ``pods``: only
        these pods (listed even when they hold nothing); ``limit``: the first rows only.
        ValueError (``ScoreError``) for a request to fix."""
        from bridge.consume.score import make_request, score

        req = make_request(model, token_ids, lora_name, lora_id, media, cache_salt, pods, limit)
        return score(self, req)

    def resident_blocks(self) -> int:
        return sum(st.blocks() for st in self.streams.values())

    def summary(self) -> dict[str, Any]:
        pods = []
        for (pod, rank), st in sorted(self.streams.items()):
            pods.append(
                {
                    "pod": pod,
                    "model": self.models.get(pod),
                    "dp_rank": rank,
                    "epoch": st.epoch,
                    "last_seq": st.last_seq,
                    "blocks": st.blocks(),
                    "blocks_by_medium": _by_medium(st),
                    "uncertain": st.uncertain,
                    "lost_batches": st.lost_batches,
                }
            )
        return {
            "policy": self.policy,
            "records_applied": self.applied,
            "duplicates_skipped": self.duplicates,
            "stale_skipped": self.stale,
            "markers": dict(self.markers),
            "streams": pods,
        }

    def to_json(self) -> dict[str, Any]:
        """:meth:`summary` plus every tier's resident hashes (``0x`` hex, sorted)."""
        out = self.summary()
        for entry in out["streams"]:
            st = self.streams[(entry["pod"], entry["dp_rank"])]
            entry["tiers"] = [
                {
                    "medium": medium,
                    "group_idx": group,
                    "blocks": sorted(hash_text(h) for h in blocks),
                }
                for (medium, group), blocks in sorted(st.tiers.items(), key=_tier_order)
                if blocks
            ]
        return out

    # --- snapshots -------------------------------------------------------------------------

    def snapshot(self, topic: str, offsets: dict[int, int]) -> dict[str, Any]:
        """A JSON document of the whole state, the topic and the per-partition next offsets it
        reflects (the records below those offsets are applied, none at or after)."""
        streams = []
        content = self.content
        for (pod, rank), st in sorted(self.streams.items()):
            sizes = content.sizes_of((pod, rank)) if content is not None else None
            doc: dict[str, Any] = {
                "pod": pod,
                "model": self.models.get(pod),
                "dp_rank": rank,
                "epoch": st.epoch,
                "last_seq": st.last_seq,
                "last_index": st.last_index,
                "last_part": st.last_part,
                "uncertain": st.uncertain,
                "lost_batches": st.lost_batches,
                "cleared_at": st.cleared_at,
                "lost_to": st.lost_to,
                "tiers": [
                    {
                        "medium": medium,
                        "group_idx": group,
                        # [hash, parent(, copies(, content key))] in insertion order (hex;
                        # parent null when unknown; copies given when > 1 or a key follows)
                        "blocks": _blocks_doc(
                            blocks,
                            st.copies.get((medium, group)),
                            content.held((pod, rank), (medium, group)) if content else None,
                        ),
                    }
                    for (medium, group), blocks in sorted(st.tiers.items(), key=_tier_order)
                    if blocks
                ],
            }
            if sizes is not None:
                doc["content"] = sizes  # the block sizes scoring walks by
            streams.append(doc)
        return {
            "format": SNAPSHOT_FORMAT,
            "version": SNAPSHOT_VERSION,
            "policy": self.policy,
            "topic": topic,
            "offsets": {str(p): o for p, o in sorted(offsets.items())},
            "records_applied": self.applied,
            "stale_skipped": self.stale,
            "markers": dict(self.markers),
            "models": dict(sorted(self.models.items())),
            "streams": streams,
        }

    def save(self, path: str | Path, topic: str, offsets: dict[int, int]) -> None:
        """Write :meth:`snapshot` to ``path`` atomically (a temporary file, then rename)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.snapshot(topic, offsets), f, separators=(",", ":"))
        os.replace(tmp, path)

    @classmethod
    def from_snapshot(
        cls, doc: dict[str, Any], policy: str | None = None
    ) -> tuple[CacheState, str, dict[int, int]]:
        """(state, topic, next offsets) from a :meth:`snapshot` document (versions 1 to 3;
        blocks of versions 1 and 2 carry no content keys: counted ``unkeyed_on_load``).

        ``policy``: the policy to continue with; None takes the snapshot's (version 1
        snapshots, which kept no copies, continue with the default)."""
        if not isinstance(doc, dict) or doc.get("format") != SNAPSHOT_FORMAT:
            raise SnapshotError("not a kvbridge state snapshot (written by replay --snapshot)")
        if doc.get("version") not in SNAPSHOT_VERSIONS:
            raise SnapshotError(
                f"snapshot version {doc.get('version')!r} is not supported (this kvbridge "
                f"reads versions {', '.join(map(str, SNAPSHOT_VERSIONS))}); rebuild it with "
                "this version's replay"
            )
        saved = doc.get("policy")
        if policy is not None and saved is not None and saved != policy:
            raise SnapshotError(
                f"snapshot was built with --state-policy {saved}, not {policy}: continue it with "
                f"{saved}, or rebuild it from the topic with {policy}"
            )
        try:
            state = cls(policy or saved or DEFAULT_POLICY)
            state.applied = int(doc.get("records_applied", 0))
            state.stale = int(doc.get("stale_skipped", 0))
            state.markers.update(doc.get("markers", {}))
            state.models.update(doc.get("models", {}))
            for s in doc["streams"]:
                st = StreamState(
                    epoch=s["epoch"],
                    last_seq=s["last_seq"],
                    uncertain=bool(s["uncertain"]),
                    lost_batches=int(s["lost_batches"]),
                    last_index=int(s.get("last_index", -1)),
                    last_part=int(s.get("last_part", 0)),
                    cleared_at=int(s.get("cleared_at", -1)),
                    lost_to=int(s.get("lost_to", -1)),
                )
                sk = (s["pod"], int(s["dp_rank"]))
                content = state.content
                model = state.models.get(sk[0])
                if content is not None and model is not None:
                    content.load_sizes(sk, model, s.get("content"))
                for t in s["tiers"]:
                    tier_key = (t["medium"], t["group_idx"])
                    for b in t["blocks"]:
                        h, p = bytes.fromhex(b[0]), None if b[1] is None else bytes.fromhex(b[1])
                        st.store(tier_key, [h], p)
                        if len(b) > 2 and int(b[2]) > 1:
                            st.set_copies(tier_key, h, int(b[2]))
                        if content is not None:
                            ck = b[3] if len(b) > 3 else None
                            content.load_key(sk, model, tier_key, h, ck)
                state.streams[sk] = st
            offsets = {int(p): int(o) for p, o in doc["offsets"].items()}
            topic = str(doc["topic"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SnapshotError(f"snapshot is damaged: {type(exc).__name__}: {exc}") from None
        return state, topic, offsets

    @classmethod
    def load(
        cls, path: str | Path, policy: str | None = None
    ) -> tuple[CacheState, str, dict[int, int]]:
        """Read a snapshot file written by :meth:`save`: (state, topic, next offsets)."""
        try:
            with open(path) as f:
                doc = json.load(f)
        except FileNotFoundError:
            raise SnapshotError(f"snapshot file {str(path)!r} does not exist") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise SnapshotError(f"cannot read snapshot {str(path)!r}: {exc}") from None
        return cls.from_snapshot(doc, policy)


def _key8(h: bytes) -> bytes:
    """The 8 big-endian bytes of ``key64(h)`` (a hash shorter than 8 bytes is zero-padded)."""
    return h[-8:] if len(h) >= 8 else h.rjust(8, b"\0")


def _tier_order(kv: tuple[Tier, Any]) -> tuple[str, str]:
    return (str(kv[0][0]), str(kv[0][1]))


NO_MEDIUM = "engine"
"""How a tier without a medium is named in summaries: releases before 0.10.2 send none, and
their blocks are the engine's own (GPU) cache."""


def medium_name(medium: str | None) -> str:
    return NO_MEDIUM if medium is None else medium


def _by_medium(st: StreamState) -> dict[str, int]:
    out: Counter[str] = Counter()
    for (medium, _), blocks in st.tiers.items():
        if blocks:
            out[medium_name(medium)] += len(blocks)
    return dict(out)


def _blocks_doc(
    blocks: dict[bytes, bytes | None],
    copies: dict[bytes, int] | None,
    held: dict[bytes, bytes] | None,
) -> list[list[Any]]:
    out: list[list[Any]] = []
    for h, p in blocks.items():
        entry: list[Any] = [h.hex(), None if p is None else p.hex()]
        n = copies.get(h, 1) if copies else 1
        k = held.get(h) if held else None
        if n > 1 or k is not None:
            entry.append(n)
        if k is not None:
            entry.append(k.hex())
        out.append(entry)
    return out
