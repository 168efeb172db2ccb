"""A small, pure model of one vLLM engine core's prefix cache (one per pod and DP rank).

No I/O, no clock: given a seed, the sequence of ``step()`` results is deterministic.

What it imitates (spec §4.2, §7):

* requests built from a few prompt templates shared by every pod (same token ids
  everywhere, as with a common system prompt), optional follow-ups of an earlier
  conversation, and random suffixes; token ids in 0..150000;
* chunked prefill under a per-step token budget, then decoding one token per step;
  a block enters the prefix cache when it is full;
* block hashes chained like vLLM: ``sha256(parent digest + the block's token ids)``,
  32-byte digests; the first block's parent is ``NONE_HASH``: up to 0.28 random per model
  instance (per engine incarnation, as without ``PYTHONHASHSEED``), from 0.29 derived from
  vLLM's fixed default seed ``"vllm-none-hash"`` for the sha256 algorithms (spec §5), so
  every pod and incarnation of those releases hashes a shared prefix the same way;
* one ``BlockStored`` per request per step for the blocks it newly cached (oldest
  first, parent = the hash before the first one), blocks held by running requests are
  pinned, LRU eviction of unpinned blocks when ``capacity`` is reached (one
  ``BlockRemoved`` per evicted hash), preemption when a running request cannot get a
  block;
* ``AllBlocksCleared`` with probability ``clear_prob`` per step (running requests are
  preempted first, as a reset of the prefix cache requires);
* optionally an offloading connector (medium ``"CPU"``, releases with ``medium`` only)
  whose events follow the block pool's in the same step, as offload placeholders
  (``token_ids=[]``, ``block_size=0``, no parent, spec §8).

Events carry the raw 32-byte digests; the encoder turns them into the wire form of the
chosen hash mode. ``resident()`` reports the cache contents in the bridge's normal form.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from bridge.events import AllBlocksCleared, BlockRemoved, BlockStored, VllmEvent
from bridge.vllm.encoder import normal_hash
from bridge.vllm.releases import Release

MAX_TOKEN_ID = 150_000
# vLLM 0.29+ seeds NONE_HASH for the sha256 algorithms with a fixed default (spec §5); the
# simulator's chain hashing is its own, so is this digest of the seed.
FIXED_NONE_HASH_SINCE = Release(0, 29, 0)
FIXED_NONE_HASH = hashlib.sha256(b"vllm-none-hash").digest()
_MAX_WAITING_FACTOR = 4  # arrivals beyond max_running * this are turned away
GPU = "GPU"
CPU = "CPU"
FULL_ATTENTION = "full_attention"

TierKey = tuple[str | None, int | None]
"""(medium, group_idx) exactly as the release sends them (None where it lacks the field)."""


@dataclass(frozen=True)
class ModelConfig:
    """Workload and cache parameters (token counts are inclusive ranges)."""

    block_size: int = 16
    capacity: int = 2048  # GPU blocks
    n_templates: int = 4
    template_tokens: tuple[int, int] = (64, 512)
    suffix_tokens: tuple[int, int] = (8, 256)
    gen_tokens: tuple[int, int] = (8, 160)
    followup_prob: float = 0.3  # a new request continues an earlier conversation
    arrival_prob: float = 0.5  # a new request arrives in a step
    max_running: int = 4
    token_budget: int = 512  # tokens computed per step, all requests together
    clear_prob: float = 0.0  # AllBlocksCleared per step
    cpu_offload_prob: float = 0.0  # a newly cached GPU run is offloaded to CPU
    # vLLM's legitimate duplicates: BlockStored again for a request's prefix-cache hits
    # (kv_cache_report_mode="full", 0.26+) and a BlockRemoved repeated (connector chunk mode).
    duplicate_prob: float = 0.0
    cpu_capacity: int = 4096  # CPU-tier blocks
    template_seed: int = 0  # same templates on every pod using the same value

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.capacity < 4:
            raise ValueError("capacity must be >= 4 blocks")
        if self.cpu_capacity < 1:
            raise ValueError("cpu_capacity must be >= 1 block")
        for name in (
            "followup_prob",
            "arrival_prob",
            "clear_prob",
            "cpu_offload_prob",
            "duplicate_prob",
        ):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")
        if self.max_running < 1 or self.token_budget < 1 or self.n_templates < 1:
            raise ValueError("max_running, token_budget and n_templates must be >= 1")
        for name in ("template_tokens", "suffix_tokens", "gen_tokens"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be a range (lo, hi) with 0 <= lo <= hi")

    @property
    def max_request_tokens(self) -> int:
        """Longest request: half the GPU cache, so one request alone always fits."""
        return (self.capacity // 2) * self.block_size


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Digest of one full block: sha256(parent digest + token ids as 4-byte BE)."""
    h = hashlib.sha256(parent)
    h.update(b"".join(t.to_bytes(4, "big") for t in token_ids))
    return h.digest()


