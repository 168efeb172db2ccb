"""Scoring prompts by token ids: content keys, the index kept by CacheState, the query."""

from __future__ import annotations

import pytest

from bridge.consume.contentkeys import pack_tokens, query_extras, stored_extra
from bridge.consume.score import ScoreError, parse_body
from bridge.consume.state import CacheState
from bridge.log.markers import EventsLost, PodRemoved, PublisherRestarted
from bridge.log.records import Envelope, Record
from bridge.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4
PROMPT = list(range(100, 124))  # 6 blocks of 4


def rec(event, pod="p", rank=0, seq=0, index=0, epoch=1, model="m"):
    return Record(Envelope(pod, model, rank, epoch, seq, index, 0.0), event)


def h(n: int) -> bytes:
    return n.to_bytes(8, "big")


class Feed:
    """Records for one stream, numbered in order."""

    def __init__(self, state: CacheState, pod: str = "p", model: str = "m", rank: int = 0):
        self.state, self.pod, self.model, self.rank, self.seq = state, pod, model, rank, 0

    def __call__(self, event) -> None:
        self.seq += 1
        self.state.apply(rec(event, self.pod, self.rank, self.seq, 0, model=self.model))


def stored(hashes, parent, tokens, bs=BS, **kw):
    return BlockStored(
        [h(x) for x in hashes], None if parent is None else h(parent), tokens, bs, **kw
    )


def tokens_of(result, pod="p", rank=0):
    for row in result:
        if (row["pod"], row["dp_rank"]) == (pod, rank):
            return row["any_tier_tokens"], row["tokens"]
    return 0, {}


def test_runs_chain_across_stores_and_stop_at_the_first_missing_block():
    state = CacheState()
    feed = Feed(state)
    feed(stored([1, 2], None, PROMPT[:8], medium="GPU"))
    feed(stored([3], 2, PROMPT[8:12], medium="GPU"))
    assert tokens_of(state.score("m", PROMPT)) == (12, {"GPU": 12})
    feed(BlockRemoved([h(2)], medium="GPU"))
    assert tokens_of(state.score("m", PROMPT)) == (4, {"GPU": 4})
    # Another prompt sharing the first block only
    other = PROMPT[:4] + [7, 7, 7, 7]
    assert tokens_of(state.score("m", other)) == (4, {"GPU": 4})
    assert state.score("other-model", PROMPT) == []


def test_keys_do_not_depend_on_engine_hashes():
    """Two pods hash the same prompt differently (other NONE_HASH, other algorithm)."""
    state = CacheState()
    Feed(state, "a")(stored([1, 2, 3], None, PROMPT[:12], medium="GPU"))
    Feed(state, "b")(stored([91, 92], None, PROMPT[:8], medium="GPU"))
    rows = state.score("m", PROMPT)
    assert [(r["pod"], r["any_tier_tokens"]) for r in rows] == [("a", 12), ("b", 8)]


def test_lora_extra_keys_and_block_size_separate_caches():
    state = CacheState()
    Feed(state, "lora")(
        stored([1, 2], None, PROMPT[:8], lora_name="ad", extra_keys=[["ad"], ["ad"]])
    )
    Feed(state, "salted")(stored([1, 2], None, PROMPT[:8], extra_keys=[["salt1"], None]))
    Feed(state, "bs8")(stored([1], None, PROMPT[:8], bs=8))
    assert tokens_of(state.score("m", PROMPT), "lora") == (0, {})
    assert tokens_of(state.score("m", PROMPT, lora_name="ad"), "lora")[0] == 8
    assert tokens_of(state.score("m", PROMPT, lora_name="other"), "lora")[0] == 0
    assert tokens_of(state.score("m", PROMPT), "salted")[0] == 0
    assert tokens_of(state.score("m", PROMPT, cache_salt="salt1"), "salted")[0] == 8
    assert tokens_of(state.score("m", PROMPT, cache_salt="salt2"), "salted")[0] == 0
    rows = {r["pod"]: r for r in state.score("m", PROMPT)}
    assert rows["bs8"]["block_size"] == 8 and rows["bs8"]["any_tier_tokens"] == 8


