"""Scoring pods for a prompt by its token ids: the request, its validation, the answer (pure).

``{model, lora_name?, lora_id?, token_ids, media?, cache_salt?, pods?}`` -> per (pod, dp_rank)
of that model holding a leading block of the prompt (and every stream of the pods asked for):
the leading tokens resident per tier and in any tier, the stream's block size, and whether
the stream is certain. Answered from :class:`bridge.consume.state.CacheState`'s content index
(:mod:`bridge.consume.contentindex`): no engine hash is involved.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from bridge.consume.contentindex import ContentIndex, StreamKey, Walk
from bridge.consume.contentkeys import MAX_TOKEN_ID, lora_of, pack_tokens, query_extras
from bridge.consume.state import CacheState

MAX_PROMPT_TOKENS = 1_000_000
MAX_MEDIA = 4096
FIELDS = (
    "model",
    "lora_name",
    "lora_id",
    "token_ids",
    "media",
    "cache_salt",
    "pods",
    "limit",
    "group",
)


class ScoreError(ValueError):
    """A score request a client must fix (the HTTP server answers 400 with the message)."""


@dataclass(frozen=True)
class ScoreRequest:
    model: str
    token_ids: bytes  # packed (bridge.consume.contentkeys.pack_tokens)
    n_tokens: int
    lora_name: str | None = None
    lora_id: int | None = None
    media: tuple[tuple[str, int, int], ...] = ()
    cache_salt: str | None = None
    pods: tuple[str, ...] | None = None
    limit: int | None = None  # the first rows of the answer only
    group: bool = False  # the answer as groups of streams with equal counts (score_groups)


def _int(v: Any) -> bool:
    return type(v) is int


def make_request(
    model: Any,
    token_ids: Any,
    lora_name: Any = None,
    lora_id: Any = None,
    media: Any = None,
    cache_salt: Any = None,
    pods: Any = None,
    limit: Any = None,
    group: Any = None,
) -> ScoreRequest:
    """A validated :class:`ScoreRequest`; :class:`ScoreError` says what is wrong."""
    if not isinstance(model, str) or not model:
        raise ScoreError('"model" is required: the model name the pods serve (a string)')
    if not isinstance(token_ids, list):
        raise ScoreError('"token_ids" is required: the prompt\'s token ids (a list of ints)')
    if not token_ids:
        raise ScoreError('"token_ids" is empty: give the prompt\'s token ids')
    if len(token_ids) > MAX_PROMPT_TOKENS:
        raise ScoreError(f'"token_ids": {len(token_ids)} tokens, at most {MAX_PROMPT_TOKENS}')
    packed = pack_tokens(token_ids)  # C speed; the loop below only says what is wrong
    if packed is None:
        for i, t in enumerate(token_ids):
            if not _int(t) or not 0 <= t <= MAX_TOKEN_ID:
                raise ScoreError(
                    f'"token_ids"[{i}] = {t!r}: token ids are ints in 0..{MAX_TOKEN_ID}'
                )
        raise ScoreError('"token_ids": not a list of token ids')  # pragma: no cover
    if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
        raise ScoreError('"lora_name" must be a non-empty string (the adapter\'s name) or null')
    if lora_id is not None and (not _int(lora_id) or lora_id < 0):
        raise ScoreError('"lora_id" must be a non-negative int (releases before 0.14) or null')
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ScoreError('"cache_salt" must be a non-empty string or null')
    items: list[tuple[str, int, int]] = []
    if media is not None:
        if not isinstance(media, list) or len(media) > MAX_MEDIA:
            raise ScoreError(f'"media" must be a list (at most {MAX_MEDIA}) of multimodal inputs')
        for i, m in enumerate(media):
            if not isinstance(m, dict) or set(m) - {"identifier", "offset", "length"}:
                raise ScoreError(
                    f'"media"[{i}]: give {{"identifier": str, "offset": int, "length": int}}'
                )
            ident, off, length = m.get("identifier"), m.get("offset"), m.get("length")
            if not isinstance(ident, str) or not ident:
                raise ScoreError(f'"media"[{i}].identifier: the input\'s hash or uuid (a string)')
            if not _int(off) or not _int(length) or off < 0 or length < 1:
                raise ScoreError(
                    f'"media"[{i}]: offset (>= 0) and length (>= 1) are ints, in prompt tokens'
                )
            if off + length > len(token_ids):
                raise ScoreError(f'"media"[{i}] ends past the prompt ({len(token_ids)} tokens)')
            items.append((ident, off, length))
    pod_names: tuple[str, ...] | None = None
    if pods is not None:
        if not isinstance(pods, list) or not all(isinstance(p, str) and p for p in pods):
            raise ScoreError('"pods" must be a list of pod names, or null for every pod')
        pod_names = tuple(dict.fromkeys(pods))
    if limit is not None and (not _int(limit) or limit < 1):
        raise ScoreError('"limit" must be a positive int (the most rows to answer) or null')
    if group is not None and type(group) is not bool:
        raise ScoreError('"group" must be true (answer groups of streams), false or null')
    if group and limit is not None:
        raise ScoreError('"limit" is for the rows; a grouped answer ("group": true) has no limit')
    return ScoreRequest(
        model,
        packed,
        len(token_ids),
        lora_name,
        lora_id,
        tuple(items),
        cache_salt,
        pod_names,
        limit,
        bool(group),
    )


def parse_body(doc: Any, raw: bytes | None = None) -> ScoreRequest:
    """A decoded JSON body -> :class:`ScoreRequest`. JSON ``true``/``false`` among the token
    ids are refused (Python takes them for ints); with the ``raw`` body that check is only
    made when the body holds such a literal."""
    if not isinstance(doc, dict):
        raise ScoreError('body must be a JSON object: {"model": ..., "token_ids": [...]}')
    unknown = set(doc) - set(FIELDS)
    if unknown:
        raise ScoreError(f"unknown field(s) {sorted(unknown)}; accepted: {', '.join(FIELDS)}")
    tokens = doc.get("token_ids")
    if isinstance(tokens, list) and (raw is None or _may_hold_bools(raw)):
        for i, t in enumerate(tokens):
            if type(t) is bool:
                raise ScoreError(f'"token_ids"[{i}] = {t!r}: token ids are ints')
    return make_request(**{k: doc.get(k) for k in FIELDS})


def _may_hold_bools(raw: bytes) -> bool:
    """Whether the ``token_ids`` of a JSON text may hold ``true`` or ``false``: searched from
    each ``"token_ids"`` to the next ``]`` (the whole text when the key is not spelled so),
    with the digits, commas and blanks taken out first (3x faster; deleting can only add
    matches, which the caller's exact check then clears). A list of ints ends at its first
    ``]``; one holding anything else fails to pack, and :func:`make_request` then names the
    first item that is not an int, bools included."""
    at = raw.find(b'"token_ids"')
    if at < 0:
        return _holds_bools(raw)
    while at >= 0:
        end = raw.find(b"]", at)
        if end < 0:
            end = len(raw)
        if _holds_bools(raw[at:end]):
            return True
        at = raw.find(b'"token_ids"', end)  # a list of ints holds no quote: search on after it
    return False


def _holds_bools(text: bytes) -> bool:
    letters = text.translate(None, b"0123456789, ")
    return b"true" in letters or b"false" in letters


def _index_and_filter(
    state: CacheState, req: ScoreRequest
) -> tuple[ContentIndex, tuple[int, int] | None]:
    """The state's content index, and the masks of ``req.pods``' streams (None: every pod)."""
    content = state.content
    if content is None:
        raise ScoreError("this state keeps no content index (CacheState(content=False))")
    if req.pods is None:
        return content, None
    wanted = set(req.pods)
    keys = [k for k in state.streams if k[0] in wanted]
    missing = wanted - {k[0] for k in keys}
    if missing:
        raise ScoreError(f"unknown pod(s) {sorted(missing)}: GET /pods lists the pods")
    return content, content.stream_mask(keys)


def score(state: CacheState, req: ScoreRequest) -> list[dict[str, Any]]:
    """Per stream of ``req.model``: ``{pod, dp_rank, block_size, tokens: {tier: n},
    any_tier_tokens, uncertain}``, most leading tokens first, certain before uncertain, then
    by (pod, rank). Streams of ``req.pods`` are listed even at 0; otherwise a stream with
    nothing of the prompt is listed only if it is uncertain. :class:`ScoreError` for a pod
    in ``req.pods`` that the state does not know. ``req.limit``: the first rows only.
    Rows with equal tier counts share one ``tokens`` dict: copy it before changing it."""
    content, only = _index_and_filter(state, req)
    media, salt = req.media, req.cache_salt

    def extras(n_blocks: int, block_size: int) -> list[bytes] | None:
        return query_extras(n_blocks, block_size, media, salt)

    lora = lora_of(req.lora_name, req.lora_id)
    streams = state.streams
    unc = {key for key, st in streams.items() if st.uncertain}
    merged = req.lora_name is not None and req.lora_id is not None
    walks = content.walk(req.model, lora, req.token_ids, extras, only)
    limit = req.limit
    if merged or len(walks) > 1:
        rows = _ranked(state, req, walks, extras, only, unc)
        return rows if limit is None else rows[:limit]
    rows: list[dict[str, Any]] = []
    found = 0  # the streams answered
    if walks:
        # One walk: its drops are the answer's groups of equal length, each in (pod, rank)
        # order; longest first, and in each the certain streams before the uncertain.
        bs, stream_drops, slot_drops = walks[0]
        along = content.tiers_along(bs, slot_drops)
        left = limit
        append = rows.append
        for n, mask in reversed(stream_drops):
            if left is not None and left <= 0:
                break
            if not n or not mask:
                continue
            t = n * bs
            keys = content.keys_of(mask)
            found |= mask
            for flag, part, tokens in _split(keys, along(mask), unc):
                if left is not None:
                    if left <= 0:
                        break
                    part, tokens = part[:left], tokens[:left]
                    left -= len(part)
                # A copy of the group's row, then its own values: cheaper than a literal.
                copy = _row(None, None, bs, None, t, flag).copy
                for key, tiers in zip(part, tokens, strict=True):
                    r = copy()
                    r["pod"], r["dp_rank"] = key
                    r["tokens"] = tiers
                    append(r)
    if limit is not None and len(rows) >= limit:
        return rows
    rows += _zero_rows(state, req, _Listed(content, found), unc)
    return rows if limit is None else rows[:limit]


class _Listed:
    """Whether a stream is in a stream mask (the groups answered): no set of their keys."""

    def __init__(self, content: ContentIndex, streams: int) -> None:
        self.content = content
        self.streams = streams

    def __contains__(self, key: object) -> bool:
        s = self.content.streams.get(key)  # type: ignore[call-overload]
        return s is not None and self.streams >> s.bit & 1 == 1


def _row(
    pod: str | None, rank: int | None, bs: int, tokens: Any, n_any: int, flag: bool
) -> dict[str, Any]:
    return {
        "pod": pod,
        "dp_rank": rank,
        "block_size": bs,
        "tokens": tokens,
        "any_tier_tokens": n_any,
        "uncertain": flag,
    }


def _split(
    group: list[StreamKey], tiers: list[dict[str, int]], unc: set[StreamKey]
) -> list[tuple[bool, list[StreamKey], list[dict[str, int]]]]:
    """A group's streams (and their tiers, in step): the certain ones, then the uncertain."""
    if not unc or unc.isdisjoint(group):
        return [(False, group, tiers)]
    flags = [k in unc for k in group]
    return [
        (
            flag,
            [k for k, f in zip(group, flags, strict=True) if f is flag],
            [t for t, f in zip(tiers, flags, strict=True) if f is flag],
        )
        for flag in (False, True)
    ]


