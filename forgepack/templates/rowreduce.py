"""Row-reduction templates: softmax, log-softmax, layer norm, RMS norm, sum/mean/amax over trailing dims.

Every one of them is a short program over rows of `n` elements (the trailing dims, walked as one):
reductions (sum or NaN-propagating max) of an expression of the element `x`, per-row scalars,
per-element outputs and per-row outputs. `RowProgram` states it once; `render_rows` turns it into
CUDA or C++.

CUDA: `tpr` threads share a row (a power of two; up to 32 they reduce with warp shuffles, above that
through shared memory), `rpb` rows per block, `vec` elements per 16-byte access. When the row fits
in registers (<= 32 elements a thread) it is read once and every pass runs on registers; otherwise
each pass re-reads the row (it is then mostly in L2), and the statistics of layer/group/RMS norm
are taken in one pass with shifted sums. Numerics follow aten: fp32 accumulation, biased variance,
rsqrt(var + eps), NaN propagated by max.

CPU: one row after another, each step a loop over the row (sums in double). The search chooses the
accumulators per reduction (`acc`: independent dependency chains), the column loops' unroll hint and
whether the row is first converted to floats on the stack (`stage`): `cpu_row_axes`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from forgepack.cards import Card, TensorMeta
from forgepack.templates import generic
from forgepack.templates.common import (
    FLOATS,
    FamilyPlan,
    Template,
    View,
    align_check,
    ceil_div,
    coalesce,
    ctype,
    entry,
    flit,
    index_type,
    launch_status,
    offsets_code,
    prelude,
    value,
    vec_bytes,
)

TPRS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
RPBS = [1, 2, 4, 8, 16]
REG_ELEMS = 32  # elements a thread may keep in registers before the row is re-read per pass
SM_COUNT = 132
# cpu: partial sums (or maxima) per reduction, each its own dependency chain: one serial chain of
# double adds is bound by the add's latency (about 4 cycles an element); 2-8 independent ones overlap,
# and the compiler may put pairs of them in one SSE register. Combined pairwise at the row's end. In
# search order: one chain (the default), then the most, then fewer, so that one step from the default
# reaches the most overlap (two chains gained 5% on a Llama RMSNorm row of 64 where eight gained 40%).
CPU_ACCS = (1, 8, 4, 2)
CPU_UNROLLS = (1, 2, 4, 8)  # `#pragma GCC unroll` on the column loops (1: the compiler's choice)
CPU_STAGE_MAX = 4096  # longest row staged as floats on the stack (16 KiB)
CPU_ROW_DEFAULT = {"acc": 1, "unroll": 1, "stage": 0}  # one chain, no hint, every pass reads the input


@dataclass(frozen=True)
class Param:
    """A per-column tensor (weight, bias): `index` is a C expression of `col` and `row`, or None for
    `col` itself with a unit stride (then loaded as vectors alongside x)."""

    slot: int
    dtype: str
    index: str | None = None
    storage_offset: int = 0


@dataclass(frozen=True)
class Step:
    kind: str  # "reduce" | "let" | "write" | "rowwrite"
    name: str = ""  # reduce/let: the scalar defined; write/rowwrite: unused
    expr: str = ""  # float expression (x, col, w<k>, earlier scalars)
    op: str = "sum"  # reduce: "sum" | "max"
    slot: int = 0  # write/rowwrite: output slot
    also: tuple[tuple[str, str], ...] = ()  # reduce: more sums taken in the same pass (name, expr)


@dataclass(frozen=True)
class RowProgram:
    rows: int
    n: int
    outer: tuple[int, ...]  # coalesced outer shape (rows), row-major
    x: View  # input: strides over `outer` + (inner stride,)
    x_slot: int
    outs: tuple[tuple[int, View], ...]  # per-element outputs: (slot, view over outer + inner)
    row_outs: tuple[tuple[int, View], ...]  # per-row outputs: (slot, view over outer)
    params: tuple[Param, ...] = ()
    steps: tuple[Step, ...] = ()
    loop_steps: tuple[Step, ...] | None = None  # program to use when the row is re-read per pass
    lets: tuple[str, ...] = field(default=())  # C statements at row start (e.g. `g_ = row % G`)

    def vectorisable(self, vec: int) -> bool:
        if vec == 1:
            return True
        if self.n % vec:
            return False
        for v in [self.x] + [o for _, o in self.outs]:
            if v.strides[-1] != 1 or any(s % vec for s in v.strides[:-1]):
                return False
            if (v.storage_offset * v.itemsize) % vec_bytes(v.itemsize, vec):
                return False
        for p in self.params:
            if p.index is None and (p.storage_offset * _size(p.dtype)) % vec_bytes(_size(p.dtype), vec):
                return False
        return True


def _size(dtype: str) -> int:
    from forgepack.cards import DTYPE_SIZES

    return DTYPE_SIZES[dtype]


def row_views(meta: TensorMeta, k: int) -> tuple[tuple[int, ...], tuple[int, ...], int, int] | None:
    """(outer shape, outer strides, n, inner stride) of `meta` reduced over its last k dims; None if
    those dims are not one evenly strided run."""
    nd = len(meta.shape)
    inner_shape, inner_strides = meta.shape[nd - k:], meta.stride[nd - k:]
    dims = [(n, s) for n, s in zip(inner_shape, inner_strides, strict=True) if n != 1]
    n = math.prod(inner_shape)
    stride = dims[-1][1] if dims else 1
    expect = stride
    for size, s in reversed(dims):
        if s != expect:
            return None
        expect *= size
    return meta.shape[: nd - k], meta.stride[: nd - k], n, stride


def cpu_row_axes(prog: RowProgram) -> dict[str, list]:
    """The cpu row program's axes: `acc` independent accumulators per reduction (at most the row's
    length), `unroll` (the column loops' unroll hint), `stage` (1: the row is converted to float into a
    stack buffer once, and every later pass reads that: one strided gather or half-precision decode per
    element instead of one per pass; rows up to `CPU_STAGE_MAX`)."""
    return {"acc": [a for a in CPU_ACCS if a <= prog.n], "unroll": list(CPU_UNROLLS),
            "stage": [0, 1] if prog.n <= CPU_STAGE_MAX else [0]}


def row_axes(prog: RowProgram, target: str) -> dict[str, list]:
    if target == "cpu":
        return cpu_row_axes(prog)
    sizes = [prog.x.itemsize] + [o.itemsize for _, o in prog.outs]
    vecs = [v for v in (1, 2, 4, 8, 16) if v * min(sizes) <= 16 and prog.vectorisable(v)]
    top = 1 << math.ceil(math.log2(prog.n))
    tprs = [t for t in TPRS if t <= top]
    return {"tpr": tprs, "vec": vecs, "rpb": list(RPBS)}


def row_default(prog: RowProgram, axes: dict[str, list], target: str) -> dict:
    if target == "cpu":
        return dict(CPU_ROW_DEFAULT)
    vec = axes["vec"][-1]
    vectors = ceil_div(prog.n, vec)
    if vectors <= 32:
        tpr = 1 << math.ceil(math.log2(vectors))
    else:
        tpr = 1 << math.floor(math.log2(max(1, vectors // 4)))
    tpr = min(tpr, 1024, axes["tpr"][-1])
    rpb = max(1, min(16, 256 // tpr))
    while rpb > 1 and ceil_div(prog.rows, rpb) < 2 * SM_COUNT:
        rpb //= 2
    return {"tpr": tpr, "vec": vec, "rpb": rpb}


def effective_rpb(tpr: int, rpb: int) -> int:
    """Rows per block clamped so the block is whole warps and at most 1024 threads."""
    return max(ceil_div(32, tpr), min(rpb, 1024 // tpr))


# --- code generation -------------------------------------------------------------------------------


def _row_offsets(prog: RowProgram, itype: str) -> str:
    views = [View(prog.x.dtype, prog.x.strides[:-1], 0, 0)]
    views += [View(o.dtype, o.strides[:-1], 0, 0) for _, o in prog.outs]
    views += [View(o.dtype, o.strides, 0, 0) for _, o in prog.row_outs]
    names = ["xo_"] + [f"eo{s}_" for s, _ in prog.outs] + [f"ro{s}_" for s, _ in prog.row_outs]
    if not prog.outer:
        return "\n".join(f"const {itype} {n} = 0u;" for n in names)
    return offsets_code(prog.outer, views, "row", names, itype)


def _geom_offsets(prog: RowProgram, itype: str) -> str:
    """The row's offsets decoded from the run-time geometry `g` (view order: x, outs, row outs)."""
    names = ["xo_"] + [f"eo{s}_" for s, _ in prog.outs] + [f"ro{s}_" for s, _ in prog.row_outs]
    decl = " ".join(f"{itype} {n} = 0;" for n in names)
    adds = " ".join(f"{n} += c_ * ({itype})g.s[{v}][d];" for v, n in enumerate(names))
    return (f"{decl}\n{{ {itype} r_ = row;\n"
            f"  for (int d = g.nd - 1; d >= 0; --d) {{ const {itype} c_ = r_ % ({itype})g.n[d]; "
            f"r_ /= ({itype})g.n[d]; {adds} }} }}")


