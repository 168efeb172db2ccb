"""Scoring pods for a prompt by its token ids: the request, its validation, the answer (pure).

``{model, lora_name?, lora_id?, token_ids, media?, cache_salt?, pods?}`` -> per (pod, dp_rank)
of that model holding a leading block of the prompt (and every stream of the pods asked for):
the leading tokens resident per tier and in any tier, the stream's block size, and whether
the stream is certain. Answered from :class:`bridge.state.CacheState`'s content index
(:mod:`bridge.contentindex`): no engine hash is involved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bridge.contentkeys import MAX_TOKEN_ID, lora_of, pack_tokens, query_extras
from bridge.state import CacheState, medium_name

MAX_PROMPT_TOKENS = 1_000_000
MAX_MEDIA = 4096
FIELDS = ("model", "lora_name", "lora_id", "token_ids", "media", "cache_salt", "pods")


class ScoreError(ValueError):
    """A score request a client must fix (the HTTP server answers 400 with the message)."""


@dataclass(frozen=True)
class ScoreRequest:
    model: str
    token_ids: bytes  # packed (bridge.contentkeys.pack_tokens)
    n_tokens: int
    lora_name: str | None = None
    lora_id: int | None = None
    media: tuple[tuple[str, int, int], ...] = ()
    cache_salt: str | None = None
    pods: tuple[str, ...] | None = None


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
    return ScoreRequest(
        model, packed, len(token_ids), lora_name, lora_id, tuple(items), cache_salt, pod_names
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
    if isinstance(tokens, list) and (raw is None or b"true" in raw or b"false" in raw):
        for i, t in enumerate(tokens):
            if type(t) is bool:
                raise ScoreError(f'"token_ids"[{i}] = {t!r}: token ids are ints')
    return make_request(**{k: doc.get(k) for k in FIELDS})


def tier_name(tier: tuple[str | None, int | None]) -> str:
    """A tier as the answer names it: the medium ("engine" without one), and ``/<group>``
    for KV-cache groups other than 0."""
    medium, group = tier
    name = medium_name(medium)
    return name if not group else f"{name}/{group}"


def score(state: CacheState, req: ScoreRequest) -> list[dict[str, Any]]:
    """Per stream: ``{pod, dp_rank, block_size, tokens: {tier: n}, any_tier_tokens,
    uncertain}``, most leading tokens first. Streams of ``req.pods`` are listed even at 0;
    otherwise a stream with nothing of the prompt is listed only if it is uncertain.
    :class:`ScoreError` for a pod in ``req.pods`` that the state does not know."""
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
    found = content.score(req.model, lora, req.token_ids, extras, only)
    if req.lora_name is not None and req.lora_id is not None:
        # Releases before 0.14 name the adapter by id only: a fleet can hold both kinds.
        for key, sc in content.score(req.model, req.lora_id, req.token_ids, extras, only).items():
            if key not in found or found[key].any_tier < sc.any_tier:
                found[key] = sc
    streams, models = state.streams, state.models
    rows = [
        _row(key, models.get(key[0]), streams.get(key), sc.block_size, sc.tiers, sc.any_tier)
        for key, sc in found.items()
    ]
    for key, st in streams.items():
        if key in found:
            continue
        if req.pods is not None:
            if key[0] not in req.pods:
                continue
        elif not st.uncertain or models.get(key[0]) != req.model:
            continue
        cs = content.streams.get(key)
        rows.append(_row(key, models.get(key[0]), st, cs.block_size if cs else 0, {}, 0))
    rows.sort(key=_rank)
    return rows


def _rank(r: dict[str, Any]) -> tuple[int, bool, str, int]:
    return (-r["any_tier_tokens"], r["uncertain"], r["pod"], r["dp_rank"])


_TIER_NAMES: dict[tuple[str | None, int | None], str] = {}


def _row(
    key: tuple[str, int],
    model: str | None,
    st: Any,
    bs: int,
    tiers: dict[Any, int],
    any_blocks: int,
) -> dict[str, Any]:
    names = _TIER_NAMES
    if len(tiers) > 1:
        tiers = dict(sorted(tiers.items(), key=_order))
    by_tier = {}
    for t, n in tiers.items():
        name = names.get(t)
        if name is None:
            name = names[t] = tier_name(t)
        by_tier[name] = n * bs
    return {
        "pod": key[0],
        "dp_rank": key[1],
        "model": model,
        "block_size": bs,
        "tokens": by_tier,
        "any_tier_tokens": any_blocks * bs,
        "uncertain": bool(st.uncertain) if st is not None else False,
    }


def _order(kv: tuple[Any, int]) -> tuple[str, str]:
    return (str(kv[0][0]), str(kv[0][1]))