def test_media_keys_match_vllms_extra_keys():
    """An image at tokens 6..13 (length 8) of blocks of 4: blocks 1, 2, 3 list it, at offsets
    2, -2, -6 from their starts (vLLM's (identifier, offset - start))."""
    ev_keys = [None, [["img", 2]], [["img", -2]], [["img", -6]]]
    assert query_extras(4, BS, [("img", 6, 8)]) == [stored_extra(e, None) for e in ev_keys]
    state = CacheState()
    Feed(state)(stored([1, 2, 3, 4], None, PROMPT[:16], extra_keys=ev_keys))
    media = [{"identifier": "img", "offset": 6, "length": 8}]
    assert tokens_of(state.score("m", PROMPT, media=media))[0] == 16
    assert tokens_of(state.score("m", PROMPT))[0] == 4  # without the image: block 0 only
    other = [{"identifier": "img2", "offset": 6, "length": 8}]
    assert tokens_of(state.score("m", PROMPT, media=other))[0] == 4


def test_placeholders_take_the_keys_of_the_streams_other_tiers():
    state = CacheState()
    feed = Feed(state)
    feed(stored([1, 2, 3], None, PROMPT[:12], medium="GPU"))
    # Offloaded after the GPU evicted block 1: its key is remembered
    feed(BlockRemoved([h(1)], medium="GPU"))
    feed(BlockStored([h(1), h(2), h(3)], None, [], 0, medium="CPU"))
    feed(BlockStored([h(77)], None, [], 0, medium="CPU"))  # never keyed: skipped
    any_tokens, tiers = tokens_of(state.score("m", PROMPT))
    assert tiers == {"CPU": 12, "GPU": 0} or tiers == {"CPU": 12}
    assert any_tokens == 12
    assert state.content.skipped["unknown_hash"] == 1


def test_any_tier_spans_tiers():
    state = CacheState()
    feed = Feed(state)
    feed(stored([1, 2, 3, 4], None, PROMPT[:16], medium="GPU"))
    feed(BlockStored([h(3), h(4)], None, [], 0, medium="CPU"))
    feed(BlockRemoved([h(3)], medium="GPU"))
    feed(BlockRemoved([h(4)], medium="GPU"))
    any_tokens, tiers = tokens_of(state.score("m", PROMPT))
    assert (any_tokens, tiers) == (16, {"GPU": 8})  # CPU holds 2, 3 but not the first


def test_misaligned_and_bad_blocks_are_counted_and_do_not_break_others():
    state = CacheState()
    feed = Feed(state)
    feed(stored([1, 2], None, PROMPT[:12]))  # Mamba align: tokens span a skipped block
    feed(stored([3], 2, PROMPT[12:16]))  # child of an unkeyed block
    feed(stored([4], None, [1, -5, 2, 3]))  # token ids out of domain
    feed(stored([7], None, PROMPT[:4], extra_keys=[None, ["x"]]))  # not one per block
    assert state.content.skipped == {"misaligned": 3, "unchained": 1, "token_domain": 1}
    assert state.score("m", PROMPT) == []
    assert state.resident_blocks() == 5  # residency by engine hash is unaffected
    feed(stored([5, 6], None, PROMPT[:8]))
    assert tokens_of(state.score("m", PROMPT))[0] == 8


def test_copies_clears_restarts_and_pod_removal():
    state = CacheState()
    feed = Feed(state)
    feed(stored([1, 2], None, PROMPT[:8]))
    feed(stored([1, 2], None, PROMPT[:8]))  # a second copy (count policy)
    feed(BlockRemoved([h(2)]))
    assert tokens_of(state.score("m", PROMPT))[0] == 8
    feed(BlockRemoved([h(2)]))
    assert tokens_of(state.score("m", PROMPT))[0] == 4
    feed(AllBlocksCleared())
    assert state.score("m", PROMPT) == []
    feed(stored([1, 2], None, PROMPT[:8]))
    state.apply(
        rec(PublisherRestarted(old_epoch=1, last_seq=3, first_seq=0), seq=0, index=-1, epoch=2)
    )
    assert state.score("m", PROMPT) == []
    Feed(state, "q")(stored([1], None, PROMPT[:4]))
    state.apply(rec(PodRemoved(reason="gone"), pod="q", index=-1))
    assert state.score("m", PROMPT) == [] and not state.content.slot_holders


def test_uncertain_streams_are_listed_and_pods_filter():
    state = CacheState()
    Feed(state, "a")(stored([1], None, PROMPT[:4]))
    Feed(state, "b")(stored([1], None, PROMPT[:4]))
    Feed(state, "c")(stored([9], None, [1, 1, 1, 1]))
    state.apply(rec(EventsLost(from_seq=5, to_seq=6, reason="gap"), pod="c", index=-1))
    rows = state.score("m", PROMPT)
    assert [(r["pod"], r["any_tier_tokens"], r["uncertain"]) for r in rows] == [
        ("a", 4, False),
        ("b", 4, False),
        ("c", 0, True),
    ]
    rows = state.score("m", PROMPT, pods=["b", "c"])
    assert [(r["pod"], r["any_tier_tokens"]) for r in rows] == [("b", 4), ("c", 0)]
    with pytest.raises(ScoreError, match="unknown pod"):
        state.score("m", PROMPT, pods=["zz"])


