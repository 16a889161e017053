"""The guarded dispatch shim's code generation: what it refuses, what it emits, and that the emitted
guards fire on exactly the captured calls for every kind of argument (compiled, loaded and called in a
separate process, so this process's dispatcher is never touched)."""

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
from pack_kernels import DECLINE, signature_cases

from forgepack.capture import card_from_call
from forgepack.cards import TensorMeta
from forgepack.compile import compile_kernel
from forgepack.pack import shimgen

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def card(func, *args, **kwargs):
    return card_from_call(func, args, kwargs)[0]


# --- what the shim refuses, with a reason ------------------------------------------------------------------


@pytest.mark.parametrize(("make", "words"), [
    (lambda: card(torch.ops.aten.add_.Tensor, torch.randn(4), torch.randn(4)), "mutates or aliases"),
    (lambda: card(torch.ops.aten.view.default, torch.randn(4, 2), [8]), "mutates or aliases"),
    (lambda: card(torch.ops.aten._local_scalar_dense.default, torch.tensor(3.0)), "fresh tensors"),
    (lambda: card(torch.ops.aten.arange.default, 8), "no tensor input"),
    (lambda: card(torch.ops.aten.neg.default, torch.randn(0, 3)), "empty tensor"),
    (lambda: card(torch.ops.aten.neg.default, torch.randn(1, 1, 1, 1, 1, 1, 1, 1, 2)), "9 dims"),
    (lambda: card(torch.ops.aten.neg.default, torch.randn(4, dtype=torch.complex64)), "not in the kernel ABI"),
    (lambda: card(torch.ops.aten.index.Tensor, torch.randn(4, 4), [torch.tensor([0, 1])]), "list type"),
    (lambda: dataclasses.replace(card(torch.ops.aten.neg.default, torch.randn(4)), kind="fusion"), "fusion"),
])
@pytest.mark.filterwarnings("ignore:Casting complex values")  # the complex64 card's value statistics
def test_unsupported_cards_are_refused_with_a_reason(make, words):
    reason = shimgen.unsupported_reason(make(), "cpu", shimgen.torch_include_dirs())
    assert reason is not None and words in reason


def test_a_cpu_card_is_not_served_by_a_cuda_pack():
    c = card(torch.ops.aten.neg.default, torch.randn(4))
    assert shimgen.unsupported_reason(c, "cpu") is None
    assert "the pack targets cuda" in shimgen.unsupported_reason(c, "cuda")


def test_literals_are_exact():
    for v in (0.1, 1e-6, -2.5e-300, 1 / 3, 5e-324):
        assert float.fromhex(shimgen.cpp_double(v)) == v
    assert "infinity" in shimgen.cpp_double(float("-inf")) and shimgen.cpp_double(float("-inf")).startswith("-")
    assert shimgen.cpp_int(-(2**63)) == "INT64_MIN" and shimgen.cpp_int(2**63 - 1) == "int64_t(9223372036854775807LL)"
    assert shimgen.scalar_spec(True).startswith("fpg::ScalarSpec{FP_SCALAR_BOOL, 1")
    assert shimgen.scalar_spec(2).startswith("fpg::ScalarSpec{FP_SCALAR_INT, int64_t(2LL)")
    assert shimgen.cpp_string('a"b\\c') == '"a\\"b\\\\c"'


def test_generated_guard_checks_values_first_and_every_tensor_fact():
    x = torch.randn(64, 32)[:, 1:17]  # strided, storage offset 1 (4 bytes: misaligned for 16)
    c = card(torch.ops.aten.add.Tensor, x, 1e-6)
    code = shimgen.generate([shimgen.ShimVariant(c, "kernels/a.so")], "forgepack_t", "cpu")
    guard = code[code.index("if (variants[0]"):code.index("fpg::SameDevice same")]
    wrapped, tensor = guard.index("fpg::eq_wrapped(a1"), guard.index("fpg::match(a0")
    assert wrapped < tensor  # cheap value checks before tensor checks
    assert f"fpg::ScalarSpec{{FP_SCALAR_FLOAT, 0, {(1e-6).hex()}}}" in guard
    assert "constexpr int64_t v0_a0_sizes[] = {64, 16};" in code and "v0_a0_strides[] = {32, 1};" in code
    assert "c10::ScalarType::Float, 0, 2, v0_a0_sizes, v0_a0_strides, 4}" in code  # align: 1 * 4 bytes
    assert 'lib.impl("add.Tensor", TORCH_FN(override_0));' in code
    assert "TORCH_LIBRARY(forgepack_t, m)" in code
    with pytest.raises(ValueError):
        shimgen.generate([shimgen.ShimVariant(c, "kernels/a.so")], "Bad-Name", "cpu")