def _param_loads(prog: RowProgram, target: str, exprs: list[str], vector: bool) -> tuple[list[str], list[str]]:
    """(per-vector statements, per-element statements) loading the params the expressions use."""
    per_vec, per_elem = [], []
    for k, p in enumerate(prog.params):
        if not any(f"w{k}" in e for e in exprs):
            continue
        t = ctype(p.dtype, target)
        if p.index is None and vector:
            per_vec.append(f"const fp_vec<{t}, VEC> wv{k} = "
                           f"*reinterpret_cast<const fp_vec<{t}, VEC>*>(p.in{p.slot} + c0);")
            per_elem.append(f"const float w{k} = fp_ld(wv{k}.v[j]);")
        else:
            per_elem.append(f"const float w{k} = fp_ld(p.in{p.slot}[{p.index or 'col'}]);")
    return per_vec, per_elem


def _cuda_pass(prog: RowProgram, step: Step, regs: bool, full: bool) -> str:
    """One pass over the row for a reduce or write step."""
    exprs = [step.expr] + [e for _, e in step.also]
    per_vec, per_elem = _param_loads(prog, "cuda", exprs, vector=True)
    xs = prog.x.strides[-1]
    if step.kind == "reduce":
        accs = [(step.name, step.op, step.expr)] + [(n, "sum", e) for n, e in step.also]
        init = " ".join(f"float {n} = {'-FP_INF' if op == 'max' else '0.0f'};" for n, op, _ in accs)
        body = " ".join(f"{n} = fp_max_nan({n}, {e});" if op == "max" else f"{n} += {e};" for n, op, e in accs)
        pre, post = "", ""
    else:
        out_t = ctype(dict(prog.outs)[step.slot].dtype, "cuda")
        init = ""
        pre = f"fp_vec<{out_t}, VEC> r_;"
        body = f"r_.v[j] = fp_st<{out_t}>({step.expr});"
        ostride = dict(prog.outs)[step.slot].strides[-1]
        post = (f"if (row_ok) *reinterpret_cast<fp_vec<{out_t}, VEC>*>"
                f"(p.out{step.slot} + eo{step.slot}_ + c0 * {ostride}u) = r_;")
    elem = " ".join(per_elem)
    if regs:
        guard = "true" if full else "c0 < N"
        loop = f"""#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {{
    const int c0 = (it * TPR + lane) * VEC;
    if ({guard}) {{
      {' '.join(per_vec)} {pre}
#pragma unroll
      for (int j = 0; j < VEC; ++j) {{ const float x = xf[it][j]; const int col = c0 + j; (void)col; {elem} {body} }}
      {post}
    }}
  }}"""
    else:
        xt = ctype(prog.x.dtype, "cuda")
        loop = f"""for (int c0 = lane * VEC; c0 < N; c0 += TPR * VEC) {{
    const fp_vec<{xt}, VEC> xv_ = *reinterpret_cast<const fp_vec<{xt}, VEC>*>(p.in{prog.x_slot} + xo_ + c0 * {xs}u);
    {' '.join(per_vec)} {pre}
#pragma unroll
    for (int j = 0; j < VEC; ++j) {{
      const float x = fp_ld(xv_.v[j]); const int col = c0 + j; (void)col; {elem} {body}
    }}
    {post}
  }}"""
    if step.kind != "reduce":
        return "  " + loop
    names = [(step.name, step.op)] + [(n, "sum") for n, _ in step.also]
    reduce = "\n  ".join(_cuda_cross(n, op) for n, op in names)
    return f"  {init}\n  {loop}\n  {reduce}"