def _zero_rows(
    state: CacheState, req: ScoreRequest, found: Container[StreamKey], unc: set[StreamKey]
) -> list[dict[str, Any]]:
    """The rows of the streams listed at 0: those of ``req.pods``, or the uncertain ones of
    the model; certain first, then by (pod, rank)."""
    if req.pods is not None:
        wanted = set(req.pods)
        keys = [k for k in state.streams if k[0] in wanted and k not in found]
    else:
        models = state.models
        keys = [k for k in unc if k not in found and models.get(k[0]) == req.model]
    content = state.content
    assert content is not None
    out = []
    for key in sorted(keys, key=lambda k: (k in unc, k)):
        cs = content.streams.get(key)
        out.append(
            {
                "pod": key[0],
                "dp_rank": key[1],
                "block_size": cs.block_size if cs else 0,
                "tokens": {},
                "any_tier_tokens": 0,
                "uncertain": key in unc,
            }
        )
    return out


def _ranked(
    state: CacheState,
    req: ScoreRequest,
    walks: list[Walk],
    extras: Any,
    only: tuple[int, int] | None,
    unc: set[StreamKey],
) -> list[dict[str, Any]]:
    """The answer merged from several walks (block sizes; the LoRA's name and its id), each
    stream's longest, ranked by a sort."""
    content = state.content
    assert content is not None
    found: dict[StreamKey, list] = {}
    runs = [walks]
    if req.lora_name is not None and req.lora_id is not None:
        # Releases before 0.14 name the adapter by id only: a fleet can hold both kinds.
        runs.append(content.walk(req.model, req.lora_id, req.token_ids, extras, only))
    for run in runs:
        for bs, stream_drops, slot_drops in run:
            tiers = content.tiers_of(bs, slot_drops)
            for n, mask in stream_drops:
                if n and mask:
                    t = n * bs
                    for key in content.keys_of(mask):
                        entry = found.get(key)
                        if entry is None or entry[1] < t:
                            found[key] = [bs, t, tiers[key]]
    order = sorted(
        (
            (-2 * n_any + (key in unc), key, bs, n_any, tiers)
            for key, (bs, n_any, tiers) in found.items()
        )
    )
    rows = [
        {
            "pod": key[0],
            "dp_rank": key[1],
            "block_size": bs,
            "tokens": tiers,
            "any_tier_tokens": n_any,
            "uncertain": key in unc,
        }
        for _, key, bs, n_any, tiers in order
    ]
    return rows + _zero_rows(state, req, found, unc)


