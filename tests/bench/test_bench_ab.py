"""bench.ab: the side-by-side comparison of two trees' bench runs (pure parts, and git)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench import ab


def _doc(ceiling_cpu: float, decode_cpu: float, eps: float, cpu: float, naive_eps: float):
    return {
        "ceiling": [
            {
                "label": "e2e mix",
                "cpu_us_per_event": ceiling_cpu,
                "decode_cpu_us_per_event": decode_cpu,
            }
        ],
        "bridge": {"scaling": [{"pods": 16, "events_per_s": eps, "cpu_us_per_event": cpu}]},
        "naive": {"pods": 16, "events_per_s": naive_eps, "cpu_us_per_event": 50.0},
    }


def test_compare_takes_medians_and_orients_speedups():
    runs = {
        "baseline": [_doc(8.0, 4.0, 40_000, 20.0, 10_000), _doc(9.0, 5.0, 30_000, 25.0, 9_000)]
        + [_doc(100.0, 50.0, 1.0, 99.0, 1.0)],
        "this": [_doc(4.0, 2.0, 60_000, 10.0, 10_000), _doc(4.5, 2.5, 66_000, 11.0, 9_000)]
        + [_doc(3.0, 1.0, 90_000, 9.0, 11_000)],
    }
    rows = {r["figure"]: r for r in ab.compare(runs)}
    ceiling = rows["ceiling e2e mix: CPU µs/event"]
    assert (ceiling["baseline"], ceiling["this"], ceiling["speedup"]) == (9.0, 4.0, 2.25)
    bridge = rows["bridge 16 pods: events/s"]
    assert (bridge["baseline"], bridge["this"], bridge["speedup"]) == (30_000, 66_000, 2.2)
    assert rows["bridge 16 pods: CPU µs/event"]["speedup"] == 2.5  # 25 / 10: lower is better
    assert rows["naive loop 16 pods: events/s"]["speedup"] == 1.11  # 10,000 / 9,000
    assert rows["ceiling e2e mix: decode µs/event"]["this_values"] == [2.0, 2.5, 1.0]
    text = ab.render(list(rows.values()), "main~1", 3)
    assert "2.25×" in text and "medians of 3 interleaved rounds" in text


def test_a_figure_missing_from_one_tree_is_left_out():
    base = _doc(8.0, 4.0, 40_000, 20.0, 10_000)
    del base["ceiling"][0]["decode_cpu_us_per_event"]  # an older bench without the split
    rows = ab.compare({"baseline": [base], "this": [_doc(4.0, 2.0, 60_000, 10.0, 10_000)]})
    assert "ceiling e2e mix: decode µs/event" not in {r["figure"] for r in rows}
    assert len(rows) == 5


def test_baseline_revision_is_a_temporary_worktree_removed_afterwards():
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ab.ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    with ab.baseline_tree("HEAD") as (tree, desc):
        assert (tree / "bridge").is_dir() and (tree / "bench").is_dir()
        assert desc == f"HEAD = {head[:12]}"
        listed = subprocess.run(
            ["git", "worktree", "list"], cwd=ab.ROOT, capture_output=True, text=True
        ).stdout
        assert str(tree) in listed
    assert not tree.exists()
    listed = subprocess.run(
        ["git", "worktree", "list"], cwd=ab.ROOT, capture_output=True, text=True
    ).stdout
    assert str(tree) not in listed


def test_bad_baselines_are_refused_with_a_reason(tmp_path: Path):
    with pytest.raises(SystemExit, match="not a checkout"), ab.baseline_tree(str(tmp_path)):
        pass
    with pytest.raises(SystemExit, match="git rev-parse"), ab.baseline_tree("no-such-rev-xyz"):
        pass
