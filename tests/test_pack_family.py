"""A family variant in a staged pack: the builder carries the kernel's stated needs into the manifest
and the guard, the pack's runtime counts its hits and misses per variant like any other (`stats()`),
and `forgepack inspect` lists it."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pack_kernels import MUL, _record, tiny_llama_workspace
from rich.console import Console
from test_shim_families import FAMILY_NEEDS, family_card

from forgepack import families
from forgepack.accepted import save_all
from forgepack.cli.inspect import read_manifest, variants_table
from forgepack.evaluate import Evaluator
from forgepack.pack import builder

TESTS = Path(__file__).resolve().parent
PACKAGE = "forgepack_pack_tiny_llama"


def stage_family_pack(root: Path, **record: object):
    """The family card's mul kernel, verified by the real evaluator, staged as a pack under `root`
    (its accepted record changed by `record`, e.g. `served=` for a sub-range): (stage dir, manifest, card)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGEPACK_HOME", str(root / "home"))
        mp.setenv("FORGEPACK_CACHE", str(root / "cache"))
        ws, recipe, _ = tiny_llama_workspace(root / "ws", entries=[])
        fam = family_card()
        ws.save_card(fam)
        with Evaluator("cpu") as evaluator:  # the real evaluator, at the family's representative member
            verdict = evaluator.evaluate(fam, MUL, margin=-0.99)
        assert verdict.accepted, verdict.reason
        kept = _record(ws, fam, MUL, verdict.binary, verdict.source_hash, verdict.speedup, verdict.ci_low,
                       verdict.ci_high, verdict.eager_us, verdict.kernel_us)
        save_all(ws.root, [dataclasses.replace(kept, needs=FAMILY_NEEDS, **record)])
        chosen, dropped = builder.select(ws, recipe, margin=-0.99)
        assert [c.card.id for c in chosen] == [fam.id], dropped
        manifest = builder.stage(ws, recipe, chosen, root / "stage", "0.0.1", "skipped")
    return root / "stage", manifest, fam


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    return stage_family_pack(tmp_path_factory.mktemp("fampack"))


CALLS = r"""
import json, sys
import torch
sys.path.insert(0, TESTS)
from test_shim_families import mul_inputs
import forgepack_pack_tiny_llama as pack
pack.activate(strict=True)
for b, s in ((3, 6), (4, 7), (3, 5), (5, 2)):  # two members, an odd numel (a stated need), out of range
    torch.mul(*mul_inputs(b, s))
print(json.dumps(pack.stats()))
"""


def run_staged(stage: Path, script: str, cwd: Path):
    """`script` in a fresh Python that imports the staged pack (TESTS set to the tests folder): the JSON
    its last line prints."""
    code = f"TESTS = {str(TESTS)!r}\n{script}"
    env = {**{k: v for k, v in os.environ.items() if k != "FORGEPACK_DISABLE"},
           "PYTHONPATH": f"{stage}{os.pathsep}{TESTS.parent}{os.pathsep}{TESTS}"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_runtime_counts_a_family_variants_hits_and_inspect_lists_it(staged, tmp_path):
    stage, manifest, fam = staged
    assert manifest.variants[0].id == fam.id and manifest.variants[0].needs == FAMILY_NEEDS
    assert read_manifest(stage / PACKAGE) == manifest
    shim = (stage / PACKAGE / "sources" / "shim.cpp").read_text()
    assert "fpg::bind(a0" in shim and "v0_a0_strides, 0, 8};" in shim  # the stated need, not the offset
    stats = run_staged(stage, CALLS, tmp_path)
    assert stats == {fam.id: {"op": "aten.mul.Tensor", "hits": 2, "misses": 2, "errors": 0}}
    text = io.StringIO()
    Console(file=text, width=250).print(variants_table(manifest))
    assert fam.id in text.getvalue() and families.describe(fam) in text.getvalue()  # the family's ranges