def _cuda_cross(name: str, op: str) -> str:
    fn = "fp_warp_max" if op == "max" else "fp_warp_sum"
    comb = f"{name} = fp_max_nan({name}, red_{name}[rib][w]);" if op == "max" else f"{name} += red_{name}[rib][w];"
    return (
        f"{name} = {fn}<(TPR < 32 ? TPR : 32)>({name});\n"
        f"  if (TPR > 32) {{\n"
        f"    __shared__ float red_{name}[RPB][TPR > 32 ? TPR / 32 : 1];\n"
        f"    if (lane % 32 == 0) red_{name}[rib][lane / 32] = {name};\n"
        f"    __syncthreads();\n"
        f"    {name} = red_{name}[rib][0];\n"
        f"    for (int w = 1; w < TPR / 32; ++w) {comb}\n"
        f"  }}"
    )


def _cuda_kernel(prog: RowProgram, tpr: int, vec: int, rpb: int, itype: str, geom: bool = False) -> str:
    """`geom`: the size-generic form (family cards): rows and their offsets from `g` at run time."""
    items = ceil_div(prog.n, tpr * vec)
    regs = items * vec <= REG_ELEMS
    steps = prog.steps if regs or prog.loop_steps is None else prog.loop_steps
    full = prog.n % (tpr * vec) == 0
    xt = ctype(prog.x.dtype, "cuda")
    parts = []
    if regs:
        guard = "true" if full else "c0 < N"
        parts.append(f"""  float xf[ITEMS][VEC];
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {{
    const int c0 = (it * TPR + lane) * VEC;
    if ({guard}) {{
      const fp_vec<{xt}, VEC> v_ =
          *reinterpret_cast<const fp_vec<{xt}, VEC>*>(p.in{prog.x_slot} + xo_ + c0 * {prog.x.strides[-1]}u);
#pragma unroll
      for (int j = 0; j < VEC; ++j) xf[it][j] = fp_ld(v_.v[j]);
    }}
  }}""")
    for st in steps:
        if st.kind in ("reduce", "write"):
            parts.append(_cuda_pass(prog, st, regs, full))
        elif st.kind == "let":
            parts.append(f"  const float {st.name} = {st.expr}; (void){st.name};")
        else:
            t = ctype(dict(prog.row_outs)[st.slot].dtype, "cuda")
            parts.append(f"  if (lane == 0 && row_ok) p.out{st.slot}[ro{st.slot}_] = fp_st<{t}>({st.expr});")
    body = "\n".join(parts)
    rows, last = ("g.numel", "g.numel - 1") if geom else (f"{prog.rows}u", f"{prog.rows - 1}u")
    return f"""
template <int VEC, int TPR, int RPB>
__global__ void __launch_bounds__(TPR * RPB) fp_rows(const fp_args p{", const fp_geom g" if geom else ""}) {{
  constexpr int N = {prog.n};
  {"constexpr int ITEMS = (N + TPR * VEC - 1) / (TPR * VEC);" if regs else ""}
  const int lane = threadIdx.x % TPR, rib = threadIdx.x / TPR;
  const {itype} row_raw = ({itype})blockIdx.x * RPB + rib;
  const bool row_ok = row_raw < {rows};
  const {itype} row = row_ok ? row_raw : {last};  // idle rows still join the shuffles
  (void)row;
  {_indent(_geom_offsets(prog, itype) if geom else _row_offsets(prog, itype), 2)}
  {_indent(chr(10).join(prog.lets), 2)}
{body}
}}
"""


def _indent(text: str, n: int) -> str:
    return text.replace("\n", "\n" + " " * n)


