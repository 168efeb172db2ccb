"""Content keys through kv-state and snapshots: a loaded state scores as the replayed one.

A random fleet's records (stores from a sequence's start and continuations of it, stores
split over two records, offload placeholders, removes, clears, losses, restarts) are applied
to a reference :class:`CacheState` and, up to a bootstrap point, to a :class:`StateSync`
whose change records are loaded back (:func:`bridge.consume.statesync.load`), and to a snapshot
(:meth:`CacheState.snapshot` -> :meth:`CacheState.from_snapshot`). The loaded states index
the same content keys and answer ``score`` as the reference, at the bootstrap point and
after the rest of the records (continuations chaining from restored parents), and kv-state
written by the loaded StateSync loads to the same again.
"""

from __future__ import annotations

import json
from hashlib import blake2b
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.consume.contentindex import SKIP_REASONS
from bridge.consume.score import ScoreError, make_request, score
from bridge.consume.state import CacheState
from bridge.consume.statesync import StateSync, load
from bridge.log.markers import EventsLost, StreamStarted
from bridge.log.records import Envelope, Record
from bridge.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored

MODEL = "m"
PODS = ("a", "b", "c")
SIZES = {"a": 4, "b": 4, "c": 2}


def ehash(pod: str, bs: int, toks: list[int]) -> bytes:
    """A pod's engine hash of a block: its own (salted by the pod), chained over the tokens."""
    return blake2b(f"{pod}{bs}:{toks}".encode(), digest_size=8).digest()


prompts = st.lists(st.lists(st.integers(0, 3), min_size=8, max_size=32), min_size=1, max_size=3)
ops = st.lists(
    st.tuples(
        st.sampled_from(PODS),
        st.integers(0, 1),  # dp rank
        st.sampled_from(
            ["store", "store", "store", "extend", "extend", "split", "offload", "remove"]
            + ["remove", "clear", "lost", "restart"]
        ),
        st.integers(0, 2),  # prompt
        st.integers(1, 8),  # blocks of it
        st.sampled_from(("GPU", "CPU")),
        st.integers(0, 7),  # which block (remove) / where a continuation starts
    ),
    max_size=40,
)


