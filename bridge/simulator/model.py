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
* physical blocks as vLLM's ``BlockPool``: a block that becomes full is cached even if its
  hash is cached already (another *copy*, with its own ``BlockStored``: a block-aligned
  prompt served again recomputes its last block, two running requests compute the same
  prefix), and evicting any copy emits ``BlockRemoved`` (vllm#55092);
* from 0.26, requests with ``kv_cache_report_mode="full"`` (``report_full_prob``): their
  prefix-cache hits are announced again as ``BlockStored`` of resident blocks;
* optionally an offloading connector (medium ``"CPU"``, releases with ``medium`` only)
  whose events follow the block pool's in the same step, as offload placeholders
  (``token_ids=[]``, ``block_size=0``, no parent, spec §8), per block or in chunk mode
  (``offload_chunk_blocks``: overlapping chunks, a block stored and removed once per chunk);
* optionally ``remaining_copy_counts`` on every ``BlockRemoved`` (vllm#48933, 0.24+);
* optionally LoRA adapters (``lora_id``; ``lora_name`` from 0.14), multimodal inputs (an
  image's placeholder tokens, all one token id, told apart only by the image's identifier)
  and cache salts. As vLLM (``generate_block_hash_extra_keys``), they enter a block's hash
  as its *extra keys*: ``lora_name``, then ``(identifier, offset - block start)`` of each
  image overlapping the block, then the salt (first block only); from 0.17 each
  ``BlockStored`` lists them per block in ``extra_keys``.

``resident_prefix(prompt)`` answers what a router asks: how many leading blocks of a prompt
(of those in ``served_prompts()``, or any) each tier holds, walking the prompt's block
hashes as vLLM's ``find_longest_cache_hit`` does (stop at the first block not cached).

``copies()`` is the truth at every step: per tier, how many copies of each hash the
engine holds. docs/vllm-cache-semantics.md names the vLLM sources this follows.

Events carry the raw 32-byte digests; the encoder turns them into the wire form of the
chosen hash mode. ``resident()`` reports the cache contents in the bridge's normal form.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgpack

from bridge.vllm.encoder import normal_hash
from bridge.vllm.events import (
    REMAINING_COPY_COUNTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    VllmEvent,
    copy_counts,
)
from bridge.vllm.releases import Release

MAX_TOKEN_ID = 150_000
IMAGE_TOKEN = 150_000  # every image placeholder token (as a VLM's <image> id)
# vLLM 0.29+ seeds NONE_HASH for the sha256 algorithms with a fixed default (spec §5); the
# simulator's chain hashing is its own, so is this digest of the seed.
FIXED_NONE_HASH_SINCE = Release(0, 29, 0)
FIXED_NONE_HASH = hashlib.sha256(b"vllm-none-hash").digest()
_MAX_WAITING_FACTOR = 4  # arrivals beyond max_running * this are turned away
REPORT_MODE_SINCE = Release(0, 26, 0)  # kv_cache_report_mode="full" (vllm#47923)
MAP_EVENTS_SINCE = Release(0, 24, 0)  # events are msgpack maps: new fields travel by name
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
    cpu_capacity: int = 4096  # CPU-tier blocks
    template_seed: int = 0  # same templates on every pod using the same value
    # A new request serves an earlier prompt again, cut to whole blocks: vLLM recomputes its
    # last block into a new physical block, a second copy of that hash (vllm#55092).
    repeat_prob: float = 0.0
    # Requests with kv_cache_report_mode="full" (0.26+ only): their prefix-cache hits are
    # announced again as a BlockStored of blocks already resident.
    report_full_prob: float = 0.0
    # OffloadingConnector chunk mode: CPU entries are chunks of this many blocks, each
    # overlapping the next by one block (stored twice, removed twice); 0 = one per block.
    offload_chunk_blocks: int = 0
    # BlockRemoved carries remaining_copy_counts (vllm#48933, an open PR; map-encoded
    # releases only, 0.24+, sent as the field a newer vLLM would add).
    copy_counts: bool = False
    # LoRA: a new conversation uses one of these adapters with this probability (lora_id is
    # the adapter's position + 1). Follow-ups keep their conversation's adapter, salt, images.
    lora_names: tuple[str, ...] = ()
    lora_prob: float = 0.0
    # An image in a new request's suffix: placeholder tokens (IMAGE_TOKEN) of a length in
    # media_tokens, its identifier one of n_media shared by every pod of the template_seed.
    mm_prob: float = 0.0
    media_tokens: tuple[int, int] = (8, 48)
    n_media: int = 4
    # A cache salt (one of salts) on a new conversation.
    salt_prob: float = 0.0
    salts: tuple[str, ...] = ("tenant-a", "tenant-b")

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.capacity < 4:
            raise ValueError("capacity must be >= 4 blocks")
        if self.cpu_capacity < 1:
            raise ValueError("cpu_capacity must be >= 1 block")
        if self.offload_chunk_blocks < 0 or self.offload_chunk_blocks == 1:
            raise ValueError("offload_chunk_blocks must be 0 (per block) or >= 2")
        for name in (
            "followup_prob",
            "arrival_prob",
            "clear_prob",
            "cpu_offload_prob",
            "repeat_prob",
            "report_full_prob",
            "lora_prob",
            "mm_prob",
            "salt_prob",
        ):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")
        if self.max_running < 1 or self.token_budget < 1 or self.n_templates < 1:
            raise ValueError("max_running, token_budget and n_templates must be >= 1")
        if self.lora_prob and not self.lora_names:
            raise ValueError("lora_prob needs lora_names")
        if self.salt_prob and not self.salts:
            raise ValueError("salt_prob needs salts")
        if self.n_media < 1 or self.media_tokens[0] < 1:
            raise ValueError("n_media and media_tokens must be >= 1")
        for name in ("template_tokens", "suffix_tokens", "gen_tokens", "media_tokens"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be a range (lo, hi) with 0 <= lo <= hi")

    @property
    def max_request_tokens(self) -> int:
        """Longest request: half the GPU cache, so one request alone always fits."""
        return (self.capacity // 2) * self.block_size


def chain_hash(parent: bytes, token_ids: list[int], extra: tuple | None = None) -> bytes:
    """Digest of one full block: sha256(parent digest + token ids as 4-byte BE [+ msgpack of
    the block's extra keys, when it has some])."""
    h = hashlib.sha256(parent)
    h.update(b"".join(t.to_bytes(4, "big") for t in token_ids))
    if extra:
        h.update(msgpack.packb(list(extra), use_bin_type=True))
    return h.digest()


Media = tuple[tuple[str, int, int], ...]  # (identifier, offset, length) in prompt tokens


@dataclass(frozen=True)
class Prompt:
    """A prompt as a router sees it: its tokens and what else makes its cache distinct."""

    tokens: tuple[int, ...]
    lora: tuple[str, int] | None = None  # (lora_name, lora_id)
    media: Media = ()
    salt: str | None = None


def block_extra_keys(
    start: int, end: int, lora: tuple[str, int] | None, media: Media, salt: str | None
) -> tuple | None:
    """A block's extra keys as vLLM's ``generate_block_hash_extra_keys``: the LoRA name, each
    image overlapping [start, end) as ``(identifier, offset - start)``, the salt (first
    block only); None when there are none."""
    keys: list = [lora[0]] if lora else []
    for ident, off, length in media:
        if start < off + length and end > off:
            keys.append((ident, off - start))
    if salt and start == 0:
        keys.append(salt)
    return tuple(keys) if keys else None


def media_identifiers(config: ModelConfig) -> list[str]:
    """The image identifiers (as vLLM's mm hashes) shared by pods with one template_seed."""
    return [
        hashlib.sha256(f"image:{config.template_seed}:{i}".encode()).hexdigest()[:32]
        for i in range(config.n_media)
    ]


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
    report_full: bool = False  # kv_cache_report_mode="full" (0.26+)
    lora: tuple[str, int] | None = None
    media: Media = ()
    salt: str | None = None
    computed: int = 0  # tokens whose KV is computed
    blocks: list[int] = field(default_factory=list)  # held (pinned) physical blocks, in order
    hashes: list[bytes] = field(default_factory=list)  # their hashes


class PrefixCacheModel:
    """The prefix cache of one engine core; ``step()`` yields one engine step's events.

    GPU blocks are physical: as vLLM's ``BlockPool`` (``cached_block_hash_to_block``), a
    hash may be held by several blocks (a block is never de-duplicated when it becomes
    full), a lookup takes the first copy, and evicting any copy emits a ``BlockRemoved``.
    """

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
        self._report_full = release >= REPORT_MODE_SINCE and self.config.report_full_prob > 0
        self._copy_counts = self.config.copy_counts and release >= MAP_EVENTS_SINCE
        self.gpu_key: TierKey = (
            GPU if self._has_medium else None,
            0 if "group_idx" in stored else None,
        )
        self.cpu_key: TierKey = (CPU, None)
        # Physical GPU blocks that hold a cached (full) block: id -> its hash, id -> number
        # of running requests holding it; hash -> its copies (ids, oldest first); free
        # (unpinned) blocks in LRU order.
        self._hash_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}
        self._copies: dict[bytes, dict[int, None]] = {}
        self._free: OrderedDict[int, None] = OrderedDict()
        self._next_block = 0
        # CPU tier: entries (one block, or a chunk) in LRU order; hash -> entries holding it.
        self._cpu: OrderedDict[tuple[bytes, ...], None] = OrderedDict()
        self._cpu_count: dict[bytes, int] = {}
        self._cpu_used = 0
        self._running: list[_Request] = []
        self._waiting: list[_Request] = []
        self._history: list[list[int]] = []  # finished conversations, for follow-ups
        self._history_ctx: list[tuple] = []  # their (lora, media, salt), in step
        self._prompts: list[list[int]] = []  # recent prompts, for repeats
        self._prompts_ctx: list[tuple] = []
        self._served: list[Prompt] = []  # recent prompts admitted, for served_prompts()
        self._media_ids = media_identifiers(self.config)
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
            if not self._admit(self._waiting[0], events):
                break
            self._waiting.pop(0)
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
        return {t: set(c) for t, c in self.copies().items()}

    def copies(self) -> dict[TierKey, dict[bytes, int]]:
        """The truth per tier: normal-form hash -> how many copies the engine holds (GPU:
        physical blocks; CPU: offloaded entries listing it). Empty tiers left out."""
        out: dict[TierKey, dict[bytes, int]] = {}
        if self._copies:
            out[self.gpu_key] = {
                normal_hash(h, self.hash_mode): len(c) for h, c in self._copies.items()
            }
        if self._cpu_count:
            out[self.cpu_key] = {
                normal_hash(h, self.hash_mode): n for h, n in self._cpu_count.items()
            }
        return out

    def served_prompts(self) -> list[Prompt]:
        """The last prompts admitted (up to 64), oldest first."""
        return list(self._served)

    def prompt_hashes(self, prompt: Prompt) -> list[bytes]:
        """The raw block hashes of a prompt's full blocks, as this engine computes them."""
        bs = self.config.block_size
        out: list[bytes] = []
        parent = self.none_hash
        for i in range(len(prompt.tokens) // bs):
            extra = None
            if prompt.lora is not None or prompt.media or prompt.salt is not None:
                extra = block_extra_keys(
                    i * bs, (i + 1) * bs, prompt.lora, prompt.media, prompt.salt
                )
            parent = chain_hash(parent, list(prompt.tokens[i * bs : (i + 1) * bs]), extra)
            out.append(parent)
        return out

    def resident_prefix(self, prompt: Prompt) -> tuple[dict[TierKey, int], int]:
        """The truth a router wants: per tier, how many leading blocks of ``prompt`` it holds
        (vLLM's ``find_longest_cache_hit``: left to right, stop at the first block not
        cached; tiers holding none left out), and how many leading blocks are each in some
        tier. Residency, not a hit: vLLM recomputes at least the last token on admission."""
        hashes = self.prompt_hashes(prompt)
        tiers: dict[TierKey, int] = {}
        for key, held in ((self.gpu_key, self._copies), (self.cpu_key, self._cpu_count)):
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            if n:
                tiers[key] = n
        n_any = 0
        for h in hashes:
            if h not in self._copies and h not in self._cpu_count:
                break
            n_any += 1
        return tiers, n_any

    @property
    def gpu_blocks(self) -> int:
        return len(self._refs)

    @property
    def cpu_blocks(self) -> int:
        return self._cpu_used

    # --- requests ---------------------------------------------------------------------

    def _new_request(self) -> _Request:
        cfg, rng = self.config, self._rng
        limit = cfg.max_request_tokens
        ctx: tuple = (None, (), None)  # (lora, media, salt)
        if self._prompts and cfg.repeat_prob and rng.random() < cfg.repeat_prob:
            # The same prompt again, block-aligned: every block but the last is a hit.
            j = rng.randrange(len(self._prompts))
            prompt, ctx = list(self._prompts[j]), self._prompts_ctx[j]
            prompt = prompt[: max(1, len(prompt) // cfg.block_size) * cfg.block_size]
        else:
            if self._history and rng.random() < cfg.followup_prob:
                j = rng.randrange(len(self._history))
                prefix, ctx = list(self._history[j]), self._history_ctx[j]
            else:
                prefix = list(rng.choice(self._templates))
                ctx = self._new_context()
            n_suffix = rng.randint(*cfg.suffix_tokens)
            suffix = [rng.randint(0, MAX_TOKEN_ID) for _ in range(n_suffix)]
            if cfg.mm_prob and suffix and rng.random() < cfg.mm_prob:
                n = min(len(suffix), rng.randint(*cfg.media_tokens))
                at = rng.randint(0, len(suffix) - n)
                suffix[at : at + n] = [IMAGE_TOKEN] * n
                image = (rng.choice(self._media_ids), len(prefix) + at, n)
                ctx = (ctx[0], (*ctx[1], image), ctx[2])
            prompt = (prefix + suffix)[: max(1, limit - 1)] or [rng.randint(0, MAX_TOKEN_ID)]
        gen = [rng.randint(0, MAX_TOKEN_ID) for _ in range(rng.randint(*cfg.gen_tokens))]
        prompt = prompt[: max(1, limit - 1)]
        lora, media, salt = ctx
        media = tuple(m for m in media if m[1] + m[2] <= len(prompt))  # cut with the prompt
        tokens = (prompt + gen)[:limit]
        if cfg.repeat_prob:
            self._prompts.append(prompt)
            self._prompts_ctx.append((lora, media, salt))
            del self._prompts[:-16]
            del self._prompts_ctx[:-16]
        full = self._report_full and rng.random() < cfg.report_full_prob
        return _Request(
            tokens=tokens, prompt_len=len(prompt), report_full=full, lora=lora, media=media,
            salt=salt,
        )  # fmt: skip

    def _new_context(self) -> tuple:
        """(lora, media, salt) of a new conversation. Draws nothing unless configured, so
        that workloads without them keep their random streams."""
        cfg, rng = self.config, self._rng
        lora = salt = None
        if cfg.lora_prob and rng.random() < cfg.lora_prob:
            i = rng.randrange(len(cfg.lora_names))
            lora = (cfg.lora_names[i], i + 1)
        if cfg.salt_prob and rng.random() < cfg.salt_prob:
            salt = rng.choice(cfg.salts)
        return (lora, (), salt)

    def _extra(self, req: _Request, i: int) -> tuple | None:
        if req.lora is None and not req.media and req.salt is None:
            return None
        bs = self.config.block_size
        return block_extra_keys(i * bs, (i + 1) * bs, req.lora, req.media, req.salt)

    def _admit(self, req: _Request, events: list[VllmEvent]) -> bool:
        """Start ``req`` if its remaining blocks fit: pin its longest cached prefix.

        As vLLM's ``get_computed_blocks``: at most ``num_tokens - 1`` tokens can hit, in
        whole blocks, so a block-aligned prompt always recomputes its last block."""
        bs = self.config.block_size
        known = req.computed if req.computed > req.prompt_len else req.prompt_len
        hits: list[int] = []
        hashes: list[bytes] = []
        parent = self.none_hash
        for i in range((known - 1) // bs):
            h = chain_hash(parent, req.tokens[i * bs : (i + 1) * bs], self._extra(req, i))
            copies = self._copies.get(h)
            if not copies:
                break
            hits.append(next(iter(copies)))  # the first copy, as BlockPool.get_cached_block
            hashes.append(h)
            parent = h
        unpinned_hits = sum(1 for b in hits if self._refs[b] == 0)
        available = self.config.capacity - len(self._refs) + len(self._free) - unpinned_hits
        if len(req.tokens) // bs - len(hits) > available:
            return False  # wait until running requests free enough blocks
        for b in hits:
            self._pin(b)
        req.blocks, req.hashes = hits, hashes
        req.computed = len(hits) * bs
        self._running.append(req)
        if req.computed <= req.prompt_len:  # not a preempted request coming back
            self._served.append(
                Prompt(tuple(req.tokens[: req.prompt_len]), req.lora, req.media, req.salt)
            )
            del self._served[:-64]
        if req.report_full and hashes:  # 0.26+ report mode "full": hits announced again
            events.append(self._stored(list(hashes), None, req.tokens[: len(hashes) * bs], req, 0))
        return True

    def _compute(
        self, req: _Request, n: int, events: list[VllmEvent], connector: list[VllmEvent]
    ) -> None:
        bs = self.config.block_size
        target = req.computed + n
        run_start = len(req.blocks)  # index of the first block of the current run
        for i in range(len(req.blocks), target // bs):
            parent = req.hashes[-1] if req.hashes else self.none_hash
            h = chain_hash(parent, req.tokens[i * bs : (i + 1) * bs], self._extra(req, i))
            b = self._allocate(req, events)
            if b is None:
                self._flush(req, run_start, events, connector)
                self._preempt(req)
                return
            # Cached as one more copy even if the hash is cached already (vLLM does not
            # de-duplicate, so that block tables stay append-only).
            self._refs[b] = 1
            self._hash_of[b] = h
            self._copies.setdefault(h, {})[b] = None
            req.blocks.append(b)
            req.hashes.append(h)
        self._flush(req, run_start, events, connector)
        req.computed = target
        if req.computed >= len(req.tokens):
            self._running.remove(req)
            self._release(req)
            self._history.append(req.tokens)
            self._history_ctx.append((req.lora, req.media, req.salt))
            del self._history[:-16]
            del self._history_ctx[:-16]

    # --- cache ------------------------------------------------------------------------

    def _pin(self, b: int) -> None:
        if self._refs[b] == 0:
            del self._free[b]
        self._refs[b] += 1

    def _release(self, req: _Request) -> None:
        """Unpin a request's blocks, last block first, so tails are evicted first (as vLLM)."""
        for b in reversed(req.blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None
        req.blocks.clear()
        req.hashes.clear()

    def _allocate(self, req: _Request, events: list[VllmEvent]) -> int | None:
        """A new physical block: evict the LRU free block if the pool is full, else preempt
        the most recently started request (as vLLM's scheduler); None if that is ``req``."""
        while len(self._refs) >= self.config.capacity:
            if self._evict(events):
                continue
            victim = self._running[-1]
            if victim is req:
                return None
            self._preempt(victim)
        self._next_block += 1
        return self._next_block

    def _evict(self, events: list[VllmEvent]) -> bool:
        if not self._free:
            return False
        b, _ = self._free.popitem(last=False)
        del self._refs[b]
        h = self._hash_of.pop(b)
        copies = self._copies[h]
        del copies[b]
        if not copies:
            del self._copies[h]
        # One BlockRemoved per evicted block, whether or not other copies stay (vllm#55092).
        events.append(self._removed([h], self.gpu_key, [len(copies)]))
        return True

    def _preempt(self, req: _Request) -> None:
        """Free a request that cannot get a block; it is recomputed later (cached prefix hits)."""
        self._running.remove(req)
        self._release(req)
        self._waiting.insert(0, req)

    def _clear(self) -> None:
        for req in list(self._running):
            self._preempt(req)
        self._hash_of.clear()
        self._refs.clear()
        self._copies.clear()
        self._free.clear()
        self._cpu.clear()
        self._cpu_count.clear()
        self._cpu_used = 0

    def _flush(
        self, req: _Request, start: int, events: list[VllmEvent], connector: list[VllmEvent]
    ) -> None:
        """Emit the BlockStored of the newly cached run ``req.hashes[start:]``."""
        run = req.hashes[start:]
        if not run:
            return
        bs = self.config.block_size
        parent = req.hashes[start - 1] if start > 0 else None
        tokens = req.tokens[start * bs : (start + len(run)) * bs]
        events.append(self._stored(run, parent, tokens, req, start))
        cfg = self.config
        if self._has_medium and cfg.cpu_offload_prob and self._rng.random() < cfg.cpu_offload_prob:
            self._offload(run, connector)

    def _offload(self, run: list[bytes], connector: list[VllmEvent]) -> None:
        """Copy a run to the CPU tier, as the OffloadingConnector: per block, or in chunks of
        ``offload_chunk_blocks`` that overlap by one block (chunk mode). Entries already
        offloaded are touched; the LRU entries are evicted to make room."""
        size = self.config.offload_chunk_blocks
        cap = self.config.cpu_capacity
        if size:
            step = size - 1
            entries = [tuple(run[j : j + size]) for j in range(0, max(1, len(run) - 1), step)]
        else:
            entries = [(h,) for h in run]
        for e in entries:
            if e in self._cpu:
                self._cpu.move_to_end(e)
        new = list(dict.fromkeys(e for e in entries if e not in self._cpu and len(e) <= cap))
        while sum(map(len, new)) > cap:
            new.pop(0)  # keep the newest that fit
        if not new:
            return
        need = sum(map(len, new))
        while self._cpu_used + need > cap:
            old, _ = self._cpu.popitem(last=False)
            self._cpu_used -= len(old)
            left = []
            for h in old:
                n = self._cpu_count[h] - 1
                if n:
                    self._cpu_count[h] = n
                else:
                    del self._cpu_count[h]
                left.append(n)
            connector.append(self._removed(list(old), self.cpu_key, left))
        for e in new:
            self._cpu[e] = None
            self._cpu_used += len(e)
            for h in e:
                self._cpu_count[h] = self._cpu_count.get(h, 0) + 1
        if size:  # one BlockStored per chunk: a block in two chunks is stored twice
            for e in new:
                connector.append(BlockStored(list(e), None, [], 0, medium=CPU))
        else:
            connector.append(BlockStored([e[0] for e in new], None, [], 0, medium=CPU))

    # --- events -----------------------------------------------------------------------

    def _stored(
        self, run: list[bytes], parent: bytes | None, tokens: list[int], req: _Request, start: int
    ) -> BlockStored:
        event = BlockStored(list(run), parent, tokens, self.config.block_size)
        if self._has_medium:
            event.medium = GPU
        if req.lora is not None:
            event.lora_id = req.lora[1]
            if "lora_name" in self._stored_has:
                event.lora_name = req.lora[0]
        if "extra_keys" in self._stored_has:
            extra = [self._extra(req, start + i) for i in range(len(run))]
            event.extra_keys = [None if e is None else list(e) for e in extra]
        if "group_idx" in self._stored_has:
            event.group_idx = 0
        if "kv_cache_spec_kind" in self._stored_has:
            event.kv_cache_spec_kind = FULL_ATTENTION
        return event

    def _removed(self, hashes: list[bytes], tier: TierKey, left: list[int]) -> BlockRemoved:
        event = BlockRemoved(hashes, medium=tier[0], group_idx=tier[1])
        if self._copy_counts:  # as a newer vLLM's field: unknown to this release's schema
            event.extra[REMAINING_COPY_COUNTS] = msgpack.packb(left)
        return event


def apply_events(
    state: dict[TierKey, dict[bytes, int]], events: Iterable[VllmEvent]
) -> dict[TierKey, dict[bytes, int]]:
    """Apply events (normal-form hashes) to per-(medium, group_idx) copy counts, in place.

    The reference semantics of the ``count`` policy (docs/vllm-cache-semantics.md): a store
    adds a copy of each hash, a remove drops one (``remaining_copy_counts``, when sent, sets
    the count), AllBlocksCleared empties everything of that rank. Exact for every release's
    physical copies and offload chunks; not for re-announced hits (``report_full_prob``).
    Empty tiers are dropped; :func:`residency` gives the hashes per tier."""
    for e in events:
        if isinstance(e, AllBlocksCleared):
            state.clear()
        elif isinstance(e, BlockStored):
            tier = state.setdefault((e.medium, e.group_idx), {})
            for h in e.block_hashes:
                tier[h] = tier.get(h, 0) + 1
        elif isinstance(e, BlockRemoved):
            key = (e.medium, e.group_idx)
            tier = state.setdefault(key, {})
            left = copy_counts(e)
            for i, h in enumerate(e.block_hashes):
                n = left[i] if left is not None else tier.get(h, 0) - 1
                if n > 0:
                    tier[h] = n
                else:
                    tier.pop(h, None)
            if not tier:
                del state[key]
    return state


def residency(state: dict[TierKey, dict[bytes, int]]) -> dict[TierKey, set[bytes]]:
    """The resident hashes per tier of :func:`apply_events` counts (empty tiers left out)."""
    return {t: set(c) for t, c in state.items() if c}