def _cpu_kernel(prog: RowProgram, itype: str, params: dict, geom: bool = False) -> str:
    """The row loop: each step of the program in turn (see `cpu_row_axes` for the parameters).

    A reduction over `acc` > 1 accumulators: column c adds into accumulator c % acc, the row's last
    n % acc columns into the first; then the accumulators are combined pairwise. Sums are kept in
    double either way: the order moves a row's sum far less than the one float rounding at its end;
    maxima propagate NaN from either side (`fp_max_nan`), in any order."""
    acc, unroll, stage = params["acc"], params["unroll"], params["stage"]
    hint = f"#pragma GCC unroll {unroll}\n    " if unroll > 1 else ""
    parts = []
    xs = prog.x.strides[-1]
    n = prog.n

    def element(c: str, per_elem: list[str]) -> str:
        x = f"xf_[{c}]" if stage else f"fp_ld(p.in{prog.x_slot}[xo_ + {c} * {xs}u])"
        return f"const float x = {x}; const {itype} col = {c}; (void)col; {' '.join(per_elem)}"

    if stage:
        parts.append(f"{hint}for ({itype} c_ = 0; c_ < {n}u; ++c_) "
                     f"xf_[c_] = fp_ld(p.in{prog.x_slot}[xo_ + c_ * {xs}u]);")
    for st in prog.steps:
        exprs = [st.expr] + [e for _, e in st.also]
        _, per_elem = _param_loads(prog, "cpu", exprs, vector=False)
        head = f"{hint}for ({itype} c_ = 0; c_ < {n}u; ++c_) {{ {element('c_', per_elem)}"
        if st.kind == "reduce":
            accs = [(st.name, st.op, st.expr)] + [(name, "sum", e) for name, e in st.also]
            if acc == 1:
                for name, op, _ in accs:
                    parts.append(f"float {name}_m = -FP_INF;" if op == "max" else f"double {name}_s = 0.0;")
                body = " ".join(f"{name}_m = fp_max_nan({name}_m, {e});" if op == "max"
                                else f"{name}_s += (double)({e});" for name, op, e in accs)
                parts.append(f"{head} {body} }}")
                for name, op, _ in accs:
                    parts.append(f"const float {name} = {name}_m;" if op == "max"
                                 else f"const float {name} = (float){name}_s;")
            else:
                parts += _cpu_split_reduce(accs, acc, n, itype, hint, element("c_", per_elem))
        elif st.kind == "let":
            parts.append(f"const float {st.name} = {st.expr};")
        elif st.kind == "write":
            o = dict(prog.outs)[st.slot]
            t = ctype(o.dtype, "cpu")
            parts.append(f"{head} p.out{st.slot}[eo{st.slot}_ + c_ * {o.strides[-1]}u] = fp_st<{t}>({st.expr}); }}")
        else:
            t = ctype(dict(prog.row_outs)[st.slot].dtype, "cpu")
            parts.append(f"p.out{st.slot}[ro{st.slot}_] = fp_st<{t}>({st.expr});")
    body = "\n    ".join(parts)
    buffer = f"\n  float xf_[{n}];" if stage else ""
    return f"""
static void fp_rows(const fp_args& p{", const fp_geom& g" if geom else ""}) {{{buffer}
  for ({itype} row = 0; row < {"g.numel" if geom else f"{prog.rows}u"}; ++row) {{
    {_indent(_geom_offsets(prog, itype) if geom else _row_offsets(prog, itype), 4)}
    {_indent(chr(10).join(prog.lets), 4)}
    {body}
  }}
}}
"""


def _cpu_split_reduce(accs: list[tuple[str, str, str]], acc: int, n: int, itype: str, hint: str,
                      element: str) -> list[str]:
    """Statements of one reduction pass over `acc` accumulators per value (`_cpu_kernel`); `element`
    defines x, col and the params at column `c_`."""
    lines = []
    for name, op, _ in accs:
        if op == "max":
            lines.append(f"float {name}_m[{acc}]; for (int k_ = 0; k_ < {acc}; ++k_) {name}_m[k_] = -FP_INF;")
        else:
            lines.append(f"double {name}_s[{acc}] = {{}};")

    def update(k: str) -> str:
        return " ".join(f"{name}_m[{k}] = fp_max_nan({name}_m[{k}], {e});" if op == "max"
                        else f"{name}_s[{k}] += (double)({e});" for name, op, e in accs)

    whole = n - n % acc
    lines.append(f"{hint}for ({itype} b_ = 0; b_ < {whole}u; b_ += {acc}u) {{\n"
                 f"#pragma GCC unroll {acc}\n"
                 f"      for (int k_ = 0; k_ < {acc}; ++k_) {{ const {itype} c_ = b_ + (unsigned)k_; "
                 f"{element} {update('k_')} }}\n    }}")
    if whole < n:
        lines.append(f"for ({itype} c_ = {whole}u; c_ < {n}u; ++c_) {{ {element} {update('0')} }}")
    half = acc // 2
    while half:
        lines.append(" ".join(f"{name}_m[{k}] = fp_max_nan({name}_m[{k}], {name}_m[{k + half}]);" if op == "max"
                              else f"{name}_s[{k}] += {name}_s[{k + half}];"
                              for k in range(half) for name, op, _ in accs))
        half //= 2
    for name, op, _ in accs:
        lines.append(f"const float {name} = {name}_m[0];" if op == "max"
                     else f"const float {name} = (float){name}_s[0];")
    return lines


