"""The fair serving benchmark (servebench.bench_peers, forgepack.servepeers): every column in a fresh
process, warmed, >= 5 rounds in a rotating order, intervals, recompiles counted, and on a trained model
(clear logit margins) every column's greedy tokens equal to eager's. CPU: compiled columns run Inductor's
CPU backend, graphs the emulated backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forgepack import servebench, servepeers, trainedlm

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return trainedlm.train_tiny_lm(tmp_path_factory.mktemp("trainedlm") / "lm")


def test_pinned_lengths_hold_each_bucket_s_longest_request():
    trace = [{"batch": 1, "prompt": 10, "new": 5}, {"batch": 1, "prompt": 70, "new": 4},
             {"batch": 2, "prompt": 8, "new": 8}]
    assert servepeers.pinned_lengths(trace, cap=512) == {1: 128, 2: 64}
    assert servepeers.pinned_lengths(trace, cap=100) == {1: 100, 2: 64}


def test_dynamo_state_counts_the_graphs_compiled_since_a_snapshot():
    """The recompile count is real: a new shape after the snapshot is a new graph and a guard failure."""
    import torch

    fn = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    fn(torch.ones(3))
    before = servepeers.DynamoState.now()
    fn(torch.ones(3))
    assert servepeers.DynamoState.now().since(before)["recompiles"] == 0
    fn(torch.ones(5))
    after = servepeers.DynamoState.now().since(before)
    assert after["recompiles"] == 1 and after["guard_failures"] >= 1 and after["reasons"], after


def test_a_column_that_fails_to_start_is_reported_not_raised(trained, tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps([{"id": 0, "batch": 1, "prompt": 8, "new": 2}]))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = ["--model", str(trained), "--trace", str(trace), "--pack", "no_such_pack_module"]
    peer = servebench.start_peer("pack+graphs", args, env, tmp_path / "column.log")
    assert "no_such_pack_module" in peer.info["error"] and peer.proc.poll() is not None, peer.info


def test_bench_serve_peers_runs_every_column_in_its_own_process_on_the_trained_model(trained, isolated_dirs):
    """The whole harness through `forgepack bench --serve --peers`: 5 rounds per column, each round's
    time kept, median tokens/s inside its interval, ratios to every peer, 0 recompiles during the rounds
    for the warmed compiled columns, and every column's greedy tokens equal to eager's, which walk the
    grammar the model was trained on."""
    from typer.testing import CliRunner

    from forgepack.cli import app

    args = ["bench", str(trained), "--target", "cpu", "--serve", "--peers", "--requests", "3", "--batches", "1,2",
            "--prompt", "8,24", "--new", "4,8", "--rounds", "5", "--json"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    cols = doc["columns"]
    assert list(cols) == ["eager", "static-pinned", "compiled-loop", "graphs"] and doc["grammar"]
    for name, col in cols.items():
        assert "error" not in col, (name, col)
        assert len(col["round_s"]) == 5 and all(t > 0 for t in col["round_s"]), name
        low, high = col["interval"]
        assert low <= col["tokens_per_s"] <= high, (name, col)
        assert set(col["vs"]) == set(cols) - {name}, name
        assert all(v["interval"][0] <= v["ratio"] <= v["interval"][1] for v in col["vs"].values()), name
        assert col["recompiles"] == 0, (name, col["reasons"])
        assert col["requests_equal_eager"] == col["requests"] == len(doc["trace"]), name
        assert col["first_request_s"] > 0 and col["warmup_s"] >= col["first_request_s"], name
    for request in doc["eager_tokens"]:
        for row in request:
            assert trainedlm.follows_grammar(row), row
    # no pack: the coverage process ran the stock trace twice, and nothing was replaced
    assert "error" not in doc["coverage"], doc["coverage"]
    assert doc["time_share"] == 0.0 and doc["call_share"] == 0.0
    assert doc["coverage"]["stock_calls"] > 0 and doc["coverage"]["stock_ms"] > 0
    saved = json.loads((isolated_dirs / ".forgepack" / trained.name / "serve_bench.json").read_text())
    assert saved["columns"].keys() == cols.keys()


@pytest.mark.slow  # about 35 s on 2 cores: two kernels evaluated, a shim compiled, the trace run three times
def test_time_share_counts_the_stock_time_a_pack_replaces(tmp_path):
    """A pack of two operator kernels (silu and mul at the tiny Llama's prefill signature), through
    `python -m forgepack.servedshare` as the benchmark runs it: the calls it replaced are the calls its
    kernels served, a share of the stock trace's calls and wall time strictly between 0 and 1."""
    from pack_kernels import MUL, SILU, tiny_llama_workspace

    from forgepack.pack.builder import build_pack

    ws, recipe, _ = tiny_llama_workspace(tmp_path / "ws", entries=[
        ("aten.silu.default", "f32[1,32,128]", SILU), ("aten.mul.Tensor", "f32[1,32,128], f32[1,32,128]", MUL)])
    wheel = build_pack(ws, recipe, margin=-0.99, gate=False, out_dir=tmp_path / "packs").wheel
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps([{"id": 0, "batch": 1, "prompt": 32, "new": 3}]))  # the kernels' prefill
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "forgepack.servedshare", "--model", "tiny-llama", "--trace",
                           str(trace), "--pack", str(wheel)], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cov = json.loads(proc.stdout.strip().splitlines()[-1])
    # tiny-llama's 2 layers: one silu and one gated mul each in the prefill; the decode steps' are [1,1,128]
    assert cov["kernel_calls"] == cov["replaced_calls"] == 4, cov
    assert 0 < cov["call_share"] < 0.05 and cov["call_share"] == round(4 / cov["stock_calls"], 4), cov
    assert 0 < cov["time_share"] < 1 and 0 < cov["replaced_ms"] < cov["stock_ms"], cov


def test_the_report_gives_each_columns_decode_step_launches_stock_beside_the_packs_blocks():
    res = {"columns": {"eager": {"tokens_per_s": 1.0},
                       "pack+graphs": {"launches": {"b1 c256": {"launches": 120, "with_blocks": 42, "blocks": 13}}},
                       "graphs": {"serving": {"decode_loop": {"programs": {}}}}}}
    line = servebench.launches_line(res)
    assert line.startswith("decode step launches: pack+graphs b1 c256: 120 stock, 42 with 13 blocks")
    assert "graphs b1" not in line.replace("pack+graphs b1", "")
    assert servebench.launches_line({"columns": {"eager": {}}}) == ""
