"""The pack's self-test judges a kernel's output as the build's verifier judged it: one comparison,
`forgepack.runtime.compare.kernel_mismatch`, under the manifest's tolerance (the kernel table of
`forgepack.runtime.tolerances`). Running the self-test on a built pack is test_pack_wheel's."""

from __future__ import annotations

import pytest
import torch

from forgepack import verify
from forgepack.runtime import selftest, tolerances
from forgepack.runtime.packinfo import OutputTolerance


def _manifest_tolerance(dtype: str) -> OutputTolerance:
    """What the builder writes into the manifest for an output of this dtype."""
    tol = tolerances.tolerance(dtype)
    return OutputTolerance(dtype) if tol is None else OutputTolerance(dtype, tol.rtol, tol.atol)


def test_the_self_test_names_values_outside_the_tolerance():
    ref = torch.linspace(1, 2, 16)
    problem, err = selftest.compare(ref + 0.1, ref, _manifest_tolerance("float32"))
    assert problem.startswith("16 of 16 elements outside rtol=1e-05, atol=1e-05")  # raised TypeError before
    assert err == pytest.approx(0.1, rel=1e-5)
    problem, _ = selftest.compare(ref + 0.1, ref, OutputTolerance("float32"))  # a manifest asking for exact
    assert "elements differ" in problem


BOOL_TWO = torch.tensor([1, 2], dtype=torch.uint8).view(torch.bool)  # a kernel wrote byte 2 for true
CASES = [  # (name, out, ref, dtype, input scale, normalisation statistic, accepted)
    ("one ulp", torch.tensor([1.0, 2.0]).nextafter(torch.tensor(9.0)), torch.tensor([1.0, 2.0]), "float32", 0.0,
     False, True),
    ("far off", torch.tensor([1.1, 2.0]), torch.tensor([1.0, 2.0]), "float32", 0.0, False, False),
    # the absolute term scales with the magnitude: 5e-3 next to 1000 is rounding, alone it is not
    ("beside a large value", torch.tensor([1000.0, 5e-3]), torch.tensor([1000.0, 0.0]), "float32", 0.0, False, True),
    ("a cancelling result", torch.tensor([5e-3]), torch.tensor([0.0]), "float32", 1000.0, False, True),
    ("alone", torch.tensor([5e-3]), torch.tensor([0.0]), "float32", 0.0, False, False),
    ("NaN for inf", torch.tensor([float("nan"), 1.0]), torch.tensor([float("inf"), 1.0]), "float32", 0.0, False,
     False),
    ("a statistic's NaN for inf", torch.tensor([float("nan"), 1.0]), torch.tensor([float("inf"), 1.0]), "float32",
     0.0, True, True),
    ("a statistic made finite", torch.tensor([1.0, 1.0]), torch.tensor([float("inf"), 1.0]), "float32", 0.0, True,
     False),
    ("ints", torch.tensor([1, 2, 4]), torch.tensor([1, 2, 3]), "int64", 0.0, False, False),
    ("a bool byte of 2", BOOL_TWO, torch.tensor([True, True]), "bool", 0.0, False, False),
    ("bools", torch.tensor([True, False]), torch.tensor([True, False]), "bool", 0.0, False, True),
]


@pytest.mark.parametrize(("out", "ref", "dtype", "scale", "statistic", "accepted"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_the_self_test_judges_an_output_as_the_verifier_did(out, ref, dtype, scale, statistic, accepted):
    problem, _ = selftest.compare(out, ref, _manifest_tolerance(dtype), scale, statistic)
    assert (problem is None) == accepted, problem
    assert (verify.compare(out, ref, dtype, statistic, scale) is None) == accepted


def test_the_self_test_wants_stock_s_output_layout():
    ref = torch.randn(3, 4)
    problem, err = selftest.compare(ref.t().contiguous().t(), ref, _manifest_tolerance("float32"))
    assert "strides [1, 3]" in problem and "stock gives" in problem and err == float("inf")
    problem, _ = selftest.compare(ref.half(), ref, _manifest_tolerance("float32"))
    assert problem.startswith("got torch.float16")


def test_normalisation_statistics_are_named_once_for_both():
    assert tolerances.is_statistic("aten.native_layer_norm.default", 1)
    assert not tolerances.is_statistic("aten.native_layer_norm.default", 0)
    assert verify.is_statistic is tolerances.is_statistic