def _fields(card: Card, prog: RowProgram, target: str) -> tuple[str, list[str]]:
    ins, outs = card.tensor_inputs(), card.outputs
    restrict = " __restrict__" if target == "cuda" else ""
    fields, inits = [], []
    for slot in sorted({prog.x_slot} | {p.slot for p in prog.params}):
        t = ctype(ins[slot].dtype, target)
        fields.append(f"const {t}*{restrict} in{slot};")
        inits.append(f"p.in{slot} = (const {t}*)call->inputs[{slot}].data;")
    for slot in sorted({s for s, _ in prog.outs} | {s for s, _ in prog.row_outs}):
        t = ctype(outs[slot].dtype, target)
        fields.append(f"{t}*{restrict} out{slot};")
        inits.append(f"p.out{slot} = ({t}*)call->outputs[{slot}].data;")
    return " ".join(fields), inits


def _cpu_params(params: dict) -> dict:
    """A cpu point, the default's values for what it leaves out (callers from before the cpu axes)."""
    return {**CPU_ROW_DEFAULT, **params}


def render_rows(card: Card, target: str, prog: RowProgram, params: dict, family_k: int | None = None) -> str:
    """`family_k`: a family card reduced over its last k dims, rendered size-generic (`render_family_rows`)."""
    if family_k is not None:
        return render_family_rows(card, target, prog, params, family_k)
    fields, inits = _fields(card, prog, target)
    views = [prog.x] + [o for _, o in prog.outs] + [o for _, o in prog.row_outs]
    shape = (*prog.outer, prog.n) if prog.outer else (prog.n,)
    full_views = [View(v.dtype, v.strides if len(v.strides) == len(shape) else (*v.strides, 0)) for v in views]
    itype = index_type(shape, full_views)
    head = prelude(target) + f"\nstruct fp_args {{ {fields} }};\n"
    if target == "cpu":
        return head + _cpu_kernel(prog, itype, _cpu_params(params)) + entry(
            card, target, "fp_args p;\n  " + "\n  ".join(inits) + "\n  fp_rows(p);\n  " + launch_status(target))
    tpr, vec, rpb = params["tpr"], params["vec"], effective_rpb(params["tpr"], params["rpb"])
    grid = ceil_div(prog.rows, rpb)
    checks = []
    if vec > 1:
        checks = [(f"p.in{prog.x_slot}", vec_bytes(prog.x.itemsize, vec))]
        checks += [(f"p.out{s}", vec_bytes(o.itemsize, vec)) for s, o in prog.outs]
        checks += [(f"p.in{q.slot}", vec_bytes(_size(q.dtype), vec)) for q in prog.params if q.index is None]
    launch = (
        "fp_args p;\n  " + "\n  ".join(inits) + "\n  "
        f"if ({align_check(checks)}) fp_rows<{vec}, {tpr}, {rpb}><<<{grid}u, {tpr * rpb}, 0, stream>>>(p);\n  "
        f"else fp_rows<1, {tpr}, {rpb}><<<{grid}u, {tpr * rpb}, 0, stream>>>(p);\n  " + launch_status(target)
    )
    return head + _cuda_kernel(prog, tpr, vec, rpb, itype) + entry(card, target, launch)


def render_family_rows(card: Card, target: str, prog: RowProgram, params: dict, k: int) -> str:
    """The row program with N (and every inner stride, every parameter's layout) a constant, the rows
    and their strides read from the descriptors: the outer dims of x, each per-element output and each
    per-row output, coalesced on the host (`generic.HOST_HELPERS`)."""
    fields, inits = _fields(card, prog, target)
    ins, outs = card.tensor_inputs(), card.outputs
    nviews = 1 + len(prog.outs) + len(prog.row_outs)
    head = prelude(target) + generic.helpers(nviews) + f"\nstruct fp_args {{ {fields} }};\n"
    x = f"call->inputs[{prog.x_slot}]"
    outer = len(ins[prog.x_slot].shape) - k
    body = ["fp_args p;", *inits, *_fixed_stride_checks(card, prog, k), "fp_geom g;",
            f"g.nd = {outer};", f"for (int d = 0; d < {outer}; ++d) g.n[d] = {x}.sizes[d];",
            "for (int v = 0; v < FP_GV; ++v) { g.base[v] = 0; for (int d = 0; d < FP_GD; ++d) g.s[v][d] = 0; }"]
    descs = [x] + [f"call->outputs[{s}]" for s, _ in prog.outs] + [f"call->outputs[{s}]" for s, _ in prog.row_outs]
    for v, desc in enumerate(descs):
        body.append(f"for (int d = 0; d < {outer}; ++d) {{ if ({desc}.ndim < {outer} || {desc}.sizes[d] != g.n[d]) "
                    f"return FP_ERR_UNSUPPORTED; g.s[{v}][d] = g.n[d] == 1 ? 0 : {desc}.strides[d]; }}")
    for s_, _ in prog.outs:
        body.append(f"for (int d = 0; d < {len(outs[s_].shape)}; ++d) if (call->outputs[{s_}].sizes[d] != "
                    f"{x}.sizes[d]) return FP_ERR_UNSUPPORTED;")
    for s_, _ in prog.row_outs:  # keepdim: trailing size-1 dims
        body.append(f"for (int d = {outer}; d < call->outputs[{s_}].ndim; ++d) if (call->outputs[{s_}].sizes[d] != 1) "
                    "return FP_ERR_UNSUPPORTED;")
    body += ["fp_geom_coalesce(&g);", "if (g.numel == 0) return FP_OK;"]
    itype = "uint64_t"
    if target == "cpu":
        body += ["fp_rows(p, g);", launch_status(target)]
        return (head + _cpu_kernel(prog, itype, _cpu_params(params), geom=True)
                + generic.entry(card, target, "\n  ".join(body)))
    tpr, vec, rpb = params["tpr"], params["vec"], effective_rpb(params["tpr"], params["rpb"])
    checks = []
    if vec > 1:
        checks = [(f"p.in{prog.x_slot}", vec_bytes(prog.x.itemsize, vec))]
        checks += [(f"p.out{s}", vec_bytes(o.itemsize, vec)) for s, o in prog.outs]
        checks += [(f"p.in{q.slot}", vec_bytes(_size(q.dtype), vec)) for q in prog.params if q.index is None]
        body.append(f"bool vec_ = {align_check(checks)};")
        body.append(f"for (int v = 0; v <= {len(prog.outs)}; ++v) for (int d = 0; d < g.nd; ++d) "
                    f"if (g.s[v][d] % {vec}) vec_ = false;")
    else:
        body.append("const bool vec_ = false;")
    launch = f"<<<(unsigned)((g.numel + {rpb - 1}) / {rpb}), {tpr * rpb}, 0, stream>>>(p, g);"
    body += [f"if (vec_) fp_rows<{vec}, {tpr}, {rpb}>{launch}", f"else fp_rows<1, {tpr}, {rpb}>{launch}",
             launch_status(target)]
    return head + _cuda_kernel(prog, tpr, vec, rpb, itype, geom=True) + generic.entry(card, target, "\n  ".join(body))


