"""``bridge.consume.score.score`` against a plainly written reference and against the code
before the p99 round (bench/score_before.py), on random fleets; the ``limit`` field; and the grouped
answer (``score_groups``) against the reference's rows grouped."""

from __future__ import annotations

import json
from hashlib import blake2b
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.score_before import score_before
from bridge.consume import contentindex
from bridge.consume.contentkeys import chain, lora_of, pack_tokens, query_extras, root_key
from bridge.consume.score import (
    ScoreError,
    group_rows,
    make_request,
    parse_body,
    score,
    score_groups,
)
from bridge.consume.state import CacheState
from bridge.log.markers import EventsLost, PodRemoved, StreamStarted
from bridge.log.records import Envelope, Record
from bridge.vllm.events import BlockRemoved, BlockStored

MODEL = "m"
PODS = ("a", "b", "c", "d", "e")
MEDIA = ("GPU", "CPU")


def reference(state: CacheState, req) -> list[dict[str, Any]]:
    """Per stream, per slot: the leading blocks of the prompt whose content key the slot
    holds, counted block by block; ranked by a sort on (-tokens, uncertain, pod, rank)."""
    content = state.content
    assert content is not None
    loras = [lora_of(req.lora_name, req.lora_id)]
    if req.lora_name is not None and req.lora_id is not None:
        loras.append(req.lora_id)
    n_tokens = req.n_tokens
    rows = []
    for key, st_ in state.streams.items():
        if req.pods is not None and key[0] not in req.pods:
            continue
        cs = content.streams.get(key)
        best: tuple[int, int, dict[str, int]] | None = None
        if cs is not None and state.models.get(key[0]) == req.model:
            for bs in sorted(content.sizes.get(req.model, ())):
                nb = n_tokens // bs
                if not nb:
                    continue
                extras = query_extras(nb, bs, req.media, req.cache_salt)
                for lora in loras:
                    keys = chain(content.root(req.model, lora, bs), req.token_ids, bs, nb, extras)
                    tiers = {}
                    for slot in cs.slots.values():
                        held = set(slot.held.values())
                        n = 0
                        while n < nb and keys[n] in held:
                            n += 1
                        if n:
                            tiers[slot.name] = n * bs
                    n_any = 0
                    while n_any < nb and any(
                        keys[n_any] in set(s.held.values()) for s in cs.slots.values()
                    ):
                        n_any += 1
                    if n_any and (best is None or best[1] < n_any * bs):
                        best = (bs, n_any * bs, dict(sorted(tiers.items())))
        unc = bool(st_.uncertain)
        if best is None:
            if req.pods is None and not unc:
                continue
            best = (cs.block_size if cs else 0, 0, {})
        bs, n_any, tiers = best
        rows.append(
            {
                "pod": key[0],
                "dp_rank": key[1],
                "block_size": bs,
                "tokens": tiers,
                "any_tier_tokens": n_any,
                "uncertain": unc,
            }
        )
    rows.sort(key=lambda r: (-2 * r["any_tier_tokens"] + r["uncertain"], r["pod"], r["dp_rank"]))
    return rows if req.limit is None else rows[: req.limit]


# A fleet: each op stores a prefix of one of a few shared prompts (in one or two tiers),
# removes a stream's blocks, or marks a stream uncertain.
prompts = st.lists(st.lists(st.integers(0, 3), min_size=8, max_size=40), min_size=1, max_size=3)
ops = st.lists(
    st.tuples(
        st.sampled_from(PODS),
        st.integers(0, 1),  # dp rank
        st.sampled_from(("store", "store", "store", "remove", "lost", "restart", "gone")),
        st.integers(0, 2),  # prompt
        st.integers(1, 40),  # tokens of it
        st.sampled_from(MEDIA),
        st.integers(0, 7),  # block to remove
    ),
    max_size=30,
)


