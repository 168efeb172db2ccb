"""vLLM's repeated hashes on real parts: simulated pods -> the bridge -> Kafka -> the state.

Each pod sends one kind of repeated hash exactly as vLLM does (bridge/simulator/model.py,
docs/vllm-cache-semantics.md); the rebuilt state is compared with the simulator's truth
(which hashes each tier holds, and how many copies):

- physical copies (0.20.0, prompts served again): evicting one copy keeps the hash;
- offload chunks (OffloadingConnector chunk mode, CPU tier): stored twice, removed twice;
- re-announced hits (0.33.0, kv_cache_report_mode="full"): a store of resident blocks;
- remaining_copy_counts on every remove (vllm#48933): the engine's own count.
"""

from __future__ import annotations

import json

import pytest
from bridge_util import read_all, running_bridge
from e2e_util import run_cli, wait_for

from bridge.consume.sentlog import compare_with_sent
from bridge.consume.state import CacheState
from bridge.log.records import Record
from bridge.ops.config import PodConfig
from bridge.simulator.model import ModelConfig
from bridge.simulator.pod import PodSpec, SimulatedFleet
from bridge.vllm.events import BlockRemoved, BlockStored, key64

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]

COPIES = ModelConfig(capacity=32, repeat_prob=0.5, followup_prob=0.0, gen_tokens=(1, 40))
CHUNKS = ModelConfig(
    capacity=64, cpu_offload_prob=1.0, cpu_capacity=40, offload_chunk_blocks=3,
    followup_prob=0.6, token_budget=128,
)  # fmt: skip
# One request at a time and no repeats: no physical copies, only re-announced hits.
HITS = ModelConfig(capacity=32, report_full_prob=1.0, max_running=1, followup_prob=0.8)
COUNTED = ModelConfig(
    capacity=32, repeat_prob=0.5, report_full_prob=1.0, cpu_offload_prob=0.5, cpu_capacity=16,
    offload_chunk_blocks=3, copy_counts=True,
)  # fmt: skip
SPECS = [
    PodSpec(name="copies", release="0.20.0", rate=300, batches=200, seed=1, cache=COPIES,
            wait_for_subscriber=True),
    PodSpec(name="chunks", release="0.33.0", rate=300, batches=200, seed=2, cache=CHUNKS,
            wait_for_subscriber=True),
    PodSpec(name="hits", release="0.33.0", rate=300, batches=200, seed=3, cache=HITS,
            wait_for_subscriber=True),
    PodSpec(name="counted", release="0.33.0", rate=300, batches=200, seed=4, cache=COUNTED,
            wait_for_subscriber=True),
]  # fmt: skip


@pytest.fixture(scope="module")
def run(kafka_bootstrap, kafka_admin):
    from kafka_broker import create_topic, topic_name

    topic = create_topic(kafka_admin, topic_name("state-copies"), 2)
    with SimulatedFleet(*SPECS) as fleet:
        pods = [PodConfig(p.name, p.model, p.pub, p.replay, p.dp_size) for p in fleet.pods]
        with running_bridge(kafka_bootstrap, topic, pods):
            fleet.wait_done(timeout=60)
            sent = fleet.sent()
            last: list[str] = []

            def agree() -> bool:
                last[:] = compare_with_sent(read_all(kafka_bootstrap, topic), sent)
                return not last

            try:
                wait_for(agree, 60, "the topic to hold what the pods published", interval=0.5)
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {last[:10]}") from None
        truth = {p.name: fleet.copies(p.name) for p in fleet.pods}
    return {
        "bootstrap": kafka_bootstrap,
        "topic": topic,
        "truth": truth,
        "records": read_all(kafka_bootstrap, topic),
    }


def rebuild(records: list[Record], policy: str) -> CacheState:
    state = CacheState(policy)
    for r in records:
        state.apply(r)
    return state


def copies_of(state: CacheState, pod: str) -> dict:
    st = state.streams[(pod, 0)]
    return {
        tier: {h: st.copies_of(tier, h) for h in blocks}
        for tier, blocks in st.tiers.items()
        if blocks
    }


def residency(copies: dict) -> dict:
    return {t: set(c) for t, c in copies.items() if c}