def shared_templates(config: ModelConfig) -> list[list[int]]:
    """The prompt templates, identical for every model with the same ``template_seed``."""
    rng = random.Random(f"kvbridge-templates:{config.template_seed}")
    lo, hi = config.template_tokens
    return [
        [rng.randint(0, MAX_TOKEN_ID) for _ in range(rng.randint(lo, hi))]
        for _ in range(config.n_templates)
    ]


@dataclass(eq=False)  # compared by identity
class _Request:
    tokens: list[int]  # prompt followed by every token it will generate
    prompt_len: int
    computed: int = 0  # tokens whose KV is computed
    blocks: list[bytes] = field(default_factory=list)  # held (pinned) full blocks, in order


class PrefixCacheModel:
    """The prefix cache of one engine core; ``step()`` yields one engine step's events."""

    def __init__(
        self,
        release: Release,
        hash_mode: str,
        seed: int | str,
        config: ModelConfig | None = None,
        templates: list[list[int]] | None = None,
    ) -> None:
        self.release = release
        self.hash_mode = hash_mode
        self.config = config or ModelConfig()
        self._rng = random.Random(f"kvbridge-model:{seed}")
        random_none_hash = self._rng.randbytes(32)  # drawn always: keeps the rng stream
        self.none_hash = FIXED_NONE_HASH if release >= FIXED_NONE_HASH_SINCE else random_none_hash
        self._templates = templates if templates is not None else shared_templates(self.config)
        stored = set(release.stored_fields)
        self._has_medium = "medium" in stored
        self._stored_has = stored
        self.gpu_key: TierKey = (
            GPU if self._has_medium else None,
            0 if "group_idx" in stored else None,
        )
        self.cpu_key: TierKey = (CPU, None)
        # digest -> number of running requests holding it; free (unpinned) blocks in LRU order
        self._refs: dict[bytes, int] = {}
        self._free: OrderedDict[bytes, None] = OrderedDict()
        self._cpu: OrderedDict[bytes, None] = OrderedDict()
        self._running: list[_Request] = []
        self._waiting: list[_Request] = []
        self._history: list[list[int]] = []  # finished conversations, for follow-ups
        self.steps = 0

    # --- public -----------------------------------------------------------------------

    def step(self) -> list[VllmEvent]:
        """Advance one engine step; the block pool's events, then the connector's."""
        self.steps += 1
        events: list[VllmEvent] = []
        connector: list[VllmEvent] = []
        cfg = self.config
        if cfg.clear_prob and self._rng.random() < cfg.clear_prob:
            self._clear()
            events.append(AllBlocksCleared())
        arrived = self._rng.random() < cfg.arrival_prob
        if arrived and len(self._waiting) < _MAX_WAITING_FACTOR * cfg.max_running:
            self._waiting.append(self._new_request())
        while self._waiting and len(self._running) < cfg.max_running:
            if not self._admit(self._waiting[0]):
                break
            req = self._waiting.pop(0)
            if cfg.duplicate_prob and req.blocks and self._rng.random() < cfg.duplicate_prob:
                hits = list(req.blocks)  # already resident: a duplicate store, by design
                events.append(self._stored(hits, None, req.tokens[: len(hits) * cfg.block_size]))
        budget = cfg.token_budget
        for req in list(self._running):
            if budget <= 0:
                break
            if req not in self._running:  # preempted by an older request in this step
                continue
            prefill_left = req.prompt_len - req.computed
            n = min(prefill_left, budget) if prefill_left > 0 else 1  # prefill chunk or 1 decode
            budget -= n
            self._compute(req, n, events, connector)
        return events + connector

    def resident(self) -> dict[TierKey, set[bytes]]:
        """Cached hashes in normal form per (medium, group_idx); empty tiers left out."""
        out: dict[TierKey, set[bytes]] = {}
        if self._refs:
            out[self.gpu_key] = {normal_hash(h, self.hash_mode) for h in self._refs}
        if self._cpu:
            out[self.cpu_key] = {normal_hash(h, self.hash_mode) for h in self._cpu}
        return out

    @property
    def gpu_blocks(self) -> int:
        return len(self._refs)

    @property
    def cpu_blocks(self) -> int:
        return len(self._cpu)

    # --- requests ---------------------------------------------------------------------

    def _new_request(self) -> _Request:
        cfg, rng = self.config, self._rng
        if self._history and rng.random() < cfg.followup_prob:
            prefix = list(rng.choice(self._history))
        else:
            prefix = list(rng.choice(self._templates))
        suffix = [rng.randint(0, MAX_TOKEN_ID) for _ in range(rng.randint(*cfg.suffix_tokens))]
        gen = [rng.randint(0, MAX_TOKEN_ID) for _ in range(rng.randint(*cfg.gen_tokens))]
        limit = cfg.max_request_tokens
        prompt = (prefix + suffix)[: max(1, limit - 1)] or [rng.randint(0, MAX_TOKEN_ID)]
        tokens = (prompt + gen)[:limit]
        return _Request(tokens=tokens, prompt_len=len(prompt))

    def _admit(self, req: _Request) -> bool:
        """Start ``req`` if its remaining blocks fit: pin its longest cached prefix."""
        bs = self.config.block_size
        known = req.computed if req.computed > req.prompt_len else req.prompt_len
        hits: list[bytes] = []
        parent = self.none_hash
        for i in range(known // bs):
            h = chain_hash(parent, req.tokens[i * bs : (i + 1) * bs])
            if h not in self._refs:
                break
            hits.append(h)
            parent = h
        unpinned_hits = sum(1 for h in hits if self._refs[h] == 0)
        available = self.config.capacity - len(self._refs) + len(self._free) - unpinned_hits
        if len(req.tokens) // bs - len(hits) > available:
            return False  # wait until running requests free enough blocks
        for h in hits:
            self._pin(h)
        req.blocks = hits
        # As vLLM: at least one token is always recomputed.
        req.computed = min(len(hits) * bs, known - 1)
        self._running.append(req)
        return True

    def _compute(
        self, req: _Request, n: int, events: list[VllmEvent], connector: list[VllmEvent]
    ) -> None:
        bs = self.config.block_size
        target = req.computed + n
        run_start = len(req.blocks)  # index of the first block of the current run
        for i in range(len(req.blocks), target // bs):
            parent = req.blocks[-1] if req.blocks else self.none_hash
            h = chain_hash(parent, req.tokens[i * bs : (i + 1) * bs])
            if h in self._refs:  # cached meanwhile by another request: reuse, no event
                self._flush(req, run_start, events, connector)
                run_start = i + 1
                self._pin(h)
            else:
                if not self._allocate(req, events):
                    self._flush(req, run_start, events, connector)
                    self._preempt(req)
                    return
                self._refs[h] = 1
            req.blocks.append(h)
        self._flush(req, run_start, events, connector)
        req.computed = target
        if req.computed >= len(req.tokens):
            self._running.remove(req)
            self._release(req)
            self._history.append(req.tokens)
            del self._history[:-16]

    # --- cache ------------------------------------------------------------------------

    def _pin(self, h: bytes) -> None:
        if self._refs[h] == 0:
            del self._free[h]
        self._refs[h] += 1

    def _release(self, req: _Request) -> None:
        """Unpin a request's blocks, last block first, so tails are evicted first (as vLLM)."""
        for h in reversed(req.blocks):
            self._refs[h] -= 1
            if self._refs[h] == 0:
                self._free[h] = None
        req.blocks.clear()

    def _allocate(self, req: _Request, events: list[VllmEvent]) -> bool:
        """Make room for one new block: evict the LRU free block, else preempt the most
        recently started request (as vLLM's scheduler); False if that would be ``req``."""
        while len(self._refs) >= self.config.capacity:
            if self._evict(events):
                continue
            victim = self._running[-1]
            if victim is req:
                return False
            self._preempt(victim)
        return True

    def _evict(self, events: list[VllmEvent]) -> bool:
        if not self._free:
            return False
        h, _ = self._free.popitem(last=False)
        del self._refs[h]
        events.append(self._removed(h, self.gpu_key[0], self.gpu_key[1]))
        p = self.config.duplicate_prob
        if p and self._rng.random() < p:
            events.append(self._removed(h, self.gpu_key[0], self.gpu_key[1]))  # repeated
        return True

    def _preempt(self, req: _Request) -> None:
        """Free a request that cannot get a block; it is recomputed later (cached prefix hits)."""
        self._running.remove(req)
        self._release(req)
        self._waiting.insert(0, req)

    def _clear(self) -> None:
        for req in list(self._running):
            self._preempt(req)
        self._refs.clear()
        self._free.clear()
        self._cpu.clear()

    def _flush(
        self, req: _Request, start: int, events: list[VllmEvent], connector: list[VllmEvent]
    ) -> None:
        """Emit the BlockStored of the newly cached run ``req.blocks[start:]``."""
        run = req.blocks[start:]
        if not run:
            return
        bs = self.config.block_size
        parent = req.blocks[start - 1] if start > 0 else None
        tokens = req.tokens[start * bs : (start + len(run)) * bs]
        events.append(self._stored(run, parent, tokens))
        cfg = self.config
        if self._has_medium and cfg.cpu_offload_prob and self._rng.random() < cfg.cpu_offload_prob:
            self._offload(run, connector)

    def _offload(self, run: list[bytes], connector: list[VllmEvent]) -> None:
        """Copy a run to the CPU tier (the newest ``cpu_capacity`` blocks of it at most)."""
        for h in run:
            if h in self._cpu:
                self._cpu.move_to_end(h)
        new = [h for h in run if h not in self._cpu][-self.config.cpu_capacity :]
        if not new:
            return
        while len(self._cpu) + len(new) > self.config.cpu_capacity:
            old, _ = self._cpu.popitem(last=False)
            connector.append(self._removed(old, CPU, None))
        for h in new:
            self._cpu[h] = None
        connector.append(BlockStored(new, None, [], 0, medium=CPU))

    # --- events -----------------------------------------------------------------------

    def _stored(self, run: list[bytes], parent: bytes | None, tokens: list[int]) -> BlockStored:
        event = BlockStored(list(run), parent, tokens, self.config.block_size)
        if self._has_medium:
            event.medium = GPU
        if "extra_keys" in self._stored_has:
            event.extra_keys = [None] * len(run)
        if "group_idx" in self._stored_has:
            event.group_idx = 0
        if "kv_cache_spec_kind" in self._stored_has:
            event.kv_cache_spec_kind = FULL_ATTENTION
        return event

    def _removed(self, h: bytes, medium: str | None, group_idx: int | None) -> BlockRemoved:
        return BlockRemoved([h], medium=medium, group_idx=group_idx)


def apply_events(
    state: dict[TierKey, set[bytes]], events: Iterable[VllmEvent]
) -> dict[TierKey, set[bytes]]:
    """Apply events (normal-form hashes) to a per-(medium, group_idx) state, in place.

    The reference semantics a consumer uses (spec §12): stores add, removes discard,
    AllBlocksCleared empties everything of that rank. Empty tiers are dropped.
    """
    for e in events:
        if isinstance(e, AllBlocksCleared):
            state.clear()
        elif isinstance(e, BlockStored):
            state.setdefault((e.medium, e.group_idx), set()).update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            key = (e.medium, e.group_idx)
            if key in state:
                state[key].difference_update(e.block_hashes)
                if not state[key]:
                    del state[key]
    return state
