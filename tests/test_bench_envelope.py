"""tools/bench_envelope.py: the share of a mixed generate() trace's calls an envelope pack serves, counted
from the pack's own stats(); its CPU mode end to end on tiny-llama (a real build, a real trace)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def test_served_counts_every_kernel_of_an_op_once_against_its_calls(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import bench_envelope

    before = {"aten.mul.Tensor-Fa": {"op": "aten.mul.Tensor", "hits": 5, "misses": 5, "errors": 0, "outside": 2},
              "aten.mul.Tensor-b": {"op": "aten.mul.Tensor", "hits": 1, "misses": 9, "errors": 0},
              "aten.mm.default-c": {"op": "aten.mm.default", "hits": 0, "misses": 10, "errors": 0}}
    after = {"aten.mul.Tensor-Fa": {"op": "aten.mul.Tensor", "hits": 65, "misses": 45, "errors": 1, "outside": 7},
             "aten.mul.Tensor-b": {"op": "aten.mul.Tensor", "hits": 21, "misses": 89, "errors": 0},
             "aten.mm.default-c": {"op": "aten.mm.default", "hits": 4, "misses": 16, "errors": 0}}
    # 100 mul calls: 60 by the family, 20 by the exact kernel, 5 sent to stock by the family kernel's
    # sub-range (it does not pay there); mm has no family: not counted
    assert bench_envelope.served(before, after) == {"aten.mul.Tensor": {"calls": 100, "hits": 80, "errors": 1,
                                                                        "outside": 5}}
    assert bench_envelope.share(bench_envelope.served(before, after)) == pytest.approx(0.8)


def test_fused_kernels_count_their_sites_calls_once_and_every_variants_hits(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import bench_envelope

    # two exact-size RMSNorm variants on one site (decode at batch 1 and at batch 2), 100 site calls
    before = {"fusion_rmsnorm-a": {"op": "fusion.rmsnorm.default", "hits": 0, "misses": 0, "errors": 0, "sites": [0]},
              "fusion_rmsnorm-b": {"op": "fusion.rmsnorm.default", "hits": 0, "misses": 0, "errors": 0, "sites": [0]}}
    after = {"fusion_rmsnorm-a": {"op": "fusion.rmsnorm.default", "hits": 60, "misses": 40, "errors": 0, "sites": [0]},
             "fusion_rmsnorm-b": {"op": "fusion.rmsnorm.default", "hits": 30, "misses": 70, "errors": 1, "sites": [0]},
             "aten.mul.Tensor-Fa": {"op": "aten.mul.Tensor", "hits": 5, "misses": 5, "errors": 0}}
    assert bench_envelope.fused_served(before, after) == {"fusion.rmsnorm.default": {"calls": 100, "hits": 90,
                                                                                   "errors": 1}}


def test_the_families_table_marks_points_timed_at_several_placements(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import bench_envelope

    runs = [{"speedup": 0.85, "ci_low": 0.83, "ci_high": 0.9}, {"speedup": 1.15, "ci_low": 1.1, "ci_high": 1.19}]
    points = [{"values": {"d0": 3, "d1": 720}, "weight": 0.5, "speedup": 0.99, "ci_low": 0.83, "ci_high": 1.19,
               "eager_us": 7.3, "kernel_us": 7.35, "placements": runs},
              {"values": {"d0": 8, "d1": 2050}, "weight": 0.5, "speedup": 1.08, "ci_low": 1.05, "ci_high": 1.1,
               "eager_us": 14.0, "kernel_us": 13.0}]
    kept = [bench_envelope._point(p) for p in points]
    assert kept[0]["placements"] == runs and "placements" not in kept[1]
    md = bench_envelope.families_md([{"card": "cat-F0", "served": None, "share": None, "speedup": 1.03,
                                      "whole_speedup": 1.03, "points": kept}])
    assert "3/720: 0.99x (2 placements)" in md and "8/2050: 1.08x," not in md and "8/2050: 1.08x" in md


def test_a_replay_under_todays_rule_serves_a_parity_point_a_build_once_cut(tmp_path):
    # call 1 of benchmarks/2026-12-04-h200-envelope-confirmed-loss: the residual add kept for batch 1-3 over batch 4's
    # 0.968x [0.961, 1.000]; today's rule keeps it whole, and a loss at every placement stays cut
    def point(b, s, speedup, low, high, weight):
        return {"values": {"d0": b, "d1": s}, "weight": weight, "speedup": speedup, "ci_low": low, "ci_high": high,
                "eager_us": 4.0, "kernel_us": 4.0 / speedup}

    add = [point(1, 16, 1.053, 1.0, 1.146, 0.07), point(1, 1, 1.049, 0.993, 1.188, 0.16),
           point(3, 719, 1.019, 0.998, 1.042, 0.07), point(4, 1123, 0.996, 0.990, 1.0, 0.05),
           point(4, 1, 0.968, 0.961, 1.0, 0.42), point(8, 2296, 0.997, 0.991, 1.003, 0.23)]
    lost = [point(1, 1, 0.948, 0.912, 0.952, 0.375), point(8, 1, 1.055, 1.055, 1.106, 0.625)]
    families = {"commit": "fc3f9d9", "families": [
        {"card": "add_Tensor-Fddcbd7dcc0", "served": "d0 in 1..3", "share": 0.28, "points": add},
        {"card": "mul_Tensor-Fa97de3b98c", "served": "d0 in 8..8", "share": 0.625, "points": lost}]}
    source = tmp_path / "bench_envelope-llama_envelope-families.json"
    source.write_text(json.dumps(families))
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    proc = subprocess.run([sys.executable, str(TOOLS / "replay_subranges.py"), str(source)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "results" / "replay_subranges-llama_envelope.json").read_text())
    add_row, mul_row = data["families"]
    assert add_row["built"] == "d0 in 1..3" and add_row["now"] == "whole range" and add_row["now_share"] == 1.0
    assert mul_row["now"] != "whole range" and mul_row["points_now"] == 1 and mul_row["now_share"] == 0.625
    assert data["source_commit"] == "fc3f9d9"
    (tmp_path / "other.json").write_text(json.dumps({"served": 0.9}))  # a trace's JSON, not a build's families
    for bad in (tmp_path / "missing.json", tmp_path / "other.json"):
        proc = subprocess.run([sys.executable, str(TOOLS / "replay_subranges.py"), str(bad)], env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and str(bad) in proc.stderr


def test_the_envelope_recipe_carries_the_build_knobs(monkeypatch):
    """A device call's build: a time limit, and for the served-share measurement every verified kernel
    kept (margin -0.99); left out, the base recipe's margin stands."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import bench_envelope

    r = bench_envelope.envelope_recipe("tiny-llama", "1-8", "16-2048", 2304, 8, "cpu", 48, False, 240.0, -0.99)
    assert (r.build.budget, r.build.gate, r.build.time_limit, r.build.margin) == (48, False, 240.0, -0.99)
    assert r.workload.phase == "generate" and (r.workload.batch.min, r.workload.batch.max) == (1, 8)
    plain = bench_envelope.envelope_recipe("tiny-llama", "1-8", "16-2048", 2304, 8, "cpu", 48, True)
    assert plain.build.time_limit is None and plain.build.margin == 0.05


