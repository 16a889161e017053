"""`forgepack profile` of a served decode recipe lists its decode blocks as fusion cards named for the
block (issue 41), for checkpoints of the held-out architectures loaded as a user's are: the CLI, the
real capture and the real block finder; and what matched no block is said in the profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import heldout_models  # noqa: E402

RECIPE = """name = "{name}-decode"

[model]
path = "{path}"

[workload]
task = "causal-lm"
phase = "decode"
batch = 1
seq_len = 1
cache_len = 16
dtype = "float32"
static_cache = true

[target]
device = "cpu"
"""
BLOCKS = {"fusion.qkv", "fusion.attention", "fusion.proj_add", "fusion.gate_up", "fusion.lm_head"}


def profile(tmp_path: Path, name: str, **overrides) -> tuple[dict, set[str]]:
    path = heldout_models.save(tmp_path, name, **overrides)
    recipe = tmp_path / f"{name}.toml"
    recipe.write_text(RECIPE.format(name=name, path=path))
    env = {**os.environ, "PYTHONPATH": str(REPO), "FORGEPACK_HOME": str(tmp_path / "home"),
           "FORGEPACK_CACHE": str(tmp_path / "cache")}
    ws = tmp_path / "ws"
    done = subprocess.run([sys.executable, "-m", "forgepack", "profile", str(recipe), "--workspace", str(ws),
                           "--json"], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((ws / "profile.json").read_text())
    ops = {json.loads(p.read_text())["op"].removesuffix(".default") for p in (ws / "cards").glob("*.json")}
    return result, ops


@pytest.mark.parametrize("name", ["tiny-gemma2", pytest.param("tiny-phi3", marks=pytest.mark.slow),
                                  pytest.param("tiny-mistral", marks=pytest.mark.slow),
                                  pytest.param("tiny-qwen2", marks=pytest.mark.slow)])
def test_profile_lists_the_decode_blocks_of_each_architecture(tmp_path, name):
    # the released windows (4096) cover the cache: the loop serves these layers, and the blocks with them
    overrides = {"sliding_window": 4096} if "sliding_window" in heldout_models.MODELS[name][1] else {}
    result, ops = profile(tmp_path, name, **overrides)
    assert ops >= BLOCKS, sorted(ops)
    assert result["blocks_skipped"] == [], result["blocks_skipped"]
    (stock, with_blocks), = {tuple(v) for v in result["decode_launches"].values()}
    assert with_blocks < stock / 2, result["decode_launches"]


def test_a_window_shorter_than_the_cache_is_said_in_the_profile(tmp_path):
    """Mistral with a 48-slot window under the serving caches (256 slots): the loop cannot serve it, so no
    block is built, and the profile says why."""
    result, ops = profile(tmp_path, "tiny-mistral", sliding_window=48)
    assert not ops & BLOCKS
    assert any("could not be recorded" in s for s in result["blocks_skipped"]), result["blocks_skipped"]