def test_many_streams_sharing_a_prefix():
    state = CacheState()
    for i in range(300):
        n = 1 + i % 6
        Feed(state, f"p{i}")(stored(list(range(1, n + 1)), None, PROMPT[: n * BS]))
    rows = state.score("m", PROMPT)
    assert len(rows) == 300
    assert all(r["any_tier_tokens"] == (1 + int(r["pod"][1:]) % 6) * BS for r in rows)


@pytest.mark.parametrize(
    "body, message",
    [
        ([], "JSON object"),
        ({"token_ids": [1]}, '"model" is required'),
        ({"model": "m"}, '"token_ids" is required'),
        ({"model": "m", "token_ids": []}, "empty"),
        ({"model": "m", "token_ids": [1, "2"]}, r'"token_ids"\[1\]'),
        ({"model": "m", "token_ids": [1, 2**32]}, "0..4294967295"),
        ({"model": "m", "token_ids": [True]}, r'"token_ids"\[0\]'),
        ({"model": "m", "token_ids": [1], "lora_name": 3}, "lora_name"),
        ({"model": "m", "token_ids": [1], "pods": "a"}, "pods"),
        ({"model": "m", "token_ids": [1], "media": [{"identifier": "x"}]}, "offset"),
        (
            {
                "model": "m",
                "token_ids": [1],
                "media": [{"identifier": "x", "offset": 0, "length": 5}],
            },
            "ends past the prompt",
        ),  # fmt: skip
        ({"model": "m", "token_ids": [1], "hashes": [1]}, "unknown field"),
    ],
)
def test_bad_requests(body, message):
    with pytest.raises(ScoreError, match=message):
        parse_body(body)


def test_too_long_prompt():
    with pytest.raises(ScoreError, match="at most"):
        parse_body({"model": "m", "token_ids": [0] * 1_000_001})


def test_pack_tokens_domain():
    assert pack_tokens([0, 2**32 - 1]) == b"\0\0\0\0\xff\xff\xff\xff"
    assert pack_tokens([-1]) is None and pack_tokens([2**32]) is None


# --- against the simulator's truth (pure: the model's events applied directly) ------------


def _wire_tiers(tiers: dict, bs: int) -> dict[str, int]:
    from bridge.consume.contentindex import tier_name

    return {tier_name(t): n * bs for t, n in tiers.items()}


def check_against_model(model, prompts, state: CacheState, pod: str = "p") -> int:
    """Every prompt: the state's score of the pod equals the model's resident prefix."""
    bs = model.config.block_size
    checked = 0
    for pr in prompts:
        truth_tiers, truth_any = model.resident_prefix(pr)
        media = [{"identifier": i, "offset": o, "length": n} for i, o, n in pr.media]
        rows = state.score(
            "m",
            list(pr.tokens),
            lora_name=pr.lora[0] if pr.lora else None,
            lora_id=pr.lora[1] if pr.lora else None,  # releases before 0.14 send only the id
            media=media or None,
            cache_salt=pr.salt,
            pods=[pod],
        )
        row = rows[0]
        got = {t: n for t, n in row["tokens"].items() if n}
        assert (row["any_tier_tokens"], got) == (truth_any * bs, _wire_tiers(truth_tiers, bs)), pr
        checked += truth_any > 0
    return checked


RICH = dict(
    capacity=96, lora_names=("ad-a", "ad-b"), lora_prob=0.4, mm_prob=0.5, salt_prob=0.3,
    cpu_offload_prob=0.5, cpu_capacity=64, repeat_prob=0.2, followup_prob=0.5,
)  # fmt: skip