def test_variants_of_one_op_share_one_override_in_the_given_order():
    a = card(torch.ops.aten.neg.default, torch.randn(4))
    b = card(torch.ops.aten.neg.default, torch.randn(8))
    code = shimgen.generate([shimgen.ShimVariant(b, "kernels/b.so"), shimgen.ShimVariant(a, "kernels/a.so")],
                            "forgepack_t", "cpu")
    assert code.count("R0 override_0(") == 1 and "override_1" not in code
    assert code.index("// variant 0: " + b.id) < code.index("// variant 1: " + a.id)


# --- compiled and called: the guards of every argument kind ---------------------------------------------------


@pytest.fixture(scope="module")
def declining_shim(tmp_path_factory):
    """A shim with one variant per signature case, each served by a kernel that always declines: a guard
    that fires shows as an error count, and the call is still answered by stock PyTorch."""
    root = tmp_path_factory.mktemp("shim")
    cards = [card(op, *args, **kwargs) for _, op, args, kwargs, _, _ in signature_cases()]
    for c in cards:
        assert shimgen.unsupported_reason(c, "cpu", shimgen.torch_include_dirs()) is None, c.op
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGEPACK_CACHE", str(root / "cache"))
        compiled = compile_kernel(DECLINE, "cpu")
    assert compiled.ok, compiled.log
    (root / "kernels").mkdir()
    shutil.copyfile(compiled.binary, root / "kernels" / "decline.so")
    src = root / "shim.cpp"
    src.write_text(shimgen.generate([shimgen.ShimVariant(c, "kernels/decline.so") for c in cards],
                                    "forgepack_sigtest", "cpu"))
    shimgen.compile_shim(src, root / "shim.so", [shimgen.SHIM_DIR, shimgen.ABI_DIR])
    return root, cards


CALLS = r"""
import json, sys
import torch
sys.path.insert(0, TESTS)
from pack_kernels import signature_cases
torch.ops.load_library(ROOT + "/shim.so")
ns = torch.ops.forgepack_sigtest
n = len(list(ns.variants()))
def errors():
    return list(ns.stats())[n:2 * n]
def flat(r):
    return [r] if isinstance(r, torch.Tensor) else [t for t in r]
ns.activate(ROOT, [])
out = {}
for v, (name, op, args, kwargs, margs, mkwargs) in enumerate(signature_cases()):
    row = {}
    for label, (a, k) in (("same", (args, kwargs)), ("other", (margs, mkwargs))):
        before = errors()
        got = flat(op(*a, **k))
        fired = [i for i, (x, y) in enumerate(zip(before, errors())) if x != y]
        ns.deactivate()
        ref = flat(op(*a, **k))
        ns.activate(ROOT, [])
        row[label] = {"fired": fired, "equal": all(torch.equal(x, y) for x, y in zip(got, ref))}
    out[name] = {"index": v, **row}
print(json.dumps(out))
"""


def test_every_argument_kind_is_guarded_exactly(declining_shim, tmp_path):
    root, cards = declining_shim
    code = f"TESTS = {str(TESTS)!r}\nROOT = {str(root)!r}\n{CALLS}"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == len(cards)
    for name, row in rows.items():
        # the captured call reaches its own variant's kernel (which declines: stock answers, exactly)
        assert row["same"] == {"fired": [row["index"]], "equal": True}, name
        # a call differing in one argument never reaches a kernel
        assert row["other"] == {"fired": [], "equal": True}, name


def test_tensor_meta_alignment_is_taken_from_the_storage_offset():
    meta = TensorMeta("float16", (4,), (1,), storage_offset=3)
    c = card(torch.ops.aten.neg.default, torch.randn(4).half())
    c = dataclasses.replace(c, args=(dataclasses.replace(c.args[0], tensor=meta),))
    code = shimgen.generate([shimgen.ShimVariant(c, "k.so")], "forgepack_t", "cpu")
    assert "c10::ScalarType::Half, 1, 1, v0_a0_sizes, v0_a0_strides, 6}" in code  # 3 * 2 bytes
