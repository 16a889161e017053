"""Family guards in the generated C++ shim give the same answers as their Python twin.

A `mul.Tensor` family (a contiguous [d0, d1, 8] times a transposed view of a contiguous [d1, d0, 8]:
equal dims across the two inputs, strides that are products of dims, a fixed size) is folded from
captured calls, served by a real strided kernel whose stated needs are 8- and 4-byte pointers and an
even element count, next to an exact variant of the same op. The shim is generated, compiled with g++,
loaded with torch in a separate process and called at members inside the range, outside it, with
unequal equal dims, broken strides, a wrong fixed size, misaligned and 8-mod-16 pointers: every hit and
miss in the shim's stats is what `families.bind` and `needs.pointers_ok` / `sizes_ok` say, and every
call's result is stock PyTorch's, bit for bit, with stock's sizes and strides.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pack_kernels import MUL

from forgepack import cards, families, needs
from forgepack.capture import capture, card_from_call
from forgepack.compile import compile_kernel
from forgepack.needs import Align, Needs
from forgepack.pack import shimgen
from forgepack.templates import on_device

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
POINTS = ((2, 3), (4, 5), (1, 7), (3, 2))


def mul_inputs(b: int, s: int, a_offset: int = 0, t_offset: int = 0):
    a = torch.randn(b * s * 8 + a_offset)[a_offset:].view(b, s, 8)
    t = torch.randn(s * b * 8 + t_offset)[t_offset:].view(s, b, 8).transpose(0, 1)
    return a, t


def family_card():
    captured = [card_from_call(torch.ops.aten.mul.Tensor, mul_inputs(b, s), {})[0] for b, s in POINTS]
    folded = families.fold(captured)
    assert len(folded) == 1 and folded[0].family is not None
    return folded[0]


FAMILY_NEEDS = Needs(align=(Align(8), Align(4)), numel_multiple=((0, 16),))


@pytest.fixture(scope="module")
def family_shim(tmp_path_factory):
    root = tmp_path_factory.mktemp("famshim")
    fam = family_card()
    exact = card_from_call(torch.ops.aten.mul.Tensor, (torch.randn(5, 2, 8), torch.randn(5, 2, 8)), {})[0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGEPACK_CACHE", str(root / "cache"))
        compiled = compile_kernel(MUL, "cpu")
    assert compiled.ok, compiled.log
    (root / "kernels").mkdir()
    shutil.copyfile(compiled.binary, root / "kernels" / "mul.so")
    variants = [shimgen.ShimVariant(fam, "kernels/mul.so", FAMILY_NEEDS), shimgen.ShimVariant(exact, "kernels/mul.so")]
    src = root / "shim.cpp"
    src.write_text(shimgen.generate(variants, "forgepack_famtest", "cpu"))
    shimgen.compile_shim(src, root / "shim.so", [shimgen.SHIM_DIR, shimgen.ABI_DIR])
    cards.save(fam, root / "family.json")
    cards.save(exact, root / "exact.json")
    (root / "needs.json").write_text(json.dumps(needs.to_json(FAMILY_NEEDS)))
    return root


CALLS = r"""
import json, sys
import torch
sys.path.insert(0, TESTS)
from test_shim_families import mul_inputs
from forgepack import cards, families, needs
from forgepack.cards import TensorMeta

torch.ops.load_library(ROOT + "/shim.so")
ns = torch.ops.forgepack_famtest
fam, exact = cards.load(ROOT + "/family.json"), cards.load(ROOT + "/exact.json")
fam_needs = needs.from_json(json.load(open(ROOT + "/needs.json")))

def meta(t):
    return TensorMeta(str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()), t.storage_offset())

def twin(a, b):
    # which variant the guards should pick, in guard order (None: stock)
    metas, addrs = [meta(a), meta(b)], [a.data_ptr(), b.data_ptr()]
    values = families.bind(fam, metas)
    if values is not None and needs.pointers_ok(fam_needs, addrs) and needs.sizes_ok(fam_needs, values, metas):
        return 0
    want = [m.key()[:3] for m in exact.tensor_inputs()]
    if [m.key()[:3] for m in metas] == want and needs.pointers_ok(needs.default(exact), addrs):
        return 1
    return None