def build(
    prompt_list, op_list, sizes, lora: bool, state: CacheState | None = None, seq=None
) -> CacheState:
    """The fleet of ``op_list`` (applied to ``state``, with its ``seq`` per stream, if given);
    a "restart" is a StreamStarted (the stream forgotten), "gone" a PodRemoved."""
    state = CacheState() if state is None else state
    seq = {} if seq is None else seq
    for pod, rank, kind, p, n, medium, which in op_list:
        toks = prompt_list[p % len(prompt_list)]
        bs = sizes[PODS.index(pod) % len(sizes)]
        k = (pod, rank)
        seq[k] = seq.get(k, 0) + 1
        # engine hashes: this pod's own (a salt), chained over the tokens
        hashes = [
            blake2b(f"{pod}{bs}:{toks[: (i + 1) * bs]}".encode(), digest_size=8).digest()
            for i in range(min(n, len(toks)) // bs)
        ]
        if kind == "store" and hashes:
            ev: Any = BlockStored(
                hashes,
                None,
                toks[: len(hashes) * bs],
                bs,
                medium=medium,
                lora_name="ad" if lora and pod in "ab" else None,
                lora_id=7 if lora and pod in "cd" else None,
            )
        elif kind == "remove" and hashes:
            ev = BlockRemoved([hashes[which % len(hashes)]], medium=medium)
        elif kind in ("restart", "gone"):
            mark: Any = StreamStarted(0, "tcp://x") if kind == "restart" else PodRemoved("scaled")
            state.apply(Record(Envelope(pod, MODEL, rank, 1, seq[k], -1, 0.0), mark))
            continue
        elif kind == "lost":
            ev = EventsLost(from_seq=seq[k], to_seq=seq[k], reason="gap")
            seq[k] += 1
            state.apply(Record(Envelope(pod, MODEL, rank, 1, seq[k] - 1, -1, 0.0), ev))
            continue
        else:
            continue
        state.apply(Record(Envelope(pod, MODEL, rank, 1, seq[k], 0, 0.0), ev))
    return state


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt_list=prompts,
    op_list=ops,
    sizes=st.sampled_from([(4,), (4,), (2, 4)]),
    lora=st.booleans(),
    query=st.tuples(st.integers(0, 2), st.integers(1, 40), st.lists(st.integers(0, 3), max_size=8)),
    pods=st.none() | st.lists(st.sampled_from(PODS), min_size=1, max_size=3),
    limit=st.none() | st.integers(1, 6),
    lora_q=st.sampled_from([(None, None), ("ad", None), (None, 7), ("ad", 7)]),
)
def test_score_equals_the_reference_and_the_code_before(
    prompt_list, op_list, sizes, lora, query, pods, limit, lora_q
):
    state = build(prompt_list, op_list, sizes, lora)
    p, n, tail = query
    toks = prompt_list[p % len(prompt_list)][:n] + tail
    known = {k[0] for k in state.streams}
    if pods is not None:
        pods = [x for x in pods if x in known] or None
    req = make_request(MODEL, toks, lora_q[0], lora_q[1], pods=pods, limit=limit)
    got = score(state, req)
    assert got == reference(state, req)
    before = score_before(state, req)
    if limit is not None:
        before = before[:limit]
    # the same rows in the same order, the tiers in the same order (the JSON text)
    assert json.dumps(got) == json.dumps(before)
    # grouped: the same streams and counts, built from the masks (one walk) or the rows
    greq = make_request(MODEL, toks, lora_q[0], lora_q[1], pods=pods, group=True)
    groups = score_groups(state, greq)
    want = group_rows(reference(state, greq))
    assert json.dumps(groups) == json.dumps(want)
    assert sum(len(g["streams"]) for g in groups) == len(score(state, greq))


def test_groups_are_sets_of_equal_rows():
    """Hand-made: five pods; a, b hold 8 tokens on GPU, c holds 8 on GPU and 4 on CPU, d
    holds 4, e is uncertain and holds 8; f holds nothing of the prompt."""
    state = CacheState()
    prompt = list(range(40))

    def store(pod: str, n: int, medium: str = "GPU", seq: int = 1) -> None:
        hashes = [f"{pod}{j}".encode() for j in range(n // 4)]
        ev = BlockStored(hashes, None, prompt[:n], 4, medium=medium)
        state.apply(Record(Envelope(pod, MODEL, 0, 1, seq, 0, 0.0), ev))

    for pod, n in (("a", 8), ("b", 8), ("c", 8), ("d", 4), ("e", 8)):
        store(pod, n)
    store("c", 4, "CPU", 2)
    lost = EventsLost(from_seq=2, to_seq=2, reason="gap")
    state.apply(Record(Envelope("e", MODEL, 0, 1, 2, -1, 0.0), lost))
    ev = BlockStored([b"f0"], None, [9, 9, 9, 9], 4, medium="GPU")
    state.apply(Record(Envelope("f", MODEL, 0, 1, 1, 0, 0.0), ev))
    groups = score_groups(state, make_request(MODEL, prompt, group=True))
    assert [(g["any_tier_tokens"], g["tokens"], g["uncertain"], g["streams"]) for g in groups] == [
        (8, {"GPU": 8}, False, [("a", 0), ("b", 0)]),
        (8, {"CPU": 4, "GPU": 8}, False, [("c", 0)]),
        (8, {"GPU": 8}, True, [("e", 0)]),
        (4, {"GPU": 4}, False, [("d", 0)]),
    ]
    assert all(g["block_size"] == 4 for g in groups)
    # pods asked for are listed even at 0, as the rows are
    asked = score_groups(state, make_request(MODEL, prompt, pods=["d", "f"], group=True))
    assert [(g["any_tier_tokens"], g["streams"]) for g in asked] == [
        (4, [("d", 0)]),
        (0, [("f", 0)]),
    ]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"group": 1}, '"group" must be true'),
        ({"group": "yes"}, '"group" must be true'),
        ({"group": True, "limit": 3}, '"limit" is for the rows'),
    ],
)
def test_bad_group(body, message):
    with pytest.raises(ScoreError, match=message):
        parse_body({"model": MODEL, "token_ids": [1, 2], **body})


