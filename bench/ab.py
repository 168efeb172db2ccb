"""`python -m bench.ab --baseline REV`: this tree against another revision, side by side.

Each round runs ``python -m bench`` once with this tree's code and once with the baseline's
(a ``git worktree`` of REV, or a directory), alternating which goes first, against one shared
broker; every run measures the ceiling (decode + encode) and the ``--ref-pods`` drain of the
bridge and of the naive loop (``--only ceiling``: the ceiling alone), so each tree's bridge is
measured in the same run as its own ceiling and naive loop. The report gives, per figure,
the median of the rounds for each tree and their ratio (this tree / baseline; for CPU per
event, baseline / this tree, so that > 1 always means this tree is faster). Each tree's own
bench code drives it: the figures are those its ``python -m bench`` prints.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import report

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"


def _git(*args: str, cwd: Path = ROOT) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench.ab: git {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout.strip()


@contextmanager
def baseline_tree(spec: str) -> Iterator[tuple[Path, str]]:
    """``spec`` as a directory holding a kvbridge checkout, or a revision checked out in a
    temporary ``git worktree`` (removed at the end). Yields (directory, description)."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "bridge").is_dir() or not (path / "bench").is_dir():
            raise SystemExit(f"bench.ab: {spec} holds no bridge/ and bench/: not a checkout")
        yield path.resolve(), f"{spec} (directory)"
        return
    rev = _git("rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}")
    tmp = Path(tempfile.mkdtemp(prefix="kvbridge-ab-"))
    tree = tmp / "baseline"
    _git("worktree", "add", "--detach", "--quiet", str(tree), rev)
    try:
        local = ROOT / ".kafka-local"
        if local.exists() and not (tree / ".kafka-local").exists():
            (tree / ".kafka-local").symlink_to(local)
        yield tree, f"{spec} = {rev[:12]}"
    finally:
        _git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(tmp, ignore_errors=True)


def _figures(doc: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """The compared figures of one bench run: name -> (value, 'higher'|'lower' is better)."""
    out: dict[str, tuple[float, str]] = {}
    for c in doc.get("ceiling", []):
        if c.get("cpu_us_per_event"):
            out[f"ceiling {c['label']}: CPU µs/event"] = (c["cpu_us_per_event"], "lower")
        if c.get("decode_cpu_us_per_event"):
            out[f"ceiling {c['label']}: decode µs/event"] = (c["decode_cpu_us_per_event"], "lower")
    drains = [("bridge", r) for r in doc.get("bridge", {}).get("scaling", [])[:1]]
    if isinstance(doc.get("naive"), dict):
        drains.append(("naive loop", doc["naive"]))
    for name, r in drains:
        if r.get("events_per_s"):
            pods = r.get("pods", "?")
            out[f"{name} {pods} pods: events/s"] = (r["events_per_s"], "higher")
            out[f"{name} {pods} pods: CPU µs/event"] = (r["cpu_us_per_event"], "lower")
    return out


def compare(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows of (figure, baseline median, this tree's median, speed-up, values)."""
    per_tree = {t: [_figures(d) for d in docs] for t, docs in runs.items()}
    names = list(dict.fromkeys(n for figs in per_tree["this"] for n in figs))
    rows = []
    for name in names:
        vals = {t: [f[name][0] for f in figs if name in f] for t, figs in per_tree.items()}
        if not vals["this"] or not vals["baseline"]:
            continue
        better = next(f[name][1] for f in per_tree["this"] if name in f)
        base, this = statistics.median(vals["baseline"]), statistics.median(vals["this"])
        speedup = (this / base if better == "higher" else base / this) if base and this else None
        rows.append(
            {
                "figure": name,
                "baseline": round(base, 2),
                "this": round(this, 2),
                "speedup": round(speedup, 2) if speedup else None,
                "baseline_values": vals["baseline"],
                "this_values": vals["this"],
            }
        )
    return rows


def render(rows: list[dict[str, Any]], base_desc: str, rounds: int) -> str:
    lines = [
        f"This tree vs baseline {base_desc}: medians of {rounds} interleaved rounds;",
        "speed-up > 1 means this tree is faster (events/s up, or CPU per event down).",
        "",
    ]
    table = [
        [r["figure"], r["baseline"], r["this"], f"{r['speedup']}×" if r["speedup"] else "-"]
        for r in rows
    ]
    lines += report._table(["figure", "baseline", "this tree", "speed-up"], table)
    return "\n".join(lines)


def _run_bench(tree: Path, args: argparse.Namespace, bootstrap: str | None, out: Path) -> dict:
    cmd = [sys.executable, "-m", "bench", "--only", args.only, "--out", str(out)]
    if bootstrap:
        cmd += ["--bootstrap", bootstrap, "--ref-pods", str(args.ref_pods), "--repeat", "1"]
    cmd += ["--results-dir", str(out.parent)]
    if args.quick:
        cmd.append("--quick")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise SystemExit(f"bench.ab: the bench of {tree} failed ({proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m bench.ab --baseline main~3            # ~10 min\n"
        "  python -m bench.ab --baseline HEAD~5 --only ceiling --rounds 7   # ~3 min, no broker",
    )
    p.add_argument(
        "--baseline",
        required=True,
        help="a git revision (checked out in a temporary "
        "worktree) or the directory of another checkout",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running both trees (3)")
    p.add_argument("--quick", action="store_true", help="the bench's small sizes (~1 min a run)")
    p.add_argument(
        "--only",
        choices=["ceiling,naive", "ceiling"],
        default="ceiling,naive",
        metavar="PARTS",
        help="the bench parts of each run: 'ceiling,naive' (default), the ceiling and the "
        "drains of the bridge and the naive loop, or 'ceiling', the ceiling alone (seconds a "
        "run, no broker)",
    )
    p.add_argument("--ref-pods", type=int, default=16, help="pods of the drains (16)")
    p.add_argument("--bootstrap", help="use this broker (default: start a private one)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")

    from bench.kafka import broker

    # SIGTERM unwinds like Ctrl-C: the temporary worktree and the broker are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = datetime.now(UTC)
    runs: dict[str, list[dict[str, Any]]] = {"this": [], "baseline": []}
    drains = args.only != "ceiling"
    with (
        baseline_tree(args.baseline) as (base, base_desc),
        broker(args.bootstrap) if drains else nullcontext() as b,
    ):
        bootstrap = b.bootstrap if b is not None else None
        trees = {"this": ROOT, "baseline": base}
        work = Path(tempfile.mkdtemp(prefix="kvbridge-ab-runs-"))
        try:
            for i in range(args.rounds):
                order = ["this", "baseline"] if i % 2 == 0 else ["baseline", "this"]
                for name in order:
                    t0 = time.monotonic()
                    print(f"round {i + 1}/{args.rounds}: {name} ...", flush=True, end=" ")
                    doc = _run_bench(trees[name], args, bootstrap, work / f"{name}-{i}.json")
                    runs[name].append(doc)
                    print(f"{time.monotonic() - t0:.0f}s", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    rows = compare(runs)
    print()
    print(render(rows, base_desc, args.rounds))
    result = {
        "ab": {
            "started": started.isoformat(),
            "baseline": base_desc,
            "this": _git("rev-parse", "--short=12", "HEAD"),
            "rounds": args.rounds,
            "quick": args.quick,
            "parts": args.only,
            "loadavg_end": os.getloadavg(),
        },
        "rows": rows,
        "runs": runs,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"ab-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    report.save(result, path)
    if args.out:
        report.save(result, Path(args.out))
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