def _fixed_stride_checks(card: Card, prog: RowProgram, k: int) -> list[str]:
    """The constants the program bakes in: inner strides of x and the per-element outputs, every
    stride of a parameter (weight, bias)."""
    ins, outs = card.tensor_inputs(), card.outputs
    tensors = [(f"call->inputs[{prog.x_slot}]", ins[prog.x_slot], k)]
    tensors += [(f"call->outputs[{s}]", outs[s], k) for s, _ in prog.outs]
    tensors += [(f"call->inputs[{q.slot}]", ins[q.slot], len(ins[q.slot].shape)) for q in prog.params]
    lines = []
    for var, meta, last in tensors:
        nd = len(meta.shape)
        for d in range(nd - last, nd):
            if meta.shape[d] != 1:
                lines.append(f"if ({var}.strides[{d}] != {meta.stride[d]}LL) return FP_ERR_UNSUPPORTED;")
    return lines


def family_refusal(card: Card, prog: RowProgram) -> int | str:
    """The number of reduced (trailing) dims if the family keeps the row and its parameters fixed, so
    the program's constants hold for every member; else the reason."""
    fam = card.family
    x = fam.inputs[prog.x_slot]
    k, n = 0, 1
    while k < len(x.shape) and (k == 0 or n < prog.n):
        size = x.shape[len(x.shape) - 1 - k]
        if isinstance(size, str):
            return "the row length varies across the family"
        n *= size
        k += 1
    if n != prog.n:
        return "the rows do not match the input's trailing dims"
    layouts = [x] + [fam.outputs[s] for s, _ in prog.outs]
    for lay in layouts:
        tail = list(zip(lay.shape[len(lay.shape) - k:], lay.stride[len(lay.stride) - k:], strict=True))
        if any(isinstance(size, str) or (size != 1 and dims) for size, (_, dims) in tail):
            return "the rows' inner layout varies across the family"
    for q in prog.params:
        lay = fam.inputs[q.slot]
        if any(isinstance(size, str) for size in lay.shape) or any(dims for _, dims in lay.stride):
            return "a weight or bias varies across the family"
    return k


# --- building programs from cards ------------------------------------------------------------------


def build_rows(x: TensorMeta, x_slot: int, k: int, outs: list[tuple[int, TensorMeta]],
               row_outs: list[tuple[int, TensorMeta]]) -> tuple | str:
    """(outer, x view, outs, row_outs, n) for a reduction of x over its last k dims."""
    rv = row_views(x, k)
    if rv is None:
        return "the reduced dims are not one evenly strided run"
    outer, xstr, n, xs = rv
    if n == 0:
        return "empty rows"
    views = [View(x.dtype, xstr, 0, x.storage_offset)]
    inner = [xs]
    for _, m in outs:
        if m.shape != x.shape:
            return "output shape differs from the input"
        r = row_views(m, k)
        if r is None:
            return "output rows are not evenly strided"
        views.append(View(m.dtype, r[1], 0, m.storage_offset))
        inner.append(r[3])
    for _, m in row_outs:
        strides = _row_out_strides(m, outer)
        if strides is None:
            return "per-row output shape does not match the rows"
        views.append(View(m.dtype, strides, 0, m.storage_offset))
    cshape, cviews = coalesce(tuple(outer), views) if outer else ((), views)
    if cshape == (1,) and math.prod(outer) == 1:
        cshape = ()
        cviews = [View(v.dtype, (), 0, v.storage_offset) for v in views]
    ne = 1 + len(outs)
    x_view = View(x.dtype, (*cviews[0].strides, inner[0]), 0, x.storage_offset)
    out_views = [(s, View(m.dtype, (*cviews[1 + i].strides, inner[1 + i]), 0, m.storage_offset))
                 for i, (s, m) in enumerate(outs)]
    row_views_ = [(s, cviews[ne + i]) for i, (s, _) in enumerate(row_outs)]
    return cshape, x_view, tuple(out_views), tuple(row_views_), n, math.prod(outer)