def chains(records: list[Record], pod: str, held: set[bytes]) -> list[list[int]]:
    """For every held GPU hash, the keys of its prefix (root first) as far as it is held."""
    parent: dict[bytes, bytes | None] = {}
    for r in records:
        ev = r.event
        if r.envelope.pod == pod and isinstance(ev, BlockStored) and ev.medium != "CPU":
            p = ev.parent_block_hash
            for h in ev.block_hashes:
                if p is not None or h not in parent:  # a re-announcement has no parent
                    parent[h] = p
                p = h
    out = []
    for h in held:
        chain = [h]
        while (p := parent.get(chain[-1])) is not None and p in held:
            chain.append(p)
        if parent.get(chain[-1]) is None:  # reaches the first block: a full prefix
            out.append([key64(x) for x in reversed(chain)])
    return out


def test_every_kind_is_in_the_run(run):
    recs = run["records"]

    def of(pod: str) -> list:
        return [r.event for r in recs if r.envelope.pod == pod]

    # Removes of a hash while another copy of it stays (counted as the records come).
    state, removed_copy = CacheState("count"), 0
    for r in recs:
        ev = r.event
        if r.envelope.pod == "copies" and isinstance(ev, BlockRemoved):
            st = state.streams[("copies", 0)]
            removed_copy += st.copies_of((ev.medium, ev.group_idx), ev.block_hashes[0]) > 1
        state.apply(r)
    assert removed_copy >= 3
    cpu = [e for e in of("chunks") if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert len(cpu) > 10 and all(len(e.block_hashes) <= 3 for e in cpu)
    removes = [e for e in of("counted") if isinstance(e, BlockRemoved)]
    assert removes and all(e.remaining_copy_counts is not None for e in removes)
    assert not any(e.remaining_copy_counts for e in of("copies") if isinstance(e, BlockRemoved))


def test_a_removed_copy_leaves_the_hash_and_its_prefixes_resident(run):
    recs, truth = run["records"], run["truth"]["copies"]
    counted = rebuild(recs, "count")
    assert copies_of(counted, "copies") == truth
    as_set = rebuild(recs, "set")
    assert residency(copies_of(as_set, "copies")) != residency(truth)  # a set loses hashes
    held = next(iter(residency(truth).values()))
    paths = chains(recs, "copies", held)
    assert paths
    for keys in paths:  # a router asking for any served prefix gets all of it
        assert counted.prefix_match(keys, "GPU")[("copies", 0)] == len(keys)
    short = [k for k in paths if as_set.prefix_match(k, "GPU")[("copies", 0)] < len(k)]
    assert short, "the set policy should lose prefixes through evicted copies"


def test_offload_chunks_on_the_cpu_tier_are_counted(run):
    recs, truth = run["records"], run["truth"]["chunks"]
    counted = copies_of(rebuild(recs, "count"), "chunks")
    assert counted == truth
    # Counting is exact at the end; along the way a set dropped blocks that a second chunk
    # still held, each time the first chunk was evicted.
    counting, as_set, differ = CacheState("count"), CacheState("set"), 0
    for r in recs:
        if r.envelope.pod == "chunks":
            counting.apply(r)
            as_set.apply(r)
            differ += counting.resident("chunks", 0) != as_set.resident("chunks", 0)
    assert differ >= 10


def test_report_mode_re_announcements_need_the_hits_policy(run):
    recs, truth = run["records"], run["truth"]["hits"]
    assert residency(copies_of(rebuild(recs, "hits"), "hits")) == residency(truth)
    over = residency(copies_of(rebuild(recs, "count"), "hits"))
    gpu = next(t for t in truth if t[0] == "GPU")
    # Counting every store keeps hashes whose only block the engine evicted.
    assert over[gpu] > residency(truth)[gpu]


def test_remaining_copy_counts_make_every_policy_exact(run):
    recs, truth = run["records"], run["truth"]["counted"]
    for policy in ("count", "set", "hits"):
        assert residency(copies_of(rebuild(recs, policy), "counted")) == residency(truth), policy


def test_replay_cli_takes_the_policy(run):
    base = ["replay", "--bootstrap-servers", run["bootstrap"], "--topic", run["topic"], "--json"]
    for policy, exact in (("hits", {"hits", "counted"}), ("count", {"copies", "chunks"})):
        got = run_cli([*base, "--state-policy", policy])
        assert got.returncode == 0, got.stderr
        doc = json.loads(got.stdout)
        assert doc["policy"] == policy
        for s in doc["streams"]:
            if s["pod"] in exact:
                blocks = {(t["medium"], t["group_idx"]): set(t["blocks"]) for t in s["tiers"]}
                want = {t: {"0x" + h.hex() for h in c} for t, c in run["truth"][s["pod"]].items()}
                assert blocks == want, (policy, s["pod"])
