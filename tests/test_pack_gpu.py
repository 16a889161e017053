"""The tiny-llama pack on the cuda target (skipped without a GPU): CUDA kernels through the evaluator,
the wheel installed into a fresh venv, activated in a separate process: model outputs match stock,
kernels launch on the current stream and inside a CUDA graph capture, misses are bit-identical, the
self-test passes on this GPU, and the gate runs on the real model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from pack_kernels import CUDA_KERNELS, SLOW_CUDA_SILU, tiny_llama_workspace

from forgepack.pack import gate as gate_mod
from forgepack.pack.builder import build_pack

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "forgepack_pack_tiny_llama"


@pytest.fixture(scope="module")
def cuda_pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("cudapack")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGEPACK_HOME", str(root / "home"))
        mp.setenv("FORGEPACK_CACHE", str(root / "cache"))
        ws, recipe, _ = tiny_llama_workspace(root / "ws", entries=CUDA_KERNELS, target="cuda")
        result = build_pack(ws, recipe, margin=-0.99, gate=False, out_dir=root / "packs")
    assert result.wheel is not None and result.manifest.target == "cuda" and result.manifest.arch
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()
    (Path(site) / "_parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--no-deps", "-q",
                    str(result.wheel)], check=True, capture_output=True)
    return result, ws, recipe, python


SCRIPT = r"""
import json, sys
import torch
import forgepack_pack_tiny_llama as pack
sys.path.insert(0, REPO)
from forgepack import models, recipe
r = recipe.resolve("tiny-llama").replace(target={"device": "cuda"})
with models.quiet_transformers():
    lm = models.load(r)
stock = lm.output_tensor(lm.run()).clone()
res = {"activated": pack.activate()}
out = lm.output_tensor(lm.run())
torch.cuda.synchronize()
res["max_diff"] = float((out - stock).abs().max())
res["hits"] = {k: v["hits"] for k, v in pack.stats().items()}

# on a side stream: the kernels follow PyTorch's current stream
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(1, 32, 128, device="cuda", generator=g)
z = torch.randn(1, 32, 128, device="cuda", generator=g)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
h = sum(v["hits"] for v in pack.stats().values())
with torch.cuda.stream(side):
    y_side = torch.nn.functional.silu(x) * z
torch.cuda.current_stream().wait_stream(side)
torch.cuda.synchronize()
side_hits = sum(v["hits"] for v in pack.stats().values()) - h
pack.deactivate()
res["side_stream"] = {"hits": side_hits,
                      "close": bool(torch.allclose(y_side, torch.nn.functional.silu(x) * z, rtol=1e-5, atol=1e-6))}
pack.activate()

# inside a CUDA graph: captured once, replayed on new values
graph = torch.cuda.CUDAGraph()
before = sum(v["hits"] for v in pack.stats().values())
with torch.cuda.graph(graph):
    y = torch.nn.functional.silu(x) * z
captured = sum(v["hits"] for v in pack.stats().values()) - before
x.copy_(torch.randn(1, 32, 128, device="cuda", generator=g))
graph.replay()
torch.cuda.synchronize()
replayed = sum(v["hits"] for v in pack.stats().values()) - before - captured
pack.deactivate()
ref = torch.nn.functional.silu(x) * z
res["graph"] = {"captured_hits": captured, "replay_hits": replayed,
                "close": bool(torch.allclose(y, ref, rtol=1e-5, atol=1e-6))}
pack.activate()
miss_x = torch.randn(2, 32, 128, device="cuda", generator=g)
h = sum(v["hits"] for v in pack.stats().values())
got = torch.nn.functional.silu(miss_x)
res["miss_hits"] = sum(v["hits"] for v in pack.stats().values()) - h
pack.deactivate()
res["miss_bit_identical"] = bool(torch.equal(got, torch.nn.functional.silu(miss_x)))
res["after_bit_identical"] = bool(torch.equal(lm.output_tensor(lm.run()), stock))
print(json.dumps(res))
"""


def test_cuda_pack_installed_runs_on_the_current_stream_and_in_graphs(cuda_pack, tmp_path):
    _, _, _, python = cuda_pack
    proc = subprocess.run([str(python), "-c", f"REPO = {str(REPO)!r}\n{SCRIPT}"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["activated"] and res["max_diff"] < 1e-4
    assert all(h > 0 for h in res["hits"].values()), res["hits"]
    assert res["side_stream"] == {"hits": 2, "close": True}
    assert res["graph"] == {"captured_hits": 2, "replay_hits": 0, "close": True}
    assert res["miss_hits"] == 0 and res["miss_bit_identical"] and res["after_bit_identical"]


def test_cuda_selftest_passes_on_this_gpu(cuda_pack, tmp_path):
    _, _, _, python = cuda_pack
    proc = subprocess.run([str(python), "-m", PACKAGE, "selftest"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, check=False, env={**os.environ})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(CUDA_KERNELS)} of {len(CUDA_KERNELS)} kernels verified" in proc.stdout


def test_cuda_gate_verifies_every_kernel_in_the_model_and_under_graph_replay(cuda_pack):
    """The gate's verify mode on the real model: every kernel is used, the model's outputs and greedy
    tokens match stock with all of them on, and the forward replayed from a CUDA graph matches eager."""
    result, ws, recipe, _ = cuda_pack
    outcome = gate_mod.run(recipe, ws.pack_dir / "stage", result.manifest.name, "verify", rounds=3)
    ids = {v.id for v in result.manifest.variants}
    assert len(ids) == len(CUDA_KERNELS)
    assert set(outcome.kept) == ids and not outcome.dropped, outcome.dropped
    assert all(outcome.hits[i] > 0 for i in ids), outcome.hits
    assert outcome.graphs is not None and outcome.graphs.enabled, outcome.graphs


def test_cuda_gate_never_ships_a_pack_that_is_slower_under_graph_replay(tmp_path):
    """A correct kernel about 40x slower than stock's silu (`SLOW_CUDA_SILU`, accepted at margin -0.99): the
    gate times the model under graph replay, as it is served, finds it slower with the kernel, drops the
    kernel and writes no wheel. The slowdown is hundreds of microseconds a forward: no clock noise hides it."""
    ws, recipe, _ = tiny_llama_workspace(tmp_path / "ws", entries=[("aten.silu.default", "f32[1,32,128]",
                                                                      SLOW_CUDA_SILU)], target="cuda")
    result = build_pack(ws, recipe, margin=-0.99, gate=True, out_dir=tmp_path / "packs", rounds=3)
    assert result.gate == "failed" and result.wheel is None and not result.kept, (result.gate, result.refused)
    assert result.refused, "a refused pack says why"
    (dropped,) = result.dropped
    assert dropped.reason.startswith("does not pay end to end: the model is"), dropped.reason
    assert "faster without it under CUDA graph replay" in dropped.reason, dropped.reason
    assert not list((tmp_path / "packs").glob("*.whl"))