def score_groups(state: CacheState, req: ScoreRequest) -> list[dict[str, Any]]:
    """:func:`score`'s answer grouped: one ``{block_size, tokens: {tier: n}, any_tier_tokens,
    uncertain, streams: [(pod, dp_rank), ...]}`` per set of streams whose rows would be equal
    but for the stream, ordered by (most leading tokens, certain first, first stream); the
    streams of each in (pod, rank) order. The same streams and counts as the rows, built from
    the walk's masks without a row per stream (``req.limit`` does not apply)."""
    content, only = _index_and_filter(state, req)
    merged = req.lora_name is not None and req.lora_id is not None
    if merged or len(content.sizes.get(req.model, ())) > 1:  # several walks: by the rows
        return group_rows(score(state, req))
    media, salt = req.media, req.cache_salt
    walks = content.walk(
        req.model,
        lora_of(req.lora_name, req.lora_id),
        req.token_ids,
        lambda nb, bs: query_extras(nb, bs, media, salt),
        only,
    )
    unc = {key for key, st in state.streams.items() if st.uncertain}
    if not walks:  # no block of the prompt is held (or fills a block): the zero rows only
        return group_rows(_zero_rows(state, req, _Listed(content, 0), unc))
    unc_mask = content.stream_mask(unc)[1] if unc else 0
    bs, stream_drops, slot_drops = walks[0]
    tier_parts = content.tier_parts(bs, slot_drops)
    parts: list[tuple[int, bool, int, dict[str, int]]] = []
    found = 0
    for n, mask in stream_drops:  # streams of equal length, split by their tiers' counts
        if not n or not mask:
            continue
        found |= mask
        t = n * bs
        rest = mask
        for in_part, tiers in tier_parts:
            x = rest & in_part
            if not x:
                continue
            if x & ~unc_mask:
                parts.append((t, False, x & ~unc_mask, tiers))
            if x & unc_mask:
                parts.append((t, True, x & unc_mask, tiers))
            rest ^= x
            if not rest:
                break
    groups = [
        (-t, flag, keys, tiers) for t, flag, x, tiers in parts for keys in (content.keys_of(x),)
    ]
    groups.sort(key=lambda g: (g[0], g[1], g[2][0]))
    out = [
        {
            "block_size": bs,
            "tokens": tiers,
            "any_tier_tokens": -t,
            "uncertain": flag,
            "streams": list(keys),
        }
        for t, flag, keys, tiers in groups
    ]
    return out + group_rows(_zero_rows(state, req, _Listed(content, found), unc))


def group_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows (as :func:`score` answers them) grouped as :func:`score_groups` answers."""
    groups: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        g = (r["block_size"], r["any_tier_tokens"], tuple(r["tokens"].items()), r["uncertain"])
        entry = groups.get(g)
        if entry is None:
            entry = groups[g] = {
                "block_size": r["block_size"],
                "tokens": r["tokens"],
                "any_tier_tokens": r["any_tier_tokens"],
                "uncertain": r["uncertain"],
                "streams": [],
            }
        entry["streams"].append((r["pod"], r["dp_rank"]))
    for entry in groups.values():
        entry["streams"].sort()
    return sorted(
        groups.values(), key=lambda e: (-e["any_tier_tokens"], e["uncertain"], e["streams"][0])
    )
