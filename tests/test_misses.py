"""`pack.record_misses()`: the calls of the ops a pack overrides that its guards sent to stock, by signature,
read from the shim's own hit counters around each call, in real staged packs (cpu): the family `mul` pack of
test_pack_family and a pack of the tiny Llama's fused kernels, whose module sites keep serving under the
recorder (any other dispatch mode makes them decline)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_pack_family import run_staged, stage_family_pack
from test_pack_fused import _fusion_cards, _run, _stage

from forgepack import recipe

PACKAGE = "forgepack_pack_tiny_llama"


@pytest.fixture(scope="module")
def family_pack(tmp_path_factory):
    return stage_family_pack(tmp_path_factory.mktemp("misspack"))


FAMILY = r"""
import json, torch
from test_shim_families import mul_inputs
import forgepack_pack_tiny_llama as pack
torch.manual_seed(0)
# two members of the family, two calls outside its range, one of another dtype, and an op it does not override
calls = [mul_inputs(3, 6), mul_inputs(4, 7), mul_inputs(5, 2), mul_inputs(5, 2),
         [t.double() for t in mul_inputs(3, 6)]]
res = {}
try:
    pack.record_misses()
except pack.PackError as err:
    res["inactive"] = str(err)
pack.activate(strict=True)
plain = [torch.mul(*c) for c in calls]
before = pack.stats()
with pack.record_misses() as rec:
    recorded = [torch.mul(*c) for c in calls]
    torch.add(*calls[0])
after = pack.stats()
key = next(iter(after))
res.update(hits=rec.hits, misses=rec.misses, top=rec.top(), table=rec.table(), one=rec.top(1),
           same=all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(plain, recorded)),
           served=after[key]["hits"] - before[key]["hits"])
print(json.dumps(res))
"""


def test_misses_are_recorded_by_signature_and_hits_are_not(family_pack, tmp_path):
    stage = family_pack[0]
    res = run_staged(stage, FAMILY, tmp_path)
    assert "not active" in res["inactive"]
    assert (res["hits"], res["misses"], res["served"]) == (2, 3, 2)  # the shim agrees on the hits
    (op, outside, count), (op2, double, count2) = res["top"]
    assert (op, count, op2, count2) == ("aten.mul.Tensor", 2, "aten.mul.Tensor", 1)
    # the first argument: contiguous [b, s, 8]; the second a transposed view of a contiguous [s, b, 8]
    assert outside == "float32[5,2,8] s(16,8,1) +0 cpu, float32[5,2,8] s(8,40,1) +0 cpu"
    assert double.startswith("float64[3,6,8] s(48,8,1) +0 cpu")
    assert not any(o != "aten.mul.Tensor" for o, _, _ in res["top"])  # add is not the pack's: not seen
    assert res["one"] == res["top"][:1]
    assert res["same"]  # hits and misses alike, what ran is what runs without the recorder
    assert "5 calls of the pack's ops: 2 served, 3 missed" in res["table"] and outside in res["table"]


@pytest.fixture(scope="module")
def fused_pack(tmp_path_factory):
    base = recipe.resolve("tiny-llama")
    base = dataclasses.replace(base, workload=dataclasses.replace(base.workload, dtype="bfloat16"),
                               target=dataclasses.replace(base.target, device="cpu"))
    return _stage(tmp_path_factory.mktemp("missfused"), base, _fusion_cards(base))


FUSED = r"""
import json, torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM
import forgepack_pack_tiny_llama as pack

class Other(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

def hits():
    return sum(s["hits"] for s in pack.stats().values())

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16).eval()
ids = torch.randint(0, CONFIG["vocab_size"], (1, 32))  # the recipe's workload: the fused kernels' sizes
res = {}
with torch.no_grad():
    pack.activate(strict=True)
    h0 = hits()
    plain = model(ids).logits
    h1 = hits()
    with pack.record_misses() as rec:
        recorded = model(ids).logits
    h2 = hits()
    with Other():
        model(ids)
    h3 = hits()
res.update(plain=h1 - h0, recorded=h2 - h1, other=h3 - h2, same=bool(torch.equal(plain, recorded)),
           counted=[rec.hits, rec.misses])
print(json.dumps(res))
"""


def test_fused_sites_still_serve_under_the_recorder_and_under_no_other_mode(fused_pack):
    config = recipe.resolve("tiny-llama").model.config
    proc = _run(f"CONFIG = {dict(config)!r}\n" + FUSED, fused_pack)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["plain"] > 0 and res["recorded"] == res["plain"]  # the same sites served, recorder or not
    assert res["other"] == 0  # another dispatch mode would not see the chains: the sites decline
    assert res["same"]
    assert res["counted"] == [0, 0]  # a pack of fused kernels only overrides no op


def test_views_of_a_growing_tensor_fold_into_one_row():
    import torch

    from forgepack.runtime.misses import MissRecorder, folded

    rec = MissRecorder({"aten.clone.default": (0,)}, lambda: [0])  # a hit counter no call moves: all miss
    with rec:
        for n in range(20, 30):  # a decode step's last-token column of ids that grow by one a step
            torch.arange(2 * n).reshape(2, n)[:, -1:].clone()
        torch.ones(2, 3).clone()
        torch.ones(3, 2).t().clone()  # a transposed view: its unit-stride dim stays visible
    assert rec.misses == 12 and len(rec.top(None)) == 12  # one signature per step, unfolded
    rows = rec.top(None, fold=True)
    assert rows[0] == ("aten.clone.default", "int64[2,1] s(*,1) +* cpu", 10)
    assert {(s, c) for _, s, c in rows[1:]} == {("float32[2,3] s(3,1) +0 cpu", 1), ("float32[2,3] s(1,*) +0 cpu", 1)}
    assert "10  aten.clone.default  int64[2,1] s(*,1) +* cpu" in rec.table(fold=True)
    assert folded("bfloat16[8,1,2048] s(2048,2048,1) +0 cuda, 1.0") == "bfloat16[8,1,2048] s(2048,2048,1) +0 cuda, 1.0"
