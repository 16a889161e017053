"""Comparing two calls' outputs: nested structures leaf by leaf, tensors within a tolerance.

`outputs_mismatch` / `tensor_mismatch` ('' when they match, else the first difference) serve graph
replay verification (`replaycheck.py`); `scale_error` is also the pack gate's measure of a model's
outputs against stock. Part of the pack runtime: torch and the standard library only.
"""

from __future__ import annotations

from typing import Any

import torch

from .graphkeys import leaves
from .tolerances import REPLAY_TOLERANCES


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