def contiguous(b, s, d=8, dtype=torch.float32):
    return torch.randn(b, s, d, dtype=dtype), torch.randn(b, s, d, dtype=dtype)

cases = {
    "captured point (2,3)": mul_inputs(2, 3),
    "inside, not captured (3,6)": mul_inputs(3, 6),
    "range min (1,2)": mul_inputs(1, 2),
    "range max (4,7)": mul_inputs(4, 7),
    "inside, odd numel (3,5)": mul_inputs(3, 5),
    "d0 above range (5,2)": mul_inputs(5, 2),
    "d1 above range (2,8)": mul_inputs(2, 8),
    "d1 below range (2,1)": mul_inputs(2, 1),
    "unequal equal dims": (mul_inputs(1, 4)[0], mul_inputs(2, 4)[1]),
    "broken stride (contiguous second input)": contiguous(2, 3),
    "broken stride (sliced last axis)": (torch.randn(2, 3, 16)[:, :, ::2], mul_inputs(2, 3)[1]),
    "fixed size differs": (torch.randn(2, 3, 16), torch.randn(3, 2, 16).transpose(0, 1)),
    "first input 4 mod 8": mul_inputs(2, 3, a_offset=1),
    "first input 8 mod 16": mul_inputs(2, 3, a_offset=2),
    "second input 4 mod 16": mul_inputs(2, 3, t_offset=1),
    "dtype differs": tuple(x.double() for x in mul_inputs(2, 3)),
    "exact variant": contiguous(5, 2),
    "exact variant, 4 mod 16": (torch.randn(81)[1:].view(5, 2, 8), torch.randn(5, 2, 8)),
}
n = len(list(ns.variants()))
ns.activate(ROOT, [])
rows = {}
for name, (a, b) in cases.items():
    before = list(ns.stats())
    got = torch.ops.aten.mul.Tensor(a, b)
    after = list(ns.stats())
    hits = [after[v] - before[v] for v in range(n)]
    errors = [after[n + v] - before[n + v] for v in range(n)]
    ns.deactivate()
    ref = torch.ops.aten.mul.Tensor(a, b)
    ns.activate(ROOT, [])
    rows[name] = {"twin": twin(a, b), "hits": hits, "errors": errors,
                  "same": torch.equal(got, ref) and got.stride() == ref.stride() and got.dtype == ref.dtype}
