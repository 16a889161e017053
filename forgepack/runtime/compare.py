"""Comparing two calls' outputs: nested structures leaf by leaf, tensors within a tolerance.

`kernel_mismatch` / `kernel_mismatches` judge a kernel's output against stock's under the kernel
tolerance (`tolerances.TOLERANCES`, the absolute term scaled by the computation's magnitude): the
build's verifier (`forgepack.verify`) and the pack's self-test judge through them, so a kernel is held
to the same rule on the serving machine as when it was accepted. `outputs_mismatch` /
`tensor_mismatch` ('' when they match, else the first difference) serve graph replay verification
(`replaycheck.py`); `scale_error` is also the pack gate's measure of a model's outputs against stock.
Part of the pack runtime: torch and the standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .graphkeys import leaves
from .tolerances import REPLAY_TOLERANCES, Tolerance, scaled_atol

# An exact comparison of bools compares their bytes: a kernel must write 0 or 1 (the ABI's bool).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def input_scale(tensors: Iterable[torch.Tensor | None]) -> float:
    """The largest finite |value| among the float tensors (0 without any): the kernel tolerance's
    absolute term scales with it (`tolerances.scaled_atol`)."""
    scale = 0.0
    for t in tensors:
        if t is not None and t.is_floating_point() and t.numel():
            scale = max(scale, _largest_finite(t.detach().abs()))
    return scale


def _largest_finite(magnitudes: torch.Tensor) -> float:
    """The largest finite value of a non-negative tensor, 0.0 when none is: in its own dtype (a max is
    exact there) and without copying out the finite elements, since the verifier asks this of every
    output of every run (a masked float64 copy made it a tenth of a second per 2M-element output)."""
    if not magnitudes.numel():
        return 0.0
    return float(magnitudes.masked_fill(~torch.isfinite(magnitudes), 0).max())


def kernel_mismatches(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance | None, input_scale: float = 0.0,
                      statistic: bool = False, exact: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """(which elements of a kernel's output are not stock's, as a bool mask; the absolute tolerance used).

    `tol` None: bitwise exact. Else ``|out - ref| <= atol * m + rtol * |ref|`` where both are finite, m
    the larger of stock's largest finite |value| and `input_scale`; NaN where stock has NaN, the same
    infinities. `statistic` (a normalisation's mean or rstd, `tolerances.is_statistic`): NaN and +-inf
    are interchangeable, but non-finite must stay non-finite and finite values must still match.

    `exact`: the same stock computation in float64, where the caller has it. Where stock's own result is
    ill-conditioned (a normalised constant row: `x * rstd * w` near 700 cancelling to `b` near 1), its
    rounding can exceed the tolerance and a kernel as accurate as stock, or more, would fail against it.
    Such an element passes when the kernel is within the tolerance of the exact value plus twice stock's
    own error there; where stock is accurate that allowance is nil, so nothing else loosens."""
    if tol is None:
        a = out.contiguous().view(_BITS[out.element_size()]) if out.dtype == torch.bool else out
        b = ref.contiguous().view(_BITS[ref.element_size()]) if out.dtype == torch.bool else ref.to(out.dtype)
        return a != b, 0.0
    if out.dtype == ref.dtype and torch.equal(out, ref):  # bit for bit, no NaN anywhere: one pass decides
        return torch.zeros(out.shape, dtype=torch.bool, device=out.device), scaled_atol(
            tol, max(_largest_finite(ref.abs()), input_scale))
    o, r = out.to(torch.float64), ref.to(torch.float64)
    ref_size = r.abs()
    atol = scaled_atol(tol, max(_largest_finite(ref_size), input_scale))
    close = (o - r).abs_() <= ref_size.mul_(tol.rtol).add_(atol)
    if exact is not None:
        e = exact.to(torch.float64)
        close |= (o - e).abs() <= atol + tol.rtol * e.abs() + 2 * (r - e).abs()
    finite_o, finite_r = torch.isfinite(out), torch.isfinite(ref)  # as in float64, at a fraction of the bytes
    same_class = ~finite_o & ~finite_r if statistic else torch.isnan(out) & torch.isnan(ref)
    ok = (o == r) | same_class | (finite_o & finite_r & close)
    return ~ok, atol


def kernel_mismatch(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance | None, input_scale: float = 0.0,
                    statistic: bool = False) -> str:
    """'' when a kernel's output is stock's under the kernel tolerance (`kernel_mismatches`), else why not."""
    if out.dtype != ref.dtype or out.shape != ref.shape:
        return f"got {out.dtype}{list(out.shape)}, stock gives {ref.dtype}{list(ref.shape)}"
    bad, atol = kernel_mismatches(out, ref, tol, input_scale, statistic)
    count = int(bad.sum())
    if not count:
        return ""
    if tol is None:
        return f"{count} of {out.numel()} elements differ (exact)"
    return f"{count} of {out.numel()} elements outside {tol.describe()} (atol scaled: {atol:.3g})"


def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |out - ref| where both are finite (0.0 when nowhere is)."""
    if out.dtype == ref.dtype and torch.equal(out, ref):  # the usual case of a correct kernel: one pass
        return 0.0
    both = torch.isfinite(out) & torch.isfinite(ref)
    o, r = out.to(torch.float64), ref.to(torch.float64)
    return float((o - r).abs_().masked_fill_(~both, 0).max()) if o.numel() else 0.0


def _tolerance(dtype: torch.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    default = REPLAY_TOLERANCES.get(str(dtype).removeprefix("torch."))
    if default is None:  # integer and bool outputs: exact
        return (0.0 if rtol is None else rtol, 0.0 if atol is None else atol)
    return (default.rtol if rtol is None else rtol, default.atol if atol is None else atol)


def tensor_mismatch(expected: torch.Tensor, got: torch.Tensor, rtol: float | None = None,
                    atol: float | None = None, scale_rtol: float | None = None) -> str:
    """'' when `got` matches `expected` (allclose, NaN and Inf in the same places), else why not.
    With `scale_rtol`, floating tensors are compared as the gate compares a model's outputs: the largest
    difference over the largest magnitude of `expected` (Inf in the same places, the same values)."""
    if expected.shape != got.shape or expected.dtype != got.dtype:
        return f"{got.dtype}{list(got.shape)} instead of {expected.dtype}{list(expected.shape)}"
    if expected.numel() == 0:
        return ""
    r, a = _tolerance(expected.dtype, rtol, atol)
    if not expected.is_floating_point() and not expected.is_complex():
        bad = int((expected != got).sum())
        return f"{bad} of {expected.numel()} elements differ" if bad else ""
    e, g = expected.detach().float(), got.detach().float().to(expected.device)
    if not torch.equal(torch.isnan(e), torch.isnan(g)):
        return "NaN in different places"
    if scale_rtol is not None:
        return _scale_mismatch(e, g, scale_rtol)
    close = torch.isclose(e, g, rtol=r, atol=a, equal_nan=True)
    if bool(close.all()):
        return ""
    finite = torch.isfinite(e) & torch.isfinite(g)
    worst = float((e - g).abs()[finite].max()) if bool(finite.any()) else float("inf")
    bad = int((~close).sum())
    return f"{bad} of {e.numel()} elements differ (max abs diff {worst:.3g}, rtol={r}, atol={a})"


def scale_error(expected: torch.Tensor, got: torch.Tensor) -> float:
    """The largest difference over the largest magnitude of `expected`, where both are finite (0.0
    when nowhere is): how the pack gate measures a model's outputs against stock."""
    finite = torch.isfinite(expected) & torch.isfinite(got)
    if not bool(finite.any()):
        return 0.0
    scale = float(expected[finite].abs().max())
    return float((expected - got)[finite].abs().max()) / max(scale, 1e-30)


def _scale_mismatch(e: torch.Tensor, g: torch.Tensor, scale_rtol: float) -> str:
    inf = torch.isinf(e)
    if not torch.equal(inf, torch.isinf(g)) or not torch.equal(e[inf], g[inf]):
        return "Inf in different places"
    err = scale_error(e, g)
    return f"differs by {err:.2e} of its scale (tolerance {scale_rtol:g})" if err > scale_rtol else ""


def outputs_mismatch(expected: Any, got: Any, keep=frozenset(), rtol: float | None = None,
                     atol: float | None = None, scale_rtol: float | None = None) -> str:
    """'' when two nested outputs have the same structure and matching leaves, else the first difference."""
    a, b = leaves(expected, "out", keep, [], set()), leaves(got, "out", keep, [], set())
    if [p for p, _ in a] != [p for p, _ in b]:
        return f"output structure differs: {[p for p, _ in a][:6]} vs {[p for p, _ in b][:6]}"
    for (path, x), (_, y) in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return f"{path}: tensor on one side only"
            why = tensor_mismatch(x, y, rtol, atol, scale_rtol)
            if why:
                return f"{path}: {why}"
        elif x != y and not (isinstance(x, float) and x != x and y != y):
            return f"{path}: {y!r} instead of {x!r}"
    return ""