@pytest.mark.parametrize(
    "release, hash_mode, config",
    [
        ("0.33.0", "int", RICH),
        ("0.33.0", "bytes", RICH),
        ("0.33.0", "int", dict(RICH, offload_chunk_blocks=3)),
        ("0.17.0", "bytes", dict(RICH, cpu_offload_prob=0.0)),
        # Before extra_keys (0.17) images and salts are not on the wire: LoRA only
        ("0.13.0", "int", dict(capacity=64, lora_names=("ad",), lora_prob=0.5)),
        ("0.9.0", "signed", dict(capacity=64, lora_names=("ad",), lora_prob=0.5)),
    ],
)
def test_scores_equal_the_simulators_truth(release, hash_mode, config):
    from bridge.simulator.model import ModelConfig, PrefixCacheModel
    from bridge.simulator.publisher import normalized
    from bridge.vllm.releases import as_release

    model = PrefixCacheModel(as_release(release), hash_mode, 7, ModelConfig(**config))
    state = CacheState()
    feed = Feed(state)
    checked = 0
    for step in range(600):
        for ev in model.step():
            feed(normalized(ev, hash_mode))
        if step % 50 == 49:
            checked += check_against_model(model, model.served_prompts(), state)
    assert checked > 50  # prompts with something resident were compared
    assert not state.content.skipped


def test_simulated_events_carry_lora_and_extra_keys_as_vllm():
    """lora_id always, lora_name from 0.14, extra_keys from 0.17: per block the LoRA name,
    then (identifier, offset - block start) of each overlapping image, then the salt (first
    block only)."""
    from bridge.simulator.model import IMAGE_TOKEN, ModelConfig, PrefixCacheModel
    from bridge.vllm.releases import as_release

    cfg = ModelConfig(lora_names=("ad",), lora_prob=1.0, mm_prob=1.0, salt_prob=1.0)
    for release, has_name, has_extra in [("0.13.0", False, False), ("0.14.0", True, False),
                                         ("0.17.0", True, True)]:  # fmt: skip
        model = PrefixCacheModel(as_release(release), "int", 3, cfg)
        stored = [e for _ in range(60) for e in model.step() if isinstance(e, BlockStored)]
        assert stored and all(e.lora_id == 1 for e in stored)
        assert all(e.lora_name == ("ad" if has_name else None) for e in stored)
        if not has_extra:
            assert all(e.extra_keys is None for e in stored)
            continue
        seen_image = seen_salt = False
        for e in stored:
            assert len(e.extra_keys) == len(e.block_hashes)
            for i, keys in enumerate(e.extra_keys):
                assert keys[0] == "ad"
                block = e.token_ids[i * 16 : (i + 1) * 16]
                images = [k for k in keys[1:] if isinstance(k, tuple)]
                assert not images or IMAGE_TOKEN in block  # an image lies in the block
                seen_image |= bool(images)
                seen_salt |= any(isinstance(k, str) for k in keys[1:])
        assert seen_image and seen_salt


def test_block_sizes_per_stream_and_groups_of_two_sizes():
    state = CacheState()
    Feed(state, "a")(stored([1, 2], None, PROMPT[:8], group_idx=0))
    Feed(state, "b")(stored([1], None, PROMPT[:8], bs=8))
    hybrid = Feed(state, "h")
    hybrid(stored([1], None, PROMPT[:4], group_idx=0))  # group 0: blocks of 4
    hybrid(stored([5, 6], None, PROMPT[:16], bs=8, group_idx=1))  # group 1: blocks of 8
    rows = {r["pod"]: r for r in state.score("m", PROMPT)}
    assert (rows["a"]["block_size"], rows["a"]["any_tier_tokens"]) == (4, 8)
    assert (rows["b"]["block_size"], rows["b"]["any_tier_tokens"]) == (8, 8)
    assert (rows["h"]["block_size"], rows["h"]["tokens"]) == (8, {"engine/1": 16})
    state.apply(rec(PodRemoved(reason="gone"), pod="h", index=-1))
    assert state.content.sizes == {"m": {4: 1, 8: 1}}


def test_split_stores_are_keyed_whole():
    """The bridge splits an oversize BlockStored over records (bridge.log.split): aligned, its
    parts chain; misaligned (tokens spanning skipped blocks), no part gets a key."""
    from bridge.log.split import split_stored

    def feed_parts(state, event, pod, seq):
        parts = split_stored(event, 3)
        for i, p in enumerate(parts):
            env = Envelope(pod, "m", 0, 1, seq, 0, 0.0, part=i, parts=len(parts))
            state.apply(Record(env, p))

    state = CacheState()
    feed_parts(state, stored([1, 2, 3, 4, 5, 6], None, PROMPT), "aligned", 1)
    # Mamba align mode: one more block of tokens than hashes, skipped at the start
    feed_parts(state, stored([1, 2, 3, 4, 5], None, PROMPT), "skipped", 1)
    rows = {r["pod"]: r["any_tier_tokens"] for r in state.score("m", PROMPT)}
    assert rows == {"aligned": 24}
    assert state.content.skipped == {"misaligned": 5}
