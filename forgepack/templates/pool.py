"""Pooling templates: `_adaptive_avg_pool2d` and `max_pool2d_with_indices`.

One thread per output element, outputs visited in their memory order (so NCHW and channels-last
outputs are both stored coalesced); each thread walks its window with the input's strides. Window
bounds follow aten exactly: adaptive bins [floor(o*I/O), ceil((o+1)*I/O)); max pool starts at
o*stride - pad, steps back into the input by whole dilations, keeps the first index of the maximum,
and lets NaN win (`val > max || isnan(val)`, so the last NaN's index is kept), as both aten kernels do.
A global average pool of a contiguous NCHW tensor (output 1x1) is a row reduction and is rendered by
the row engine (threads share a plane).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from forgepack.cards import Card, TensorMeta
from forgepack.templates.common import FLOATS, Template, ceil_div, ctype, entry, launch_status, prelude, value
from forgepack.templates.rowreduce import RowProgram, Step, build_rows, render_rows, row_axes, row_default

BLOCKS = [64, 128, 256, 512]


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


def _decode(out: TensorMeta, idx: str, itype: str) -> str:
    """Coordinates n_, c_, oh_, ow_ of output linear index `idx`, taken in the output's memory order."""
    order = sorted(range(4), key=lambda d: (out.stride[d], d), reverse=True)  # outermost first
    names = ["n_", "c_", "oh_", "ow_"]
    lines = [f"{itype} r_ = {idx};"]
    for d in reversed(order[1:]):
        lines.append(f"const {itype} {names[d]} = r_ % {out.shape[d]}u; r_ /= {out.shape[d]}u;")
    lines.append(f"const {itype} {names[order[0]]} = r_;")
    return "\n    ".join(lines)


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
    itype = "uint32_t" if max(plan.x.span(), plan.out.span(), numel) + (1 << 20) < 1 << 31 else "uint64_t"
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


class PoolTemplate(Template):
    def axes(self, plan, target):
        if isinstance(plan, RowProgram):
            return row_axes(plan, target)
        return {} if target == "cpu" else {"block": list(BLOCKS)}

    def pick_default(self, plan, axes, target):
        if isinstance(plan, RowProgram):
            return row_default(plan, axes, target)
        return {} if target == "cpu" else {"block": 256}

    def emit(self, card, plan, target, params):
        if isinstance(plan, RowProgram):
            return render_rows(card, target, plan, params)
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
