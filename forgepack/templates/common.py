"""Shared code generation for the kernel templates: dtypes, 16-byte vectors, index math, ABI checks.

Every template renders one complete source for the kernel ABI (`forgepack/abi/forgepack_abi.h`).
The card fixes dtypes, sizes, strides and non-tensor arguments, so shapes and strides are baked in as
compile-time constants: index math then compiles to multiply-shift sequences, and loops unroll.
The entry point still checks every descriptor against those constants (a few host instructions) and
returns FP_ERR_UNSUPPORTED on a mismatch, so a kernel used outside its guard falls back instead of
reading out of bounds.

Both targets share the same helper names, so expression code is written once:
`fp_ld(T) -> float`, `fp_st<T>(float)`, `fp_round_<dtype>(float)`, `fp_max_nan`, `fp_min_nan`,
`fp_rsqrt`, and the `FP_FN` qualifier (`__device__` inline on cuda, `static inline` on cpu).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

from forgepack import needs as needs_mod
from forgepack.cards import DTYPE_CODES, DTYPE_SIZES, Card, TensorMeta
from forgepack.needs import Needs

TARGETS = ("cuda", "cpu")
FLOATS = ("float32", "float16", "bfloat16")  # dtypes the arithmetic templates compute on
CAST_SOURCES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
INT32_LIMIT = 1 << 31

_CTYPES = {
    "cuda": {"float16": "__half", "bfloat16": "__nv_bfloat16"},
    "cpu": {"float16": "fp_half", "bfloat16": "fp_bf16"},
}
_PLAIN_CTYPES = {
    "float32": "float",
    "float64": "double",
    "int64": "int64_t",
    "int32": "int32_t",
    "int16": "int16_t",
    "int8": "int8_t",
    "uint8": "uint8_t",
    "bool": "bool",
}


def ctype(dtype: str, target: str) -> str:
    """The C type of one element of `dtype` in kernel source for `target`."""
    return _CTYPES[target].get(dtype) or _PLAIN_CTYPES[dtype]


# --- preludes --------------------------------------------------------------------------------------

_COMMON_MATH = r"""
// NaN-propagating max/min, as PyTorch's reductions and clamps do (fmaxf would drop the NaN).
FP_FN float fp_max_nan(float a, float b) { return (a != a || a > b) ? a : b; }
FP_FN float fp_min_nan(float a, float b) { return (a != a || a < b) ? a : b; }
FP_FN float fp_ld(float v) { return v; }
FP_FN float fp_ld(double v) { return (float)v; }
FP_FN float fp_ld(int64_t v) { return (float)v; }
FP_FN float fp_ld(int32_t v) { return (float)v; }
FP_FN float fp_ld(int16_t v) { return (float)v; }
FP_FN float fp_ld(int8_t v) { return (float)v; }
FP_FN float fp_ld(uint8_t v) { return (float)v; }
FP_FN float fp_ld(bool v) { return v ? 1.0f : 0.0f; }
template <typename T> FP_TFN T fp_st(float v);
template <> FP_TFN float fp_st<float>(float v) { return v; }
template <> FP_TFN double fp_st<double>(float v) { return (double)v; }
template <> FP_TFN bool fp_st<bool>(float v) { return v != 0.0f; }  // NaN is true, -0.0 false: torch's bool()
FP_FN float fp_round_float32(float v) { return v; }

// N elements of T in one aligned access (16 bytes or less: one vector instruction on the GPU).
template <typename T, int N>
struct alignas(sizeof(T) * N > 16 ? 16 : sizeof(T) * N) fp_vec { T v[N]; };
"""

CUDA_PRELUDE = (
    r"""#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include "forgepack_abi.h"

#define FP_FN __device__ __forceinline__
#define FP_TFN __device__ __forceinline__
#define FP_INF __int_as_float(0x7f800000)
FP_FN float fp_rsqrt(float v) { return rsqrtf(v); }
FP_FN float fp_ld(__half v) { return __half2float(v); }
FP_FN float fp_ld(__nv_bfloat16 v) { return __bfloat162float(v); }
"""
    + _COMMON_MATH
    + r"""