def _row_out_strides(m: TensorMeta, outer: tuple[int, ...]) -> tuple[int, ...] | None:
    """Strides of a per-row output over the outer dims (keepdim or not: trailing size-1 dims dropped)."""
    shape, stride = list(m.shape), list(m.stride)
    while len(shape) > len(outer) and shape[-1] == 1:
        shape.pop()
        stride.pop()
    if tuple(shape) != tuple(outer):
        return None
    return tuple(0 if n == 1 else s for n, s in zip(shape, stride, strict=True))


class RowTemplate(Template):
    generic = True  # family cards: the row length fixed, the rows read at run time (`render_family_rows`)

    def family_plan(self, card, plan, target):
        k = family_refusal(card, plan)
        return k if isinstance(k, str) else FamilyPlan(plan, k)

    def family_axes(self, plan, target):
        return row_axes(plan.base, target)

    def family_default(self, plan, axes, target):
        return row_default(plan.base, axes, target)

    def family_emit(self, card, plan, target, params):
        return render_rows(card, target, plan.base, params, family_k=plan.info)

    def axes(self, plan, target):
        return row_axes(plan, target)

    def pick_default(self, plan, axes, target):
        return row_default(plan, axes, target)

    def emit(self, card, plan, target, params):
        return render_rows(card, target, plan, params)


def _last_dim(card: Card, dim) -> bool:
    nd = len(card.tensor_inputs()[0].shape)
    return isinstance(dim, int) and nd > 0 and dim % nd == nd - 1


class SoftmaxTemplate(RowTemplate):
    """`_softmax` / `_log_softmax` over the last dim (half_to_float: fp16/bf16 in, fp32 out)."""

    def plan(self, card: Card, target: str):
        x, out = card.tensor_inputs()[0], card.outputs[0]
        if x.dtype not in FLOATS or out.dtype not in FLOATS:
            return "softmax templates serve float32/float16/bfloat16"
        if not _last_dim(card, value(card, "dim")):
            return "softmax over a dim other than the last"
        built = build_rows(x, 0, 1, [(0, out)], [])
        if isinstance(built, str):
            return built
        outer, xv, outs, _, n, rows = built
        steps = [Step("reduce", "m_", "x", "max"), Step("reduce", "s_", "expf(x - m_)")]
        if card.op == "aten._log_softmax.default":
            steps += [Step("let", "ls_", "logf(s_)"), Step("write", expr="(x - m_) - ls_", slot=0)]
        else:
            steps += [Step("write", expr="expf(x - m_) / s_", slot=0)]
        return RowProgram(rows, n, outer, xv, 0, outs, (), (), tuple(steps))


class ReduceTemplate(RowTemplate):
    """`sum.dim_IntList`, `mean.dim`, `amax` over trailing dims that form one evenly strided run."""

    def plan(self, card: Card, target: str):
        x, out = card.tensor_inputs()[0], card.outputs[0]
        if x.dtype not in FLOATS or out.dtype != x.dtype:
            return "reductions served on float32/float16/bfloat16 with the input's dtype"
        if value(card, "dtype") not in (None, x.dtype):
            return "dtype= conversion not served"
        nd = len(x.shape)
        dims = value(card, "dim")
        if not dims or nd == 0:
            return "full reductions (dim=None or []) not served"
        dims = sorted({d % nd for d in dims})
        k = len(dims)
        if dims != list(range(nd - k, nd)):
            return "reduced dims are not the trailing dims"
        built = build_rows(x, 0, k, [], [(0, out)])
        if isinstance(built, str):
            return built
        outer, xv, _, routs, n, rows = built
        if card.op == "aten.amax.default":
            steps = (Step("reduce", "m_", "x", "max"), Step("rowwrite", expr="m_", slot=0))
        elif card.op == "aten.mean.dim":
            # aten's CUDA mean multiplies by a float 1/n; its CPU mean divides by n.
            final = f"s_ * {flit(1.0 / n)}" if target == "cuda" else f"s_ / {flit(n)}"
            steps = (Step("reduce", "s_", "x"), Step("rowwrite", expr=final, slot=0))
        else:
            steps = (Step("reduce", "s_", "x"), Step("rowwrite", expr="s_", slot=0))
        return RowProgram(rows, n, outer, xv, 0, (), routs, (), steps)


def norm_steps(n: int, eps: float, affine: str, rms: bool = False) -> tuple[tuple[Step, ...], tuple[Step, ...]]:
    """(register program, re-reading program) for (x - mean) * rstd (or x * rstd for RMS), then
    `affine` (an expression of `y_`). Row outputs are written by the caller's extra steps."""
    inv_n = flit(1.0 / n)
    if rms:
        regs = (Step("reduce", "ss_", "x * x"),
                Step("let", "rstd_", f"fp_rsqrt(ss_ * {inv_n} + {flit(eps)})"))
        y = "(x * rstd_)"
        return (*regs, Step("write", expr=affine.replace("y_", y), slot=0)), None
    y = "(rstd_ * (x - mean_))"
    # The mean is summed shifted by the row's first element (`sh_`): its rounding error then scales
    # with the row's spread, not its magnitude. aten's Welford mean of a constant row is exact, and
    # the unshifted sum's few ulps, times rstd = 1/sqrt(eps) there, were off by several output ulps.
    regs = (
        Step("reduce", "s1_", "(x - sh_)"),
        Step("let", "mean_", f"sh_ + s1_ * {inv_n}"),
        Step("reduce", "s2_", "(x - mean_) * (x - mean_)"),
        Step("let", "rstd_", f"fp_rsqrt(s2_ * {inv_n} + {flit(eps)})"),
        Step("write", expr=affine.replace("y_", y), slot=0),
    )
    # One pass for both sums, shifted by the row's first element so the variance does not cancel.
    loop = (
        Step("reduce", "d1_", "(x - sh_)", also=(("d2_", "(x - sh_) * (x - sh_)"),)),
        Step("let", "dm_", f"d1_ * {inv_n}"),
        Step("let", "mean_", "sh_ + dm_"),
        Step("let", "rstd_", f"fp_rsqrt(fp_max_nan(d2_ * {inv_n} - dm_ * dm_, 0.0f) + {flit(eps)})"),
        Step("write", expr=affine.replace("y_", y), slot=0),
    )
    return regs, loop


