"""Benchmark of scoring prompts by token ids (``CacheState.score``, ``POST /score``).

    python -m bench.score [--pods 512] [--queries 2000] [--prompt-tokens 8192]

1. **Fleet.** ``--pods`` streams of one model (blocks of 16 tokens), filled through
   ``CacheState.apply`` with ``BlockStored`` events as vLLM sends them (runs of up to 32
   blocks, token ids included, parents chained, each pod its own engine hashes): every pod
   holds the fleet's system prompts (8, 1-2k tokens) and a few of its few-shot templates
   (16, 0.5-2k tokens, each after a system prompt), and its own multi-turn conversations
   (system prompt [+ template] + turns, up to ``--prompt-tokens``); half the pods also hold
   their older conversations in a CPU tier (offload placeholders, no tokens).
2. **Queries**, in this process (after ``gc.freeze()``, as ``state --serve`` does once caught
   up), timed one by one (``time.perf_counter_ns``), three kinds
   interleaved: *turn* (a pod's conversation plus a new turn: one pod matches most of it,
   every pod the system prompt), *new* (a system prompt, a template and a new question),
   *cold* (nothing cached). Each is timed as the library call (``bridge.consume.score``: validate,
   walk, rows) and as the server's work without the socket (JSON body parsed, answer
   JSON-encoded). p50/p99 per kind and over all.
3. **Memory** per resident block (tracemalloc), a smaller fleet built with and without the
   content index: the index's own bytes per block.
4. **Ingest.** The state's apply rate on the bridge benchmark's workload (bench/workload.py
   payloads, decoded to records as a reader gets them), with and without the content index,
   interleaved and repeated; next to the bridge's own per-event work on the same payloads
   (bench/ceiling.py: decode + Avro encode), the most the bridge can send.

Prints a table and writes JSON to bench/results/score-<UTC timestamp>.json (and --out FILE).
No broker needed.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
import tracemalloc
from array import array
from datetime import UTC, datetime
from hashlib import blake2b
from pathlib import Path
from typing import Any

import msgspec

from bench.ceiling import run_ceiling
from bench.score_before import score_before
from bench.workload import WorkloadConfig, generate
from bridge.consume.score import make_request, parse_body, score, score_groups
from bridge.consume.state import CacheState
from bridge.consume.stateserve import _staleness, parse_score_body, score_view
from bridge.log.markers import StreamStarted
from bridge.log.records import Envelope, Record
from bridge.vllm.decoder import decode_batch
from bridge.vllm.events import BlockStored

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODEL = "bench-model"
BS = 16
RUN = 32  # blocks per BlockStored at most (a 512-token prefill chunk)
MAX_TOKEN = 150_000


class Fleet:
    """The shared prompts and each pod's conversations (token lists), deterministic."""

    def __init__(self, pods: int, prompt_tokens: int, convs: int, seed: int) -> None:
        rng = random.Random(f"bench-score:{seed}")
        self.rng = rng
        self.prompt_tokens = prompt_tokens

        def toks(lo: int, hi: int) -> list[int]:
            return [rng.randint(0, MAX_TOKEN) for _ in range(rng.randint(lo, hi))]

        self.system = [toks(1024, 2048) for _ in range(8)]
        self.templates = [(i % 8, toks(512, 2048)) for i in range(16)]
        self.pods = [f"pod-{i:03d}" for i in range(pods)]
        self.convs: dict[str, list[list[int]]] = {}
        self.pod_templates: dict[str, list[int]] = {}
        for pod in self.pods:
            self.pod_templates[pod] = rng.sample(range(16), 4)
            out = []
            for _ in range(convs):
                if rng.random() < 0.5:
                    t = rng.choice(self.pod_templates[pod])
                    s, tmpl = self.templates[t]
                    prefix = self.system[s] + tmpl
                else:
                    prefix = list(rng.choice(self.system))
                conv = list(prefix)
                target = rng.randint(prompt_tokens // 2, prompt_tokens - 512)
                while len(conv) < target:  # turns: a user message and an answer
                    conv += toks(64, 512)
                out.append(conv[:target])
            self.convs[pod] = out

    def held(self, pod: str, i: int) -> list[tuple[list[int], str]]:
        """(tokens, medium) of the sequences pod ``i`` holds; the CPU ones stored after."""
        seqs = [(s, "GPU") for s in self.system]
        for t in self.pod_templates[pod]:
            s, tmpl = self.templates[t]
            seqs.append((self.system[s] + tmpl, "GPU"))
        convs = self.convs[pod]
        seqs += [(c, "GPU") for c in convs[: len(convs) // 2 + 1]]
        if i % 2:
            seqs += [(c, "CPU") for c in convs]
        else:
            seqs += [(c, "GPU") for c in convs[len(convs) // 2 + 1 :]]
        return seqs


def fill(state: CacheState, fleet: Fleet, pods: list[str] | None = None) -> tuple[int, float]:
    """Store every pod's sequences as vLLM would; (events applied, seconds in apply)."""
    n = 0
    spent = 0.0
    clock = time.perf_counter
    for i, pod in enumerate(pods or fleet.pods):
        salt = pod.encode()
        seq = 0
        for tokens, medium in fleet.held(pod, i):
            nb = len(tokens) // BS
            packed = array("I", tokens).tobytes()
            hashes: list[bytes] = []
            parent = salt  # this pod's own engine hashes (as its own NONE_HASH)
            for b in range(nb):
                parent = blake2b(
                    parent + packed[b * 4 * BS : (b + 1) * 4 * BS], digest_size=8
                ).digest()
                hashes.append(parent)
            if medium == "CPU":  # offload placeholders of the whole sequence
                runs = [(j, min(j + RUN, nb)) for j in range(0, nb, RUN)]
                events = [BlockStored(hashes[a:b], None, [], 0, medium="CPU") for a, b in runs]
            else:
                events = []
                for a in range(0, nb, RUN):
                    b = min(a + RUN, nb)
                    events.append(
                        BlockStored(
                            hashes[a:b],
                            hashes[a - 1] if a else None,
                            tokens[a * BS : b * BS],
                            BS,
                            medium="GPU",
                            group_idx=0,
                        )
                    )
            for ev in events:
                rec = Record(Envelope(pod, MODEL, 0, 1, seq, 0, 0.0), ev)
                t0 = clock()
                state.apply(rec)
                spent += clock() - t0
                seq += 1
                n += 1
    return n, spent


def queries(fleet: Fleet, n: int) -> list[tuple[str, tuple[int, ...]]]:
    rng = random.Random(1)
    out = []
    limit = fleet.prompt_tokens
    for q in range(n):
        kind = ("turn", "new", "cold")[q % 3]
        if kind == "turn":
            pod = rng.choice(fleet.pods)
            conv = rng.choice(fleet.convs[pod])
            toks = (conv + [rng.randint(0, MAX_TOKEN) for _ in range(256)])[:limit]
        elif kind == "new":
            s, tmpl = rng.choice(fleet.templates)
            toks = fleet.system[s] + tmpl
            toks = (toks + [rng.randint(0, MAX_TOKEN) for _ in range(limit)])[:limit]
        else:
            toks = [rng.randint(0, MAX_TOKEN) for _ in range(limit)]
        # A tuple of ints leaves the cyclic GC's lists; a list of 8k ints kept for the whole
        # run would be scanned by each full collection (a server's request lists are not kept).
        out.append((kind, tuple(toks)))
    return out


def pct(values: list[int], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] / 1000.0  # ns -> us


def _srv_before(state: CacheState, last_ts: dict, body: bytes, now: int) -> bytes:
    """What POST /score did before the p99 round (without the socket)."""
    req = parse_body(json.loads(body), body)
    rows = score_before(state, req)
    for r in rows:
        r["staleness_s"] = _staleness(last_ts, (r["pod"], r["dp_rank"]), now)
    doc = {"model": req.model, "query_tokens": req.n_tokens, "pods": rows, "ready": True}
    return json.dumps(doc).encode()


def _srv(state: CacheState, last_ts: dict, body: bytes, now: int) -> bytes:
    """What POST /score does (without the socket): parse, score, staleness, encode."""
    doc = score_view(state, last_ts, parse_score_body(body), now)
    doc["ready"] = True
    return msgspec.json.encode(doc)


def _lib(fn: Any, state: CacheState, toks: list[int], limit: int | None) -> Any:
    return fn(state, make_request(MODEL, toks, limit=limit))


def _lib_group(state: CacheState, toks: list[int]) -> Any:
    return score_groups(state, make_request(MODEL, toks, group=True))


VARIANTS = (
    "lib",
    "srv",
    "lib_before",
    "srv_before",
    "lib_limit",
    "srv_limit",
    "lib_group",
    "srv_group",
)
TAGS = ("before", "limit", "group")


def time_queries(
    state: CacheState, qs: list[tuple[str, tuple[int, ...]]], limit: int = 8
) -> dict[str, Any]:
    """Each query timed eight ways, interleaved (the order rotating query by query): the
    library call and the server's work, now, before the p99 round, with ``limit``, and
    grouped (``"group": true``)."""
    times: dict[str, dict[str, list[int]]] = {v: {} for v in VARIANTS}
    rows: dict[str, list[int]] = {}
    tokens: dict[str, list[int]] = {}
    last_ts = dict.fromkeys(state.streams, 0)  # as a live server: each stream's last record
    now = 1000
    clock = time.perf_counter_ns
    for q, (kind, tup) in enumerate(qs):
        toks = list(tup)
        body = json.dumps({"model": MODEL, "token_ids": toks}).encode()
        lbody = json.dumps({"model": MODEL, "token_ids": toks, "limit": limit}).encode()
        gbody = json.dumps({"model": MODEL, "token_ids": toks, "group": True}).encode()
        runs: dict[str, tuple[Any, ...]] = {
            "lib": (_lib, score, state, toks, None),
            "srv": (_srv, state, last_ts, body, now),
            "lib_before": (_lib, score_before, state, toks, None),
            "srv_before": (_srv_before, state, last_ts, body, now),
            "lib_limit": (_lib, score, state, toks, limit),
            "srv_limit": (_srv, state, last_ts, lbody, now),
            "lib_group": (_lib_group, state, toks),
            "srv_group": (_srv, state, last_ts, gbody, now),
        }
        r = q % len(VARIANTS)
        order = VARIANTS[r:] + VARIANTS[:r]
        got: Any = None
        for v in order:
            fn, *args = runs[v]
            t0 = clock()
            r = fn(*args)
            t1 = clock()
            times[v].setdefault(kind, []).append(t1 - t0)
            if v == "lib":
                got = r
        rows.setdefault(kind, []).append(len(got))
        tokens.setdefault(kind, []).append(max((r["any_tier_tokens"] for r in got), default=0))

    def values(d: dict[str, list[int]], kind: str) -> list[int]:
        return [v for vs in d.values() for v in vs] if kind == "all" else d[kind]

    out: dict[str, Any] = {"limit": limit}
    for kind in ("turn", "new", "cold", "all"):
        lv, sv = values(times["lib"], kind), values(times["srv"], kind)
        out[kind] = {
            "queries": len(lv),
            "lib_p50_us": pct(lv, 0.5),
            "lib_p99_us": pct(lv, 0.99),
            "server_p50_us": pct(sv, 0.5),
            "server_p99_us": pct(sv, 0.99),
            "rows_mean": round(statistics.mean(values(rows, kind)), 1),
            "best_tokens_mean": round(statistics.mean(values(tokens, kind))),
        }
        for tag in TAGS:
            lv, sv = values(times[f"lib_{tag}"], kind), values(times[f"srv_{tag}"], kind)
            out[kind][tag] = {
                "lib_p50_us": pct(lv, 0.5),
                "lib_p99_us": pct(lv, 0.99),
                "server_p50_us": pct(sv, 0.5),
                "server_p99_us": pct(sv, 0.99),
            }
    return out


def memory(fleet: Fleet, pods: int) -> dict[str, Any]:
    """tracemalloc bytes per resident block of the first ``pods`` pods, with and without
    the content index."""
    out: dict[str, Any] = {"pods": pods}
    for content in (False, True):
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        state = CacheState(content=content)
        fill(state, fleet, fleet.pods[:pods])
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        n = state.resident_blocks()
        out["resident_blocks"] = n
        out["with_index" if content else "without_index"] = round(used / n, 1)
        del state
    out["index_per_block"] = round(out["with_index"] - out["without_index"], 1)
    return out


def ingest(batches_per_pod: int, repeats: int) -> dict[str, Any]:
    """Apply rate (records/s) with and without the content index, interleaved, against the
    bridge's per-event work (the ceiling) on the same payloads."""
    cfg = WorkloadConfig(pods=16, batches_per_pod=batches_per_pod, seed=0)
    payloads = generate(cfg)
    names = cfg.pod_names()
    records: list[Record] = []
    for pod in names:
        records.append(Record(Envelope(pod, cfg.model, 0, 1, 0, -1, 0.0), StreamStarted(0, "x")))
    for i, payload in enumerate(payloads):  # generate() lists the pods' batches round-robin
        pod = names[i % len(names)]
        seq = i // len(names)
        for index, ev in enumerate(decode_batch(payload).events):
            records.append(Record(Envelope(pod, cfg.model, 0, 1, seq, index, 0.0), ev))
    rates: dict[str, list[float]] = {"with_index": [], "without_index": []}
    for _ in range(repeats):
        for content in (True, False):
            state = CacheState(content=content)
            apply = state.apply
            t0 = time.perf_counter()
            for r in records:
                apply(r)
            dt = time.perf_counter() - t0
            rates["with_index" if content else "without_index"].append(len(records) / dt)
    ceiling = [run_ceiling(payloads, "bridge")["events_per_s"] for _ in range(repeats)]
    med = {k: round(statistics.median(v)) for k, v in rates.items()}
    return {
        "records": len(records),
        "stores_share": round(sum(type(r.event) is BlockStored for r in records) / len(records), 3),
        "apply_per_s": med,
        "apply_per_s_all": {k: [round(x) for x in v] for k, v in rates.items()},
        "bridge_ceiling_events_per_s": round(statistics.median(ceiling)),
        "bridge_ceiling_all": [round(x) for x in ceiling],
        "with_index_vs_ceiling": round(med["with_index"] / statistics.median(ceiling), 2),
        "with_vs_without_index": round(med["with_index"] / med["without_index"], 2),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.score",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--pods", type=int, default=512, help="streams in the fleet (512)")
    p.add_argument("--prompt-tokens", type=int, default=8192, help="tokens per prompt (8192)")
    p.add_argument("--convs", type=int, default=4, help="conversations held per pod (4)")
    p.add_argument("--queries", type=int, default=3000, help="queries timed (3000)")
    p.add_argument("--memory-pods", type=int, default=64, help="pods of the memory fleet (64)")
    p.add_argument("--ingest-batches", type=int, default=3000, help="batches per pod (16 pods)")
    p.add_argument("--repeats", type=int, default=3, help="ingest repeats, interleaved (3)")
    p.add_argument("--limit", type=int, default=8, help='the "limit" of the limited runs (8)')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default=str(RESULTS_DIR), help="where the JSON goes")
    p.add_argument("--out", metavar="FILE", help="also write the JSON results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.pods < 1 or args.queries < 3 or args.prompt_tokens < 1024 or args.convs < 1:
        print("--pods >= 1, --queries >= 3, --prompt-tokens >= 1024, --convs >= 1", file=sys.stderr)
        return 2
    started = datetime.now(UTC)
    out: dict[str, Any] = {
        "bench": "score",
        "started": started.isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": {"cpus": _cpus(), "platform": platform.platform()},
        "pods": args.pods,
        "prompt_tokens": args.prompt_tokens,
    }
    print(f"building a fleet of {args.pods} pods ...", file=sys.stderr)
    fleet = Fleet(args.pods, args.prompt_tokens, args.convs, args.seed)
    state = CacheState()
    events, spent = fill(state, fleet)
    out["fleet"] = {
        "events": events,
        "resident_blocks": state.resident_blocks(),
        "indexed_blocks": state.content.indexed_blocks() if state.content else 0,
        "apply_score_events_per_s": round(events / spent),
        "skipped": dict(state.content.skipped) if state.content else {},
    }
    # As state --serve does once caught up: the state's objects out of the cyclic GC's scans
    gc.collect()
    gc.freeze()
    print(f"timing {args.queries} queries ...", file=sys.stderr)
    out["load_average"] = _load()
    out["queries"] = time_queries(state, queries(fleet, args.queries), args.limit)
    out["load_average_after"] = _load()
    del state
    gc.unfreeze()
    gc.collect()
    print("memory per resident block ...", file=sys.stderr)
    out["memory"] = memory(fleet, min(args.memory_pods, args.pods))
    print("ingest rate ...", file=sys.stderr)
    out["ingest"] = ingest(args.ingest_batches, args.repeats)
    print(render(out))
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"score-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    text = json.dumps(out, indent=2) + "\n"
    path.write_text(text)
    if args.out:
        Path(args.out).write_text(text)
    print(f"\nresults: {path}" + (f" and {args.out}" if args.out else ""))
    return 0


def render(r: dict[str, Any]) -> str:
    f, m, g = r["fleet"], r["memory"], r["ingest"]
    lines = [
        f"score by token ids: {r['pods']} pods, {f['resident_blocks']:,} resident blocks "
        f"({f['indexed_blocks']:,} indexed), {r['prompt_tokens']}-token prompts",
        "",
        f"{'query':<6} {'n':>5} {'lib p50 us':>11} {'lib p99 us':>11} {'srv p50 us':>11} "
        f"{'srv p99 us':>11} {'rows':>6} {'best tokens':>12}",
    ]
    for kind in ("turn", "new", "cold", "all"):
        q = r["queries"][kind]
        lines.append(
            f"{kind:<6} {q['queries']:>5} {q['lib_p50_us']:>11} {q['lib_p99_us']:>11} "
            f"{q['server_p50_us']:>11} {q['server_p99_us']:>11} {q['rows_mean']:>6} "
            f"{q['best_tokens_mean']:>12,}"
        )
    titles = (("before", "before the p99 round"), ("limit", "with limit"), ("group", "grouped"))
    for tag, title in titles:
        lim = f" {r['queries']['limit']}" if tag == "limit" else ""
        lines += ["", f"{title}{lim} (same queries, interleaved):"]
        for kind in ("turn", "new", "cold", "all"):
            q = r["queries"][kind][tag]
            lines.append(
                f"{kind:<6} {'':>5} {q['lib_p50_us']:>11} {q['lib_p99_us']:>11} "
                f"{q['server_p50_us']:>11} {q['server_p99_us']:>11}"
            )
    p99 = r["queries"]["all"]
    met = [
        name
        for name, q in (
            ("lib", p99),
            ("lib with limit", p99["limit"]),
            ("lib grouped", p99["group"]),
        )
        if q["lib_p99_us"] <= 1000
    ] + [
        name
        for name, q in (
            ("srv", p99),
            ("srv with limit", p99["limit"]),
            ("srv grouped", p99["group"]),
        )
        if q["server_p99_us"] <= 1000
    ]
    lines += [
        "",
        f"p99 <= 1 ms (all queries): {', '.join(met) if met else 'none'}; load average "
        f"{r.get('load_average')} -> {r.get('load_average_after')}",
    ]
    lines += [
        "",
        f"memory/block ({m['pods']} pods, {m['resident_blocks']:,} blocks, tracemalloc): "
        f"{m['without_index']} B without the index, {m['with_index']} B with "
        f"(index: {m['index_per_block']} B)",
        f"ingest (records/s, median of {len(g['bridge_ceiling_all'])}): with index "
        f"{g['apply_per_s']['with_index']:,}, without {g['apply_per_s']['without_index']:,}; "
        f"bridge ceiling {g['bridge_ceiling_events_per_s']:,} events/s; "
        f"with index / ceiling {g['with_index_vs_ceiling']}",
        f"fleet build: {f['apply_score_events_per_s']:,} stores/s of up to {RUN} blocks",
    ]
    return "\n".join(lines)


def _load() -> list[float]:
    import os

    return [round(x, 2) for x in os.getloadavg()]


def _cpus() -> int:
    import os

    return os.cpu_count() or 1


if __name__ == "__main__":
    sys.exit(main())