def records_for(prompt_list: list[list[int]], op_list: list[tuple]) -> list[list[Record]]:
    """The records of the ops, grouped so that a bootstrap never falls inside a split store.

    Continuations and placeholders refer to blocks the stream holds when they are sent, as
    an engine's do (a parent in the cache; an offload of a block still in the GPU tier)."""
    scratch = CacheState(content=False)
    pos: dict[tuple[str, int], list[int]] = {}  # [epoch, next seq]
    out: list[list[Record]] = []
    for pod, rank, kind, p, n, medium, which in op_list:
        key = (pod, rank)
        epoch, seq = pos.setdefault(key, [1, 0])
        bs = SIZES[pod]
        toks = prompt_list[p % len(prompt_list)]
        hashes = [ehash(pod, bs, toks[: (i + 1) * bs]) for i in range(min(n, len(toks) // bs))]
        held = scratch.streams.get(key)
        resident: set[bytes] = set()
        gpu: set[bytes] = set()
        if held is not None:
            for (m, _), blocks in held.tiers.items():
                resident |= blocks.keys()
                if m == "GPU":
                    gpu |= blocks.keys()

        def env(index=0, part=0, parts=1, e=epoch, pod=pod, rank=rank, seq=seq) -> Envelope:
            return Envelope(pod, MODEL, rank, e, seq, index, 0.0, part=part, parts=parts)

        group: list[Record] = []
        if kind in ("store", "extend", "split") and hashes:
            start = 0
            if kind == "extend":
                start = which % len(hashes)
                if start and hashes[start - 1] not in resident:
                    continue
            parent = hashes[start - 1] if start else None
            ev = BlockStored(
                hashes[start:], parent, toks[start * bs : len(hashes) * bs], bs, medium=medium
            )
            if kind == "split" and len(hashes) > 1:
                cut = max(1, len(hashes) // 2)
                first = BlockStored(hashes[:cut], None, toks[: cut * bs], bs, medium=medium)
                rest = BlockStored(
                    hashes[cut:], hashes[cut - 1], toks[cut * bs : len(hashes) * bs], bs,
                    medium=medium,
                )  # fmt: skip
                group = [Record(env(0, 0, 2), first), Record(env(0, 1, 2), rest)]
            else:
                group = [Record(env(), ev)]
        elif kind == "offload":
            on_gpu = [h for h in hashes if h in gpu]
            if not on_gpu:
                continue
            group = [Record(env(), BlockStored(on_gpu, None, [], 0, medium="CPU"))]
        elif kind == "remove" and hashes:
            group = [Record(env(), BlockRemoved([hashes[which % len(hashes)]], medium=medium))]
        elif kind == "clear":
            group = [Record(env(), AllBlocksCleared())]
        elif kind == "lost":
            group = [Record(env(-1), EventsLost(seq, seq, "test"))]
        elif kind == "restart":
            pos[key] = [epoch + 1, 0]
            out.append([Record(env(-1, e=epoch + 1), StreamStarted(0, "x"))])
            scratch.apply(out[-1][0])
            continue
        else:
            continue
        pos[key][1] += 1
        for r in group:
            scratch.apply(r)
        out.append(group)
    return out


def held_keys(state: CacheState) -> dict:
    """Per stream: its block sizes and, per tier, engine hash -> content key (non-empty)."""
    content = state.content
    assert content is not None
    return {
        key: (
            s.block_size,
            sorted(s.block_sizes),
            {t: dict(sl.held) for t, sl in s.slots.items() if sl.held},
        )
        for key, s in content.streams.items()
    }


def answers(state: CacheState, prompt_list: list[list[int]]) -> list[Any]:
    out: list[Any] = []
    pods: list[list[str] | None] = [None, *([p] for p in PODS)]
    for toks in prompt_list:
        for n in (2, 5, 8, 13, len(toks)):
            for tail in ([], [3, 2, 1, 0]):
                for only in pods:
                    try:
                        req = make_request(MODEL, toks[:n] + tail, pods=only)
                        out.append(score(state, req))
                    except ScoreError as exc:
                        out.append(str(exc))
    return out


def snapshot_of(state: CacheState) -> CacheState:
    doc = json.loads(json.dumps(state.snapshot("ev", {0: 1})))
    again, _, _ = CacheState.from_snapshot(doc)
    return again


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt_list=prompts, op_list=ops, cut=st.floats(0, 1))
def test_loaded_state_scores_as_the_replayed_one(prompt_list, op_list, cut):
    groups = records_for(prompt_list, op_list)
    k = int(cut * len(groups))
    replayed = CacheState()
    sync = StateSync("ev")
    log: list[tuple[bytes, bytes | None]] = []
    offset = 0
    for group in groups[:k]:
        for r in group:
            replayed.apply(r)
            log += sync.apply(0, offset, 1000 + offset, r)
            offset += 1
    log.append(sync.offsets_record())
    loaded, skipped = load(log, "ev")
    assert skipped == 0
    snap = snapshot_of(replayed)
    want = answers(replayed, prompt_list)
    for got in (loaded.state, snap):
        assert held_keys(got) == held_keys(replayed)
        assert answers(got, prompt_list) == want
        assert got.content is not None and got.content.skipped["unkeyed_on_load"] == 0
    # The rest of the records: applied to each; the loaded StateSync writes kv-state on.
    log = [(kk, v) for kk, v in {kk: v for kk, v in log}.items() if v is not None]
    for group in groups[k:]:
        for r in group:
            replayed.apply(r)
            snap.apply(r)
            log += loaded.apply(0, offset, 1000 + offset, r)
            offset += 1
    log.append(loaded.offsets_record())
    again, _ = load(log, "ev")
    want = answers(replayed, prompt_list)
    for got in (loaded.state, snap, again.state, snapshot_of(snap)):
        assert held_keys(got) == held_keys(replayed)
        assert answers(got, prompt_list) == want


def test_the_values_carry_content_keys_and_the_stream_its_sizes():
    s = StateSync("ev")
    toks = list(range(8))
    h = [ehash("a", 4, toks[:4]), ehash("a", 4, toks)]
    rec0 = Record(Envelope("a", MODEL, 0, 1, 0, 0, 0.0), BlockStored(h, None, toks, 4))
    changes = dict(s.apply(0, 0, 5, rec0))
    content = s.state.content
    assert content is not None
    values = [json.loads(v) for kk, v in changes.items() if json.loads(kk)[0] == "block"]
    assert [v["ck"] for v in values] == [content.held(("a", 0), (None, None))[x].hex() for x in h]
    meta = json.loads(changes[b'["stream","a",0]'])
    assert meta["content"] == {"block_size": 4, "block_sizes": [4]}
    # A placeholder in another tier takes the keys: its values carry them too.
    rec1 = Record(Envelope("a", MODEL, 0, 1, 1, 0, 0.0), BlockStored(h, None, [], 0, medium="CPU"))
    cpu = [json.loads(v) for kk, v in s.apply(0, 1, 6, rec1) if json.loads(kk)[0] == "block"]
    assert [v["ck"] for v in cpu] == [v["ck"] for v in values]


def old_format_log() -> tuple[StateSync, list[tuple[bytes, bytes | None]]]:
    """kv-state as a kvbridge before content keys wrote it: no "ck", no stream "content"."""
    s = StateSync("ev")
    toks = list(range(8))
    h = [ehash("a", 4, toks[:4]), ehash("a", 4, toks)]
    log = s.apply(
        0, 0, 5, Record(Envelope("a", MODEL, 0, 1, 0, 0, 0.0), BlockStored(h, None, toks, 4))
    )
    log.append(s.offsets_record())
    old = []
    for kk, v in log:
        doc = json.loads(v)
        doc.pop("ck", None)
        doc.pop("content", None)
        old.append((kk, json.dumps(doc).encode()))
    return s, old


def test_old_records_load_unkeyed_counted_and_still_answer_prefix():
    s, old = old_format_log()
    loaded, skipped = load(old, "ev")
    assert skipped == 0
    content = loaded.state.content
    assert content is not None and content.skipped["unkeyed_on_load"] == 2
    assert "unkeyed_on_load" in SKIP_REASONS
    keys = [int.from_bytes(h, "big") for h in s.state.streams[("a", 0)].tiers[(None, None)]]
    assert loaded.state.prefix_match(keys) == s.state.prefix_match(keys) == {("a", 0): 2}
    req = make_request(MODEL, list(range(8)))
    assert score(s.state, req)[0]["any_tier_tokens"] == 8
    assert score(loaded.state, req) == []  # unkeyed: /score cannot see them
    # A snapshot of version 2 (no keys) loads the same way.
    doc = json.loads(json.dumps(s.state.snapshot("ev", {0: 1})))
    for stream in doc["streams"]:
        stream.pop("content")
        for t in stream["tiers"]:
            t["blocks"] = [b[:2] for b in t["blocks"]]
    v2, _, _ = CacheState.from_snapshot(dict(doc, version=2))
    assert v2.content is not None and v2.content.skipped["unkeyed_on_load"] == 2
    assert v2.prefix_match(keys) == {("a", 0): 2} and score(v2, req) == []


@pytest.mark.parametrize("ck", ["zz" * 16, "ab" * 15, "ab" * 17, 12, None, ["ab"], "0 " * 16])
def test_a_malformed_content_key_is_counted_not_a_crash(ck):
    s, old = old_format_log()
    bad = []
    for kk, v in old:
        doc = json.loads(v)
        if json.loads(kk)[0] == "block":
            doc["ck"] = ck
        bad.append((kk, json.dumps(doc).encode()))
    loaded, skipped = load(bad, "ev")
    assert skipped == 0
    assert loaded.state.content is not None
    assert loaded.state.content.skipped["unkeyed_on_load"] == 2
    assert loaded.state.resident("a", 0) == s.state.resident("a", 0)
    doc = json.loads(json.dumps(s.state.snapshot("ev", {0: 1})))
    for stream in doc["streams"]:
        for t in stream["tiers"]:
            t["blocks"] = [[*b[:3], ck] for b in t["blocks"]]
    snap, _, _ = CacheState.from_snapshot(doc)
    assert snap.content is not None and snap.content.skipped["unkeyed_on_load"] == 2
    assert snap.resident("a", 0) == s.state.resident("a", 0)


def test_a_pod_serving_another_model_loses_its_keys_in_kv_state_too():
    s = StateSync("ev")
    toks = list(range(4))
    h0, h1 = ehash("a", 4, toks), ehash("a", 4, [9, 9, 9, 9])
    s.apply(
        0, 0, 5, Record(Envelope("a", MODEL, 0, 1, 0, 0, 0.0), BlockStored([h0], None, toks, 4))
    )
    ev = BlockStored([h1], None, [9, 9, 9, 9], 4)
    changes = dict(s.apply(0, 1, 6, Record(Envelope("a", "m2", 0, 1, 1, 0, 0.0), ev)))
    old = json.loads(changes[b'["block","a",0,null,null,"%s"]' % h0.hex().encode()])
    new = json.loads(changes[b'["block","a",0,null,null,"%s"]' % h1.hex().encode()])
    assert "ck" not in old and "ck" in new  # h0's key was of the other model's chain
    loaded, _ = load([*changes.items(), s.offsets_record()], "ev")
    assert held_keys(loaded.state) == held_keys(s.state)