def test_a_negative_misses_count_is_refused_before_anything_is_built(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(TOOLS))
    import bench_envelope

    with pytest.raises(SystemExit) as exit_:
        bench_envelope.main(["--misses", "-1"])
    assert exit_.value.code == 2 and "--misses takes a count" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.long
def test_cpu_mode_builds_an_envelope_pack_and_counts_what_it_serves(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "FORGEPACK_HOME": str(tmp_path / "home"),
           "FORGEPACK_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, str(TOOLS / "bench_envelope.py"), "--base", "tiny-llama", "--target", "cpu",
           "--batch", "1-2", "--seq-len", "8-16", "--capture-new", "3", "--budget", "8", "--no-gate",
           "--batches", "1,2", "--prompt", "8,16", "--new", "3,5", "--requests", "3", "--misses", "2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = tmp_path / "out" / "results"
    data = json.loads((results / "bench_envelope-tiny_llama_envelope.json").read_text())
    assert data["build"]["gate"] == "skipped" and data["recipe"]["workload"]["phase"] == "generate"
    assert len(data["requests"]) == 3 and data["same_tokens"]
    assert data["ops"] and data["served"] > 0
    assert all(d["errors"] == 0 for d in data["ops"].values())
    # float32 on CPU: the pack's decode is as close to eager as stock's own, and never wrong where no tie
    agree = data["agreement"]
    assert agree["pack"]["top1_clear"] == 1.0 and agree["pack"]["max_err_over_scale"] < 1e-4
    assert all(set(r["agreement"]) == {"stock", "pack"} for r in data["requests"])
    md = (results / "bench_envelope-tiny_llama_envelope.md").read_text()
    assert "served: **" in md and data["commit"] in md and "top-1 where not a near-tie" in md
    # --misses 2: the first request re-run under pack.record_misses(), each op's two most frequent misses
    # (the pack serves part of the calls, so some miss), named by their arguments' dtypes and sizes
    per_op = [m["op"] for m in data["misses"]]
    assert per_op and all(op.startswith("aten.") for op in per_op) and all(per_op.count(op) <= 2 for op in per_op)
    assert all(m["count"] > 0 and "[" in m["signature"] and " cpu" in m["signature"] for m in data["misses"])
    assert "re-run once with the pack under `pack.record_misses()`" in md and data["misses"][0]["signature"] in md
