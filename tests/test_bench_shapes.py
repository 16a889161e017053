"""tools/bench_shapes.py: an envelope pack against stock shape by shape, and against the exact-shape pack at
that pack's own shape; its CPU run on tiny-llama with two real builds (an envelope pack and an exact one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forgepack import recipe

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.fixture
def tool(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import bench_shapes

    return bench_shapes


def test_the_base_shape_comes_first_and_the_grid_takes_the_envelopes_form(tool):
    base = recipe.resolve("llama-1b-decode")
    grid = tool.shapes(base, [1, 8], [16, 2048], [512])
    assert [s.label for s in grid] == ["base", "prefill b1 s16", "prefill b1 s2048", "decode b1 c512",
                                       "prefill b8 s16", "prefill b8 s2048", "decode b8 c512"]
    assert grid[0].recipe == base and base.workload.static_cache  # the exact pack's own shape, as built
    prefill, decode = grid[5].recipe.workload, grid[6].recipe.workload
    assert (prefill.phase, prefill.batch, prefill.seq_len, prefill.cache_len) == ("prefill", 8, 2048, 0)
    assert (decode.phase, decode.batch, decode.seq_len, decode.cache_len) == ("decode", 8, 1, 512)
    assert not prefill.static_cache and not decode.static_cache  # generate()'s default dynamic cache


def test_slower_means_beyond_noise_and_the_exact_comparison_is_made_at_the_base_shape(tool):
    def row(shape, env_ci, exact_ci, ratio):
        return {"shape": shape, "envelope": {"ci": env_ci}, "exact": {"ci": exact_ci},
                "envelope_vs_exact": {"ratio": ratio}}

    assert tool.verdict(row("base", (0.90, 1.02), (0.95, 0.99), 0.975)) == "exact slower than stock; within 3% of exact"
    assert tool.verdict(row("base", (1.01, 1.10), (1.05, 1.20), 0.96)) == "4.0% behind exact"
    # off the exact pack's shape its kernels do not fire: no comparison with it there
    assert tool.verdict(row("decode b1 c16", (0.97, 1.05), (0.98, 1.01), 0.5)) == ""
    assert tool.verdict(row("decode b1 c16", (0.90, 0.99), (0.98, 1.01), 1.0)) == "envelope slower than stock"
    assert tool.verdict({"shape": "base", "envelope": {"ci": (1.0, 1.1)}}) == ""  # no exact pack given


def _run(cmd: list[str], env: dict, cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    """An envelope pack (batch 1-2, prompts 8-16) and tiny-llama's exact-shape pack (prefill b1 s32), each
    from a real build on the cpu target. The envelope's first calls go to its decode blocks (they weigh
    every decode step), which serve forgepack's decode loop, not the forwards timed here: a budget of 10
    reaches the families of norm and rotary too."""
    root = tmp_path_factory.mktemp("shapes")
    env = {**os.environ, "OUT": str(root / "out"), "FORGEPACK_HOME": str(root / "home"),
           "FORGEPACK_CACHE": str(root / "cache")}
    _run([sys.executable, str(TOOLS / "bench_envelope.py"), "--base", "tiny-llama", "--target", "cpu", "--batch",
          "1-2", "--seq-len", "8-16", "--capture-new", "3", "--budget", "10", "--no-gate", "--build-only"], env, root)
    exact = json.loads(_run([sys.executable, "-m", "forgepack", "build", "tiny-llama", "--target", "cpu", "--budget",
                             "2", "--no-gate", "--workspace", str(root / "exact-ws"), "--out", str(root / "exact"),
                             "--json"], env, root))
    envelope = next((root / "out" / "packs").glob("forgepack_pack_tiny_llama_envelope-*.whl"))
    return root, env, envelope, Path(exact["wheel"])


@pytest.mark.long  # two real builds first (an envelope pack and an exact one): 125 s of CI's 30 minutes
def test_cpu_run_times_stock_and_both_packs_at_every_shape(wheels):
    root, env, envelope, exact = wheels
    _run([sys.executable, str(TOOLS / "bench_shapes.py"), "--base", "tiny-llama", "--target", "cpu", "--pack",
          str(envelope), "--exact", str(exact), "--batches", "1,2", "--prompts", "8,16", "--caches", "16",
          "--rounds", "3", "--reps", "1"], env, root)
    results = root / "out" / "results"
    data = json.loads((results / "bench_shapes-tiny_llama.json").read_text())
    rows = {r["shape"]: r for r in data["rows"]}
    assert list(rows) == ["base", "prefill b1 s8", "prefill b1 s16", "decode b1 c16", "prefill b2 s8",
                          "prefill b2 s16", "decode b2 c16"]
    for r in rows.values():
        assert set(r["ms"]) == {"stock", "envelope", "exact"} and len(r["rounds_ms"]["stock"]) == 3
        for name in ("envelope", "exact"):
            low, high = r[name]["ci"]
            assert 0 < low <= high
    # the exact pack fires at its own shape; the envelope pack at every shape inside its envelope
    assert rows["base"]["exact"]["served_per_forward"] > 0
    inside = [r for label, r in rows.items() if label != "base"]
    assert all(r["envelope"]["served_per_forward"] > 0 for r in inside), {k: r["envelope"] for k, r in rows.items()}
    md = (results / "bench_shapes-tiny_llama.md").read_text()
    assert data["commit"] in md and "slower than stock beyond noise" in md and "envelope / exact" in md


def test_a_missing_wheel_is_one_line_and_a_failing_exit(tmp_path):
    proc = subprocess.run([sys.executable, str(TOOLS / "bench_shapes.py"), "--base", "tiny-llama", "--pack",
                           str(tmp_path / "no.whl")], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"bench_shapes: pack {tmp_path / 'no.whl'} does not exist"
