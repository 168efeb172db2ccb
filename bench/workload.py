"""Deterministic vLLM KV-event payloads: the very bytes `kvbridge simulate` pods publish.

A :class:`WorkloadConfig` describes a fleet of simulated pods (releases cycled over the pods,
hash mode, cache size, reset probability, seed). :func:`pod_payloads` replays pod ``i``'s
prefix-cache model (:class:`bridge.simulator.PrefixCacheModel`, seeded exactly as
:class:`bridge.simulator.SimulatedFleet` seeds it) and encodes each engine step with the
project's encoder, so the payloads equal what the simulator sends for the same options
(:meth:`WorkloadConfig.sim_args`), except for the batch timestamp, whose float64 has the same
size. That lets the in-process ceiling run on the same payloads as the end-to-end runs.

The mix, with the defaults: a small GPU cache (72 blocks of 16 tokens) that is full after a
few dozen engine steps, so every newly cached block evicts one, as in a busy engine's steady
state, whatever the number of batches per pod: about 80% ``BlockRemoved`` with one hash
each, 20% ``BlockStored`` (1-32 blocks of 16 tokens, token ids included, mean ~4.9 blocks),
and an ``AllBlocksCleared`` about once per 1,000 engine steps. vLLM 0.33.0 sends map events,
0.23.0 array events; hashes are vLLM's default unsigned 64-bit ints, or 32-byte sha256
digests with ``hash_mode="bytes"``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from bridge.simulator.model import ModelConfig, PrefixCacheModel, shared_templates
from bridge.simulator.spec import resolve_hash_mode
from bridge.vllm.encoder import encode_batch
from bridge.vllm.events import EventBatch
from bridge.vllm.releases import Release

__all__ = ["BASE_TS", "WorkloadConfig", "describe", "generate", "pod_payloads"]

BASE_TS = 1_767_225_600.0  # batch timestamps: BASE_TS + seq / 100 (the size is all that matters)
_MAX_EMPTY_STEPS = 10_000  # as the simulator: skip engine steps that produced no event


@dataclass(frozen=True)
class WorkloadConfig:
    """A fleet of simulated pods and how much each one sends (one DP rank per pod)."""

    pods: int = 16
    batches_per_pod: int = 1000
    releases: tuple[str, ...] = ("0.33.0", "0.23.0")  # cycled over the pods, as the CLI does
    hash_mode: str | None = None  # None: the release's default ("int" from 0.10.2)
    capacity: int = 72  # GPU cache blocks: small, so the steady state (evictions) comes early
    clear_prob: float = 0.001  # AllBlocksCleared per engine step
    seed: int = 0
    name: str = "pod"
    model: str = "bench-model"

    def __post_init__(self) -> None:
        if self.pods < 1 or self.batches_per_pod < 1:
            raise ValueError("pods and batches_per_pod must be >= 1")
        if not self.releases:
            raise ValueError("give at least one vLLM release")
        for i in range(min(self.pods, len(self.releases))):
            resolve_hash_mode(self.release_of(i), self.hash_mode)  # ValueError if impossible

    def pod_names(self) -> list[str]:
        """Pod names as `kvbridge simulate --pods N --name NAME` gives them."""
        if self.pods == 1:
            return [self.name]
        return [f"{self.name}-{i}" for i in range(self.pods)]

    def release_of(self, index: int) -> Release:
        return Release.parse(self.releases[index % len(self.releases)])

    def hash_mode_of(self, index: int) -> str:
        return resolve_hash_mode(self.release_of(index), self.hash_mode)

    def model_config(self) -> ModelConfig:
        return ModelConfig(capacity=self.capacity, clear_prob=self.clear_prob)

    def sim_args(self) -> list[str]:
        """`kvbridge simulate` options that make its pods send these payloads."""
        args = ["--pods", str(self.pods), "--name", self.name, "--model", self.model]
        args += ["--release", ",".join(self.releases), "--batches", str(self.batches_per_pod)]
        args += ["--capacity", str(self.capacity), "--clear-prob", repr(self.clear_prob)]
        args += ["--seed", str(self.seed)]
        if self.hash_mode is not None:
            args += ["--hash-mode", self.hash_mode]
        return args

    def label(self) -> str:
        forms = ", ".join(
            f"{r} ({'map' if Release.parse(r).map_events else 'array'})" for r in self.releases
        )
        hashes = self.hash_mode or "int"
        return f"vLLM {forms}, {hashes} hashes"


def pod_payloads(config: WorkloadConfig, index: int) -> Iterator[bytes]:
    """Payloads of pod ``index`` (rank 0, first incarnation), in seq order."""
    release = config.release_of(index)
    mode = config.hash_mode_of(index)
    cache = config.model_config()
    name = config.pod_names()[index]
    # Seeded as bridge.simulator.pod.RankPublisher seeds rank 0 of its first incarnation.
    model = PrefixCacheModel(
        release, mode, f"{config.seed}:{name}:0:0", cache, templates=shared_templates(cache)
    )
    dp_rank = 0 if release.has_dp_rank else None
    for seq in range(config.batches_per_pod):
        for _ in range(_MAX_EMPTY_STEPS):
            events = model.step()
            if events:
                break
        else:
            raise RuntimeError(f"pod {name}: the model produced no events")
        batch = EventBatch(BASE_TS + seq / 100, events, dp_rank)
        yield encode_batch(batch, release, mode)  # type: ignore[arg-type]


def generate(config: WorkloadConfig) -> list[bytes]:
    """Every pod's payloads, interleaved round-robin (as pods publishing side by side)."""
    streams = [pod_payloads(config, i) for i in range(config.pods)]
    out: list[bytes] = []
    for _ in range(config.batches_per_pod):
        out.extend(next(s) for s in streams)
    return out