template <> FP_TFN __half fp_st<__half>(float v) { return __float2half_rn(v); }
template <> FP_TFN __nv_bfloat16 fp_st<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
FP_FN float fp_round_float16(float v) { return __half2float(__float2half_rn(v)); }
FP_FN float fp_round_bfloat16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Reductions across the `W` lanes (a power of two <= 32) that share one row: butterfly shuffles,
// so every lane ends with the result.
template <int W> FP_TFN float fp_warp_sum(float v) {
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <int W> FP_TFN float fp_warp_max(float v) {
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) v = fp_max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
"""
)

CPU_PRELUDE = (
    r"""#include <stdint.h>
#include <string.h>
#include <cmath>
#include "forgepack_abi.h"

#define FP_FN static inline
#define FP_TFN inline
#define FP_INF (std::numeric_limits<float>::infinity())
#include <limits>
struct fp_half { uint16_t x; };
struct fp_bf16 { uint16_t x; };
FP_FN uint32_t fp_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
FP_FN float fp_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
FP_FN float fp_rsqrt(float v) { return 1.0f / std::sqrt(v); }
// IEEE half <-> float exactly as c10 does it (round to nearest even, subnormals, NaN kept NaN).
FP_FN float fp_ld(fp_half h) {
  const uint32_t w = (uint32_t)h.x << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normalized = fp_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = fp_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  return fp_from_bits(sign | (two_w < (1u << 27) ? fp_bits(denormalized) : fp_bits(normalized)));
}
FP_FN fp_half fp_half_from(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = fp_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = fp_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = fp_bits(base), nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
  fp_half h;
  h.x = (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
  return h;
}
FP_FN float fp_ld(fp_bf16 h) { return fp_from_bits((uint32_t)h.x << 16); }
FP_FN fp_bf16 fp_bf16_from(float f) {
  fp_bf16 h;
  if (f != f) { h.x = 0x7FC0; return h; }
  const uint32_t u = fp_bits(f);
  h.x = (uint16_t)((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16);
  return h;
}
"""
    + _COMMON_MATH
    + r"""
template <> FP_TFN fp_half fp_st<fp_half>(float v) { return fp_half_from(v); }
template <> FP_TFN fp_bf16 fp_st<fp_bf16>(float v) { return fp_bf16_from(v); }
FP_FN float fp_round_float16(float v) { return fp_ld(fp_half_from(v)); }
FP_FN float fp_round_bfloat16(float v) { return fp_ld(fp_bf16_from(v)); }
"""
)


def prelude(target: str) -> str:
    return CUDA_PRELUDE if target == "cuda" else CPU_PRELUDE


def flit(value: float) -> str:
    """A value as an exact C float literal: rounded to float32 as aten does for opmath scalars."""
    v = float(value)
    if math.isnan(v):
        return "(0.0f/0.0f)"
    if math.isinf(v):
        return "FP_INF" if v > 0 else "(-FP_INF)"
    f32 = struct.unpack("<f", struct.pack("<f", v))[0] if abs(v) < 3.4028235e38 else math.copysign(math.inf, v)
    if math.isinf(f32):
        return "FP_INF" if f32 > 0 else "(-FP_INF)"
    return f"{float.hex(f32)}f" if f32 != int(f32) or abs(f32) >= 1 << 24 else f"{f32:.1f}f"


# --- card access -----------------------------------------------------------------------------------


def arg(card: Card, name: str):
    for a in card.args:
        if a.name == name:
            return a
    return None


def value(card: Card, name: str, default: Any = None) -> Any:
    a = arg(card, name)
    return default if a is None or a.kind != "value" else a.value


def device_mismatch(card: Card, target: str) -> str | None:
    """Reason to refuse if a tensor lives on another device than the target (None if all agree)."""
    metas = [m for m in card.tensor_inputs() if m is not None] + list(card.outputs)
    for m in metas:
        if m.device != target:
            return f"a tensor is on {m.device}, the target is {target}"
    return None


def common_refusal(card: Card, target: str) -> str | None:
    """Checks every template makes: target, devices, in-place, empty or huge outputs."""
    if target not in TARGETS:
        return f"unknown target {target}"
    if card.kind != "op":
        return "fusion cards are not served by templates"
    if "(a!)" in card.schema:
        return "in-place or out= variant"
    reason = device_mismatch(card, target)
    if reason:
        return reason
    if not card.outputs or any(o.numel == 0 for o in card.outputs[:1]):
        return "empty output"
    return layout_refusal(card)


def layout_refusal(card: Card) -> str | None:
    """Layouts no kernel is rendered for: negative strides, more than 8 dims."""
    for m in [m for m in card.tensor_inputs() if m is not None] + list(card.outputs):
        if any(s < 0 for s in m.stride):
            return "negative stride"
        if len(m.shape) > 8:
            return "more than 8 dims"
    return None


# --- ABI checks (host side) ------------------------------------------------------------------------


def _desc_check(var: str, meta: TensorMeta | None) -> list[str]:
    if meta is None:
        return [f"if ({var}.data != NULL) return FP_ERR_UNSUPPORTED;"]
    lines = [
        f"if ({var}.dtype != {DTYPE_CODES[meta.dtype]} || {var}.ndim != {len(meta.shape)}) return FP_ERR_UNSUPPORTED;",
    ]
    if meta.numel > 0:
        lines.append(f"if ({var}.data == NULL) return FP_ERR_UNSUPPORTED;")
    for d, (n, s) in enumerate(zip(meta.shape, meta.stride, strict=True)):
        cond = f"{var}.sizes[{d}] != {n}LL"
        if n != 1:  # a size-1 dim's stride is meaningless; PyTorch gives it any value
            cond += f" || {var}.strides[{d}] != {s}LL"
        lines.append(f"if ({cond}) return FP_ERR_UNSUPPORTED;")
    return lines


def abi_check(card: Card) -> str:
    """Host code validating `call` against the card; `return`s an FP_ERR_* on any mismatch."""
    ins, outs = card.tensor_inputs(), card.outputs
    lines = abi_counts_check(card)
    for i, m in enumerate(ins):
        lines += _desc_check(f"call->inputs[{i}]", m)
    for j, m in enumerate(outs):
        lines += _desc_check(f"call->outputs[{j}]", m)
    return "\n  ".join(lines + scalar_checks(card))


def abi_counts_check(card: Card) -> list[str]:
    """The call's ABI version and its counts of inputs, outputs and scalars."""
    return [
        "if (call == NULL || call->abi_version != FP_ABI_VERSION) return FP_ERR_ABI;",
        f"if (call->n_inputs != {len(card.tensor_inputs())} || call->n_outputs != {len(card.outputs)} "
        f"|| call->n_scalars != {len(card.scalars())}) return FP_ERR_ABI;",
    ]


def scalar_checks(card: Card) -> list[str]:
    """Each scalar the card fixes, checked bit for bit (a NaN scalar is not checkable by value)."""
    lines = []
    for k, v in enumerate(card.scalars()):
        # `f` carries every scalar's value (ints and bools too), whatever `kind` the caller chose.
        f = float(v)
        if not math.isnan(f):
            lit = float.hex(f) if math.isfinite(f) else ("__builtin_inf()" if f > 0 else "-__builtin_inf()")
            lines.append(f"if (call->scalars[{k}].f != {lit}) return FP_ERR_UNSUPPORTED;")
    return lines


def entry(card: Card, target: str, body: str) -> str:
    """The exported entry point: ABI checks, then `body` (which launches and returns)."""
    stream = "cudaStream_t stream = (cudaStream_t)call->stream;\n  " if target == "cuda" else ""
    return (
        "FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {\n  "
        + abi_check(card)
        + "\n  "
        + stream
        + body.strip()
        + "\n}\n"
    )


def launch_status(target: str) -> str:
    return "return (int32_t)cudaGetLastError();" if target == "cuda" else "return FP_OK;"


def ptr(kind: str, index: int, dtype: str, target: str, const: bool = True) -> str:
    """`(const T*)call->inputs[i].data` (kind "inputs") or the outputs' equivalent."""
    c = "const " if const else ""
    return f"({c}{ctype(dtype, target)}*)call->{kind}[{index}].data"


# --- layouts and index math ------------------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """One tensor as a kernel sees it over an iteration space: strides per iteration dim (0 = broadcast)."""

    dtype: str
    strides: tuple[int, ...]
    offset: int = 0  # elements from `data` to the view's first element (e.g. a slice of a cat output)
    storage_offset: int = 0  # the card's storage offset: alignment of `data` depends on it

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


def broadcast_view(meta: TensorMeta, shape: tuple[int, ...]) -> View | None:
    """The view of `meta` broadcast to `shape` (None if it does not broadcast)."""
    if len(meta.shape) > len(shape):
        return None
    lead = len(shape) - len(meta.shape)
    strides = [0] * lead
    for n_in, s_in, n_out in zip(meta.shape, meta.stride, shape[lead:], strict=True):
        if n_in == n_out:
            strides.append(s_in if n_in != 1 else 0)
        elif n_in == 1:
            strides.append(0)
        else:
            return None
    return View(meta.dtype, tuple(strides), 0, meta.storage_offset)


def coalesce(shape: tuple[int, ...], views: list[View], reorder: bool = False) -> tuple[tuple[int, ...], list[View]]:
    """Merge adjacent dims that every view walks as one (as TensorIterator does); drop size-1 dims.

    `reorder`: first walk the dims in the order of the first view's strides, outermost first (as
    TensorIterator does for the output). A channels-last output then runs n, h, w, c: its stores and
    every same-layout input become one contiguous run (vectorisable), and a per-channel parameter
    becomes the inner, stride-1 dim instead of a gather. Only for jobs whose element order is free:
    every view moves with the same permutation, so each index still names one element of each."""
    walk = memory_order(shape, views[0].strides) if reorder and views else range(len(shape))
    dims = [d for d in walk if shape[d] != 1]
    if not dims:
        return (1,), [View(v.dtype, (0,), v.offset, v.storage_offset) for v in views]
    new_shape = [shape[dims[0]]]
    new_strides = [[v.strides[dims[0]]] for v in views]
    for d in dims[1:]:
        n = shape[d]
        mergeable = all(st[-1] == v.strides[d] * n for st, v in zip(new_strides, views, strict=True))
        if mergeable:
            new_shape[-1] *= n
            for st, v in zip(new_strides, views, strict=True):
                st[-1] = v.strides[d]
        else:
            new_shape.append(n)
            for st, v in zip(new_strides, views, strict=True):
                st.append(v.strides[d])
    out = [View(v.dtype, tuple(st), v.offset, v.storage_offset) for st, v in zip(new_strides, views, strict=True)]
    return tuple(new_shape), out


def memory_order(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[int]:
    """Dims from outermost to innermost in memory; ties keep their logical order, and size-1 dims keep
    their place (their stride is moot)."""
    big = sorted((d for d, n in enumerate(shape) if n != 1), key=lambda d: -strides[d])
    it = iter(big)
    return [d if n == 1 else next(it) for d, n in enumerate(shape)]


def decode_lines(idx: str, shape: tuple[int, ...], order: list[int], names: list[str], itype: str) -> list[str]:
    """Statements defining `names[d]`, the coordinates of linear index `idx` when the dims are walked in
    `order` (outermost first): the innermost is the fastest-moving."""
    lines = [f"{itype} r_ = {idx};"]
    for d in reversed(order[1:]):
        lines.append(f"const {itype} {names[d]} = r_ % {shape[d]}u; r_ /= {shape[d]}u;")
    lines.append(f"const {itype} {names[order[0]]} = r_;")
    return lines


def index_type(shape: tuple[int, ...], views: list[View]) -> str:
    """Unsigned 32-bit index math when every offset fits (cheaper division by constants), else 64."""
    numel = math.prod(shape)
    spans = [v.offset + sum((n - 1) * s for n, s in zip(shape, v.strides, strict=True)) + 1 for v in views]
    return itype_for(max([numel, *spans]))


def itype_for(biggest: int) -> str:
    """The index type for offsets up to `biggest`: unsigned 32-bit with 1M of slack, else 64."""
    return "uint32_t" if biggest + (1 << 20) < INT32_LIMIT else "uint64_t"


def offsets_code(shape: tuple[int, ...], views: list[View], idx: str, names: list[str], itype: str) -> str:
    """C statements defining `names[k]` = element offset of view k at linear (row-major) index `idx`."""
    nd = len(shape)
    lines = []
    if nd == 1:
        coords = [idx]
    else:
        lines.append(f"{itype} r_ = {idx};")
        coords = [""] * nd
        for d in range(nd - 1, 0, -1):
            lines.append(f"const {itype} c{d}_ = r_ % {shape[d]}u; r_ /= {shape[d]}u;")
            coords[d] = f"c{d}_"
        coords[0] = "r_"
    for name, v in zip(names, views, strict=True):
        terms = [f"{c} * {s}u" if s != 1 else c for c, s in zip(coords, v.strides, strict=True) if s != 0]
        if v.offset:
            terms.append(f"{v.offset}u")
        lines.append(f"const {itype} {name} = {' + '.join(terms) or '0u'};")
    return "\n".join(lines)


def vector_ok(shape: tuple[int, ...], views: list[View], vec: int) -> bool:
    """Whether `vec` consecutive inner elements form one aligned vector (or one broadcast value) in
    every view: inner size divisible, inner stride 1 or 0, every vector start aligned given the card's
    storage offsets. The base pointers' own alignment is checked at run time (`align_check`)."""
    if vec == 1:
        return True
    if shape[-1] % vec:
        return False
    for v in views:
        inner = v.strides[-1]
        if inner not in (0, 1):
            return False
        if inner == 1:
            if any(s % vec for s in v.strides[:-1]) or v.offset % vec:
                return False
            if (v.storage_offset * v.itemsize) % min(16, vec * v.itemsize):
                return False
    return True


def align_check(exprs: list[tuple[str, int]]) -> str:
    """C expression: every (pointer, alignment in bytes) pair aligned."""
    parts = [f"((uintptr_t)({p}) % {a}u == 0)" for p, a in exprs if a > 1]
    return " && ".join(parts) or "true"


def vec_bytes(itemsize: int, vec: int) -> int:
    return min(16, itemsize * vec)


def pow2_upto(n: int, cap: int) -> list[int]:
    out, v = [], 1
    while v <= min(n, cap):
        out.append(v)
        v *= 2
    return out


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- the template base -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Template:
    """A parametrised kernel for a set of ops. Subclasses (one per family) implement `plan`, which
    either refuses a card (returns the reason) or returns the facts `space` and `render` need."""

    name: str  # unique, e.g. "rowreduce.softmax"
    family: str  # "rowreduce" | "norm" | "elementwise" | "pool"
    targets: tuple[str, ...]
    ops: tuple[str, ...]  # op overloads served, e.g. ("aten._softmax.default",)
    archs: tuple[str, ...] = ()  # cuda archs whose instructions the kernel needs (empty: any)

    generic = False  # renders size-generic kernels for family cards (`forgepack.templates.generic`)

    def supports(self, card: Card, target: str, arch: str | None = None) -> str | None:
        """None if this template serves the card on `target`; else the reason it refuses. `arch`: the
        GPU the pack is built for (the recipe's or the profiled device's); None checks no arch."""
        if target == "cuda" and arch and self.archs and arch.removesuffix("a") not in self.archs:
            return f"{self.name} needs {' or '.join(self.archs)}; the target is {arch}"
        result = self._checked_plan(card, target)
        return result if isinstance(result, str) else None

    def space(self, card: Card, target: str) -> dict[str, list]:
        """Parameter axes: every combination of one value per axis is a valid point."""
        return self._axes(self._plan_or_raise(card, target), target)

    def default(self, card: Card, target: str) -> dict:
        """A good first point, from heuristics on the shape."""
        plan = self._plan_or_raise(card, target)
        if isinstance(plan, FamilyPlan):
            return self.family_default(plan, self._axes(plan, target), target)
        return self.pick_default(plan, self.axes(plan, target), target)

    def render(self, card: Card, target: str, params: dict) -> str:
        """Complete kernel source for the ABI at this parameter point."""
        plan = self._plan_or_raise(card, target)
        if target == "cpu" and not params:  # cpu callers from before the cpu axes existed: the default point
            params = self.default(card, target)
        check_params(self.name, self._axes(plan, target), params)
        if isinstance(plan, FamilyPlan):
            return self.family_emit(card, plan, target, dict(params))
        return self.emit(card, plan, target, dict(params))

    def needs(self, card: Card, target: str, params: dict) -> Needs:
        """What the kernel rendered at `params` needs of its inputs (pointer alignment, divisibility:
        `forgepack.needs`), which the pack's guard checks. A CPU render is plain loops over element
        pointers, and a size-generic render of a family card (`generic`) chooses its vector paths at
        run time: element alignment (a checkpoint's weight at 8 mod 16 still hits, once verified there:
        `familyeval.element_aligned`). An exact CUDA render lays its vectors out for the captured
        offsets: today's rule, each input at the offset modulo 16 bytes it was verified at. A template
        whose renders need more says so."""
        if target == "cpu" or (self.generic and card.family is not None):
            return needs_mod.natural(card)
        return needs_mod.default(card)

    # --- for subclasses ---
    def plan(self, card: Card, target: str) -> Any:
        raise NotImplementedError

    def axes(self, plan: Any, target: str) -> dict[str, list]:
        raise NotImplementedError

    def pick_default(self, plan: Any, axes: dict[str, list], target: str) -> dict:
        return {k: v[0] for k, v in axes.items()}

    def emit(self, card: Card, plan: Any, target: str, params: dict) -> str:
        raise NotImplementedError

    # --- for subclasses with `generic = True`: the size-generic render of a family card ---
    def family_plan(self, card: Card, plan: Any, target: str) -> Any:
        """The plan of the family's representative member, checked for the whole family (or a reason)."""
        raise NotImplementedError

    def family_axes(self, plan: FamilyPlan, target: str) -> dict[str, list]:
        raise NotImplementedError

    def family_default(self, plan: FamilyPlan, axes: dict[str, list], target: str) -> dict:
        return {k: v[0] for k, v in axes.items()}

    def family_emit(self, card: Card, plan: FamilyPlan, target: str, params: dict) -> str:
        raise NotImplementedError

    # --- internals ---
    def _axes(self, plan: Any, target: str) -> dict[str, list]:
        return self.family_axes(plan, target) if isinstance(plan, FamilyPlan) else self.axes(plan, target)

    def _checked_plan(self, card: Card, target: str) -> Any:
        if target not in self.targets:
            return f"{self.name} has no {target} kernel"
        if card.op not in self.ops:
            return f"{self.name} serves {', '.join(self.ops)}, not {card.op}"
        if card.family is not None and not self.generic:
            return f"{self.name} has no size-generic kernel for a shape family"
        reason = common_refusal(card, target)
        if reason:
            return reason
        plan = self.plan(card, target)
        if card.family is None or isinstance(plan, str):
            return plan
        return self.family_plan(card, plan, target)

    def _plan_or_raise(self, card: Card, target: str) -> Any:
        result = self._checked_plan(card, target)
        if isinstance(result, str):
            raise ValueError(f"{self.name} does not serve {card.op} [{card.signature()}] on {target}: {result}")
        return result


@dataclass(frozen=True)
class FamilyPlan:
    """A family card's plan: what its representative member's plan says (dtypes, expressions, slots),
    the sizes left to be read at run time."""

    base: Any  # the representative member's plan
    info: Any = None  # what the template's family render needs besides


def check_params(name: str, axes: dict[str, list], params: dict) -> None:
    unknown = set(params) - set(axes)
    missing = set(axes) - set(params)
    if unknown or missing:
        raise ValueError(f"{name}: parameters {sorted(params)} do not match the axes {sorted(axes)}")
    for k, v in params.items():
        if v not in axes[k]:
            raise ValueError(f"{name}: {k}={v!r} is not one of {axes[k]}")


def on_device(card: Card, device: str) -> Card:
    """The same card with every tensor on `device` (for rendering GPU kernels from CPU-built cards)."""
    import dataclasses

    def move(m):
        return None if m is None else dataclasses.replace(m, device=device)

    args = tuple(
        dataclasses.replace(a, tensor=move(a.tensor), tensors=tuple(move(t) for t in a.tensors))
        for a in card.args
    )
    args = tuple(
        dataclasses.replace(a, value=device) if a.kind == "value" and a.name == "device" and a.value in TARGETS else a
        for a in args
    )
    return dataclasses.replace(card, args=args, outputs=tuple(move(o) for o in card.outputs))


def batch_unit(sources: list[str], target: str) -> str:
    """Several rendered kernels in one translation unit, so one compiler run builds them all (tests,
    benchmarks): each in its own namespace, its entry renamed `forgepack_kernel_<i>`. What ships is
    always the single source, compiled alone."""
    head = prelude(target)
    parts, includes = [head], []
    for i, src in enumerate(sources):
        if not src.startswith(head):
            raise ValueError("not a template-rendered source for this target")
        body = src[len(head):].replace("forgepack_kernel(", f"forgepack_kernel_{i}(")
        lines = body.splitlines()
        includes += [ln for ln in lines if ln.startswith("#include") and ln not in includes]  # not in a namespace
        body = "\n".join(ln for ln in lines if not ln.startswith("#include"))
        parts.append(f"namespace k{i} {{\n{body}\n}}  // namespace k{i}\n")
    return "\n".join([head, *includes, *parts[1:]])


# Cache policies of the streaming vector accesses (binary ops, cat): plain, or for loads
# "nc" = ld.global.nc.L1::no_allocate.L2::256B (read-only path, no L1 line, the L2 fetching 256-byte
# blocks from DRAM), "cs" = evict-first streaming; for stores "cs" = st.global.cs (evict-first).
LOAD_HINTS = ["plain", "nc", "cs"]
STORE_HINTS = ["plain", "cs"]

_HINT_PTX = {"nc": "ld.global.nc.L1::no_allocate.L2::256B", "cs": "ld.global.cs", "st_cs": "st.global.cs"}


def hint_helpers(ld: str, st: str) -> str:
    """`fp_load(const V*)` / `fp_store(V*, V)` for any fp_vec (1 to 64 bytes) with the chosen cache
    policies, as 16/8/4/2-byte PTX accesses (plain C++ below sm_80, or for 1-byte vectors)."""
    def chunks(op: str, store: bool) -> str:
        forms = [("16", "uint4", "v4.u32", "{%s,%s,%s,%s}", ["x", "y", "z", "w"], "r"),
                 ("8", "uint2", "v2.u32", "{%s,%s}", ["x", "y"], "r"),
                 ("4", "unsigned int", "u32", "%s", [None], "r"), ("2", "unsigned short", "u16", "%s", [None], "h")]
        out = []
        for size, ct, suffix, regs, fields, con in forms:
            n = len(fields)
            names = [f"u.{f}" if f else "u" for f in fields]
            head = f"if constexpr (S % {size} == 0) {{\n#pragma unroll\n  for (int k = 0; k < S / {size}; ++k) {{\n"
            if store:
                args = ", ".join(f'"{con}"({x})' for x in names)
                ops = regs % tuple(f"%{i + 1}" for i in range(n))
                body = (f"    const {ct} u = reinterpret_cast<const {ct}*>(&v)[k];\n"
                        f'    asm volatile("{op}.{suffix} [%0], {ops};" :: "l"(reinterpret_cast<{ct}*>(p) + k), {args}'
                        f' : "memory");\n')
            else:
                outs = ", ".join(f'"={con}"({x})' for x in names)
                ops = regs % tuple(f"%{i}" for i in range(n))
                src = f"reinterpret_cast<const {ct}*>(p) + k"
                body = (f"    {ct} u;\n"
                        f'    asm("{op}.{suffix} {ops}, [%{n}];" : {outs} : "l"({src}));\n'
                        f"    reinterpret_cast<{ct}*>(&r)[k] = u;\n")
            out.append(head + body + "  }\n} else ")
        return "".join(out) + ("{ *p = v; }" if store else "{ r = *p; }")

    load = "template <typename V> FP_FN V fp_load(const V* p) { return *p; }\n"
    store = "template <typename V> FP_FN void fp_store(V* p, const V& v) { *p = v; }\n"
    if ld != "plain":
        load = f"""template <typename V> FP_FN V fp_load(const V* p) {{
  V r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int S = sizeof(V);
  {chunks(_HINT_PTX[ld], False)}
#else
  r = *p;
#endif
  return r;
}}
"""
    if st != "plain":
        store = f"""template <typename V> FP_FN void fp_store(V* p, const V& v) {{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int S = sizeof(V);
  {chunks(_HINT_PTX["st_" + st], True)}
#else
  *p = v;
#endif
}}
"""
    return "\n" + load + store