@functools.lru_cache(maxsize=256)
def welford_survivor(op: str, n: int, dtype: str) -> int | None:
    """The one position where aten's CPU Welford (`RowwiseMoments`) lets a lone +inf through as the
    mean of an n-element row (anywhere else the mean is NaN: inf - inf in a later update). It depends
    on the build's vector width and chunking, so it is measured on this torch: one call on n rows,
    row i holding inf at position i. None for long rows (not measured; NaN everywhere is then wrong
    only for that one position)."""
    if n > 2048 or n < 2:
        return None
    import torch

    x = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
    x.fill_diagonal_(math.inf)
    if op == "layer":
        mean = torch.ops.aten.native_layer_norm(x, [n], None, None, 1e-5)[1]
    else:
        mean = torch.ops.aten.native_group_norm(x.view(n, 1, n), None, None, n, 1, n, 1, 1e-5)[1]
    hits = (mean.reshape(-1) == math.inf).nonzero().flatten().tolist()
    return hits[0] if len(hits) == 1 else None


def mean_output_steps(target: str, kind: str, n: int, dtype: str, stride: int, slot: int) -> tuple[Step, ...]:
    """Steps writing a Welford-compatible mean: aten's Welford updates turn a row holding an inf into a
    NaN mean (inf - inf), and `0 * inf` does the same here; on cpu the one position where aten's order
    lets a lone inf through (`welford_survivor`) is honoured too."""
    nan_rule = "(mean_ + 0.0f * mean_)"
    pos = welford_survivor(kind, n, dtype) if target == "cpu" else None
    if pos is None:
        return (Step("rowwrite", expr=nan_rule, slot=slot),)
    return (
        Step("reduce", "nf_", "((x - x) != 0.0f ? 1.0f : 0.0f)"),
        Step("let", "xp_", f"fp_ld(p.in0[xo_ + {pos * stride}u])"),
        Step("rowwrite", expr=f"((nf_ == 1.0f && xp_ - xp_ != 0.0f && xp_ == xp_) ? xp_ : {nan_rule})", slot=slot),
    )


class LayerNormTemplate(RowTemplate):
    """`native_layer_norm` -> (y, mean, rstd), and `_fused_rms_norm` -> (y, rstd)."""

    def plan(self, card: Card, target: str):
        ins = card.tensor_inputs()
        x = ins[0]
        if x.dtype not in FLOATS or card.outputs[0].dtype != x.dtype:
            return "norm templates serve float32/float16/bfloat16"
        k = len(value(card, "normalized_shape") or ())
        if k == 0 or k > len(x.shape):
            return "bad normalized_shape"
        rms = card.op == "aten._fused_rms_norm.default"
        eps = value(card, "eps")
        if not isinstance(eps, int | float) or isinstance(eps, bool):
            return "eps must be given as a number"
        row_outs = [(1, card.outputs[1])] if rms else [(1, card.outputs[1]), (2, card.outputs[2])]
        built = build_rows(x, 0, k, [(0, card.outputs[0])], row_outs)
        if isinstance(built, str):
            return built
        outer, xv, outs, routs, n, rows = built
        params, affine = [], "y_"
        for slot, name in ((1, "weight"), (2, "bias")):
            if slot >= len(ins) or ins[slot] is None:
                continue
            m = ins[slot]
            if m.dtype not in FLOATS or m.numel != n or not m.is_contiguous():
                return f"{name} is not a contiguous float tensor of the normalized shape"
            params.append(Param(slot, m.dtype, None, m.storage_offset))
            w = f"w{len(params) - 1}"
            affine = f"({w} * {affine})" if name == "weight" else f"({affine} + {w})"
        regs, loop = norm_steps(n, float(eps), affine, rms)
        tail = (Step("rowwrite", expr="rstd_", slot=1),) if rms else (
            *mean_output_steps(target, "layer", n, x.dtype, xv.strides[-1], 1), Step("rowwrite", expr="rstd_", slot=2))
        lets = () if rms else ("const float sh_ = fp_ld(p.in0[xo_]); (void)sh_;",)
        return RowProgram(rows, n, outer, xv, 0, outs, routs, tuple(params), regs + tail,
                          None if loop is None else loop + tail, lets)


TEMPLATES = (
    SoftmaxTemplate("rowreduce.softmax", "rowreduce", ("cuda", "cpu"),
                    ("aten._softmax.default", "aten._log_softmax.default")),
    ReduceTemplate("rowreduce.reduce", "rowreduce", ("cuda", "cpu"),
                   ("aten.sum.dim_IntList", "aten.mean.dim", "aten.amax.default")),
    LayerNormTemplate("rowreduce.layer_norm", "rowreduce", ("cuda", "cpu"),
                      ("aten.native_layer_norm.default", "aten._fused_rms_norm.default")),
)