print(json.dumps(rows))
"""


def test_family_guard_hits_exactly_what_bind_and_the_needs_admit(family_shim, tmp_path):
    code = f"TESTS = {str(TESTS)!r}\nROOT = {str(family_shim)!r}\n{CALLS}"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{TESTS}"}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, row in rows.items():
        want = [0, 0] if row["twin"] is None else [int(v == row["twin"]) for v in (0, 1)]
        assert row["hits"] == want, (name, row)
        assert row["errors"] == [0, 0] and row["same"], (name, row)
    # the cases cover both answers of every check: the twin is not vacuous
    fired = {name: row["twin"] for name, row in rows.items()}
    assert fired["inside, not captured (3,6)"] == 0 and fired["range max (4,7)"] == 0
    assert fired["first input 8 mod 16"] == 0 and fired["second input 4 mod 16"] == 0
    assert fired["exact variant"] == 1
    for miss in ("inside, odd numel (3,5)", "d0 above range (5,2)", "d1 below range (2,1)", "unequal equal dims",
                 "broken stride (contiguous second input)", "broken stride (sliced last axis)", "fixed size differs",
                 "first input 4 mod 8", "dtype differs", "exact variant, 4 mod 16"):
        assert fired[miss] is None, miss


def test_family_guard_code_binds_dims_and_states_the_kernels_needs():
    fam = family_card()
    code = shimgen.generate([shimgen.ShimVariant(fam, "k.so", FAMILY_NEEDS)], "forgepack_t", "cpu")
    ranges = ", ".join(f"{{{d.min}, {d.max}}}" for d in fam.family.dims)
    assert f"constexpr fpg::DimRange v0_ranges[] = {{{ranges}}};" in code
    assert "int64_t dv0[2] = {-1, -1};" in code
    guard = code[code.index("if (variants[0]"):code.index("fpg::SameDevice same")]
    binds = [guard.index("fpg::bind(a0"), guard.index("fpg::bind(a1")]
    strides = [guard.index("fpg::strides_ok(a0"), guard.index("fpg::strides_ok(a1")]
    assert max(binds) < min(strides)  # strides are checked once every dim is bound
    assert "% 16 == 0)" in guard  # the stated numel divisibility
    assert "fpg::match(" not in guard
    # alignment is the stated need (offset 0 modulo 8 and 4 bytes), not the captured storage offset
    assert ", 0, 8};" in code and ", 0, 4};" in code
    assert "fpg::alloc(kBackend, same.device, v0_out0, dv0)" in code


def test_needs_that_do_not_fit_the_card_are_refused():
    fam = family_card()
    with pytest.raises(ValueError, match="alignments"):
        shimgen.generate([shimgen.ShimVariant(fam, "k.so", Needs((Align(4),)))], "forgepack_t", "cpu")
    with pytest.raises(ValueError, match="power of two"):
        shimgen.generate([shimgen.ShimVariant(fam, "k.so", Needs((Align(12), Align())))], "forgepack_t", "cpu")
    with pytest.raises(ValueError, match="dim 'd9'"):
        shimgen.generate([shimgen.ShimVariant(fam, "k.so", Needs((Align(), Align()), (("d9", 2),)))],
                         "forgepack_t", "cpu")
    exact = card_from_call(torch.ops.aten.mul.Tensor, (torch.randn(3, 5), torch.randn(3, 5)), {})[0]
    with pytest.raises(shimgen.Unsupported, match="multiple of 4"):
        shimgen.generate([shimgen.ShimVariant(exact, "k.so", Needs((Align(), Align()), (), ((0, 4),)))],
                         "forgepack_t", "cpu")


def test_an_exact_kernel_that_states_its_alignment_is_guarded_on_it_alone():
    x = torch.randn(65)[1:].view(8, 8)  # captured at 4 mod 16
    exact = card_from_call(torch.ops.aten.mul.Tensor, (x, x), {})[0]
    default = shimgen.generate([shimgen.ShimVariant(exact, "k.so")], "forgepack_t", "cpu")
    stated = shimgen.generate([shimgen.ShimVariant(exact, "k.so", needs.aligned(exact, 4))], "forgepack_t", "cpu")
    assert "v0_a0_strides, 4};" in default  # today's rule: the captured offset modulo 16
    assert "v0_a0_strides, 0, 4};" in stated  # the stated need: any 4-byte aligned pointer


def test_needs_round_trip_json_and_default_is_the_captured_offset():
    fam = family_card()
    assert needs.from_json(json.loads(json.dumps(needs.to_json(FAMILY_NEEDS)))) == FAMILY_NEEDS
    shifted = dataclasses.replace(fam.args[0], tensor=dataclasses.replace(fam.args[0].tensor, storage_offset=6))
    card = dataclasses.replace(fam, args=(shifted, *fam.args[1:]))
    assert needs.default(card).align == (Align(16, 8), Align(16, 0))  # 6 floats: 24 bytes, 8 mod 16


CACHE_STEPS = [(b, n) for b in (1, 2, 4) for n in (8, 9, 29, 64)]


def cache_cat_card():
    """The decode cache's cat: [f32[b,2,L,8], f32[b,2,1,8]] -> f32[b,2,L+1,8], L + 1 a derived dim."""
    cat = torch.ops.aten.cat.default
    calls = [card_from_call(cat, ([torch.randn(b, 2, n, 8), torch.randn(b, 2, 1, 8)], -2), {})[0]
             for b, n in CACHE_STEPS]
    (card,) = families.fold(calls)
    return card


