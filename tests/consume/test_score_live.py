"""`POST /score` on real parts: simulated pods -> the bridge -> Kafka -> `kvbridge state --serve`.

The pods serve prompts that share templates (system prompts), continue conversations, use
LoRA adapters, carry images and cache salts, and offload to a CPU tier; one pod sends integer
hashes, one raw digests, one has two DP ranks, one is a release before ``lora_name`` and
``extra_keys``. Once the topic holds what they sent, every prompt any pod served is scored
over HTTP and each stream's answer is compared with the simulator's truth: how many leading
tokens of that prompt each tier of that engine holds. A second server, started after
``kvbridge state-sync`` has written the compacted kv-state topic, bootstraps from it
(``--state-topic``) and answers every score as the server that read kv-events from its start.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import replace
from typing import Any

import pytest
from bridge_util import running_bridge, wait_topic_agrees
from e2e_util import Proc, free_port_block, run_cli, wait_for

from bridge.consume.contentindex import tier_name
from bridge.ops.config import PodConfig
from bridge.simulator.model import ModelConfig, Prompt
from bridge.simulator.pod import PodSpec, SimulatedFleet

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]

MODEL = "demo-model"
RICH = ModelConfig(
    capacity=96, lora_names=("ad-a", "ad-b"), lora_prob=0.4, mm_prob=0.5, salt_prob=0.3,
    cpu_offload_prob=0.5, cpu_capacity=64, repeat_prob=0.2, followup_prob=0.5,
)  # fmt: skip
CHUNKED = ModelConfig(
    capacity=64, lora_names=("ad-a",), lora_prob=0.5, mm_prob=0.3, cpu_offload_prob=0.7,
    cpu_capacity=48, offload_chunk_blocks=3, followup_prob=0.5,
)  # fmt: skip
OLD = ModelConfig(capacity=64, lora_names=("ad-a",), lora_prob=0.5, followup_prob=0.5)
SPECS = [
    PodSpec(name="int", model=MODEL, release="0.33.0", hash_mode="int", cache=RICH, seed=1),
    PodSpec(name="bytes", model=MODEL, release="0.33.0", hash_mode="bytes", cache=RICH, seed=2),
    PodSpec(name="dp", model=MODEL, release="0.27.0", hash_mode="bytes", cache=CHUNKED, seed=3,
            dp_size=2),
    PodSpec(name="old", model=MODEL, release="0.13.0", hash_mode="int", cache=OLD, seed=4),
]  # fmt: skip


def http(port: int, path: str, doc: Any = None) -> tuple[int, dict[str, Any]]:
    body = doc if isinstance(doc, bytes) or doc is None else json.dumps(doc).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def query(pr: Prompt) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": MODEL, "token_ids": list(pr.tokens)}
    if pr.lora:
        doc["lora_name"], doc["lora_id"] = pr.lora  # the id for releases before 0.14
    if pr.media:
        doc["media"] = [{"identifier": i, "offset": o, "length": n} for i, o, n in pr.media]
    if pr.salt:
        doc["cache_salt"] = pr.salt
    return doc


@pytest.fixture(scope="module")
def served(kafka_bootstrap, kafka_admin, tmp_path_factory):
    from kafka_broker import create_topic, topic_name

    topic = create_topic(kafka_admin, topic_name("score-live"), 2)
    specs = [replace(s, rate=300, batches=150, wait_for_subscriber=True) for s in SPECS]
    with SimulatedFleet(*specs) as fleet:
        pods = [PodConfig(p.name, p.model, p.pub, p.replay, p.dp_size) for p in fleet.pods]
        with running_bridge(kafka_bootstrap, topic, pods):
            fleet.wait_done(timeout=90)
            wait_topic_agrees(kafka_bootstrap, topic, fleet.sent())
        publishers = {(p.name, r): p.publisher(r) for p in fleet.pods for r in range(p.dp_size)}
        prompts = list(
            dict.fromkeys(pr for pub in publishers.values() for pr in pub.served_prompts())
        )
        block_size = {key: pub.model.config.block_size for key, pub in publishers.items()}
        truth = {
            (key, pr): pub.resident_prefix(pr) for key, pub in publishers.items() for pr in prompts
        }
    state_topic = f"{topic}-state"
    sync = run_cli(
        ["state-sync", "--bootstrap-servers", kafka_bootstrap, "--topic", topic]
        + ["--state-topic", state_topic, "--until-caught-up"]
    )
    assert sync.returncode == 0, sync.stderr
    port = free_port_block(2)
    boot_port = port + 1
    logs = tmp_path_factory.mktemp("score")
    args = f"state --serve --bootstrap-servers {kafka_bootstrap} --topic {topic} --port"
    proc = Proc([*args.split(), str(port)], logs / "serve.log")
    boot = Proc([*args.split(), str(boot_port), "--state-topic", state_topic], logs / "boot.log")
    try:
        for p, pt in ((proc, port), (boot, boot_port)):

            def ready(p: Proc = p, pt: int = pt) -> bool:
                assert p.alive(), p.output()
                try:
                    return http(pt, "/readyz")[0] == 200
                except OSError:
                    return False

            wait_for(ready, 60, "kvbridge state --serve to be ready")
        yield {
            "port": port,
            "boot_port": boot_port,
            "state_topic": state_topic,
            "boot_log": boot.output,
            "prompts": prompts,
            "truth": truth,
            "block_size": block_size,
        }
    finally:
        codes = proc.stop(), boot.stop()
    assert codes == (0, 0), (proc.output(), boot.output())


@pytest.mark.parametrize("which", ["port", "boot_port"])
def test_score_equals_what_each_engine_holds(served, which):
    port, prompts, truth, bs = (
        served[which],
        served["prompts"],
        served["truth"],
        served["block_size"],
    )
    assert len(prompts) > 100
    compared = set()
    kinds = {"lora": 0, "media": 0, "salt": 0, "cpu": 0, "shared": 0}
    for pr in prompts:
        status, doc = http(port, "/score", query(pr))
        assert status == 200, doc
        assert doc["ready"] is True and doc["query_tokens"] == len(pr.tokens)
        got = {
            (r["pod"], r["dp_rank"]): (
                r["any_tier_tokens"],
                {t: n for t, n in r["tokens"].items() if n},
            )
            for r in doc["pods"]
        }
        for r in doc["pods"]:
            assert r["uncertain"] is False and r["block_size"] == bs[(r["pod"], r["dp_rank"])]
        # the grouped answer: the same streams and counts, one entry per set of equal rows
        status, gdoc = http(port, "/score", {**query(pr), "group": True})
        assert status == 200 and "pods" not in gdoc, gdoc
        grouped = {}
        for g in gdoc["groups"]:
            assert g["streams"] == sorted(g["streams"]) and g["staleness_s"] >= 0
            for pod, rank in g["streams"]:
                assert g["block_size"] == bs[(pod, rank)] and g["uncertain"] is False
                grouped[(pod, rank)] = (
                    g["any_tier_tokens"],
                    {t: n for t, n in g["tokens"].items() if n},
                )
        assert grouped == got and len(gdoc["groups"]) <= len(doc["pods"])
        holders = 0
        for key in bs:
            tiers, n_any = truth[(key, pr)]
            want = (n_any * bs[key], {tier_name(t): n * bs[key] for t, n in tiers.items()})
            assert got.get(key, (0, {})) == want, (key, pr)
            if n_any:
                holders += 1
                compared.add(key)
                kinds["cpu"] += "CPU" in want[1]
        if holders:
            kinds["lora"] += pr.lora is not None
            kinds["media"] += bool(pr.media)
            kinds["salt"] += pr.salt is not None
            kinds["shared"] += holders > 1
    assert compared == set(bs)  # every stream held some prompt
    assert all(n >= 3 for n in kinds.values()), kinds


def test_score_filters_pods_and_refuses_bad_requests(served):
    port, pr = served["port"], served["prompts"][0]
    status, doc = http(port, "/score", {**query(pr), "pods": ["dp"]})
    assert status == 200 and {(r["pod"], r["dp_rank"]) for r in doc["pods"]} == {
        ("dp", 0),
        ("dp", 1),
    }
    for body, message in [
        ({**query(pr), "pods": ["nope"]}, "unknown pod(s) ['nope']"),
        ({"model": MODEL, "token_ids": [1, -2]}, "token ids are ints in 0..4294967295"),
        ({"token_ids": [1]}, '"model" is required'),
        ({"model": MODEL, "token_ids": "1,2"}, '"token_ids" is required'),
        ({**query(pr), "limit": 0}, '"limit" must be a positive int'),
        ({**query(pr), "group": 1}, '"group" must be true'),
        ({**query(pr), "group": True, "limit": 2}, '"limit" is for the rows'),
        (b'{"model": "m", "token_ids": [1, NaN]}', "token ids are ints"),
        (b'{"model": "m", "token_ids": [1', "body is not JSON"),
    ]:
        status, doc = http(port, "/score", body)
        assert (status, message in doc["error"]) == (400, True), doc
    assert http(port, "/score")[0] == 405
    # limit: the first rows of the whole answer (of a prompt more than one stream holds)
    wholes = [(p, http(port, "/score", query(p))[1]) for p in served["prompts"]]
    pr, whole = max(wholes, key=lambda pw: len(pw[1]["pods"]))
    status, doc = http(port, "/score", {**query(pr), "limit": 1})
    assert status == 200 and len(whole["pods"]) > 1
    assert [r["pod"] for r in doc["pods"]] == [whole["pods"][0]["pod"]]
    assert doc["pods"][0]["tokens"] == whole["pods"][0]["tokens"]


def test_the_server_bootstrapped_from_kv_state_scores_as_the_one_that_replayed(served):
    port, boot = served["port"], served["boot_port"]
    assert f"loaded {served['state_topic']}: 5 streams" in served["boot_log"]()
    assert http(boot, "/readyz")[1]["records_consumed"] == 0  # all of it from kv-state

    def rows(p: int, pr: Prompt) -> list[dict[str, Any]]:
        status, doc = http(p, "/score", query(pr))
        assert status == 200, doc
        return [{k: v for k, v in r.items() if k != "staleness_s"} for r in doc["pods"]]

    held = 0
    for pr in served["prompts"]:
        want = rows(port, pr)
        assert rows(boot, pr) == want, pr
        held += any(r["any_tier_tokens"] for r in want)
    assert held > 100
