"""The content index: resident blocks by content key, for scoring a prompt's token ids (pure).

Kept next to :class:`bridge.consume.state.CacheState`, which decides residency (policies, copies,
EventsLost) and tells this index when an engine hash enters or leaves a tier of a stream.
Here, per stream:

* each *slot* (a tier: medium, group_idx) maps its resident, indexed engine hashes to their
  content keys (:mod:`bridge.consume.contentkeys`). A ``BlockStored`` with tokens computes the keys
  from the parent's (looked up by the parent's engine hash in the stream); one without
  tokens (offload placeholders, ``block_size=0``) takes each hash's key from the stream's
  other tiers, or from the keys of hashes that left them recently (an offload can be
  reported after the GPU block was evicted);
* a block that cannot be keyed is left out and counted in :attr:`ContentIndex.skipped` by
  reason; it never gets a wrong key, and a child of it is unkeyable too (its parent unknown).

Globally, each content key maps to the slots holding it, as a bit mask (one bit per slot; a
single holder as ``~bit``). Scoring walks the prompt's blocks once per block size in the
model's fleet, computing keys as it goes and AND-ing masks; the streams holding a block in
any tier are the owners of its slots (mask -> stream mask, memoized: along a prompt the
holders change a few times only). O(prompt blocks + matching slots), whatever the number
of pods.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import reduce
from itertools import compress, islice
from operator import or_
from typing import Any

from bridge.consume.contentkeys import (
    KEY_HASH,
    chain,
    key_from_hex,
    lora_of,
    pack_tokens,
    root_key,
    stored_extra,
)
from bridge.vllm.events import BlockStored

StreamKey = tuple[str, int]
Tier = tuple[str | None, int | None]
Walk = tuple[int, list[tuple[int, int]], list[tuple[int, int]]]
RECENT_KEYS = 1024  # per stream: keys of hashes that left every tier, kept for placeholders
SKIP_REASONS = (
    "misaligned",
    "token_domain",
    "lookahead",
    "unchained",
    "unknown_hash",
    "unkeyed_on_load",  # a block loaded (kv-state, a snapshot) without its content key
)
MEMO = 4096  # entries per memo of masks; the oldest eighth goes when one is full
DENSE = 24  # streams_of: a slot mask of more bits is mapped tier by tier (complements)
_SELECT = bytes.maketrans(b"01", b"\0\1")


def _set_bit(holders: dict[bytes, int], k: bytes, bit: int) -> bool:
    """Set ``bit`` for ``k``; True if it was set already."""
    m = holders.get(k)
    if m is None:
        holders[k] = ~bit
        return False
    if m < 0:
        if ~m == bit:
            return True
        holders[k] = (1 << ~m) | (1 << bit)
        return False
    one = 1 << bit
    if m & one:
        return True
    holders[k] = m | one
    return False


def _clear_bit(holders: dict[bytes, int], k: bytes, bit: int) -> None:
    m = holders.get(k)
    if m is None:
        return
    if m < 0:
        if ~m == bit:
            del holders[k]
        return
    m &= ~(1 << bit)
    if m & (m - 1):
        holders[k] = m
    elif m:
        holders[k] = ~(m.bit_length() - 1)
    else:  # pragma: no cover (a positive mask has two bits or more)
        del holders[k]


def _bits(m: int) -> Iterable[int]:
    while m:
        low = m & -m
        yield low.bit_length() - 1
        m ^= low


@dataclass(slots=True, eq=False)
class _Slot:
    bit: int
    tier: Tier
    owner: StreamKey
    name: str  # tier_name(tier)
    held: dict[bytes, bytes] = field(default_factory=dict)  # engine hash -> content key
    extra: dict[bytes, int] = field(default_factory=dict)  # content key -> holders, if > 1


@dataclass(slots=True, eq=False)
class _Stream:
    key: StreamKey
    bit: int
    model: str
    block_size: int = 0  # of its last keyed store; 0 until one
    block_sizes: set[int] = field(default_factory=set)  # of all its keyed stores (groups)
    slots: dict[Tier, _Slot] = field(default_factory=dict)
    recent: OrderedDict[bytes, bytes] = field(default_factory=OrderedDict)
    # The parts so far of a BlockStored split over records (bridge.log.split): keyed together
    # with the last part, once it shows whether the whole event's tokens lined up.
    pending: list[tuple[Tier, BlockStored]] = field(default_factory=list)

    def lookup(self, h: bytes) -> bytes | None:
        for slot in self.slots.values():
            k = slot.held.get(h)
            if k is not None:
                return k
        return self.recent.get(h)


def tier_name(tier: Tier) -> str:
    """A tier as answers name it: the medium ("engine" without one: releases before 0.10.2,
    whose blocks are the engine's own), and ``/<group>`` for KV-cache groups other than 0."""
    medium, group = tier
    name = "engine" if medium is None else medium
    return name if not group else f"{name}/{group}"


def _select(m: int) -> bytes:
    """Bit i of ``m`` (>= 0) as byte i (0 or 1): a selector for :func:`itertools.compress`,
    which then picks the entries of a list indexed by bit at C speed, in bit order."""
    return bin(m)[:1:-1].encode().translate(_SELECT)


def _remember(memo: dict, k: int, v: object) -> None:
    """``memo[k] = v``, first dropping the oldest eighth of a full memo (no cliff)."""
    if len(memo) >= MEMO:
        for old in list(islice(memo, MEMO // 8 or 1)):
            del memo[old]
    memo[k] = v


def _bit_list(m: int) -> list[int]:
    """The set bits of ``m`` (>= 0), via its binary text for dense masks."""
    if not m & (m - 1):
        return [m.bit_length() - 1] if m else []
    if m.bit_count() <= 16:  # sparse: bit by bit, highest first
        return sorted(_bits(m), reverse=True)
    text = bin(m)
    top = len(text) - 3
    return [top - i for i, c in enumerate(text[2:]) if c == "1"]


class ContentIndex:
    def __init__(self) -> None:
        self.slot_holders: dict[bytes, int] = {}
        self._owner_one: list[int] = []  # slot bit -> 1 << its stream's bit
        self._owner_key: list[StreamKey | None] = []  # slot bit -> its stream's key
        self._key_by_bit: list[StreamKey | None] = []  # stream bit -> its key
        # Stream bits ascend with the keys (keys_of then needs no sort); False after a
        # stream came out of order: walk and stream_mask renumber first (_renumber).
        self._ordered = True
        self._streams_of: dict[int, int] = {}  # memo: slot mask -> stream mask
        # memos: stream mask -> stream keys; slot mask -> (owner key, tier name) per slot
        self._stream_keys: dict[int, list[StreamKey]] = {}
        self._slot_names: dict[int, list[tuple[StreamKey, str]]] = {}
        self._tiers: list[tuple[str, int]] | None = None  # memo: (tier name, its slot bits)
        # memo: per tier, (its slots' bits, their streams' bits): one slot per stream each
        self._by_tier: list[tuple[int, int]] | None = None
        self.streams: dict[StreamKey, _Stream] = {}
        self._slot_bits: list[_Slot | None] = []
        self._stream_bits: list[_Stream | None] = []
        self._free_slot_bits: list[int] = []
        self._free_stream_bits: list[int] = []
        self.sizes: dict[str, Counter[int]] = {}  # model -> block size -> streams
        self.skipped: Counter[str] = Counter()
        self._roots: dict[tuple[str, str | int | None, int], bytes] = {}

    # --- bookkeeping ----------------------------------------------------------------------

    def root(self, model: str, lora: str | int | None, block_size: int) -> bytes:
        k = (model, lora, block_size)
        r = self._roots.get(k)
        if r is None:
            r = self._roots[k] = root_key(model, lora, block_size)
        return r

    def _stream(self, key: StreamKey, model: str) -> _Stream:
        s = self.streams.get(key)
        if s is not None and s.model != model:  # the pod now serves another model
            self.forget_stream(key)
            s = None
        if s is None:
            bits = self._stream_bits
            bit = self._free_stream_bits.pop() if self._free_stream_bits else len(bits)
            s = _Stream(key, bit, model)
            if bit == len(bits):
                bits.append(s)
                self._key_by_bit.append(key)
            else:
                bits[bit] = s
                self._key_by_bit[bit] = key
            if self._ordered and not self._in_order(bit, key):
                self._ordered = False
            self.streams[key] = s
        return s

    def _in_order(self, bit: int, key: StreamKey) -> bool:
        """Whether ``key`` at ``bit`` is between the keys of the nearest streams around it."""
        keys = self._key_by_bit
        for b in range(bit - 1, -1, -1):
            if keys[b] is not None:
                if keys[b] > key:  # type: ignore[operator]
                    return False
                break
        for b in range(bit + 1, len(keys)):
            if keys[b] is not None:
                return keys[b] > key  # type: ignore[operator]
        return True

    def _renumber(self) -> None:
        """Stream bits given again in key order (memos of stream masks are then void)."""
        live = sorted(self.streams.values(), key=lambda s: s.key)
        for bit, s in enumerate(live):
            s.bit = bit
        self._stream_bits = list(live)
        self._key_by_bit = [s.key for s in live]
        self._free_stream_bits = []
        for s in live:
            for slot in s.slots.values():
                self._owner_one[slot.bit] = 1 << s.bit
        self._forget_memos()
        self._ordered = True

    def _slot(self, s: _Stream, tier: Tier) -> _Slot:
        slot = s.slots.get(tier)
        if slot is None:
            bit = self._free_slot_bits.pop() if self._free_slot_bits else len(self._slot_bits)
            slot = s.slots[tier] = _Slot(bit, tier, s.key, tier_name(tier))
            self._tiers = self._by_tier = None
            if bit == len(self._slot_bits):
                self._slot_bits.append(slot)
                self._owner_one.append(1 << s.bit)
                self._owner_key.append(s.key)
            else:
                self._slot_bits[bit] = slot
                self._owner_one[bit] = 1 << s.bit
                self._owner_key[bit] = s.key
                self._forget_memos()
        return slot

    def _set_size(self, s: _Stream, block_size: int) -> None:
        s.block_size = block_size
        if block_size not in s.block_sizes:
            s.block_sizes.add(block_size)
            self.sizes.setdefault(s.model, Counter())[block_size] += 1

    def _add(self, s: _Stream, slot: _Slot, h: bytes, k: bytes) -> None:
        slot.held[h] = k
        if _set_bit(self.slot_holders, k, slot.bit):
            slot.extra[k] = slot.extra.get(k, 1) + 1

    def _drop(self, s: _Stream, slot: _Slot, h: bytes) -> None:
        k = slot.held.pop(h, None)
        if k is None:
            return
        n = slot.extra.get(k)
        if n:
            if n > 2:
                slot.extra[k] = n - 1
            else:
                del slot.extra[k]
        else:
            _clear_bit(self.slot_holders, k, slot.bit)
        s.recent[h] = k
        if len(s.recent) > RECENT_KEYS:
            s.recent.popitem(last=False)

    # --- what CacheState reports ------------------------------------------------------------

    def stored(
        self,
        key: StreamKey,
        model: str,
        tiers: dict[Tier, dict[bytes, object]],
        tier: Tier,
        ev: BlockStored,
        part: int = 0,
        parts: int = 1,
    ) -> None:
        """``ev`` was applied to ``tier`` of the stream (``tiers``: its resident hashes per
        tier); ``part`` of ``parts`` when the bridge split one BlockStored over records."""
        s = self._stream(key, model)
        if parts > 1:
            if part == 0:
                s.pending.clear()
            s.pending.append((tier, ev))
            if part < parts - 1:
                return
            whole, s.pending = s.pending, []
            bs = whole[0][1].block_size
            if sum(len(e.token_ids) for _, e in whole) != bs * sum(
                len(e.block_hashes) for _, e in whole
            ):  # the whole event's tokens did not line up: so not its parts' either
                for t, e in whole:
                    self._store(s, tiers.get(t, {}), t, replace(e, token_ids=[1]))
                return
            for t, e in whole:
                self._store(s, tiers.get(t, {}), t, e)
            return
        self._store(s, tiers[tier], tier, ev)

    def _store(
        self, s: _Stream, resident: dict[bytes, object], tier: Tier, ev: BlockStored
    ) -> None:
        hashes = ev.block_hashes
        n = len(hashes)
        if not n:
            return
        keys = self._keys(s, ev, n)
        slot = self._slot(s, tier)
        held = slot.held
        for i, h in enumerate(hashes):
            if h in held or h not in resident:
                continue
            if keys is not None:
                k = keys[i]  # None: skipped and counted by _keys
            else:
                k = s.lookup(h)
                if k is None:
                    self.skipped["misaligned" if ev.token_ids else "unknown_hash"] += 1
            if k is not None:
                self._add(s, slot, h, k)

    def _keys(self, s: _Stream, ev: BlockStored, n: int) -> list[bytes | None] | None:
        """The content keys of a store's blocks from its tokens; None when they cannot be
        computed from it (no tokens, or tokens not lining up: then per-hash lookups)."""
        bs = ev.block_size
        toks = ev.token_ids
        if bs <= 0 or len(toks) != n * bs:
            return None
        reason = None
        ek = ev.extra_keys
        if ek is not None and len(ek) != n:
            reason = "misaligned"  # extra keys not one per block: which block has which?
        look = ev.lookahead_token_ids
        if reason is None and look is not None and any(look):
            reason = "lookahead"  # lookahead tokens went into the hash: a query cannot tell
        parent = ev.parent_block_hash
        if parent is None:
            pk: bytes | None = self.root(s.model, lora_of(ev.lora_name, ev.lora_id), bs)
        else:
            pk = s.lookup(parent)
            if pk is None and reason is None:
                reason = "unchained"
        buf = pack_tokens(toks) if reason is None else None
        if reason is None and buf is None:
            reason = "token_domain"
        if reason is not None:
            # What the stream already keyed for these hashes stays valid; the rest is skipped.
            known = [s.lookup(h) for h in ev.block_hashes]
            self.skipped[reason] += sum(1 for k in known if k is None)
            return known
        extras = None
        if ek is not None and ek.count(None) != n:
            extras = [stored_extra(e, ev.lora_name) for e in ek]
        self._set_size(s, bs)
        assert pk is not None and buf is not None
        return list(chain(pk, buf, bs, n, extras))

    def removed(
        self, key: StreamKey, resident: dict[bytes, object] | None, tier: Tier, hashes: list[bytes]
    ) -> None:
        """A remove was applied to ``tier``; ``resident``: what the tier still holds (a
        ``remaining_copy_counts`` can also make a hash resident)."""
        s = self.streams.get(key)
        if s is None:
            return
        slot = s.slots.get(tier)
        for h in hashes:
            if resident is None or h not in resident:
                if slot is not None:
                    self._drop(s, slot, h)
            else:
                if slot is None:
                    slot = self._slot(s, tier)
                if h not in slot.held:
                    k = s.lookup(h)
                    if k is None:
                        self.skipped["unknown_hash"] += 1
                    else:
                        self._add(s, slot, h, k)

    def resync(self, key: StreamKey, tier: Tier, resident: dict[bytes, object] | None) -> None:
        """Drop what ``tier`` no longer holds (after a change not told hash by hash)."""
        s = self.streams.get(key)
        slot = s.slots.get(tier) if s is not None else None
        if s is None or slot is None:
            return
        for h in [h for h in slot.held if resident is None or h not in resident]:
            self._drop(s, slot, h)

    def cleared(self, key: StreamKey) -> None:
        """Every tier of the stream was emptied (its recent keys stay valid)."""
        s = self.streams.get(key)
        if s is None:
            return
        for slot in s.slots.values():
            for h in list(slot.held):
                self._drop(s, slot, h)

    def forget_stream(self, key: StreamKey) -> None:
        """A new incarnation, a fresh start, or a removed pod: nothing of it is kept."""
        s = self.streams.pop(key, None)
        if s is None:
            return
        for slot in s.slots.values():
            for h in list(slot.held):
                self._drop(s, slot, h)
            self._slot_bits[slot.bit] = None
            self._owner_key[slot.bit] = None
            self._free_slot_bits.append(slot.bit)
        self._forget_memos()
        self._stream_bits[s.bit] = None
        self._key_by_bit[s.bit] = None
        self._free_stream_bits.append(s.bit)
        sizes = self.sizes.get(s.model)
        if sizes is not None:
            for bs in s.block_sizes:
                sizes[bs] -= 1
                if sizes[bs] <= 0:
                    del sizes[bs]
            if not sizes:
                del self.sizes[s.model]

    # --- what kv-state and snapshots carry (and restore) ------------------------------------

    def held(self, key: StreamKey, tier: Tier) -> dict[bytes, bytes] | None:
        """The engine hash -> content key map of one tier of a stream (None: none yet)."""
        s = self.streams.get(key)
        slot = s.slots.get(tier) if s is not None else None
        return slot.held if slot is not None else None

    def pending_of(self, key: StreamKey) -> list[tuple[Tier, BlockStored]]:
        """The parts so far of a split BlockStored of the stream (keyed at its last part)."""
        s = self.streams.get(key)
        return list(s.pending) if s is not None else []

    def model_of(self, key: StreamKey) -> str | None:
        s = self.streams.get(key)
        return s.model if s is not None else None

    def sizes_of(self, key: StreamKey) -> dict[str, object] | None:
        """``{"block_size", "block_sizes"}`` of a stream the index knows (None otherwise): the
        size of its last keyed store and of all of them, which scoring walks by."""
        s = self.streams.get(key)
        if s is None:
            return None
        return {"block_size": s.block_size, "block_sizes": sorted(s.block_sizes)}

    def restore_sizes(
        self, key: StreamKey, model: str, block_size: int, block_sizes: Iterable[int]
    ) -> None:
        """Give a loaded stream the block sizes :meth:`sizes_of` reported."""
        s = self._stream(key, model)
        for bs in sorted({n for n in (*block_sizes, block_size) if n > 0}):
            self._set_size(s, bs)
        s.block_size = block_size

    def restore(self, key: StreamKey, model: str, tier: Tier, h: bytes, k: bytes) -> None:
        """Index a loaded resident block ``h`` of ``tier`` under its saved content key."""
        s = self._stream(key, model)
        slot = self._slot(s, tier)
        if h not in slot.held:
            self._add(s, slot, h, k)

    def load_key(self, key: StreamKey, model: Any, tier: Tier, h: bytes, ck: Any) -> None:
        """:meth:`restore` from a saved key (hex); a block without one, with a malformed
        one, or of a stream without a model is counted as ``unkeyed_on_load``."""
        k = key_from_hex(ck)
        if k is None or not isinstance(model, str):
            self.skipped["unkeyed_on_load"] += 1
            return
        self.restore(key, model, tier, h, k)

    def load_sizes(self, key: StreamKey, model: Any, doc: Any) -> None:
        """:meth:`restore_sizes` from a saved :meth:`sizes_of`; ignored if malformed."""
        if not isinstance(doc, dict) or not isinstance(model, str):
            return
        bs, sizes = doc.get("block_size"), doc.get("block_sizes")
        if type(bs) is not int or not isinstance(sizes, list):
            return
        if not all(type(n) is int and n > 0 for n in sizes):
            return
        self.restore_sizes(key, model, bs, sizes)

    def forget_pod(self, pod: str) -> None:
        for key in [k for k in self.streams if k[0] == pod]:
            self.forget_stream(key)

    def indexed_blocks(self) -> int:
        return sum(len(sl.held) for s in self.streams.values() for sl in s.slots.values())

    # --- scoring --------------------------------------------------------------------------

    def _forget_memos(self) -> None:
        """Bits were given to other slots or streams: the memos of masks are void."""
        self._streams_of.clear()
        self._stream_keys.clear()
        self._slot_names.clear()
        self._tiers = self._by_tier = None

    def _keys_of(self, streams: int) -> list[StreamKey]:
        r = self._stream_keys.get(streams)
        if r is None:
            keys = self._key_by_bit
            if not streams & (streams - 1):
                r = [keys[streams.bit_length() - 1]] if streams else []  # type: ignore[list-item]
            else:
                r = list(compress(keys, _select(streams)))  # type: ignore[arg-type]
                if not self._ordered:  # a stream added since the last walk: bits not in order
                    r.sort()
            _remember(self._stream_keys, streams, r)
        return r

    def _tier_masks(self) -> list[tuple[str, int]]:
        """(tier name, the bits of the slots of that name), by name (memoized)."""
        r = self._tiers
        if r is None:
            masks: dict[str, int] = {}
            for slot in self._slot_bits:
                if slot is not None:
                    masks[slot.name] = masks.get(slot.name, 0) | (1 << slot.bit)
            r = self._tiers = sorted(masks.items())
        return r

    def _names_of(self, slots: int) -> list[tuple[StreamKey, str]]:
        r = self._slot_names.get(slots)
        if r is None:
            bits = self._slot_bits
            r = [(bits[b].owner, bits[b].name) for b in _bit_list(slots)]  # type: ignore[union-attr]
            _remember(self._slot_names, slots, r)
        return r

    def streams_of(self, slots: int) -> int:
        """The stream bits owning the slot bits of ``slots`` (memoized)."""
        r = self._streams_of.get(slots)
        if r is None:
            if slots.bit_count() <= DENSE:
                r = self._owners_bits(slots)
            else:  # per tier: the owners of its slots, or its streams but the others' owners
                r = 0
                for in_tier, streams in self._tier_streams():
                    m = slots & in_tier
                    if m:
                        rest = in_tier ^ m
                        if rest.bit_count() < m.bit_count():
                            r |= streams ^ self._owners_bits(rest)
                        else:
                            r |= self._owners_bits(m)
            _remember(self._streams_of, slots, r)
        return r

    def _owners_bits(self, slots: int) -> int:
        one = self._owner_one
        if not slots & (slots - 1):
            return one[slots.bit_length() - 1] if slots else 0
        return reduce(or_, compress(one, _select(slots)), 0)

    def _tier_streams(self) -> list[tuple[int, int]]:
        """Per tier (medium, group): (the bits of its slots, those of their streams); the
        slots of a tier are of distinct streams (memoized)."""
        r = self._by_tier
        if r is None:
            masks: dict[Tier, tuple[int, int]] = {}
            for slot in self._slot_bits:
                if slot is not None:
                    a, b = masks.get(slot.tier, (0, 0))
                    masks[slot.tier] = (a | 1 << slot.bit, b | self._owner_one[slot.bit])
            r = self._by_tier = list(masks.values())
        return r

    def stream_mask(self, keys: Iterable[StreamKey]) -> tuple[int, int]:
        """(slot bits, stream bits) of the given streams: a query's ``pods`` filter."""
        if not self._ordered:
            self._renumber()
        slots = streams = 0
        for key in keys:
            s = self.streams.get(key)
            if s is None:
                continue
            streams |= 1 << s.bit
            for slot in s.slots.values():
                slots |= 1 << slot.bit
        return slots, streams

    def walk(
        self,
        model: str,
        lora: str | int | None,
        tokens: bytes,
        extras_for: object = None,
        only: tuple[int, int] | None = None,
    ) -> list[Walk]:
        """Per block size of ``model``'s fleet (ascending) that the prompt (packed ``tokens``)
        fills a block of: ``(block size, stream drops, slot drops)``, each drop
        ``(n, mask)``: the streams (slots) holding exactly the first ``n`` blocks, ascending
        ``n`` (distinct), the last one the holders of the whole prompt or of the last block
        reached. ``extras_for(n_blocks, block_size)``: the blocks' extra parts (None: none);
        ``only``: a :meth:`stream_mask` to limit the answer to."""
        out: list[Walk] = []
        sizes = self.sizes.get(model)
        if not sizes:
            return out
        if not self._ordered:
            self._renumber()
        n_tokens = len(tokens) // 4
        holders_get = self.slot_holders.get
        streams_of = self.streams_of
        new_hash = KEY_HASH.copy
        for bs in sorted(sizes):
            nb = n_tokens // bs
            if not nb:
                continue
            extras = extras_for(nb, bs) if extras_for is not None else None  # type: ignore[operator]
            w = 4 * bs
            k = self.root(model, lora, bs)
            alive = salive = 0
            last = None  # the previous block's slot mask
            slot_drops: list[tuple[int, int]] = []  # (leading blocks, slots that had those)
            stream_drops: list[tuple[int, int]] = []
            i = 0
            for i in range(nb):
                # blake2b(parent + tokens + extra): fed in parts, the same digest
                h = new_hash()
                h.update(k)
                h.update(tokens[i * w : i * w + w])
                if extras is not None:
                    h.update(extras[i])
                k = h.digest()
                m = holders_get(k, 0)
                if m == last:  # the same holders as the block before: nobody dropped out
                    continue
                last = m
                if m < 0:
                    m = 1 << ~m
                if i == 0:
                    alive, salive = m, streams_of(m)
                    if only is not None:
                        alive &= only[0]
                        salive &= only[1]
                else:
                    new = alive & m
                    if new != alive:
                        slot_drops.append((i, alive ^ new))
                        alive = new
                    new = salive & streams_of(m)
                    if new != salive:
                        stream_drops.append((i, salive ^ new))
                        salive = new
                if not salive:  # a slot's bit implies its stream's: nothing left to extend
                    break
            else:
                i = nb
            slot_drops.append((i, alive))
            stream_drops.append((i, salive))
            out.append((bs, stream_drops, slot_drops))
        return out

    def keys_of(self, streams: int) -> list[StreamKey]:
        """The keys of the streams of a stream mask, sorted (memoized)."""
        return self._keys_of(streams)

    def tier_parts(self, block_size: int, slot_drops: list[tuple[int, int]]) -> list[list]:
        """The streams of a walk's slot drops split into parts of equal tokens per tier:
        ``[stream mask, {tier name: leading tokens}]`` (names in order), the masks disjoint.
        Tier by tier over the drops' masks: O(drops x tiers) mask operations."""
        parts: list[list] = []
        streams_of = self.streams_of
        for name, in_tier in self._tier_masks():
            for n, mask in slot_drops:
                m = mask & in_tier
                if not n or not m:
                    continue
                t = n * block_size
                s = streams_of(m)  # a stream has one slot per tier name
                grown = []
                for part in parts:
                    both = part[0] & s
                    if both:
                        if both == part[0]:
                            part[1] = {**part[1], name: t}
                        else:
                            part[0] ^= both
                            grown.append([both, {**part[1], name: t}])
                        s ^= both
                        if not s:
                            break
                parts += grown
                if s:
                    parts.append([s, {name: t}])
        return parts

    def tiers_of(
        self, block_size: int, slot_drops: list[tuple[int, int]]
    ) -> dict[StreamKey, dict[str, int]]:
        """Per stream of a walk's slot drops: ``{tier name: leading tokens}``, in name order.
        Streams with equal tokens per tier share one dict (the answer's users never change
        it)."""
        out: dict[StreamKey, dict[str, int]] = {}
        keys = self._key_by_bit
        for s, d in self.tier_parts(block_size, slot_drops):
            if s & (s - 1):
                out.update(dict.fromkeys(compress(keys, _select(s)), d))  # type: ignore[arg-type]
            else:
                out[keys[s.bit_length() - 1]] = d  # type: ignore[index]
        return out

    def tiers_along(
        self, block_size: int, slot_drops: list[tuple[int, int]]
    ) -> Callable[[int], list[dict[str, int]]]:
        """:meth:`tiers_of` as a function of a stream mask of the walk (its stream drops):
        the tier dicts of its streams in :meth:`keys_of` order. Per stream, a byte says its
        part: no lookups by stream key (right after a :meth:`walk`, the bits in key order)."""
        parts = self.tier_parts(block_size, slot_drops)
        if not self._ordered or len(parts) > 255:  # lookups by key
            tiers = self.tiers_of(block_size, slot_drops)
            return lambda streams: [tiers[k] for k in self.keys_of(streams)]
        which = 0  # byte b: the part of stream bit b (1-based)
        for j, (s, _) in enumerate(parts, 1):
            which += int.from_bytes(_select(s), "little") * j
        of_bit = which.to_bytes(len(self._key_by_bit), "little")
        dicts = [None] + [d for _, d in parts]
        pick = dicts.__getitem__

        def along(streams: int) -> list[dict[str, int]]:
            return list(map(pick, compress(of_bit, _select(streams))))  # type: ignore[arg-type]

        return along