SERVED_CALLS = r"""
import json, sys
import torch
from forgepack import cards, families
from forgepack.cards import TensorMeta
torch.ops.load_library(ROOT + "/shim.so")
ns = torch.ops.forgepack_generictest
fam = cards.load(ROOT + "/family.json")
def meta(t):
    return TensorMeta(str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()), t.storage_offset())
exec(MAKE)  # defines cases {name: args}, call(args), tensors(args)
ns.activate(ROOT, [])
rows = {}
for name, args in cases.items():
    before = list(ns.stats())[0]
    got = call(args)
    hit = list(ns.stats())[0] - before
    ns.deactivate()
    ref = call(args)
    ns.activate(ROOT, [])
    rows[name] = {"twin": families.bind(fam, [meta(t) for t in tensors(args)]) is not None, "hit": hit,
                  "same": torch.equal(got, ref) and got.stride() == ref.stride()}
print(json.dumps(rows))
"""

CAT_CASES = """
cases = {name: [torch.randn(b, 2, n, 8), torch.randn(b, 2, 1, 8)] for name, (b, n) in {
    "captured (2, 29)": (2, 29), "unseen length (3, 40)": (3, 40), "range max (4, 64)": (4, 64),
    "range min (1, 8)": (1, 8), "length above (2, 65)": (2, 65), "length below (2, 7)": (2, 7),
    "batch above (5, 20)": (5, 20)}.items()}
call = lambda parts: torch.ops.aten.cat.default(parts, -2)
tensors = lambda parts: parts
"""

CLONE_CASES = """
cases = {"captured (2, 9)": torch.zeros(2, 9, dtype=torch.long)[:, -1:],
         "unseen row stride (3, 40)": torch.arange(120).view(3, 40)[:, -1:],
         "long rows (2, 77)": torch.arange(154).view(2, 77)[:, -1:],
         "batch above (5, 9)": torch.arange(45).view(5, 9)[:, -1:],
         "float (2, 9)": torch.randn(2, 9)[:, -1:]}
call = lambda x: torch.ops.aten.clone.default(x)
tensors = lambda x: [x]
"""


def _serve_generic(tmp_path, card, template: str, make: str, value_misses: tuple[str, ...] = ()) -> dict:
    """The family's size-generic kernel from `template`, behind the generated guard, called in a fresh
    process at `make`'s cases: per case the twin's answer, the hit, and whether the result is stock's.
    `value_misses`: cases whose non-tensor values differ from the card's (the twin sees tensors only)."""
    from forgepack.templates import by_name

    t = by_name(template)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGEPACK_CACHE", str(tmp_path / "cache"))
        compiled = compile_kernel(t.render(card, "cpu", t.default(card, "cpu")), "cpu")
    assert compiled.ok, compiled.log
    (tmp_path / "kernels").mkdir()
    shutil.copyfile(compiled.binary, tmp_path / "kernels" / "k.so")
    code = shimgen.generate([shimgen.ShimVariant(card, "kernels/k.so", t.needs(card, "cpu", {}))],
                            "forgepack_generictest", "cpu")
    (tmp_path / "shim.cpp").write_text(code)
    shimgen.compile_shim(tmp_path / "shim.cpp", tmp_path / "shim.so", [shimgen.SHIM_DIR, shimgen.ABI_DIR])
    cards.save(card, tmp_path / "family.json")
    script = f"ROOT = {str(tmp_path)!r}\nMAKE = {make!r}\n{SERVED_CALLS}"
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, row in rows.items():
        assert row["hit"] == int(row["twin"] and name not in value_misses) and row["same"], (name, row)
    return rows