def describe(payloads: Iterable[bytes]) -> dict[str, Any]:
    """What the payloads contain, read with plain msgpack (independent of the bridge's decoder)."""
    batches = payload_bytes = 0
    types: Counter[str] = Counter()
    forms: Counter[str] = Counter()
    blocks: Counter[int] = Counter()
    tokens_per_block: Counter[int] = Counter()
    hash_sizes: Counter[str] = Counter()
    removed_hashes: Counter[int] = Counter()
    for payload in payloads:
        batches += 1
        payload_bytes += len(payload)
        for ev in msgpack.unpackb(payload, raw=False, strict_map_key=False)[1]:
            if isinstance(ev, dict):
                forms["map"] += 1
                tag = ev["type"]
                hashes = ev.get("block_hashes", [])
                tokens = ev.get("token_ids")
            else:
                forms["array"] += 1
                tag = ev[0]
                hashes = ev[1] if len(ev) > 1 else []
                tokens = ev[3] if tag == "BlockStored" else None
            types[tag] += 1
            for h in hashes:
                hash_sizes["int" if isinstance(h, int) else f"{len(h)}-byte"] += 1
            if tag == "BlockStored":
                blocks[len(hashes)] += 1
                if hashes:
                    tokens_per_block[len(tokens) // len(hashes)] += 1
            elif tag == "BlockRemoved":
                removed_hashes[len(hashes)] += 1
    events = sum(types.values())
    stored = sum(blocks.values())
    return {
        "batches": batches,
        "events": events,
        "payload_bytes": payload_bytes,
        "events_per_batch": round(events / batches, 3) if batches else 0.0,
        "bytes_per_batch": round(payload_bytes / batches, 1) if batches else 0.0,
        "by_type": dict(sorted(types.items())),
        "share_by_type": {t: round(n / events, 4) for t, n in sorted(types.items())}
        if events
        else {},
        "event_forms": dict(sorted(forms.items())),
        "hash_kinds": dict(sorted(hash_sizes.items())),
        "stored_blocks_min": min(blocks) if blocks else 0,
        "stored_blocks_max": max(blocks) if blocks else 0,
        "stored_blocks_mean": round(sum(k * n for k, n in blocks.items()) / stored, 2)
        if stored
        else 0.0,
        "tokens_per_block": sorted(tokens_per_block),
        "hashes_per_removed": sorted(removed_hashes),
    }
