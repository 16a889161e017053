"""Issue 20's CPU target, end to end: the tiny-llama recipe with phase generate over batch 1-4 and prompts
8-64 builds a pack whose kernels serve >= 90% of the calls of the ops it has families for, in generate()
at batch 1-4 and prompts 8-64 (captured sizes and others), with tokens identical to stock; counted from the
pack's own `stats()` in a fresh process that imports the built wheel.

Needs the family guard (shimgen, fp_guard.h) and size-generic templates: without them the pack's guards
serve only the representative member's exact signature and this test fails on the coverage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from forgepack import recipe as recipe_mod

REPO = Path(__file__).resolve().parent.parent
RECIPE = recipe_mod.BUILTIN_DIR / "tiny-llama.toml"
ENVELOPE = '''
[workload]
task = "causal-lm"
phase = "generate"
batch = { min = 1, max = 4 }
seq_len = { min = 8, max = 64 }
cache_len = { max = 80 }
new_tokens = 8
dtype = "float32"

[target]
device = "cpu"

[build]
budget = 40  # about one call per servable card: on cpu a family kernel has one parameter point
proposer = "templates"
margin = -0.99
gate = false
'''
# generate() at captured and other sizes of the envelope, 8 new tokens (the cache reaches 72 < 80)
SERVE = [(1, 8), (4, 64), (2, 24), (3, 50), (4, 17), (1, 63), (3, 8), (2, 41)]

MAIN = r"""
import json, sys
import torch
sys.path.insert(0, REPO)
from forgepack import models, recipe
import PACKAGE as pack
with models.quiet_transformers():
    lm = models.load(recipe.load(RECIPE_PATH))
model = lm.model
def gen(b, s):
    g = torch.Generator().manual_seed(b * 100 + s)
    ids = torch.randint(0, model.config.vocab_size, (b, s), generator=g)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                              min_new_tokens=8, do_sample=False, pad_token_id=0)
stock = {p: gen(*p) for p in POINTS}
assert pack.activate()
before = pack.stats()
same = {f"{b}x{s}": bool(torch.equal(gen(b, s), stock[(b, s)])) for b, s in POINTS}
after = pack.stats()
pack.deactivate()
print(json.dumps({"same": same, "before": before, "after": after}))
"""


def _recipe(tmp_path: Path, model: str) -> Path:
    if model == "tiny-llama":
        text = RECIPE.read_text().split("[workload]")[0].replace('name = "tiny-llama"', 'name = "tiny-llama-generate"')
    else:  # a checkpoint on disk, loaded by from_pretrained: its norm weights sit at 8 mod 16 (Qwen2's biases)
        sys.path.insert(0, str(REPO / "tools"))
        from heldout_models import save

        text = f'name = "{model}-generate"\n\n[model]\npath = "{save(tmp_path, model)}"\n\n'
    path = tmp_path / f"{model}-generate.toml"
    path.write_text(text + ENVELOPE)
    return path


def build_pack(tmp_path: Path, path: Path, timeout: int) -> tuple[Path, str, dict]:
    """`forgepack build` of this recipe through the CLI (home, cache and workspace under `tmp_path`), its
    wheel unzipped: (the directory to put on PYTHONPATH, the pack's package name, the environment)."""
    env = {**os.environ, "FORGEPACK_HOME": str(tmp_path / "home"), "FORGEPACK_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(REPO)}
    build = subprocess.run([sys.executable, "-m", "forgepack", "build", str(path), "--workspace",
                            str(tmp_path / "ws"), "--out", str(tmp_path / "packs"), "--json"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = json.loads(build.stdout)["wheel"]
    assert wheel, "no pack written: no kernel accepted"
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    package = next(p.name for p in site.iterdir() if p.name.startswith("forgepack_pack_") and "." not in p.name)
    return site, package, env


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_generate_envelope_pack_serves_90_percent_of_its_family_ops_calls(tmp_path, model):
    """Also for a checkpoint whose weights `from_pretrained` leaves at 8 mod 16 (the issue's third finding:
    every kernel taking such a weight missed in the model it was captured from)."""
    path = _recipe(tmp_path, model)
    r = recipe_mod.load(path)
    assert r.workload.is_envelope
    site, package, env = build_pack(tmp_path, path, timeout=3000)
    code = (MAIN.replace("PACKAGE", package).replace("REPO", repr(str(REPO)))
            .replace("RECIPE_PATH", repr(str(path))).replace("POINTS", repr(SERVE)))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=1200,
                         env={**env, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(res["same"].values()), res["same"]  # tokens identical to stock
    sys.path.insert(0, str(REPO / "tools"))
    from bench_envelope import served  # the H200 tool counts the same way

    per_op = served(res["before"], res["after"])
    assert per_op, "the pack has no family kernels"
    assert sum(d["errors"] for d in per_op.values()) == 0
    hits, calls = sum(d["hits"] for d in per_op.values()), sum(d["calls"] for d in per_op.values())
    assert hits >= 0.9 * calls, {op: f"{d['hits']}/{d['calls']}" for op, d in per_op.items()}
    # the fused rotary serves prefills too (batch and tokens read at run time), not the decode steps alone
    rotary = per_op["fusion.rotary.default"]
    assert rotary["calls"] and rotary["hits"] == rotary["calls"], rotary
