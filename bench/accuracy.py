"""State accuracy: does the rebuilt cache state equal the engines' caches?

``python -m bench.accuracy``: simulated vLLM pods (real ZeroMQ publishers) send each kind of
repeated hash exactly as vLLM does (docs/vllm-cache-semantics.md) -> the bridge -> Kafka;
the topic is read back and replayed into a ``CacheState`` per policy. At several points of
every stream (after batch seq N/4, N/2, 3N/4, N-1) the rebuilt state is compared with the
simulator's truth at that seq:

- residency precision and recall per tier (GPU, CPU): of the (tier, hash) pairs;
- the longest-prefix-match error for the prompts the simulator served (its running requests
  and recent conversations): |rebuilt - true| in blocks, as a router would compute it with
  ``prefix_match(keys, medium="GPU")``, and the share of prompts with any error.

The truth is rebuilt alongside: each pod's model is deterministic, so a second instance
with the same seed, stepped once per published batch, is in the pod's state at every seq
(checked against the pod's own model at the end). No drops or restarts: only the wire's
own semantics are measured.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from bench.kafka import broker, new_topic
from bridge.consume.reader import TopicReader
from bridge.consume.state import POLICIES, CacheState
from bridge.ingest.runner import Bridge
from bridge.log.records import Record
from bridge.ops.config import BridgeConfig, PodConfig
from bridge.simulator.model import ModelConfig, PrefixCacheModel, chain_hash
from bridge.simulator.pod import PodSpec, SimulatedFleet
from bridge.vllm.encoder import normal_hash
from bridge.vllm.events import key64

_MAX_EMPTY = 10_000


@dataclass(frozen=True)
class Mix:
    name: str
    ambiguous: bool  # whether the wire lets a consumer tell every kind apart
    pods: tuple[tuple[str, ModelConfig], ...]  # (release, cache) per pod


def mixes(capacity: int) -> list[Mix]:
    c = capacity
    return [
        Mix(
            "copies 0.9.1+0.20",
            False,
            (
                ("0.9.1", ModelConfig(capacity=c, repeat_prob=0.3, followup_prob=0.4)),
                ("0.20.0", ModelConfig(capacity=c, repeat_prob=0.3, followup_prob=0.4)),
            ),
        ),
        Mix(
            "copies+chunks 0.33",
            False,
            (
                (
                    "0.33.0",
                    ModelConfig(
                        capacity=c,
                        repeat_prob=0.3,
                        cpu_offload_prob=0.5,
                        cpu_capacity=2 * c,
                        offload_chunk_blocks=4,
                    ),
                ),
                ("0.27.0", ModelConfig(capacity=c, cpu_offload_prob=0.5, cpu_capacity=c)),
            ),
        ),
        Mix(
            "report-full 0.33",
            True,
            (
                ("0.33.0", ModelConfig(capacity=c, repeat_prob=0.3, report_full_prob=0.5)),
                ("0.26.0", ModelConfig(capacity=c, report_full_prob=1.0, followup_prob=0.6)),
            ),
        ),
        Mix(
            "report-full+copy-counts",
            False,
            (
                (
                    "0.33.0",
                    ModelConfig(
                        capacity=c,
                        repeat_prob=0.3,
                        report_full_prob=0.5,
                        cpu_offload_prob=0.5,
                        cpu_capacity=2 * c,
                        offload_chunk_blocks=4,
                        copy_counts=True,
                    ),
                ),
            ),
        ),
    ]


@dataclass
class Score:
    tp: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    fp: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    fn: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    prompts: int = 0
    wrong_prompts: int = 0
    error_blocks: int = 0

    def precision(self, tier: str) -> float | None:
        n = self.tp[tier] + self.fp[tier]
        return None if n == 0 else self.tp[tier] / n

    def recall(self, tier: str) -> float | None:
        n = self.tp[tier] + self.fn[tier]
        return None if n == 0 else self.tp[tier] / n


@dataclass
class Checkpoint:
    resident: dict[str, set[bytes]]  # tier name -> normal-form hashes
    prompts: list[tuple[list[int], int]]  # (GPU keys of a served prompt, true prefix blocks)


def _tier(medium: str | None) -> str:
    return "CPU" if medium == "CPU" else "GPU"  # no medium (< 0.10.2): the engine's GPU cache


def _checkpoint(m: PrefixCacheModel) -> Checkpoint:
    resident: dict[str, set[bytes]] = defaultdict(set)
    for (medium, _), hs in m.resident().items():
        resident[_tier(medium)] |= hs
    gpu = resident.get("GPU", set())
    bs = m.config.block_size
    served = [r.tokens for r in m._running] + m._history[-8:]  # noqa: SLF001 (bench peeks)
    prompts = []
    for tokens in served:
        parent, keys, held = m.none_hash, [], 0
        for i in range(len(tokens) // bs):
            parent = chain_hash(parent, tokens[i * bs : (i + 1) * bs])
            h = normal_hash(parent, m.hash_mode)
            keys.append(key64(h))
            if held == i and h in gpu:
                held += 1
        if keys:
            prompts.append((keys, held))
    return Checkpoint(dict(resident), prompts)


def truth_at(spec: PodSpec, templates: list[list[int]], incarnation: int, seqs: set[int]):
    """The pod's model at the seqs asked for, and its copies at the end (for the check)."""
    m = PrefixCacheModel(
        spec.rel, str(spec.hash_mode), f"{spec.seed}:{spec.name}:0:{incarnation}", spec.cache,
        templates=templates,
    )  # fmt: skip
    out: dict[int, Checkpoint] = {}
    for seq in range(max(seqs) + 1):
        for _ in range(_MAX_EMPTY):
            if m.step():
                break
        if seq in seqs:
            out[seq] = _checkpoint(m)
    return out, m.copies()


