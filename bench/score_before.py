"""The scoring code as it was before the p99 round (issue 16), kept for bench/score.py's
interleaved before/after timing only: the walk (``ContentIndex.score`` then) and the rows
(``bridge.consume.score.score`` then), unchanged but for their names. Not used by the bridge."""

from __future__ import annotations

from hashlib import blake2b
from operator import itemgetter
from typing import Any

from bridge.consume.contentindex import ContentIndex, StreamKey
from bridge.consume.contentkeys import KEY_BYTES, lora_of, query_extras
from bridge.consume.score import ScoreError, ScoreRequest
from bridge.consume.state import CacheState


def walk_before(
    self: ContentIndex,
    model: str,
    lora: str | int | None,
    tokens: bytes,
    extras_for: object = None,
    only: tuple[int, int] | None = None,
) -> dict[StreamKey, list]:
    """Per stream with a leading block of the prompt (packed ``tokens``):
    ``[block_size, leading tokens in any tier, {tier name: leading tokens}]``.
    ``extras_for(n_blocks, block_size)``: the blocks' extra parts (None: none); ``only``:
    a :meth:`stream_mask` to limit the answer to."""
    out: dict[StreamKey, list] = {}
    sizes = self.sizes.get(model)
    if not sizes:
        return out
    n_tokens = len(tokens) // 4
    holders_get = self.slot_holders.get
    streams_of = self.streams_of
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
            data = k + tokens[i * w : i * w + w]
            if extras is not None:
                data += extras[i]
            k = blake2b(data, digest_size=KEY_BYTES).digest()
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
        found = out if not out else {}  # a second block size: merged below
        for n, mask in stream_drops:
            if n and mask:
                t = n * bs
                for key in self._keys_of(mask):
                    found[key] = [bs, t, {}]
        for n, mask in slot_drops:
            if n and mask:
                t = n * bs
                for key, name in self._names_of(mask):
                    found[key][2][name] = t
        if found is not out:  # a stream with groups of two sizes: its longer answer
            for key, entry in found.items():
                if key not in out or out[key][1] < entry[1]:
                    out[key] = entry
    return out


def score_before(state: CacheState, req: ScoreRequest) -> list[dict[str, Any]]:
    """Per stream of ``req.model``: ``{pod, dp_rank, block_size, tokens: {tier: n},
    any_tier_tokens, uncertain}``, most leading tokens first. Streams of ``req.pods`` are
    listed even at 0; otherwise a stream with nothing of the prompt is listed only if it is
    uncertain. :class:`ScoreError` for a pod in ``req.pods`` that the state does not know."""
    content = state.content
    if content is None:
        raise ScoreError("this state keeps no content index (CacheState(content=False))")
    only = None
    if req.pods is not None:
        wanted = set(req.pods)
        keys = [k for k in state.streams if k[0] in wanted]
        missing = wanted - {k[0] for k in keys}
        if missing:
            raise ScoreError(f"unknown pod(s) {sorted(missing)}: GET /pods lists the pods")
        only = content.stream_mask(keys)
    media, salt = req.media, req.cache_salt

    def extras(n_blocks: int, block_size: int) -> list[bytes] | None:
        return query_extras(n_blocks, block_size, media, salt)

    lora = lora_of(req.lora_name, req.lora_id)
    found = walk_before(content, req.model, lora, req.token_ids, extras, only)
    if req.lora_name is not None and req.lora_id is not None:
        # Releases before 0.14 name the adapter by id only: a fleet can hold both kinds.
        for key, sc in walk_before(
            content, req.model, req.lora_id, req.token_ids, extras, only
        ).items():
            if key not in found or found[key][1] < sc[1]:
                found[key] = sc
    # Rank: most leading tokens, certain before uncertain, then by (pod, rank). The index
    # lists each group of equal length in (pod, rank) order, so a stable sort on the first
    # two is enough -- unless two walks (block sizes, LoRA name and id) were merged.
    streams, models = state.streams, state.models
    order = []
    for key, (bs, n_any, tiers) in found.items():
        st = streams.get(key)
        unc = st is not None and st.uncertain
        order.append((-2 * n_any + unc, key, bs, n_any, unc, tiers))
    extra = []
    for key, st in streams.items():
        if key in found:
            continue
        if req.pods is not None:
            if key[0] not in req.pods:
                continue
        elif not st.uncertain or models.get(key[0]) != req.model:
            continue
        cs = content.streams.get(key)
        extra.append((st.uncertain, key, cs.block_size if cs else 0, 0, st.uncertain, {}))
    order += sorted(extra)
    merged = req.lora_name is not None and req.lora_id is not None
    if merged or len(content.sizes.get(req.model, ())) > 1:
        order.sort(key=_exact)
    else:
        order.sort(key=_first)
    return [
        {
            "pod": key[0],
            "dp_rank": key[1],
            "block_size": bs,
            "tokens": dict(sorted(tiers.items())) if len(tiers) > 1 else tiers,
            "any_tier_tokens": n_any,
            "uncertain": bool(unc),
        }
        for _, key, bs, n_any, unc, tiers in order
    ]


_first = itemgetter(0)


def _exact(t: tuple) -> tuple:
    return (t[0], t[1])
