"""Cache-state rebuild: idempotent stores, tolerant removes, clears, markers, duplicates,
prefix queries and snapshots, checked against a plain brute-force reference."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.consume.state import CacheState, SnapshotError
from bridge.log.markers import EventsLost, PodRemoved, PublisherRestarted, StreamStarted
from bridge.log.records import Envelope, Record
from bridge.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored


def rec(event, pod="p", rank=0, seq=0, index=0, epoch=1):
    return Record(Envelope(pod, "m", rank, epoch, seq, index, 0.0), event)


H = [bytes([i]) * 8 for i in range(6)]


def stored(hashes, parent=None, medium="GPU", group=0):
    return BlockStored(list(hashes), parent, [], 16, medium=medium, group_idx=group)


def test_store_remove_clear_and_markers():
    s = CacheState()
    s.apply(rec(StreamStarted(0, "tcp://x"), index=-1))
    s.apply(rec(stored([H[0], H[1]]), seq=0))
    s.apply(rec(stored([H[1]], H[0]), seq=1))  # duplicate store (vLLM emits these)
    s.apply(rec(stored([H[2]], medium="CPU", group=None), seq=2))
    s.apply(rec(BlockRemoved([H[5]], medium="GPU", group_idx=0), seq=3))  # unknown: no-op
    assert s.resident("p", 0) == {("GPU", 0): {H[0], H[1]}, ("CPU", None): {H[2]}}
    assert s.streams[("p", 0)].tiers[("GPU", 0)] == {H[0]: None, H[1]: H[0]}
    s.apply(rec(BlockRemoved([H[0]], medium="CPU"), seq=4))  # other tier: no-op
    assert s.resident("p", 0)[("GPU", 0)] == {H[0], H[1]}
    s.apply(rec(EventsLost(5, 7, "test"), seq=5, index=-1))
    assert s.summary()["streams"][0]["uncertain"] is True
    assert s.summary()["streams"][0]["lost_batches"] == 3
    s.apply(rec(AllBlocksCleared(), seq=8))
    assert s.resident("p", 0) == {}
    # Everything is gone after the clear, lost or not: the state is exact again.
    assert s.streams[("p", 0)].uncertain is False
    s.apply(rec(stored([H[3]]), rank=1))
    s.apply(rec(PublisherRestarted(1, 9, 0), rank=1, index=-1, epoch=2))
    assert s.resident("p", 1) == {}
    s.apply(rec(stored([H[3]]), rank=1, epoch=2))
    assert s.resident("p", 1) == {("GPU", 0): {H[3]}}
    s.apply(rec(PodRemoved("gone"), index=-1))
    assert s.streams == {}


def test_a_loss_before_a_clear_is_forgotten_one_after_it_is_not():
    s = CacheState()
    s.apply(rec(StreamStarted(0, "tcp://x"), index=-1))
    s.apply(rec(AllBlocksCleared(), seq=4))
    s.apply(rec(EventsLost(2, 3, "kafka refused a record"), seq=2, index=-1))  # late marker
    assert s.streams[("p", 0)].uncertain is False
    s.apply(rec(EventsLost(4, 4, "kafka refused a record"), seq=4, index=-1))  # the clear's batch
    assert s.streams[("p", 0)].uncertain is True
    s.apply(rec(stored([H[0]]), seq=5))
    assert s.streams[("p", 0)].uncertain is True
    s.apply(rec(StreamStarted(0, "tcp://x"), index=-1, epoch=2))
    assert s.streams[("p", 0)].uncertain is False
    s.apply(rec(StreamStarted(40, "tcp://x"), index=-1, epoch=3))  # first contact "live"
    assert s.streams[("p", 0)].uncertain is True


def test_duplicate_records_are_skipped_by_position():
    s = CacheState()
    s.apply(rec(stored([H[0]]), seq=0))
    s.apply(rec(BlockRemoved([H[0]], medium="GPU", group_idx=0), seq=1))
    s.apply(rec(stored([H[0]]), seq=0))  # redelivered (at-least-once): must not resurrect
    assert s.resident("p", 0) == {}
    assert s.duplicates == 1
    s.apply(rec(stored([H[1]]), seq=1, index=1))  # a later event of the same batch: applied
    assert s.resident("p", 0) == {("GPU", 0): {H[1]}}
    s.apply(rec(stored([H[2]]), seq=0, epoch=2))  # another epoch: applied
    assert s.resident("p", 0)[("GPU", 0)] == {H[1], H[2]}


def test_prefix_match_uses_the_64_bit_key_and_counts_hashes_sharing_it():
    s = CacheState("set")
    digest = bytes(24) + H[1]  # a 32-byte digest whose key equals H[1]'s
    s.apply(rec(stored([H[0], H[1], digest], group=0), seq=0))
    s.apply(rec(stored([H[1]], group=1), seq=1))  # the same key in another group
    s.apply(rec(stored([digest, digest]), seq=1, index=1))  # stored again: counted once
    keys = [int.from_bytes(h, "big") for h in (H[0], H[1], H[2])]
    assert s.prefix_match(keys) == {("p", 0): 2}
    s.apply(rec(BlockRemoved([H[1]], medium="GPU", group_idx=0), seq=2))
    assert s.prefix_match(keys) == {("p", 0): 2}  # digest and group 1 still hold the key
    s.apply(rec(BlockRemoved([digest], medium="GPU", group_idx=0), seq=3))
    s.apply(rec(BlockRemoved([H[1]], medium="GPU", group_idx=1), seq=4))
    assert s.prefix_match(keys) == {("p", 0): 1}
    assert s.prefix_match(keys, medium="CPU") == {("p", 0): 0}
    assert s.prefix_match([-(2**63)]) == {("p", 0): 0}  # signed keys are accepted


def test_snapshot_round_trip_and_errors(tmp_path):
    s = CacheState()
    s.apply(rec(StreamStarted(0, "tcp://x"), index=-1))
    s.apply(rec(stored([H[0], H[1]]), seq=0))
    s.apply(rec(EventsLost(1, 1, "gap"), seq=1, index=-1))
    path = tmp_path / "snap.json"
    s.save(path, "kv-events", {0: 17, 2: 5})
    t, topic, offsets = CacheState.load(path)
    assert (topic, offsets) == ("kv-events", {0: 17, 2: 5})
    assert t.to_json() == s.to_json()
    assert t.streams[("p", 0)].tiers == s.streams[("p", 0)].tiers
    t.apply(rec(stored([H[0]]), seq=0))  # at or before the saved position: a duplicate
    assert t.duplicates == 1
    with pytest.raises(SnapshotError, match="does not exist"):
        CacheState.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(SnapshotError, match="not a kvbridge state snapshot"):
        CacheState.load(tmp_path / "bad.json")


# --- property test: any record sequence, then queries, equals a plain reference ---------

PODS = ["a", "b"]
TIERS = [("GPU", 0), ("GPU", 1), ("CPU", None)]
# 8-byte hashes and 32-byte digests, two of which share a 64-bit key with an 8-byte hash.
HASHES = [bytes([i]) * 8 for i in range(3)] + [bytes([9]) * 24 + bytes([i]) * 8 for i in (1, 2)]

event_op = st.one_of(
    st.tuples(
        st.just("store"),
        st.sampled_from(TIERS),
        st.lists(st.sampled_from(HASHES), min_size=1, max_size=4),
        st.one_of(st.none(), st.sampled_from(HASHES)),
    ),
    st.tuples(
        st.just("remove"),
        st.sampled_from(TIERS),
        st.lists(st.sampled_from(HASHES), min_size=1, max_size=3),
        st.none(),
    ),
    st.tuples(st.just("clear"), st.none(), st.none(), st.none()),
)
batch_op = st.tuples(st.just("batch"), st.lists(event_op, min_size=1, max_size=3))
marker_op = st.tuples(
    st.sampled_from(["started", "restarted", "lost", "late_lost", "removed", "duplicate"]),
    st.integers(1, 3),
)
step = st.tuples(st.sampled_from(PODS), st.integers(0, 1), st.one_of(batch_op, marker_op))


class Reference:
    """The rules written out plainly, on plain dicts and lists."""

    def __init__(self, policy: str = "count") -> None:
        self.policy = policy
        self.streams: dict[tuple[str, int], dict] = {}

    def stream(self, key):
        if key not in self.streams:
            self.streams[key] = {"tiers": {}, "lost": [], "clears": []}
        return self.streams[key]

    def drop(self, key) -> None:
        self.streams[key] = {"tiers": {}, "lost": [], "clears": []}

    def event(self, key, seq, op) -> None:
        s = self.stream(key)
        kind, tier, hashes, parent = op
        copies = s.setdefault("copies", {}).setdefault(tier, {})
        if kind == "store":
            blocks = s["tiers"].setdefault(tier, {})
            reannounce = parent is None and all(h in blocks for h in hashes)
            counted = self.policy == "count" or (self.policy == "hits" and not reannounce)
            for h in hashes:
                if h not in blocks:
                    copies[h] = 1
                elif counted:
                    copies[h] += 1
                blocks[h] = parent
                parent = h
        elif kind == "remove":
            for h in hashes:
                if h in s["tiers"].get(tier, {}):
                    if self.policy != "set" and copies[h] > 1:
                        copies[h] -= 1
                    else:
                        del s["tiers"][tier][h]
                        del copies[h]
        else:
            s["tiers"] = {}
            s["copies"] = {}
            s["clears"].append(seq)

    def uncertain(self, key) -> bool:
        s = self.streams[key]
        last_clear = max(s["clears"], default=-1)
        return any(to >= last_clear for to in s["lost"])

    def prefix(self, key, keys, medium) -> int:
        resident = set()
        for (m, _), blocks in self.streams[key]["tiers"].items():
            if medium is None or m == medium:
                resident.update(int.from_bytes(h[-8:], "big") for h in blocks)
        n = 0
        for k in keys:
            if k not in resident:
                break
            n += 1
        return n


@settings(max_examples=1000, deadline=None)
@given(
    st.lists(step, max_size=40),
    st.lists(st.sampled_from(HASHES), min_size=1, max_size=4),
    st.sampled_from([None, "GPU", "CPU"]),
    st.sampled_from(["count", "set", "hits"]),
)
def test_any_record_sequence_matches_the_reference(steps, query, medium, policy):
    state = CacheState(policy)
    ref = Reference(policy)
    epoch: dict[tuple[str, int], int] = {}
    next_seq: dict[tuple[str, int], int] = {}
    history: dict[tuple[str, int], list[Record]] = {}
    for pod, rank, (kind, arg) in steps:
        key = (pod, rank)
        e = epoch.setdefault(key, 1)
        seq = next_seq.setdefault(key, 0)
        if kind == "batch":
            for i, op in enumerate(arg):
                if op[0] == "store":
                    ev = stored(op[2], op[3], medium=op[1][0], group=op[1][1])
                elif op[0] == "remove":
                    ev = BlockRemoved(list(op[2]), medium=op[1][0], group_idx=op[1][1])
                else:
                    ev = AllBlocksCleared()
                r = rec(ev, pod, rank, seq, i, e)
                state.apply(r)
                history.setdefault(key, []).append(r)
                ref.event(key, seq, op)
            next_seq[key] = seq + 1
        elif kind in ("started", "restarted"):
            epoch[key] = e + 1
            next_seq[key] = 0
            marker = StreamStarted(0, "x") if kind == "started" else PublisherRestarted(e, seq, 0)
            state.apply(rec(marker, pod, rank, 0, -1, e + 1))
            ref.drop(key)
            history[key] = []
        elif kind == "lost":
            state.apply(rec(EventsLost(seq, seq + arg - 1, "gap"), pod, rank, seq, -1, e))
            ref.stream(key)["lost"].append(seq + arg - 1)
            next_seq[key] = seq + arg
        elif kind == "late_lost":  # a marker for an earlier seq (a batch Kafka refused)
            s0 = max(0, seq - arg)
            state.apply(rec(EventsLost(s0, s0, "kafka refused a record"), pod, rank, s0, -1, e))
            ref.stream(key)["lost"].append(s0)
        elif kind == "removed":
            state.apply(rec(PodRemoved("gone"), pod, rank, seq, -1, e))
            for k in [k for k in ref.streams if k[0] == pod]:
                del ref.streams[k]
            for k in [k for k in history if k[0] == pod]:
                history[k] = []
            for k in [k for k in epoch if k[0] == pod]:
                epoch[k] += 1  # a new StreamStarted would open a new epoch
                next_seq[k] = 0
        elif history.get(key):  # duplicate: redeliver an earlier record of this epoch
            state.apply(history[key][-arg % len(history[key])])
            ref.stream(key)

    assert set(state.streams) == set(ref.streams)
    keys = [int.from_bytes(h[-8:], "big") for h in query]
    got = state.prefix_match(keys, medium)
    for key, want in ref.streams.items():
        st_ = state.streams[key]
        assert {t: b for t, b in st_.tiers.items() if b} == {
            t: b for t, b in want["tiers"].items() if b
        }, key
        assert st_.uncertain == ref.uncertain(key), key
        assert got[key] == ref.prefix(key, keys, medium), key
        for tier, blocks in want["tiers"].items():
            for h in blocks:
                assert st_.copies_of(tier, h) == want["copies"][tier][h], (key, tier, h)
    # A snapshot restores the same state and answers.
    doc = json.loads(json.dumps(state.snapshot("t", {0: 1})))
    again, _, _ = CacheState.from_snapshot(doc)
    assert again.to_json()["streams"] == state.to_json()["streams"]
    assert again.prefix_match(keys, medium) == got


def test_query_parsing_accepts_vllm_keys_and_digests():
    from bridge.cli.read import parse_query
    from bridge.ops.config import ConfigError

    digest = "0x" + "ab" * 24 + "0102030405060708"
    assert parse_query(f"5, 0x10, {digest}, -1") == [5, 16, 0x0102030405060708, 2**64 - 1]
    with pytest.raises(ConfigError, match="not a block hash"):
        parse_query("5,zz")


def test_time_and_offset_parsing():
    from bridge.cli.read import parse_offsets, parse_time
    from bridge.ops.config import ConfigError

    assert parse_time("2026-12-02T16:00:00Z") == 1796227200000
    assert parse_time("1796227200000") == 1796227200000
    with pytest.raises(ConfigError, match="add a timezone"):
        parse_time("2026-12-02T16:00:00")
    with pytest.raises(ConfigError, match="--to-timestamp 'yesterday'"):
        parse_time("yesterday", "--to-timestamp")
    assert parse_offsets("0:5,2:7", None, "--from-offset") == {0: 5, 2: 7}
    assert parse_offsets("9", 1, "--from-offset") == {1: 9}
    assert parse_offsets("9", None, "--to-offset") == 9
    with pytest.raises(ConfigError, match="expected an offset"):
        parse_offsets("0:x", None, "--from-offset")
    with pytest.raises(ConfigError, match="drop --partition"):
        parse_offsets("0:5", 0, "--from-offset")


def test_a_copy_removed_leaves_the_hash_resident_under_count():
    # vLLM keeps one physical block per copy and removes each on its own (vllm#55092).
    for policy, left in (("count", {H[0], H[1]}), ("set", {H[0]})):
        s = CacheState(policy)
        s.apply(rec(stored([H[0], H[1]]), seq=0))
        s.apply(rec(stored([H[1]], H[0]), seq=1))  # the recomputed last block: a 2nd copy
        s.apply(rec(BlockRemoved([H[1]], medium="GPU", group_idx=0), seq=2))
        assert s.resident("p", 0) == {("GPU", 0): left}, policy
        keys = [int.from_bytes(h, "big") for h in (H[0], H[1])]
        assert s.prefix_match(keys) == {("p", 0): len(left)}, policy
    s.apply(rec(BlockRemoved([H[1]], medium="GPU", group_idx=0), seq=3))
    assert s.resident("p", 0) == {("GPU", 0): {H[0]}}


def test_hits_policy_takes_a_re_announced_prefix_as_no_new_copy():
    s = CacheState("hits")
    s.apply(rec(stored([H[0], H[1]]), seq=0))
    s.apply(rec(stored([H[0], H[1]]), seq=1))  # report mode "full": the hits again
    s.apply(rec(stored([H[1]], H[0]), seq=2))  # a recomputed copy (has a parent): counted
    st_ = s.streams[("p", 0)]
    assert (st_.copies_of(("GPU", 0), H[0]), st_.copies_of(("GPU", 0), H[1])) == (1, 2)


def test_remaining_copy_counts_override_the_policy():
    import msgpack

    for policy in ("count", "set", "hits"):
        s = CacheState(policy)
        s.apply(rec(stored([H[0], H[1]]), seq=0))
        s.apply(rec(stored([H[0], H[1]]), seq=1))
        gone = BlockRemoved([H[0], H[1]], medium="GPU", group_idx=0)
        gone.remaining_copy_counts = [0, 3]  # typed
        s.apply(rec(gone, seq=2))
        assert s.resident("p", 0) == {("GPU", 0): {H[1]}}
        assert s.streams[("p", 0)].copies_of(("GPU", 0), H[1]) == 3
        # As vLLM sends it today: an unknown field, preserved as msgpack.
        raw = BlockRemoved([H[1]], medium="GPU", group_idx=0)
        raw.extra["remaining_copy_counts"] = msgpack.packb([0])
        s.apply(rec(raw, seq=3))
        assert s.resident("p", 0) == {}, policy


def test_records_of_an_older_epoch_are_not_applied():
    s = CacheState()
    s.apply(rec(StreamStarted(0, "x"), index=-1, epoch=1))
    s.apply(rec(stored([H[0]]), seq=0, epoch=1))
    s.apply(rec(StreamStarted(0, "x"), index=-1, epoch=2))  # moved: new epoch, read first
    s.apply(rec(stored([H[1]]), seq=0, epoch=2))
    s.apply(rec(stored([H[2]]), seq=1, epoch=1))  # the old partition's rest, read later
    s.apply(rec(EventsLost(2, 3, "x"), seq=2, index=-1, epoch=1))
    s.apply(rec(StreamStarted(0, "x"), index=-1, epoch=1))
    assert s.resident("p", 0) == {("GPU", 0): {H[1]}}
    assert s.streams[("p", 0)].epoch == 2 and not s.streams[("p", 0)].uncertain
    assert s.stale == 3 and s.summary()["stale_skipped"] == 3


def test_snapshots_keep_copies_and_versions_1_and_2_still_load():
    s = CacheState()
    s.apply(rec(stored([H[0], H[1]]), seq=0))
    s.apply(rec(stored([H[1]], H[0]), seq=1))
    doc = json.loads(json.dumps(s.snapshot("t", {0: 2})))
    assert doc["version"] == 3 and doc["policy"] == "count"
    v2, _, _ = CacheState.from_snapshot(dict(doc, version=2))
    assert v2.resident("p", 0) == s.resident("p", 0)
    with pytest.raises(SnapshotError, match="reads versions 1, 2, 3"):
        CacheState.from_snapshot(dict(doc, version=4))
    again, _, _ = CacheState.from_snapshot(doc)
    assert again.streams[("p", 0)].copies_of(("GPU", 0), H[1]) == 2
    with pytest.raises(SnapshotError, match="state-policy count, not set"):
        CacheState.from_snapshot(doc, "set")
    v1 = dict(doc, version=1)
    del v1["policy"]
    for stream in v1["streams"]:
        for t in stream["tiers"]:
            t["blocks"] = [b[:2] for b in t["blocks"]]
    old, _, _ = CacheState.from_snapshot(v1, "set")
    assert old.resident("p", 0) == s.resident("p", 0) and old.policy == "set"


def test_the_hash_consume_prints_is_read_by_query_and_the_server():
    from bridge.cli.args import ConfigError
    from bridge.cli.read import parse_query
    from bridge.consume.stateserve import BadRequest, parse_hash
    from bridge.vllm.events import key64
    from bridge.vllm.jsonview import event_to_json

    digest = bytes(range(32))
    shown = event_to_json(stored([H[3], digest]))["block_hashes"]
    assert shown == ["0x" + H[3].hex(), "0x" + digest.hex()]
    keys = [key64(H[3]), key64(digest)]
    assert parse_query(",".join(shown)) == keys
    assert [parse_hash(h) for h in shown] == keys
    s = CacheState()
    s.apply(rec(stored([H[3], digest])))
    assert s.to_json()["streams"][0]["tiers"][0]["blocks"] == sorted(shown)
    with pytest.raises(ConfigError, match="0x61ecd2ddffece405"):
        parse_query("61ecd2ddffece405")  # bare hex: said how to write it
    with pytest.raises(BadRequest, match="0x61ecd2ddffece405"):
        parse_hash("61ecd2ddffece405")


def test_tiers_without_a_medium_are_named_as_the_engines_own_cache():
    s = CacheState()
    s.apply(rec(stored([H[0], H[1]], medium=None, group=None)))
    assert s.summary()["streams"][0]["blocks_by_medium"] == {"engine": 2}