def test_a_derived_dim_guard_computes_the_output_length_and_serves_unseen_cache_lengths(tmp_path):
    """The shim's guard binds b and L from the inputs, derives L + 1 for the output it allocates, and
    serves every cache length in range with the size-generic cat kernel; outside, stock serves."""
    card = cache_cat_card()
    assert "fpg::derive(" in shimgen.generate([shimgen.ShimVariant(card, "k.so")], "forgepack_x", "cpu")
    rows = _serve_generic(tmp_path, card, "elementwise.cat", CAT_CASES)
    assert [name for name, row in rows.items() if row["hit"]] == [
        "captured (2, 29)", "unseen length (3, 40)", "range max (4, 64)", "range min (1, 8)"]


def test_a_free_stride_guard_serves_any_row_stride(tmp_path):
    """generate()'s last-token slice of the growing ids (int64[b,1], row stride L): the free stride is
    not checked, so every step's slice hits, served by the size-generic copy reading the stride."""
    steps = [(b, n) for b in (2, 4) for n in (8, 9, 29)]
    calls = [card_from_call(torch.ops.aten.clone.default, (torch.zeros(b, n, dtype=torch.long)[:, -1:],), {})[0]
             for b, n in steps]
    (card,) = families.fold(calls)
    assert card.family.inputs[0].stride[0] == cards.FREE_STRIDE
    rows = _serve_generic(tmp_path, card, "elementwise.copy", CLONE_CASES)
    assert [name for name, row in rows.items() if row["hit"]] == [
        "captured (2, 9)", "unseen row stride (3, 40)", "long rows (2, 77)"]


TO_COPY_CASES = """
cases = {"device cpu (3, 256)": (torch.randn(3, 256), torch.device("cpu")),
         "no device (3, 256)": (torch.randn(3, 256), None)}
call = lambda a: torch.ops.aten._to_copy.default(a[0], dtype=torch.float32, device=a[1])
tensors = lambda a: [a[0]]
"""


def test_a_device_argument_is_guarded(tmp_path):
    """generate()'s `logits.to(copy=True, dtype=float32, device=cpu)`: `_to_copy` with a device argument
    was unservable; the guard checks it is the cpu (its twin `bind` sees tensors only)."""
    calls = [card_from_call(torch.ops.aten._to_copy.default, (torch.randn(b, 256),),
                            {"dtype": torch.float32, "device": torch.device("cpu")})[0] for b in (1, 2, 4)]
    (card,) = families.fold(calls)
    assert shimgen.unsupported_reason(card, "cpu") is None
    # on cuda the same card is served too (it was dropped: "argument device of type Device = 'cuda'"), the
    # device argument held to the inputs' device once their adds have bound it
    cuda = on_device(card, "cuda")
    assert shimgen.unsupported_reason(cuda, "cuda") is None
    code = shimgen.generate([shimgen.ShimVariant(cuda, "k.so")], "forgepack_x", "cuda")
    assert "fpg::is_type((*a3), kDevice)" in code and code.index("same.add(a0)") < code.index("same.device_is((*a3))")
    rows = _serve_generic(tmp_path, card, "elementwise.copy", TO_COPY_CASES, value_misses=("no device (3, 256)",))
    assert rows["device cpu (3, 256)"]["hit"] == 1 and rows["no device (3, 256)"]["hit"] == 0


GENERATE_PROMPTS = ((1, 8), (2, 13), (3, 5))


def first_write_cat_card():
    """The first cache write of a DynamicCache, as tiny Llama's real `generate()` makes it (transformers
    5.x: `cat([torch.tensor([]), key_states], -2)`, the keys a transposed view), folded over three prompts."""
    from test_families import _tiny_llama

    from forgepack import models

    model = _tiny_llama()
    prompts = [torch.randint(0, 128, p, generator=torch.Generator().manual_seed(sum(p))) for p in GENERATE_PROMPTS]
    with models.quiet_transformers():
        cap = capture(model, lambda: [models.generate(model, ids, 2) for ids in prompts], keep_samples=False)
    first = [c for c in families.fold(cap.cards)
             if c.op == "aten.cat.default" and arg_tensors(c)[0].shape == (0,)]
    assert len(first) == 1 and first[0].family is not None, [c.signature() for c in first]
    return first[0]


def arg_tensors(card):
    return next(a.tensors for a in card.args if a.kind == "tensors")


