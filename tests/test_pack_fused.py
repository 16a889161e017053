"""A pack with fused kernels (module-level chains of the tiny Llama, cpu), staged by the real builder:
what `forgepack inspect`, the pack's `info` and `selftest` show of them, and two such packs at once."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forgepack import capture, fusion, models, recipe
from forgepack.accepted import AcceptedKernel
from forgepack.compile import compile_kernel
from forgepack.pack import builder
from forgepack.templates import fused
from forgepack.workspace import Workspace

REPO = Path(__file__).resolve().parent.parent


def _fusion_cards(r: recipe.Recipe) -> list:
    with models.quiet_transformers():
        lm = models.load(r)
    cap = capture.capture(lm.model, lm.forward, keep_samples=False, functions=fusion.function_sites(lm.model))
    candidates, _ = fusion.find(cap)
    found = fusion.group(cap, candidates)

    def run():
        out = lm.forward()
        lm.reset()
        return out

    return fusion.check_and_sample(lm.model, run, found).cards


def _stage(root: Path, r: recipe.Recipe, cards: list) -> Path:
    """Stage a pack of these fusion cards' template kernels, as `builder.stage` does for a build, each with
    the needs its template states (a family kernel's guard checks exactly those)."""
    ws = Workspace(root / "ws").create()
    chosen = []
    for card in cards:
        t = next(t for t in fused.TEMPLATES if t.supports(card, "cpu") is None)
        params = t.default(card, "cpu")
        source = t.render(card, "cpu", params)
        compiled = compile_kernel(source, "cpu")
        assert compiled.ok, compiled.log
        (ws.root / "kernels").mkdir(exist_ok=True)
        shutil.copyfile(compiled.binary, ws.root / "kernels" / f"{card.id}.so")
        (ws.root / "kernels" / f"{card.id}.cpp").write_text(source)
        kernel = AcceptedKernel(card.id, "cpu", None, f"kernels/{card.id}.cpp", f"kernels/{card.id}.so", "0" * 64,
                                1.5, 1.4, 1.6, 10.0, 6.0, f"templates:{t.name}", kind="fusion",
                                needs=t.needs(card, "cpu", params))
        chosen.append(builder._Chosen(kernel, card))
    builder.stage(ws, r, chosen, root / "stage", "0.0.1", "skipped")
    return root / "stage"


@pytest.fixture(scope="module")
def two_packs(tmp_path_factory):
    base = recipe.resolve("tiny-llama")
    base = dataclasses.replace(base, workload=dataclasses.replace(base.workload, dtype="bfloat16"),
                               target=dataclasses.replace(base.target, device="cpu"))
    cards = _fusion_cards(base)
    root = tmp_path_factory.mktemp("fused")
    first = _stage(root / "a", base, cards)
    second = _stage(root / "b", dataclasses.replace(base, name="tiny-llama-b"), cards)
    return cards, first, second


def _run(code: str, *paths: Path, args: tuple = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FORGEPACK_DISABLE"}
    env["PYTHONPATH"] = os.pathsep.join(map(str, paths))
    cmd = [sys.executable, *(("-c", code) if code else ()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)


def test_inspect_info_and_selftest_see_the_fused_kernels(two_packs):
    from typer.testing import CliRunner

    from forgepack.cli import app

    cards, first, _ = two_packs
    ids = {c.id for c in cards}
    assert len(ids) >= 3
    shown = CliRunner().invoke(app, ["inspect", str(first / "forgepack_pack_tiny_llama")], terminal_width=240)
    assert shown.exit_code == 0, shown.output
    assert all(i in shown.output for i in ids) and f"{len(ids)} ({len(ids)} fused)" in shown.output
    info = _run("", first, args=("-m", "forgepack_pack_tiny_llama", "info"))
    assert info.returncode == 0, info.stderr[-2000:]
    assert f"{len(ids)} kernels (0 operator, {len(ids)} fused)" in info.stdout
    test = _run("", first, args=("-m", "forgepack_pack_tiny_llama", "selftest"))
    assert test.returncode == 0, test.stdout + test.stderr[-2000:]
    assert all(i in test.stdout for i in ids) and f"{len(ids)} fused kernels not re-checked" in test.stdout


OFF_SHAPE = r"""
import json, torch
from transformers import LlamaConfig, LlamaForCausalLM
import forgepack_pack_tiny_llama as pack
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16).eval()
ids = torch.randint(0, CONFIG["vocab_size"], (3, 7))
with torch.no_grad():
    stock = model(ids).logits
    pack.activate(strict=True)
    served = model(ids).logits
    pack.deactivate()
spec = json.loads(open(pack.__path__[0] + "/modules.json").read())
print(json.dumps({"same": bool(torch.equal(stock, served)), "shapes": [v.get("shapes") for v in spec["variants"]],
                  "stats": pack.stats()}))
"""


def test_the_pack_lists_each_fused_variants_sizes_and_other_sizes_run_stock_bit_for_bit(two_packs):
    cards, first, _ = two_packs
    config = recipe.resolve("tiny-llama").model.config
    proc = _run(f"CONFIG = {dict(config)!r}\n" + OFF_SHAPE, first, REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    by_id = {c.id: c for c in cards}
    assert res["shapes"] == [[list(m.shape) for m in by_id[v].tensor_inputs()] for v in res["stats"] if v in by_id]
    assert res["same"]  # batch 3, 7 tokens: no fused variant's sizes; the originals ran
    assert all(s["hits"] == 0 for s in res["stats"].values()) and any(s["misses"] for s in res["stats"].values())


TWO = r"""
import json, warnings
import forgepack_pack_tiny_llama as a
import forgepack_pack_tiny_llama_b as b
res = {"a": a.activate()}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    res["b"] = b.activate()
res["warnings"] = [str(w.message) for w in caught]
res["b_active"] = b.is_active()
res["b_stats"] = len(b.stats())
a.deactivate()
res["b_after"] = b.activate()
print(json.dumps(res))
"""


def test_a_second_pack_whose_patches_are_taken_is_refused_saying_what_is_off(two_packs):
    """Two packs with fused patches for the same classes: the second used to skip them (INFO only) while
    activate() returned True."""
    cards, first, second = two_packs
    proc = _run(TWO, first, second)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["a"] is True and res["b"] is False and res["b_active"] is False
    assert len(res["warnings"]) == 1 and "already patched by another forgepack pack" in res["warnings"][0]
    assert "LlamaRMSNorm" in res["warnings"][0] and "not activated" in res["warnings"][0]
    assert res["b_stats"] == len(cards)
    assert res["b_after"] is True  # once the first pack is off, the second applies
