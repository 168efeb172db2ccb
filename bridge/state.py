"""Per-pod prefix-cache state rebuilt from kv-events records.

State is kept per stream (pod, dp_rank) and, inside it, per (medium, group_idx): the
resident block hashes, each with the parent hash BlockStored gave for it. Stores are
idempotent, removes of unknown hashes are no-ops (vLLM emits both), AllBlocksCleared
and restart markers empty the stream, EventsLost marks it uncertain.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bridge.events import AllBlocksCleared, BlockRemoved, BlockStored, key64
from bridge.markers import EventsLost, PodRemoved, PublisherRestarted, StreamStarted
from bridge.records import Record

Tier = tuple[str | None, int | None]  # (medium, group_idx)


@dataclass(slots=True)
class StreamState:
    epoch: int | None = None
    last_seq: int | None = None
    uncertain: bool = False
    lost_batches: int = 0
    tiers: dict[Tier, dict[bytes, bytes | None]] = field(default_factory=dict)

    def blocks(self) -> int:
        return sum(len(t) for t in self.tiers.values())


class CacheState:
    def __init__(self) -> None:
        self.streams: dict[tuple[str, int], StreamState] = {}
        self.models: dict[str, str] = {}
        self.applied = 0
        self.markers: Counter[str] = Counter()

    def apply(self, rec: Record) -> None:
        env, ev = rec.envelope, rec.event
        key = (env.pod, env.dp_rank)
        st = self.streams.get(key)
        if st is None:
            st = self.streams[key] = StreamState()
        self.models[env.pod] = env.model
        self.applied += 1
        if isinstance(ev, BlockStored):
            tier = st.tiers.setdefault((ev.medium, ev.group_idx), {})
            parent = ev.parent_block_hash
            for h in ev.block_hashes:
                tier[h] = parent
                parent = h
        elif isinstance(ev, BlockRemoved):
            tier = st.tiers.get((ev.medium, ev.group_idx))
            if tier:
                for h in ev.block_hashes:
                    tier.pop(h, None)
        elif isinstance(ev, AllBlocksCleared):
            st.tiers.clear()
        elif isinstance(ev, StreamStarted | PublisherRestarted):
            self.markers[type(ev).__name__] += 1
            st.tiers.clear()
            st.uncertain = False
        elif isinstance(ev, EventsLost):
            self.markers["EventsLost"] += 1
            st.uncertain = True
            st.lost_batches += ev.to_seq - ev.from_seq + 1
        elif isinstance(ev, PodRemoved):
            self.markers["PodRemoved"] += 1
            for k in [k for k in self.streams if k[0] == env.pod]:
                del self.streams[k]
            return
        st.epoch = env.epoch
        if env.index >= 0:
            st.last_seq = env.seq

    def resident(self, pod: str, dp_rank: int) -> dict[Tier, set[bytes]]:
        st = self.streams.get((pod, dp_rank))
        if st is None:
            return {}
        return {t: set(blocks) for t, blocks in st.tiers.items() if blocks}

    def prefix_match(
        self, keys: list[int], medium: str | None = None
    ) -> dict[tuple[str, int], int]:
        """For a request's block hashes in order (as vLLM's 64-bit keys), how many leading
        blocks each stream holds: what a KV-aware router asks. ``medium`` limits the tiers
        (e.g. "GPU"); None counts every tier."""
        out = {}
        for key, st in self.streams.items():
            resident = {
                key64(h)
                for (m, _), blocks in st.tiers.items()
                if medium is None or m == medium
                for h in blocks
            }
            n = 0
            for k in keys:
                if k not in resident:
                    break
                n += 1
            out[key] = n
        return out

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
        return {"records_applied": self.applied, "markers": dict(self.markers), "streams": pods}

    def to_json(self) -> dict[str, Any]:
        out = self.summary()
        for entry in out["streams"]:
            st = self.streams[(entry["pod"], entry["dp_rank"])]
            entry["tiers"] = [
                {
                    "medium": medium,
                    "group_idx": group,
                    "blocks": sorted(h.hex() for h in blocks),
                }
                for (medium, group), blocks in sorted(
                    st.tiers.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))
                )
                if blocks
            ]
        return out


def _by_medium(st: StreamState) -> dict[str, int]:
    out: Counter[str] = Counter()
    for (medium, _), blocks in st.tiers.items():
        out[str(medium)] += len(blocks)
    return dict(out)