FIRST_WRITE_CASES = """
def keys(b, s):  # [b, s, heads, head_dim] projected, viewed as [b, heads, s, head_dim] (DynamicLayer's input)
    return torch.randn(b, s, 2, 16).transpose(1, 2)
cases = {
    "captured (2, 13)": [torch.tensor([]), keys(2, 13)],
    "unseen prompt (3, 11)": [torch.tensor([]), keys(3, 11)],
    "empty slice (1, 7)": [torch.randn(9)[3:3], keys(1, 7)],
    "prompt above the range (2, 14)": [torch.tensor([]), keys(2, 14)],
    "batch above the range (4, 8)": [torch.tensor([]), keys(4, 8)],
    "contiguous keys (2, 8)": [torch.tensor([]), torch.randn(2, 2, 8, 16)],
    "a non-empty first input (2, 8)": [torch.randn(2, 2, 1, 16), keys(2, 8)],
}
call = lambda parts: torch.ops.aten.cat.default(parts, -2)
tensors = lambda parts: parts
"""


def test_the_first_cache_write_of_generate_is_served(tmp_path):
    """generate()'s first write to each layer's DynamicCache concatenates the new keys onto an empty 1-D
    tensor. The shim refused every card with an empty tensor; now an empty input is admitted (its data
    pointer is NULL, PyTorch's for every empty tensor, a slice's too), and the size-generic cat copies
    only the keys. Every hit is what `families.bind` says and its result is stock's, bit for bit."""
    card = first_write_cat_card()
    assert card.family.inputs[0].shape == (0,) and {d.max for d in card.family.dims} == {3, 13}
    assert shimgen.unsupported_reason(card, "cpu") is None
    rows = _serve_generic(tmp_path, card, "elementwise.cat", FIRST_WRITE_CASES)
    assert [name for name, row in rows.items() if row["hit"]] == [
        "captured (2, 13)", "unseen prompt (3, 11)", "empty slice (1, 7)"]


def test_an_output_that_may_be_empty_is_refused():
    """A family whose output holds a dim ranging down to 0 would have the guard call a kernel with nothing
    to compute (and allocate strides stock does not give an empty tensor): left to stock."""
    calls = [card_from_call(torch.ops.aten.neg.default, (torch.randn(n, 4),), {})[0] for n in (3, 0, 5)]
    (card,) = families.fold(calls)
    assert card.family.dims[0].min == 0
    assert "may be empty" in shimgen.unsupported_reason(card, "cpu")


CHUNK_CASES = """
cases = {name: [past, torch.randn(b, 2, 4, 16)] for name, (b, past) in {
    "captured (2, 5)": (2, torch.randn(2, 2, 5, 16)),
    "empty past (3, 0)": (3, torch.randn(3, 2, 0, 16)),
    "empty slice past (2, 0)": (2, torch.randn(2, 2, 9, 16)[:, :, 4:4]),
    "unseen past (1, 11)": (1, torch.randn(1, 2, 11, 16)),
    "sliced past (2, 3)": (2, torch.randn(2, 2, 9, 16)[:, :, :3]),
    "past above the range (2, 13)": (2, torch.randn(2, 2, 13, 16))}.items()}
call = lambda parts: torch.ops.aten.cat.default(parts, -2)
tensors = lambda parts: parts
"""


def test_a_past_that_may_be_empty_is_served_whatever_its_strides(tmp_path):
    """A chunked cache's cat whose past length ranges down to 0: its strides are rules of the dims where
    it has elements, and where it is empty the guard checks none of them (PyTorch's strides of an empty
    tensor are c * max(size, 1) products, an empty slice keeps its parent's), as `families.bind` does."""
    from test_cache_first_write import chunked_cache_card

    rows = _serve_generic(tmp_path, chunked_cache_card(), "elementwise.cat", CHUNK_CASES)
    assert [name for name, row in rows.items() if row["hit"]] == [
        "captured (2, 5)", "empty past (3, 0)", "empty slice past (2, 0)", "unseen past (1, 11)"]
