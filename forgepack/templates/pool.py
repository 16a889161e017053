"""Pooling templates: `_adaptive_avg_pool2d` and `max_pool2d_with_indices`.

One thread per output element, outputs visited in their memory order (so NCHW and channels-last
outputs are both stored coalesced); each thread walks its window with the input's strides. Window
bounds follow aten exactly: adaptive bins [floor(o*I/O), ceil((o+1)*I/O)); max pool starts at
o*stride - pad, steps back into the input by whole dilations, keeps the first index of the maximum,
and lets NaN win (`val > max || isnan(val)`, so the last NaN's index is kept), as both aten kernels do.
A global average pool of a contiguous NCHW tensor (output 1x1) is a row reduction and is rendered by
the row engine (threads share a plane).

Max pool on cuda (windows up to a register budget) is bandwidth-shaped instead: each thread computes
`oht` x `owt` neighbouring outputs (rows x columns), loads the input rows and columns their windows
cover once into registers (neighbouring windows share them; the whole window is unrolled, so every
load is in flight before the first compare), and compares in aten's order. A position outside the
input reads as -inf, which can never win `val > max || isnan(val)`, and the index starts at the
window's first in-bounds position, so the result is aten's. Where the layout allows, the input rows
are read as aligned `lvec`-element vectors (columns a thread needs, rounded out to whole vectors:
the vector grid is fixed because `owt * stride` is a multiple of the width) and an NCHW output's
`owt` values and int64 indices are stored as vectors; misaligned base pointers at run time take the
same kernel's scalar instantiation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from forgepack.cards import DTYPE_SIZES, Card, TensorMeta
from forgepack.templates.common import (
    FLOATS,
    Template,
    align_check,
    ceil_div,
    ctype,
    decode_lines,
    entry,
    itype_for,
    launch_status,
    prelude,
    value,
    vec_bytes,
)
from forgepack.templates.rowreduce import RowProgram, Step, build_rows, render_rows, row_axes, row_default

BLOCKS = [64, 128, 256, 512]
OWTS = [1, 2, 4, 8]  # max pool: outputs per thread along W
OHTS = [1, 2, 4]  # max pool: outputs per thread along H
LOAD_BUDGET = 128  # input values one thread holds in registers
CMP_BUDGET = 512  # unrolled compares per thread (outputs x window)


@dataclass(frozen=True)
class PoolPlan:
    kind: str  # "avg" | "max"
    x: TensorMeta  # as 4-D (N, C, H, W)
    out: TensorMeta  # as 4-D
    idx: TensorMeta | None  # max pool indices, as 4-D
    kernel: tuple[int, int] = (1, 1)
    stride: tuple[int, int] = (1, 1)
    pad: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)


def as_4d(m: TensorMeta) -> TensorMeta:
    if len(m.shape) == 4:
        return m
    return TensorMeta(m.dtype, (1, *m.shape), (m.numel, *m.stride), m.storage_offset, m.device)


def _decode(out: TensorMeta, idx: str, itype: str, shape: tuple[int, ...] | None = None) -> str:
    """Coordinates n_, c_, oh_, ow_ of output linear index `idx`, taken in the output's memory order
    (over `shape` if given: the output's grid of thread tiles)."""
    order = sorted(range(4), key=lambda d: (out.stride[d], d), reverse=True)  # outermost first
    shape = shape or out.shape
    return "\n    ".join(decode_lines(idx, shape, order, ["n_", "c_", "oh_", "ow_"], itype))


def _offset(m: TensorMeta, coords: tuple[str, str, str, str]) -> str:
    terms = [f"{c} * {s}u" for c, s, n in zip(coords, m.stride, m.shape, strict=True) if n != 1 and s != 0]
    return " + ".join(terms) or "0u"


def _body(plan: PoolPlan, target: str, itype: str) -> str:
    x, out = plan.x, plan.out
    _, _, h, w = x.shape
    _, _, oh, ow = out.shape
    sh, sw = x.stride[2], x.stride[3]
    base = _offset(x, ("n_", "c_", "0", "0"))
    o_off = _offset(out, ("n_", "c_", "oh_", "ow_"))
    ot = ctype(out.dtype, target)
    if plan.kind == "avg":
        return f"""
    const int h0 = (int)((oh_ * {h}u) / {oh}u), h1 = (int)(((oh_ + 1u) * {h}u + {oh - 1}u) / {oh}u);
    const int w0 = (int)((ow_ * {w}u) / {ow}u), w1 = (int)(((ow_ + 1u) * {w}u + {ow - 1}u) / {ow}u);
    const {itype} xb = {base};
    float s = 0.0f;
    for (int ih = h0; ih < h1; ++ih)
      for (int iw = w0; iw < w1; ++iw) s += fp_ld(p.x[xb + ({itype})ih * {sh}u + ({itype})iw * {sw}u]);
    p.out[{o_off}] = fp_st<{ot}>(s / (float)((h1 - h0) * (w1 - w0)));"""
    (kh, kw), (st_h, st_w), (ph, pw), (dh, dw) = plan.kernel, plan.stride, plan.pad, plan.dilation
    i_off = _offset(plan.idx, ("n_", "c_", "oh_", "ow_"))
    return f"""
    int hs = (int)oh_ * {st_h} - {ph}, ws = (int)ow_ * {st_w} - {pw};
    const int he = hs + {(kh - 1) * dh + 1} < {h} ? hs + {(kh - 1) * dh + 1} : {h};
    const int we = ws + {(kw - 1) * dw + 1} < {w} ? ws + {(kw - 1) * dw + 1} : {w};
    while (hs < 0) hs += {dh};
    while (ws < 0) ws += {dw};
    const {itype} xb = {base};
    float m = -FP_INF;
    int64_t mi = (int64_t)hs * {w} + ws;
    for (int ih = hs; ih < he; ih += {dh})
      for (int iw = ws; iw < we; iw += {dw}) {{
        const float v = fp_ld(p.x[xb + ({itype})ih * {sh}u + ({itype})iw * {sw}u]);
        if (v > m || v != v) {{ m = v; mi = (int64_t)ih * {w} + iw; }}
      }}
    p.out[{o_off}] = fp_st<{ot}>(m);
    p.idx[{i_off}] = mi;"""


def render_pool(card: Card, target: str, plan: PoolPlan, params: dict) -> str:
    numel = plan.out.numel
    itype = itype_for(max(plan.x.span(), plan.out.span(), numel))
    xt, ot = ctype(plan.x.dtype, target), ctype(plan.out.dtype, target)
    restrict = " __restrict__" if target == "cuda" else ""
    fields = f"const {xt}*{restrict} x; {ot}*{restrict} out;" + (f" int64_t*{restrict} idx;" if plan.idx else "")
    inits = [f"p.x = (const {xt}*)call->inputs[0].data;", f"p.out = ({ot}*)call->outputs[0].data;"]
    if plan.idx:
        inits.append("p.idx = (int64_t*)call->outputs[1].data;")
    head = prelude(target) + f"\nstruct fp_args {{ {fields} }};\n"
    body = _body(plan, target, itype)
    if target == "cpu":
        kernel = f"""
static void fp_pool(const fp_args& p) {{
  for ({itype} e_ = 0; e_ < {numel}u; ++e_) {{
    {_decode(plan.out, "e_", itype)}
    {body}
  }}
}}
"""
        call = "fp_pool(p);"
    else:
        block = params["block"]
        kernel = f"""
__global__ void __launch_bounds__({block}) fp_pool(const fp_args p) {{
  const {itype} e_ = ({itype})blockIdx.x * {block}u + threadIdx.x;
  if (e_ >= {numel}u) return;
  {{
    {_decode(plan.out, "e_", itype)}
    {body}
  }}
}}
"""
        call = f"fp_pool<<<{ceil_div(numel, block)}u, {block}, 0, stream>>>(p);"
    launch = "fp_args p;\n  " + "\n  ".join(inits) + f"\n  {call}\n  " + launch_status(target)
    return head + kernel + entry(card, target, launch)


# --- max pool on cuda: register tiles of outputs ---------------------------------------------------


def _tile(plan: PoolPlan, oht: int, owt: int) -> tuple[list[int], list[int]]:
    """Input rows and columns (relative to the tile's first window origin) that oht x owt windows read."""
    (kh, kw), (sh, sw), (dh, dw) = plan.kernel, plan.stride, plan.dilation
    rows = sorted({a * sh + i * dh for a in range(oht) for i in range(kh)})
    cols = sorted({b * sw + j * dw for b in range(owt) for j in range(kw)})
    return rows, cols


def _fits(plan: PoolPlan, oht: int, owt: int) -> bool:
    rows, cols = _tile(plan, oht, owt)
    return len(rows) * len(cols) <= LOAD_BUDGET and oht * owt * math.prod(plan.kernel) <= CMP_BUDGET


def _aligned(m: TensorMeta, dims: list[int], vec: int) -> bool:
    """`vec` consecutive elements along the last dim form aligned vectors wherever `dims` index."""
    if m.stride[3] != 1 or any(m.shape[d] != 1 and m.stride[d] % vec for d in dims):
        return False
    return (m.storage_offset * DTYPE_SIZES[m.dtype]) % vec_bytes(DTYPE_SIZES[m.dtype], vec) == 0


def max_axes(plan: PoolPlan) -> dict[str, list]:
    """block, owt, oht, lvec; just block where even one output's window is over the register budget."""
    oh, ow = plan.out.shape[2:]
    owts = [v for v in OWTS if v == 1 or v < 2 * ow]
    ohts = [v for v in OHTS if v == 1 or v < 2 * oh]
    if not _fits(plan, 1, 1):
        return {"block": list(BLOCKS)}
    while not _fits(plan, ohts[-1], owts[-1]):  # every combination must fit: trim the largest corner
        (ohts if len(ohts) > 1 else owts).pop()  # W first: whole-vector stores, shared columns
    x = plan.x
    w = x.shape[3]
    lvecs, v = [1], 2
    while v * DTYPE_SIZES[x.dtype] <= 16:
        if w % v == 0 and _aligned(x, [0, 1, 2], v):
            lvecs.append(v)
        v *= 2
    return {"block": list(BLOCKS), "owt": owts, "oht": ohts, "lvec": lvecs}


def max_default(plan: PoolPlan, axes: dict[str, list]) -> dict:
    if "owt" not in axes:
        return {"block": 256}
    nchw = plan.out.stride[3] == 1
    # NCHW: a few outputs per thread along W (stores of whole vectors, shared columns); channels-last
    # is already coalesced across threads by channel.
    owt = max(v for v in axes["owt"] if v <= (4 if nchw else 1))
    return {"block": 256, "owt": owt, "oht": 1, "lvec": axes["lvec"][-1]}


def render_max_cuda(card: Card, plan: PoolPlan, params: dict) -> str:
    x, out, idx = plan.x, plan.out, plan.idx
    block, owt, oht = params["block"], params["owt"], params["oht"]
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = plan.kernel, plan.stride, plan.pad, plan.dilation
    n, c, h, w = x.shape
    _, _, oh, ow = out.shape
    lv = params["lvec"]
    while (owt * sw) % lv:  # the vector grid must not move between thread tiles
        lv //= 2
    groups = (n, c, ceil_div(oh, oht), ceil_div(ow, owt))
    units = math.prod(groups)
    itype = itype_for(max(x.span(), out.span(), idx.span(), units))
    xt, ot = ctype(x.dtype, "cuda"), ctype(out.dtype, "cuda")
    osz = DTYPE_SIZES[out.dtype]
    vstore = owt > 1 and ow % owt == 0 and _aligned(out, [0, 1, 2], owt) and _aligned(idx, [0, 1, 2], owt)
    rows, cols = _tile(plan, oht, owt)
    sxh, sxw = x.stride[2], x.stride[3]
    lines = [
        f"const int oh0 = (int)oh_ * {oht}, ow0 = (int)ow_ * {owt};",
        f"const int hb = oh0 * {sh} - {ph}, g_ = ow0 * {sw}, wb = g_ - {pw};",
        f"const {itype} xb = {_offset(x, ('n_', 'c_', '0', '0'))};",
    ]
    lines += [f"const bool rv{r} = (unsigned)(hb + {r}) < {h}u;" for r in rows]
    lines += [f"float t{r}_{q};" for r in rows for q in cols]
    scalar = [f"t{r}_{q} = (rv{r} && (unsigned)(wb + {q}) < {w}u) ? fp_ld(p.x[xb + ({itype})(hb + {r}) * {sxh}u"
              f" + ({itype})(wb + {q}) * {sxw}u]) : -FP_INF;" for r in rows for q in cols]
    if lv > 1:
        chunks = sorted({(q - pw) // lv for q in cols})  # vector k starts at column g_ + k * lv
        k0 = chunks[0]
        vec = []
        for r in rows:
            for k in chunks:
                v = f"{r}_{k - k0}"
                vec.append(f"fp_vec<{xt}, {lv}> v{v} = {{}}; const bool ok{v} = rv{r} && (unsigned)(g_ + {k * lv})"
                           f" < {w}u;")  # w % lv == 0: a vector is wholly inside the row or wholly outside
                vec.append(f"if (ok{v}) v{v} = *reinterpret_cast<const fp_vec<{xt}, {lv}>*>(p.x + xb + "
                           f"({itype})(hb + {r}) * {sxh}u + ({itype})(g_ + {k * lv}));")
            for q in cols:
                k, e = (q - pw) // lv, (q - pw) % lv
                vec.append(f"t{r}_{q} = ok{r}_{k - k0} ? fp_ld(v{r}_{k - k0}.v[{e}]) : -FP_INF;")
        lines += ["if constexpr (VEC) {", *("  " + v for v in vec), "} else {", *("  " + v for v in scalar), "}"]
    else:
        lines += scalar
    for a in range(oht):
        for b in range(owt):
            lines += [
                f"float m{a}_{b} = -FP_INF; int64_t i{a}_{b};",
                f"{{ int hs = (oh0 + {a}) * {sh} - {ph}, ws = (ow0 + {b}) * {sw} - {pw};",
                f"  if (hs < 0) hs += ((-hs + {dh - 1}) / {dh}) * {dh};",
                f"  if (ws < 0) ws += ((-ws + {dw - 1}) / {dw}) * {dw};",
                f"  i{a}_{b} = (int64_t)hs * {w} + ws; }}",
            ]
            for i in range(kh):  # aten's order: rows, then columns; first maximum kept, NaN wins
                for j in range(kw):
                    r, q = a * sh + i * dh, b * sw + j * dw
                    lines.append(f"if (t{r}_{q} > m{a}_{b} || t{r}_{q} != t{r}_{q}) {{ m{a}_{b} = t{r}_{q}; "
                                 f"i{a}_{b} = (int64_t)(hb + {r}) * {w} + (wb + {q}); }}")
    for a in range(oht):
        o_row = _offset(out, ("n_", "c_", f"({itype})(oh0 + {a})", "0"))
        i_row = _offset(idx, ("n_", "c_", f"({itype})(oh0 + {a})", "0"))
        so, si = out.stride[3], idx.stride[3]
        scalar = [f"if (ow0 + {b} < {ow}) {{ p.out[o_ + ({itype})(ow0 + {b}) * {so}u] = fp_st<{ot}>(m{a}_{b}); "
                  f"p.idx[i_ + ({itype})(ow0 + {b}) * {si}u] = i{a}_{b}; }}" for b in range(owt)]
        lines += [f"if (oh0 + {a} < {oh}) {{", f"  const {itype} o_ = {o_row}, i_ = {i_row};"]
        if vstore:
            lines += [
                "  if constexpr (VEC) {",
                f"    fp_vec<{ot}, {owt}> mv; fp_vec<int64_t, {owt}> iv;",
                *(f"    mv.v[{b}] = fp_st<{ot}>(m{a}_{b}); iv.v[{b}] = i{a}_{b};" for b in range(owt)),
                f"    *reinterpret_cast<fp_vec<{ot}, {owt}>*>(p.out + o_ + ({itype})ow0) = mv;",
                f"    *reinterpret_cast<fp_vec<int64_t, {owt}>*>(p.idx + i_ + ({itype})ow0) = iv;",
                "  } else {", *("    " + t for t in scalar), "  }",
            ]
        else:
            lines += ["  " + t for t in scalar]
        lines.append("}")
    body = "\n    ".join(lines)
    fields = f"const {xt}* __restrict__ x; {ot}* __restrict__ out; int64_t* __restrict__ idx;"
    kernel = f"""
struct fp_args {{ {fields} }};

template <bool VEC>
__global__ void __launch_bounds__({block}) fp_maxpool(const fp_args p) {{
  const {itype} e_ = ({itype})blockIdx.x * {block}u + threadIdx.x;
  if (e_ >= {units}u) return;
  {{
    {_decode(out, "e_", itype, groups)}
    {body}
  }}
}}
"""
    checks = [("p.x", vec_bytes(DTYPE_SIZES[x.dtype], lv))] if lv > 1 else []
    if vstore:
        checks += [("p.out", vec_bytes(osz, owt)), ("p.idx", vec_bytes(8, owt))]
    cond = align_check(checks)
    grid = ceil_div(units, block)
    launch = (f"fp_args p;\n  p.x = (const {xt}*)call->inputs[0].data;\n  p.out = ({ot}*)call->outputs[0].data;\n  "
              f"p.idx = (int64_t*)call->outputs[1].data;\n  "
              f"if ({cond}) fp_maxpool<true><<<{grid}u, {block}, 0, stream>>>(p);\n  "
              f"else fp_maxpool<false><<<{grid}u, {block}, 0, stream>>>(p);\n  " + launch_status("cuda"))
    return prelude("cuda") + kernel + entry(card, "cuda", launch)


class PoolTemplate(Template):
    def axes(self, plan, target):
        if isinstance(plan, RowProgram):
            return row_axes(plan, target)
        if target == "cpu":
            return {}
        return max_axes(plan) if plan.kind == "max" else {"block": list(BLOCKS)}

    def pick_default(self, plan, axes, target):
        if isinstance(plan, RowProgram):
            return row_default(plan, axes, target)
        if target == "cpu":
            return {}
        return max_default(plan, axes) if plan.kind == "max" else {"block": 256}

    def emit(self, card, plan, target, params):
        if isinstance(plan, RowProgram):
            return render_rows(card, target, plan, params)
        if target == "cuda" and "owt" in params:
            return render_max_cuda(card, plan, params)
        return render_pool(card, target, plan, params)


class AdaptiveAvgPoolTemplate(PoolTemplate):
    def plan(self, card: Card, target: str):
        x, out = card.tensor_inputs()[0], card.outputs[0]
        if x.dtype not in FLOATS or out.dtype != x.dtype or len(x.shape) not in (3, 4):
            return "adaptive avg pool served on 3-D/4-D float32/float16/bfloat16"
        x4, o4 = as_4d(x), as_4d(out)
        if o4.shape[:2] != x4.shape[:2] or 0 in x4.shape:
            return "output does not match the input's N, C"
        if o4.shape[2:] == (1, 1):
            built = build_rows(x, 0, 2, [], [(0, out)])
            if not isinstance(built, str):
                outer, xv, _, routs, n, rows = built
                inv = f"s_ / {float(n)!r}f"  # aten divides the bin's float sum by its size
                steps = (Step("reduce", "s_", "x"), Step("rowwrite", expr=inv, slot=0))
                return RowProgram(rows, n, outer, xv, 0, (), routs, (), steps)
        return PoolPlan("avg", x4, o4, None)


class MaxPoolTemplate(PoolTemplate):
    def plan(self, card: Card, target: str):
        x = card.tensor_inputs()[0]
        out, idx = card.outputs
        if x.dtype not in FLOATS or out.dtype != x.dtype or idx.dtype != "int64" or len(x.shape) not in (3, 4):
            return "max pool served on 3-D/4-D float32/float16/bfloat16"
        x4, o4, i4 = as_4d(x), as_4d(out), as_4d(idx)
        if o4.shape != i4.shape or o4.shape[:2] != x4.shape[:2]:
            return "outputs do not match the input's N, C"

        def pair(name, default):
            v = value(card, name) or default
            v = list(v) if isinstance(v, list | tuple) else [v]
            return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])

        kernel = pair("kernel_size", None)
        stride = pair("stride", kernel) if value(card, "stride") else kernel
        pad, dil = pair("padding", [0]), pair("dilation", [1])
        if min(*kernel, *stride, *dil) <= 0 or min(pad) < 0:
            return "bad pooling parameters"
        if math.prod(kernel) > 1024:
            return "window too large"
        return PoolPlan("max", x4, o4, i4, kernel, stride, pad, dil)


TEMPLATES = (
    AdaptiveAvgPoolTemplate("pool.adaptive_avg", "pool", ("cuda", "cpu"), ("aten._adaptive_avg_pool2d.default",)),
    MaxPoolTemplate("pool.max2d", "pool", ("cuda", "cpu"), ("aten.max_pool2d_with_indices.default",)),
)