def score(
    records: list[Record],
    pod: str,
    truth: dict[int, Checkpoint],
    policy: str,
    sc: Score,
    medium: str | None,
) -> None:
    state = CacheState(policy)
    points = sorted(truth)

    def compare(seq: int) -> None:
        t = truth[seq]
        got: dict[str, set[bytes]] = defaultdict(set)
        for (m, _), hs in state.resident(pod, 0).items():
            got[_tier(m)] |= hs
        for tier in ("GPU", "CPU"):
            g, w = got.get(tier, set()), t.resident.get(tier, set())
            sc.tp[tier] += len(g & w)
            sc.fp[tier] += len(g - w)
            sc.fn[tier] += len(w - g)
        for keys, held in t.prompts:
            n = state.prefix_match(keys, medium).get((pod, 0), 0)
            sc.prompts += 1
            sc.wrong_prompts += n != held
            sc.error_blocks += abs(n - held)

    i = 0
    for r in records:
        if r.envelope.pod != pod:
            continue
        while i < len(points) and r.envelope.index >= 0 and r.envelope.seq > points[i]:
            compare(points[i])
            i += 1
        state.apply(r)
    while i < len(points):
        compare(points[i])
        i += 1


@contextmanager
def running_bridge(bootstrap: str, topic: str, pods: list[PodConfig]) -> Iterator[Bridge]:
    bridge = Bridge(
        BridgeConfig(bootstrap_servers=bootstrap, topic=topic, pods=pods, metrics_port=0)
    )
    bridge.open()
    t = threading.Thread(target=bridge.run, name="bridge", daemon=True)
    t.start()
    try:
        yield bridge
    finally:
        bridge.stop.set()
        t.join(60)


def run_mix(bootstrap: str, mix: Mix, batches: int, rate: float) -> dict[str, Score]:
    specs = [
        PodSpec(name=f"p{i}", release=rel, rate=rate, batches=batches, seed=7 + i, cache=cache,
                wait_for_subscriber=True)
        for i, (rel, cache) in enumerate(mix.pods)
    ]  # fmt: skip
    topic = new_topic(bootstrap, "accuracy", 2)
    n_events = 0
    with SimulatedFleet(*specs) as fleet:
        pods = [PodConfig(p.name, p.model, p.pub, p.replay, p.dp_size) for p in fleet.pods]
        with running_bridge(bootstrap, topic, pods):
            fleet.wait_done(timeout=600)
            n_events = sum(len(r["events"]) for r in fleet.sent())
            records: list[Record] = []
            for _ in range(120):
                with TopicReader(bootstrap, topic) as reader:
                    records = [c.record for c in reader.read()]
                if sum(r.envelope.index >= 0 for r in records) >= n_events:
                    break
                threading.Event().wait(0.5)
        finals = {p.name: fleet.copies(p.name) for p in fleet.pods}
        info = {p.name: (p, fleet[p.name].publisher(0).incarnation) for p in fleet.pods}
    seqs = {batches // 4, batches // 2, 3 * batches // 4, batches - 1}
    scores = {policy: Score() for policy in POLICIES}
    for spec in specs:
        pod, inc = info[spec.name]
        truth, final = truth_at(spec, pod.templates, inc, seqs)
        if final != finals[spec.name]:
            raise RuntimeError(f"{mix.name}/{spec.name}: the shadow model left the pod's state")
        for policy in POLICIES:
            medium = "GPU" if "medium" in spec.rel.stored_fields else None
            score(records, spec.name, truth, policy, scores[policy], medium)
    return scores


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def table(results: list[tuple[Mix, dict[str, Score]]]) -> str:
    head = (
        "| mix | wire | policy | GPU precision | GPU recall | CPU precision | CPU recall "
        "| prompts with a wrong prefix | mean prefix error (blocks) |"
    )
    lines = [head, "|" + " --- |" * 9]
    for mix, scores in results:
        for policy, s in scores.items():
            wrong = s.wrong_prompts / s.prompts if s.prompts else 0.0
            err = s.error_blocks / s.prompts if s.prompts else 0.0
            lines.append(
                f"| {mix.name} | {'ambiguous' if mix.ambiguous else 'exact'} | {policy} "
                f"| {_f(s.precision('GPU'))} | {_f(s.recall('GPU'))} | {_f(s.precision('CPU'))} "
                f"| {_f(s.recall('CPU'))} | {wrong:.1%} ({s.prompts}) | {err:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.accuracy", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--bootstrap", help="use this broker (default: start a private one)")
    p.add_argument("--batches", type=int, default=400, help="batches per pod (400)")
    p.add_argument("--rate", type=float, default=400.0, help="batches per second per pod")
    p.add_argument("--capacity", type=int, default=64, help="GPU blocks per engine (64)")
    args = p.parse_args(argv)
    results = []
    with broker(args.bootstrap) as b:
        for mix in mixes(args.capacity):
            results.append((mix, run_mix(b.bootstrap, mix, args.batches, args.rate)))
            print(f"done: {mix.name}", file=sys.stderr, flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
