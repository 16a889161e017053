"""tools/bench_executor.py's comparisons: what its report says about two executors' runs of one search."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bench_executor


def _arm(name: str, sources: list[str], accepted: list[list[str]], s_per: float = 2.0) -> dict:
    return {"arm": name, "s_per_candidate": s_per, "per_minute": 60 / s_per, "dispatch_s": 0.002,
            "accepted": accepted, "sources": sources, "slots_s": [s_per] * len(sources)}


def test_the_same_candidates_with_other_verdicts_are_told_apart_from_another_search():
    """On the H200 both executors evaluated the same 48 candidates in the same order and still kept
    different kernels (verdicts near the margin flip with timing): the report says which it was."""
    sources = ["a1", "b2", "c3"]
    local = _arm("local:1", sources, [["card-x", "a1"], ["card-y", "c3"]])
    ray = _arm("ray:1", sources, [["card-x", "a1"]], s_per=2.04)
    c = bench_executor.comparisons([local, ray])
    assert c["same_candidates"] and not c["same_accepted"]
    assert c["accepted_differences"] == {"ray:1": [("card-y", "c3")]}
    assert abs(c["ray_overhead_per_candidate"] - 0.02) < 1e-9
    other = bench_executor.comparisons([local, _arm("ray:1", ["a1", "c3", "b2"], local["accepted"])])
    assert not other["same_candidates"] and other["same_accepted"]
