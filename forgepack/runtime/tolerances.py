"""Tolerances, one table per purpose, by output dtype (the runtime holds them; the build side imports
them): kernel against stock (`TOLERANCES`, judged by `compare.kernel_mismatch` in the verifier and
the pack's self-test), the model with the pack against stock (`MODEL_RTOL`: max |pack - stock| over
max |stock|, the gate), a graph replay against eager (`REPLAY_TOLERANCES`).

The kernel table: how close a kernel's output must be to stock PyTorch's.

An element passes when ``|out - ref| <= atol * m + rtol * |ref|`` (both finite), or both are NaN, or
both are the same infinity, where ``m`` is the largest finite |value| of the output and of the float
inputs (`scaled_atol`): the absolute term is relative to the computation's magnitude (a normwise bound),
so that an output near 4e-4 computed from inputs near 4e-4 cannot carry the 0.37% error of an fp32 mean
computed through bf16 (a fixed 1e-5 allowed it), while a result that cancels (a mean near zero of
values near one, a norm's ``xhat * w + b`` with large weights) is judged against the scale of what it
was computed from, not its own. Integer and bool outputs must match exactly.

The float tolerances are a few units in the last place of each dtype, so a kernel may reorder a
reduction or use fused multiply-adds, but an fp32 op computed through bf16, fp16 or TF32 fails
(those lose 3-5 decimal digits; fp32 keeps about 7):

| dtype    | rtol   | atol  | unit roundoff | why                                        |
|----------|--------|-------|---------------|--------------------------------------------|
| float64  | 1e-7   | 1e-7  | 1.1e-16       | generous for reordering, far below fp32    |
| float32  | 1e-5   | 1e-5  | 6.0e-8        | ~100 ulp; TF32 (4.9e-4) and bf16 fail      |
| float16  | 2e-3   | 1e-4  | 4.9e-4        | ~2 ulp of an fp32-accumulated result       |
| bfloat16 | 1.6e-2 | 1e-3  | 3.9e-3        | ~2 ulp of an fp32-accumulated result       |
| ints     | exact  | exact |               |                                            |
| bool     | exact  | exact |               | the byte must be 0 or 1                    |
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float

    def describe(self) -> str:
        return f"rtol={self.rtol:g}, atol={self.atol:g}"


TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(1e-7, 1e-7),
    "float32": Tolerance(1e-5, 1e-5),
    "float16": Tolerance(2e-3, 1e-4),
    "bfloat16": Tolerance(1.6e-2, 1e-3),
}
EXACT_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "bool")


def tolerance(dtype: str) -> Tolerance | None:
    """The tolerance for an output dtype name ("float32"); None means bitwise-exact."""
    if dtype in TOLERANCES:
        return TOLERANCES[dtype]
    if dtype in EXACT_DTYPES:
        return None
    raise ValueError(f"no tolerance for dtype {dtype!r}")


def scaled_atol(tol: Tolerance, magnitude: float) -> float:
    """The absolute term for an output whose largest finite |value| is `magnitude` (see the docstring)."""
    return tol.atol * max(magnitude, 0.0)


def describe(dtype: str) -> str:
    tol = tolerance(dtype)
    return "exact" if tol is None else tol.describe()


# Outputs that are statistics of a normalisation (op -> output indices): mean and rstd/invstd. Over a
# row holding inf or NaN such a statistic is NaN or +-inf depending on the algorithm (Welford gives
# inf - inf = NaN where a two-pass sum gives inf), and the row's normalised output is NaN either way.
# There, the only promise is "not finite where stock is not finite" (`compare.kernel_mismatches`).
STATISTICS_OUTPUTS = {
    "aten.native_layer_norm.default": (1, 2),
    "aten.native_group_norm.default": (1, 2),
    "aten.native_batch_norm.default": (1, 2),
    "aten._native_batch_norm_legit_no_training.default": (1, 2),
    "aten.cudnn_batch_norm.default": (1, 2),
}


def is_statistic(op: str, output: int) -> bool:
    return output in STATISTICS_OUTPUTS.get(op, ())


# Through a few dozen layers a few ulp per op grow by about an order of magnitude (bf16 logits of a
# patched model typically differ by 1-2%; Liger: 1.8%).
MODEL_RTOL = {"float64": 1e-6, "float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}


def model_rtol(dtype: str) -> float:
    return MODEL_RTOL.get(dtype, 1e-3)


# Replay runs eager's kernels, but under capture libraries take capture-safe paths (an explicit mask
# for `is_causal`): a few ulps in low precision; a stale replay is far off. Other dtypes: exact.
REPLAY_TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(1e-7, 1e-7), "float32": Tolerance(1e-4, 1e-4),
    "float16": Tolerance(1e-2, 1e-2), "bfloat16": Tolerance(3e-2, 3e-2),
}