def test_group_false_or_null_is_rows():
    for v in (False, None):
        assert parse_body({"model": MODEL, "token_ids": [1], "group": v}).group is False
    assert parse_body({"model": MODEL, "token_ids": [1], "group": True, "limit": None}).group


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt_list=prompts,
    first=ops,
    then=ops,
    queries=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 40), st.lists(st.integers(0, 3), max_size=4)),
        min_size=1,
        max_size=4,
    ),
    memo=st.sampled_from([1, 2, 4096]),
    dense=st.sampled_from([0, 2, 24]),
)
def test_score_after_more_changes_equals_the_reference(
    prompt_list, first, then, queries, memo, dense
):
    """Memos filled by queries, then streams added, forgotten (bits freed and given again,
    stream bits renumbered in key order) and changed: the next answers are still right,
    with memos of any size (the oldest entries evicted), masks mapped to streams either way."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(contentindex, "MEMO", memo)
        mp.setattr(contentindex, "DENSE", dense)  # 0: every mask mapped tier by tier
        seq: dict = {}
        state = build(prompt_list, first, (4,), False, seq=seq)
        for ops_now in ([], then):
            build(prompt_list, ops_now, (4,), False, state, seq)
            for p, n, tail in queries:
                toks = prompt_list[p % len(prompt_list)][:n] + tail
                req = make_request(MODEL, toks)
                got = score(state, req)
                assert got == reference(state, req)
                assert json.dumps(got) == json.dumps(score_before(state, req))
        content = state.content
        assert content is not None
        assert all(len(m) <= max(memo, 1) for m in (content._streams_of, content._stream_keys))


def test_keys_of_is_sorted_before_a_walk_renumbers():
    """A stream added with a key below the others': until a walk gives the bits again in
    key order, keys_of sorts; after it, the bits ascend with the keys."""
    state = CacheState()
    prompt = list(range(8))
    for pod in ("b", "c", "a"):
        ev = BlockStored([f"{pod}0".encode()], None, prompt[:4], 4, medium="GPU")
        state.apply(Record(Envelope(pod, MODEL, 0, 1, 1, 0, 0.0), ev))
    content = state.content
    assert content is not None
    everyone = content.stream_mask(list(state.streams))[1]  # renumbers
    assert content.keys_of(everyone) == [("a", 0), ("b", 0), ("c", 0)]
    assert [content.streams[(p, 0)].bit for p in "abc"] == [0, 1, 2]
    ev = BlockStored([b"A0"], None, prompt[:4], 4, medium="GPU")
    state.apply(Record(Envelope("A", MODEL, 0, 1, 1, 0, 0.0), ev))  # "A" < "a": out of order
    assert content.streams[("A", 0)].bit == 3
    assert content.keys_of(everyone | 1 << 3) == [("A", 0), ("a", 0), ("b", 0), ("c", 0)]
    rows = score(state, make_request(MODEL, prompt))
    assert [r["pod"] for r in rows] == ["A", "a", "b", "c"]
    assert [content.streams[(p, 0)].bit for p in "Aabc"] == [0, 1, 2, 3]


def test_limit_keeps_the_first_rows():
    state = CacheState()
    prompt = list(range(40))
    for i, pod in enumerate(PODS):
        n = 4 * (i + 1)
        hashes = [f"{pod}{j}".encode() for j in range(n // 4)]
        ev = BlockStored(hashes, None, prompt[:n], 4, medium="GPU")
        state.apply(Record(Envelope(pod, MODEL, 0, 1, 1, 0, 0.0), ev))
    full = score(state, make_request(MODEL, prompt))
    assert [r["pod"] for r in full] == ["e", "d", "c", "b", "a"]
    for limit in (1, 2, 5, 9):
        assert score(state, make_request(MODEL, prompt, limit=limit)) == full[:limit]
    assert state.score(MODEL, prompt, limit=2) == full[:2]
    assert score(state, make_request(MODEL, prompt, pods=["a", "b"], limit=1)) == [full[3]]


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "3", [1]])
def test_bad_limit(limit):
    with pytest.raises(ScoreError, match='"limit" must be a positive int'):
        parse_body({"model": MODEL, "token_ids": [1, 2], "limit": limit})


def test_limit_null_is_no_limit():
    assert parse_body({"model": MODEL, "token_ids": [1], "limit": None}).limit is None
    assert parse_body({"model": MODEL, "token_ids": [1], "limit": 3}).limit == 3


def test_content_keys_are_unchanged():
    """Pinned: the keys ingest and the kv-events log define (BLAKE2b-16 of parent key +
    tokens little-endian + extra), whatever way the code feeds the hash."""
    root = root_key("m", None, 4)
    keys = chain(root, pack_tokens(list(range(8))), 4, 2, [b"", b"x"])
    assert root.hex() == "a862052ecd10e2ca7e7228fb507206d7"
    assert [k.hex() for k in keys] == [
        "5666dcf0e369f8375f610a7c83030968",
        "3b9bf9cb25926fe14fd100845a3ed756",
    ]
    plain = blake2b(root + pack_tokens([0, 1, 2, 3]), digest_size=16).digest()
    assert keys[0] == plain
    assert keys[1] == blake2b(plain + pack_tokens([4, 5, 6, 7]) + b"x", digest_size=16).digest()


@pytest.mark.parametrize("text", ["[1, true]", "[1,false ]", '{"token_ids": [true]}'])
def test_bools_among_token_ids_are_found_in_the_raw_body(text):
    body = '{"model": "m", "token_ids": ' + text.split(":")[-1].rstrip("}") + "}"
    with pytest.raises(ScoreError, match="token ids are ints"):
        parse_body(json.loads(body), body.encode())


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "token_ids": [1, true], "group": true}',
        b'{"model": "\\"token_ids", "token_ids": [1,false]}',
        b'{"model": "m", "token\\u005fids": [true, 2]}',  # the key spelled with an escape
        b'{"model": "m", "token_ids": [1, 2], "token_ids": [3, true]}',  # the last one counts
    ],
)
def test_bools_are_found_whatever_else_the_body_holds(body):
    with pytest.raises(ScoreError, match="token ids are ints"):
        parse_body(json.loads(body), body)


def test_true_elsewhere_in_the_body_is_not_a_bool_token():
    body = b'{"model": "m", "token_ids": [1, 2, 3], "group": true}'
    assert parse_body(json.loads(body), body).group is True


def _staircase(pods: int) -> tuple[CacheState, list[int]]:
    """Pod i holds the first i + 1 blocks (of 1 token) of one prompt, in the GPU tier."""
    state = CacheState()
    prompt = list(range(pods))
    for i in range(pods):
        pod = f"p{i:03d}"
        hashes = [f"{pod}:{j}".encode() for j in range(i + 1)]
        ev = BlockStored(hashes, None, prompt[: i + 1], 1, medium="GPU")
        state.apply(Record(Envelope(pod, MODEL, 0, 1, 1, 0, 0.0), ev))
    return state, prompt


def test_more_tier_parts_than_a_byte_numbers():
    """300 streams of 300 lengths: 300 parts of equal tiers, more than tiers_along's byte per
    stream can tell apart; the answer is still the reference's."""
    state, prompt = _staircase(300)
    req = make_request(MODEL, prompt)
    rows = score(state, req)
    assert rows == reference(state, req)
    assert [r["tokens"] for r in rows[:2]] == [{"GPU": 300}, {"GPU": 299}]


def test_tiers_along_before_a_walk_renumbers():
    """Drops with a stream whose bit is out of key order (no walk since it came): tiers_along
    still answers in keys_of's order (sorted)."""
    state, prompt = _staircase(5)
    ev = BlockStored([b"A"], None, prompt[:1], 1, medium="CPU")  # "A" < "p000": out of order
    state.apply(Record(Envelope("A", MODEL, 0, 1, 1, 0, 0.0), ev))
    content = state.content
    assert content is not None
    slots = streams = 0
    for s in content.streams.values():
        streams |= 1 << s.bit
        for slot in s.slots.values():
            slots |= 1 << slot.bit
    assert content.streams[("A", 0)].bit == 5
    drops = [(1, slots)]  # as if every slot held the first block only
    tiers = content.tiers_of(1, drops)
    assert (
        content.tiers_along(1, drops)(streams)
        == [tiers[k] for k in content.keys_of(streams)]
        == [{"CPU": 1}] + [{"GPU": 1}] * 5
    )
