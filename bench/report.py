"""The results document (JSON) and its rendering as tables.

Top-level keys of the JSON document (``SCHEMA_VERSION`` 1):

``bench``       {"schema_version", "mode", "started", "finished", "seconds", "command"}
``machine``     {"cpus", "platform", "python", "loadavg_start", "loadavg_end"}
``settings``    the options of the run (pod counts, sizes, seed, ...)
``workload``    what the payloads contain (:func:`bench.workload.describe`) and their config
``ceiling``     list of ceiling results (:func:`bench.ceiling.run_ceiling`)
``peers``       the Go peers next to kvbridge's decoder (:func:`bench.peers.run_peers`), or
                {"skipped": why} (not selected, or no ``go`` command) / {"error": ...}:
                {"rounds", "pinned_cpu" (the one CPU every decoder ran on; null where the OS
                cannot pin), "seconds" (of the rounds), "other_cores" (CPU used meanwhile by
                anything but this process and its children, in cores), "pinned_cpu_other_share"
                (the same on the pinned CPU: its share of that CPU's time), "primary" (the
                workload every peer accepts),
                "go": {"version", "gomaxprocs", "modules": {module path: version},
                "decoders": {key: what it calls}, "go_version", "binary", "build_seconds",
                "cached"},
                "workloads": [{"label", "description", "batches", "events"}],
                "results": [one per decoder and workload: {"workload", "decoder" (aibrix,
                llm-d, msgpack: Go; kvbridge_decode, kvbridge_decode_encode, python_unpackb:
                this process), "name", "batches", "ok_batches", "failed_batches", "events"
                (of the decoded batches), "accepts_all", "events_agree" (every batch decoded,
                to as many events as kvbridge's decoder found), "first_error" (if any),
                "cpu_seconds" (median), and only when every batch decoded:
                "cpu_us_per_event" (median of the rounds), "cpu_us_per_event_min", "_max",
                "cpu_us_per_event_rounds", "events_per_s" (median, wall clock)}]}
``naive``       drain result of the naive loop (:func:`bench.e2e.drain_run`; the median of
                the repeats, each listed under "repeats"), or {"skipped": ...} / {"error": ...}
``bridge``      {"warmup": drain result, "scaling": [drain results by pod count; the
                reference pod count is the median of its repeats], "latency": [latency results
                (:func:`bench.e2e.latency_run`)], "workers": [drain results of the same
                32-pod fleet with ``--workers 1`` and ``--workers 2`` (key "workers")]}
``ratios``      list of {"name", "value", "numerator", "denominator"} measured in this run
``notes``       list of strings (what was skipped and why, caveats)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
TOP_KEYS = ("bench", "machine", "settings", "workload", "ceiling", "naive", "bridge", "ratios")
PEER_KEYS = ("rounds", "pinned_cpu", "other_cores", "go", "workloads", "primary", "results")
PEER_RESULT_KEYS = ("workload", "decoder", "name", "batches", "failed_batches", "events")
PEER_RESULT_KEYS += ("accepts_all", "events_agree", "cpu_seconds")
CEILING_KEYS = ("label", "events", "payload_bytes", "seconds", "events_per_s", "mb_per_s")
CEILING_KEYS += ("cpu_us_per_event", "decode_cpu_us_per_event", "encode_cpu_us_per_event")
DRAIN_KEYS = ("target", "pods", "events", "seconds", "events_per_s", "mb_per_s")
DRAIN_KEYS += ("cpu_us_per_event", "cores", "rss_mb", "peak_rss_mb", "complete")
LATENCY_KEYS = ("pods", "load", "target_events_per_s", "achieved_events_per_s", "samples")
LATENCY_KEYS += ("p50_ms", "p99_ms", "p999_ms")
RATIO_KEYS = ("name", "value", "numerator", "denominator")

__all__ = ["SCHEMA_VERSION", "compute_ratios", "render", "save", "validate"]


def _ok(entry: Any) -> bool:
    return isinstance(entry, dict) and "error" not in entry and "skipped" not in entry


def _ratio(name: str, num: Any, den: Any, num_label: str, den_label: str) -> dict[str, Any]:
    value = None
    if isinstance(num, int | float) and isinstance(den, int | float) and den:
        value = round(num / den, 3)
    return {"name": name, "value": value, "numerator": num_label, "denominator": den_label}


def _peer_ratios(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """kvbridge's decoder speed per core over each Go peer's, on the workload all accept."""
    peers = doc.get("peers")
    if not _ok(peers):
        return []
    primary = {
        r["decoder"]: r
        for r in peers.get("results", [])
        if r.get("workload") == peers.get("primary") and "cpu_us_per_event" in r
    }
    mine = primary.get("kvbridge_decode")
    if mine is None:
        return []
    out = []
    for key, peer, target in (("aibrix", "AIBrix", " (target >= 1.0)"), ("llm-d", "llm-d", "")):
        if key in primary:
            out.append(
                _ratio(
                    f"kvbridge decode / {peer} speed per core{target}",
                    primary[key]["cpu_us_per_event"],
                    mine["cpu_us_per_event"],
                    f"{primary[key]['name']}, CPU µs/ev",
                    f"{mine['name']}, CPU µs/ev ({peers['primary']})",
                )
            )
    return out


def compute_ratios(doc: dict[str, Any], ref_pods: int) -> list[dict[str, Any]]:
    """bridge/ceiling and bridge/naive, for events/s and CPU per event, from this document;
    kvbridge's decoder against the Go peers'."""
    peer_ratios = _peer_ratios(doc)
    ceiling = next((c for c in doc.get("ceiling", []) if c.get("same_payloads_as_e2e")), None)
    bridge = next(
        (r for r in doc.get("bridge", {}).get("scaling", []) if _ok(r) and r["pods"] == ref_pods),
        None,
    )
    naive = doc.get("naive")
    if bridge is None:
        return peer_ratios
    b_label = f"bridge, {ref_pods} pods"
    out = []
    if ceiling is not None:
        c_label = f"ceiling ({ceiling['label']})"
        out.append(
            _ratio(
                "bridge/ceiling events/s",
                bridge["events_per_s"],
                ceiling["events_per_s"],
                b_label,
                c_label,
            )
        )
        out.append(
            _ratio(
                "bridge/ceiling CPU per event",
                bridge["cpu_us_per_event"],
                ceiling["cpu_us_per_event"],
                b_label,
                c_label,
            )
        )
    if _ok(naive):
        n_label = f"naive loop, {naive['pods']} pods"
        out.append(
            _ratio(
                "bridge/naive events/s",
                bridge["events_per_s"],
                naive["events_per_s"],
                b_label,
                n_label,
            )
        )
        out.append(
            _ratio(
                "bridge/naive CPU per event",
                bridge["cpu_us_per_event"],
                naive["cpu_us_per_event"],
                b_label,
                n_label,
            )
        )
    workers = [r for r in doc.get("bridge", {}).get("workers", []) if _ok(r)]
    one = next((r for r in workers if r.get("workers") == 1), None)
    for r in workers:
        if one is not None and r.get("workers", 1) > 1:
            n = r["workers"]
            out.append(
                _ratio(
                    f"--workers {n} / 1 events/s (target >= {0.85 * n:.2f})",
                    r["events_per_s"],
                    one["events_per_s"],
                    f"bridge --workers {n}, {r['pods']} pods",
                    f"bridge --workers 1, {one['pods']} pods",
                )
            )
    return out + peer_ratios


def validate(doc: dict[str, Any]) -> list[str]:
    """Structural problems of a results document (empty list: well-formed)."""
    problems = []
    for key in TOP_KEYS:
        if key not in doc:
            problems.append(f"missing top-level key {key!r}")
    if doc.get("bench", {}).get("schema_version") != SCHEMA_VERSION:
        problems.append("bench.schema_version is not 1")

    def check(entry: Any, keys: tuple[str, ...], where: str) -> None:
        if not isinstance(entry, dict):
            problems.append(f"{where}: not an object")
            return
        if "skipped" in entry or "error" in entry:
            return
        for k in keys:
            if k not in entry:
                problems.append(f"{where}: missing {k!r}")

    for i, c in enumerate(doc.get("ceiling", [])):
        check(c, CEILING_KEYS, f"ceiling[{i}]")
    peers = doc.get("peers", {"skipped": "absent"})
    check(peers, PEER_KEYS, "peers")
    if _ok(peers):
        for i, r in enumerate(peers.get("results", [])):
            check(r, PEER_RESULT_KEYS, f"peers.results[{i}]")
    if "naive" in doc:
        check(doc["naive"], DRAIN_KEYS, "naive")
    bridge = doc.get("bridge", {})
    if not isinstance(bridge, dict) or not {"scaling", "latency"} <= set(bridge):
        problems.append("bridge: expected {'scaling': [...], 'latency': [...]}")
    else:
        for i, r in enumerate(bridge["scaling"]):
            check(r, DRAIN_KEYS, f"bridge.scaling[{i}]")
        for i, r in enumerate(bridge["latency"]):
            check(r, LATENCY_KEYS, f"bridge.latency[{i}]")
    for i, r in enumerate(doc.get("ratios", [])):
        check(r, RATIO_KEYS, f"ratios[{i}]")
    try:
        json.dumps(doc, allow_nan=False)
    except ValueError as exc:
        problems.append(f"not strict JSON: {exc}")
    return problems


def save(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")


# --------------------------------------------------------------------------- tables


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits if abs(value) >= 10 else 2}f}"
    return str(value)


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [[_fmt(v) if not isinstance(v, str) else v for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(
        h.ljust(w) if i == 0 else h.rjust(w)
        for i, (h, w) in enumerate(zip(headers, widths, strict=True))
    )
    out = [line, "  ".join("-" * w for w in widths)]
    for r in cells:
        out.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return out


def _short(label: str) -> str:
    return label.replace(" hashes", "").replace("32-byte", "bytes")


def _render_peers(peers: Any) -> list[str]:
    """The peer tables: every decoder on the primary workload; what each accepts."""
    if not isinstance(peers, dict) or peers.get("skipped") == "not selected":
        return []
    if "skipped" in peers or "error" in peers:
        return ["", f"Peers: {peers.get('skipped') or 'failed: ' + str(peers.get('error'))}"]
    results = peers["results"]
    primary = peers["primary"]
    workload = next((w for w in peers["workloads"] if w["label"] == primary), {})
    cpu = peers["pinned_cpu"]
    go = peers["go"]
    mods = ", ".join(
        f"{m.split('/')[-1] if 'msgpack' not in m else 'msgpack/v5'} {v}"
        for m, v in sorted(go.get("modules", {}).items())
    )
    lines = [
        "",
        f"Peers: {primary} ({workload.get('batches', 0):,} batches, "
        f"{workload.get('events', 0):,} events), all on CPU {cpu}, median of {peers['rounds']} "
        f"interleaved rounds ({go.get('version')}, GOMAXPROCS {go.get('gomaxprocs')}; {mods})",
        f"  meanwhile other processes used {_fmt(peers.get('other_cores'))} cores, and "
        f"{_fmt(peers.get('pinned_cpu_other_share'))} of CPU {cpu}",
    ]
    mine = next(
        (r for r in results if r["workload"] == primary and r["decoder"] == "kvbridge_decode"),
        {},
    )
    headers = ["decoder", "CPU µs/ev", "min-max", "events/s", "kvbridge decode CPU / this"]
    headers += ["events", "all decoded"]
    rows = []
    for r in results:
        if r["workload"] != primary:
            continue
        per = r.get("cpu_us_per_event")
        rel = mine.get("cpu_us_per_event") / per if per and mine.get("cpu_us_per_event") else None
        rows.append(
            [
                r["name"],
                per,
                f"{_fmt(r.get('cpu_us_per_event_min'))}-{_fmt(r.get('cpu_us_per_event_max'))}",
                r.get("events_per_s"),
                "-" if rel is None else f"{rel:.2f}",
                r["events"],
                r["events_agree"],
            ]
        )
    lines += _table(headers, rows)
    labels = [w["label"] for w in peers["workloads"]]
    lines += ["", "Peers: CPU µs/ev per workload where every batch decoded, else batches rejected"]
    rows = []
    errors: list[str] = []
    for name in dict.fromkeys(r["name"] for r in results):
        row: list[Any] = [name]
        for label in labels:
            r = next((x for x in results if x["name"] == name and x["workload"] == label), None)
            if r is None:
                row.append("-")
            elif r["accepts_all"]:
                row.append(r.get("cpu_us_per_event"))
            else:
                row.append(f"rejects {r['failed_batches']:,}/{r['batches']:,}")
                if r.get("first_error") and not any(e.startswith(name) for e in errors):
                    errors.append(f"{name} on {label}: {r['first_error'][:160]}")
        rows.append(row)
    lines += _table(["decoder", *map(_short, labels)], rows)
    lines += [f"  {e}" for e in errors]
    return lines


def render(doc: dict[str, Any]) -> str:
    """The human-readable report: throughput, latency, ratios, notes."""
    b = doc["bench"]
    m = doc["machine"]
    lines = [
        f"kvbridge benchmark ({b['mode']}): {m['cpus']} CPUs, {m['platform']}, Python "
        f"{m['python']}, {b['seconds']:.0f} s, load average {m['loadavg_start']} at start",
    ]
    w = doc.get("workload", {})
    if w:
        share = w.get("share_by_type", {})
        lines.append(
            f"workload: {w.get('label', '')}; {w.get('events_per_batch')} events/batch, "
            f"{w.get('bytes_per_batch')} payload bytes/batch; "
            + ", ".join(f"{k} {v:.1%}" for k, v in share.items())
            + f"; BlockStored {w.get('stored_blocks_min')}-{w.get('stored_blocks_max')} blocks "
            f"(mean {w.get('stored_blocks_mean')}) of {w.get('tokens_per_block')} tokens"
        )
    throughput_title = "Throughput (ceiling: in-process; others: backlog drained into Kafka, acked)"
    headers = ["run", "pods", "events", "ev/batch", "seconds", "events/s", "MB/s", "CPU µs/ev"]
    headers += ["cores"]
    headers += ["idle MB", "RSS MB", "peak MB", "other cores", "complete"]
    rows: list[list[Any]] = []
    for c in doc.get("ceiling", []):
        rows.append(
            [f"ceiling: {c['label']}", "-", c["events"], c["events"] / c["batches"]]
            + [f"{c['seconds']:.2f}", c["events_per_s"]]
            + [c["mb_per_s"], c["cpu_us_per_event"], "1.00", "-", "-", "-", "-", "-"]
        )

    problems: list[str] = []

    def drain_row(name: str, r: dict[str, Any]) -> list[Any]:
        if "skipped" in r or "error" in r:
            kind = "skipped" if "skipped" in r else "failed"
            problems.append(f"{name}, {r.get('pods', '?')} pods: {r.get(kind, r.get('error'))}")
            return [name, r.get("pods", "-"), kind] + [""] * 11
        return [
            name,
            r["pods"],
            r["events"],
            r.get("mix", {}).get("events_per_batch"),
            f"{r['seconds']:.2f}",
            r["events_per_s"],
            r["mb_per_s"],
            r["cpu_us_per_event"],
            r["cores"],
            r.get("rss_idle_mb"),
            r["rss_mb"],
            r["peak_rss_mb"],
            r.get("other_cores"),
            r["complete"],
        ]

    naive = doc.get("naive")
    if isinstance(naive, dict) and naive.get("skipped") != "not selected":
        rows.append(drain_row("naive loop", naive))
    for r in doc.get("bridge", {}).get("scaling", []):
        rows.append(drain_row("bridge", r))
    for r in doc.get("bridge", {}).get("workers", []):
        rows.append(drain_row(f"bridge --workers {r.get('workers', '?')}", r))
    if rows:
        lines += ["", throughput_title, *_table(headers, rows)]
    lines += [f"  {p}" for p in problems]
    split = [c for c in doc.get("ceiling", []) if "decode_cpu_us_per_event" in c]
    if split:
        lines += [
            "",
            "Ceiling split (CPU µs per event; encode = decode + encode minus decode alone)",
        ]
        lines += _table(
            ["ceiling", "decode", "encode", "encode alone", "decode + encode"],
            [
                [c["label"], c["decode_cpu_us_per_event"], c["encode_cpu_us_per_event"]]
                + [c.get("encode_only_cpu_us_per_event", ""), c["cpu_us_per_event"]]
                for c in split
            ],
        )

    lines += _render_peers(doc.get("peers"))

    lat = doc.get("bridge", {}).get("latency", [])
    if lat:
        pods = next((r["pods"] for r in lat if "pods" in r), "?")
        source = next((r["source"] for r in lat if "source" in r), "?")
        lines += [
            "",
            f"Latency, bridge, {pods} pods ({source}): vLLM batch ts -> consumer receives the "
            "record (ms; 'to producer': ts -> the bridge hands it to the Kafka producer)",
        ]
        headers = ["load", "target ev/s", "achieved ev/s", "samples", "p50 ms", "p99 ms"]
        headers += ["p99.9 ms", "to producer p50/p99", "bridge cores", "pods cores"]
        headers += ["broker cores", "other cores", "complete"]
        rows = []
        lat_problems: list[str] = []
        for r in lat:
            if "skipped" in r or "error" in r:
                kind = "skipped" if "skipped" in r else "failed"
                lat_problems.append(f"{r.get('load', 0):.0%}: {r.get(kind, r.get('error'))}")
                rows.append([f"{r.get('load', 0):.0%}", kind] + [""] * 11)
                continue
            rows.append(
                [
                    f"{r['load']:.0%}",
                    r["target_events_per_s"],
                    r["achieved_events_per_s"],
                    r["samples"],
                    r["p50_ms"],
                    r["p99_ms"],
                    r["p999_ms"],
                    f"{_fmt(r.get('to_producer_p50_ms'))}/{_fmt(r.get('to_producer_p99_ms'))}",
                    r.get("bridge_cores"),
                    r.get("pods_cores"),
                    r.get("broker_cores"),
                    r.get("other_cores"),
                    r.get("complete"),
                ]
            )
        lines += _table(headers, rows)
        lines += [f"  {p}" for p in lat_problems]

    ratios = doc.get("ratios", [])
    if ratios:
        lines += ["", "Ratios (measured side by side in this run)"]
        rows = [
            [r["name"], "-" if r["value"] is None else f"{r['value']:.2f}", r["numerator"]]
            + [r["denominator"]]
            for r in ratios
        ]
        lines += _table(["ratio", "value", "numerator", "denominator"], rows)
    notes = doc.get("notes", [])
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(lines)
