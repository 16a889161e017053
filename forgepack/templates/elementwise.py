"""Elementwise templates: unary activations, binary ops with broadcasting, casts and copies, cat.

All of them are "pointwise jobs": out[i] = f(in_0[i], in_1[i], ...) over an iteration shape, each
tensor walked with its own (broadcast) strides. Dims every tensor walks as one are merged first, so a
contiguous or simply broadcast case becomes 1-D or 2-D index math on constants. On cuda each thread
moves `unroll` vectors of `vec` elements along the innermost dim (16-byte accesses where the layout
allows), all loads issued before any store; a tensor broadcast along the innermost dim is one scalar
load per vector. If a base pointer turns out misaligned at run time, the same kernel runs with
vec = 1. `cat` is one launch of several jobs (one per input, writing a slice of the output), the grid
split between them (`order`: one job after another, or their blocks round-robin so that every input
streams at once). Binary ops and cat also search the cache policy of their vector loads (`ld`: plain,
read-only with no L1 line and 256-byte L2 fetches, or evict-first) and stores (`st`: plain or
evict-first). A copy that transposes goes through a shared-memory tile (`tile`, `vec`-element vectors
on both sides, `group`ed block order) instead: see `render_transpose`. On the cpu the jobs are nested
loops over the coalesced dims; the search chooses the innermost loop's unroll hint and whether it runs
in strips of `vec` elements (`CPU_VECS`).

Arithmetic follows aten: inputs are cast to the common dtype (the output's), computed in float
(opmath), rounded once; a Python-number operand stays unrounded in float, as aten's
`opmath_gpu_kernel_with_scalars` / `original_scalar_value` do.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

from forgepack.cards import DTYPE_SIZES, Card
from forgepack.templates import generic
from forgepack.templates.common import (
    CAST_SOURCES,
    FLOATS,
    LOAD_HINTS,
    STORE_HINTS,
    FamilyPlan,
    Template,
    View,
    align_check,
    arg,
    broadcast_view,
    ceil_div,
    coalesce,
    ctype,
    entry,
    flit,
    hint_helpers,
    index_type,
    launch_status,
    offsets_code,
    prelude,
    value,
    vec_bytes,
    vector_ok,
)

BLOCKS = [128, 256, 512, 1024]
UNROLLS = [1, 2, 4, 8]
FAMILY_UNROLLS = [1, 2, 4]  # a family kernel's vectors per thread: 1 first (decode sizes), more for long caches
SM_COUNT = 132  # H200; only used for the default's "enough blocks" heuristic
ORDERS = ["split", "interleave"]  # several jobs: one after another, or their blocks round-robin


@dataclass(frozen=True)
class Job:
    """out[slot][i] = expr(a0, a1, ...) over `shape` (already coalesced).

    `expr` is a C float expression of `a0..` (inputs loaded and converted to float); None copies the
    single input's raw elements (same dtype: bit-exact, any dtype)."""

    shape: tuple[int, ...]
    out: View
    out_slot: int
    ins: tuple[View, ...]
    in_slots: tuple[int, ...]
    expr: str | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def views(self) -> list[View]:
        return [self.out, *self.ins]

    def best_vec(self, vec: int) -> int:
        """The widest vector width <= vec this job's layout allows."""
        while vec > 1 and not vector_ok(self.shape, self.views(), vec):
            vec //= 2
        return vec


def make_job(out_meta, out_slot: int, in_metas: list, in_slots: list[int], expr: str | None, out_offset: int = 0,
             shape: tuple[int, ...] | None = None, out_strides: tuple[int, ...] | None = None) -> Job | None:
    """A job over `shape` (default: the output's), inputs broadcast to it; None if one does not broadcast."""
    shape = tuple(shape or out_meta.shape)
    out_view = View(out_meta.dtype, tuple(out_strides or out_meta.stride), out_offset, out_meta.storage_offset)
    out_view = View(out_view.dtype, tuple(0 if n == 1 else s for n, s in zip(shape, out_view.strides, strict=True)),
                    out_view.offset, out_view.storage_offset)
    ins = []
    for m in in_metas:
        v = broadcast_view(m, shape)
        if v is None:
            return None
        ins.append(v)
    cshape, cviews = coalesce(shape, [out_view, *ins], reorder=True)
    return Job(cshape, cviews[0], out_slot, tuple(cviews[1:]), tuple(in_slots), expr)


def vec_axis(jobs: list[Job]) -> list[int]:
    sizes = [v.itemsize for j in jobs for v in j.views()]
    cap = 16 // min(sizes)
    options = [1]
    v = 2
    while v <= cap:
        if any(j.best_vec(v) == v for j in jobs):
            options.append(v)
        v *= 2
    return options


CPU_UNROLLS = (1, 2, 4, 8)  # the innermost loop's unroll hint on the cpu target (1: none, the compiler's choice)
# The innermost loop strip-mined into strips of `vec` elements (1: one plain loop), each strip loaded
# into stack arrays, computed, then stored: the compute runs on local arrays no store can alias, so the
# compiler vectorises it without run-time overlap checks, even where a strided or broadcast load keeps
# the loads scalar; the loads of a strip are issued before any of its stores.
CPU_VECS = (1, 4, 8, 16)


def cpu_vec_axis(jobs: list[Job]) -> list[int]:
    """Strip widths no longer than the longest innermost dim of the jobs (a longer strip is all tail)."""
    inner = max(j.shape[-1] if j.shape else 1 for j in jobs)
    return [v for v in CPU_VECS if v == 1 or v <= inner]


def pointwise_axes(jobs: list[Job], target: str) -> dict[str, list]:
    if target == "cpu":
        return {"unroll": list(CPU_UNROLLS), "vec": cpu_vec_axis(jobs)}
    return {"block": list(BLOCKS), "vec": vec_axis(jobs), "unroll": list(UNROLLS)}


def pointwise_default(jobs: list[Job], axes: dict[str, list], target: str) -> dict:
    if target == "cpu":
        return {"unroll": 1, "vec": 1}
    vec = axes["vec"][-1]
    numel = max(j.numel for j in jobs)
    block = 256
    unroll = 1
    # Several waves of blocks first; then more bytes in flight per thread.
    for u in (4, 2):
        if ceil_div(numel, vec * block * u) >= 8 * SM_COUNT:
            unroll = u
            break
    return {"block": block, "vec": vec, "unroll": unroll}


def _pointer_fields(card: Card, jobs: list[Job], target: str) -> tuple[list[str], list[str]]:
    """Struct fields and their host-side initialisers: one pointer per ABI slot the jobs use."""
    fields, inits, seen = [], [], set()
    ins, outs = card.tensor_inputs(), card.outputs
    for job in jobs:
        for slot in job.in_slots:
            if ("i", slot) not in seen:
                seen.add(("i", slot))
                t = ctype(ins[slot].dtype, target)
                fields.append(f"const {t}* __restrict__ in{slot};" if target == "cuda" else f"const {t}* in{slot};")
                inits.append(f"p.in{slot} = (const {t}*)call->inputs[{slot}].data;")
        if ("o", job.out_slot) not in seen:
            seen.add(("o", job.out_slot))
            t = ctype(outs[job.out_slot].dtype, target)
            fields.append(f"{t}* __restrict__ out{job.out_slot};" if target == "cuda" else f"{t}* out{job.out_slot};")
            inits.append(f"p.out{job.out_slot} = ({t}*)call->outputs[{job.out_slot}].data;")
    return fields, inits


def _cuda_job(k: int, job: Job, card: Card, itype: str) -> str:
    out_t = ctype(job.out.dtype, "cuda")
    names = ["oo_"] + [f"o{i}_" for i in range(len(job.ins))]
    loads, regs, convs = [], [], []
    for i, (v, slot) in enumerate(zip(job.ins, job.in_slots, strict=True)):
        t = ctype(v.dtype, "cuda")
        if v.strides[-1] == 0:  # broadcast along the inner dim: one value per vector
            regs.append(f"float x{i}[UNROLL];")
            loads.append(f"x{i}[u] = fp_ld(p.in{slot}[o{i}_]);")
            convs.append(f"const float a{i} = x{i}[u];")
        else:
            regs.append(f"fp_vec<{t}, VEC> x{i}[UNROLL];")
            loads.append(f"x{i}[u] = fp_load(reinterpret_cast<const fp_vec<{t}, VEC>*>(p.in{slot} + o{i}_));")
            convs.append(f"const float a{i} = fp_ld(x{i}[u].v[j]);" if job.expr is not None else "")
    if job.expr is None:
        compute = "r.v[j] = x0[u].v[j];"
    else:
        compute = " ".join(c for c in convs if c) + f" r.v[j] = fp_st<{out_t}>({job.expr});"
    offsets = offsets_code(job.shape, job.views(), "e_", names, itype)
    return f"""
template <int VEC>
FP_FN void fp_job{k}({itype} blk, const fp_args& p) {{
  constexpr {itype} NV = {job.numel}u / VEC;
  {' '.join(regs)}
  {itype} oo[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {{
    const {itype} v_ = blk * (BLOCK * UNROLL) + u * BLOCK + threadIdx.x;
    if (v_ < NV) {{
      const {itype} e_ = v_ * VEC;
      {_indent(offsets, 6)}
      oo[u] = oo_;
      {' '.join(loads)}
    }}
  }}
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {{
    const {itype} v_ = blk * (BLOCK * UNROLL) + u * BLOCK + threadIdx.x;
    if (v_ < NV) {{
      fp_vec<{out_t}, VEC> r;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {{ {compute} }}
      fp_store(reinterpret_cast<fp_vec<{out_t}, VEC>*>(p.out{job.out_slot} + oo[u]), r);
    }}
  }}
}}
"""


def _indent(text: str, n: int) -> str:
    return text.replace("\n", "\n" + " " * n)


def render_pointwise(card: Card, target: str, jobs: list[Job], params: dict) -> str:
    """Complete kernel source for these jobs (one launch)."""
    fields, inits = _pointer_fields(card, jobs, target)
    itype = max((index_type(j.shape, j.views()) for j in jobs), key=lambda t: t == "uint64_t")
    head = prelude(target) + f"\ntypedef {itype} fp_idx;\nstruct fp_args {{ {' '.join(fields)} }};\n"
    if target == "cpu":
        unroll, vec = params.get("unroll", 1), params.get("vec", 1)
        return head + "".join(_cpu_job(k, j, itype, unroll, vec) for k, j in enumerate(jobs)) + entry(
            card, target, "fp_args p;\n  " + "\n  ".join(inits) + "\n  "
            + " ".join(f"fp_job{k}(p);" for k in range(len(jobs))) + "\n  " + launch_status(target))
    block, unroll = params["block"], params["unroll"]
    vecs = [j.best_vec(params["vec"]) for j in jobs]
    per_block = block * unroll
    grid_v = sum(ceil_div(j.numel // v, per_block) for j, v in zip(jobs, vecs, strict=True))
    grid_1 = sum(ceil_div(j.numel, per_block) for j in jobs)
    body = head + f"constexpr int BLOCK = {block};\nconstexpr int UNROLL = {unroll};\n"
    body += hint_helpers(params.get("ld", "plain"), params.get("st", "plain"))
    body += f"FP_FN bool fp_below({itype} b, {itype} n) {{ return b < n; }}\n"
    body += "".join(_cuda_job(k, j, card, itype) for k, j in enumerate(jobs))
    body += (
        "\ntemplate <bool VECTOR>\n__global__ void __launch_bounds__(BLOCK) fp_pointwise(const fp_args p) {\n"
        f"  {itype} b = blockIdx.x;\n" + _dispatch(jobs, vecs, per_block, itype, params.get("order", "split"))
        + "\n}\n"
    )
    checks = []
    for j, v in zip(jobs, vecs, strict=True):
        if v > 1:
            checks += [(f"p.in{s}", vec_bytes(view.itemsize, v)) for view, s in zip(j.ins, j.in_slots, strict=True)
                       if view.strides[-1] == 1]
            checks.append((f"p.out{j.out_slot}", vec_bytes(j.out.itemsize, v)))
    launch = (
        "fp_args p;\n  " + "\n  ".join(inits) + "\n  "
        f"if ({align_check(checks)}) fp_pointwise<true><<<{grid_v}u, BLOCK, 0, stream>>>(p);\n  "
        f"else fp_pointwise<false><<<{grid_1}u, BLOCK, 0, stream>>>(p);\n  " + launch_status(target)
    )
    return body + entry(card, target, launch)


def _dispatch(jobs: list[Job], vecs: list[int], per_block: int, itype: str, order: str) -> str:
    """Block b -> (job, block within the job). "split": the jobs' blocks one after another.
    "interleave": the first J x M blocks (M: the fewest any job has) round-robin over the J jobs, so
    all of them stream at once (e.g. both halves of every cat output row), then each job's rest."""
    lines = [f"  constexpr int V{k} = VECTOR ? {v} : 1;\n"
             f"  constexpr {itype} NB{k} = ({j.numel}u / V{k} + {per_block - 1}u) / {per_block}u;"
             for k, (j, v) in enumerate(zip(jobs, vecs, strict=True))]
    first = "0u"
    if order == "interleave" and len(jobs) > 1:
        least = "NB0"
        for k in range(1, len(jobs)):
            least = f"(NB{k} < {least} ? NB{k} : {least})"
        cases = " ".join(f"case {k}: fp_job{k}<V{k}>(l_, p); return;" for k in range(len(jobs)))
        lines += [f"  constexpr {itype} M_ = {least};",
                  f"  if (b < {len(jobs)}u * M_) {{ const {itype} l_ = b / {len(jobs)}u;",
                  f"    switch (b % {len(jobs)}u) {{ {cases} default: return; }} }}",
                  f"  b -= {len(jobs)}u * M_;"]
        first = "M_"
    for k in range(len(jobs)):  # fp_below: a job's rest may be empty (no "b < 0" warning)
        lines.append(f"  if (fp_below(b, NB{k} - {first})) {{ fp_job{k}<V{k}>(b + {first}, p); return; }} "
                     f"b -= NB{k} - {first};")
    return "\n".join(lines)


def _cpu_job(k: int, job: Job, itype: str, unroll: int = 1, vec: int = 1) -> str:
    """Nested loops over the coalesced dims (offsets kept incrementally by the compiler). `unroll` > 1
    asks the compiler to unroll the innermost loop that many times, `vec` > 1 strip-mines it
    (`CPU_VECS`): whether either pays depends on the expression and the row length, so they are search
    axes, not rules."""
    nd = len(job.shape)
    loops, close = [], []
    strips = vec > 1 and nd > 0 and job.shape[-1] >= vec
    for d, n in enumerate(job.shape):
        if strips and d == nd - 1:
            break
        if d == nd - 1 and unroll > 1:
            loops.append(" " * (2 + 2 * d) + f"#pragma GCC unroll {unroll}")
        loops.append(" " * (2 + 2 * d) + f"for ({itype} c{d}_ = 0; c{d}_ < {n}u; ++c{d}_) {{")
        close.append(" " * (2 + 2 * (nd - 1 - d)) + "}")
    ind = " " * (2 + 2 * nd)

    def off(v: View) -> str:
        terms = [f"c{d}_ * {s}u" for d, s in enumerate(v.strides) if s != 0]
        if v.offset:
            terms.append(f"{v.offset}u")
        return " + ".join(terms) or "0u"

    out_t = ctype(job.out.dtype, "cpu")
    if job.expr is None:
        stmt = f"p.out{job.out_slot}[{off(job.out)}] = p.in{job.in_slots[0]}[{off(job.ins[0])}];"
    else:
        loads = " ".join(f"const float a{i} = fp_ld(p.in{s}[{off(v)}]);"
                         for i, (v, s) in enumerate(zip(job.ins, job.in_slots, strict=True)))
        stmt = f"{loads} p.out{job.out_slot}[{off(job.out)}] = fp_st<{out_t}>({job.expr});"
    if strips:  # the outer loops, then the innermost dim's strips
        outer = [" " * (2 + 2 * d) + "}" for d in reversed(range(nd - 1))]
        return (f"\nstatic void fp_job{k}(const fp_args& p) {{\n" + "".join(ln + "\n" for ln in loops)
                + _cpu_strips(job, itype, unroll, vec, off, stmt, " " * (2 * nd)) + "".join("\n" + ln for ln in outer)
                + "\n}\n")
    return (
        f"\nstatic void fp_job{k}(const fp_args& p) {{\n" + "\n".join(loops) + f"\n{ind}{stmt}\n"
        + "\n".join(close) + "\n}\n"
    )


def _cpu_strips(job: Job, itype: str, unroll: int, vec: int, off, stmt: str, ind: str) -> str:
    """The innermost loop in strips of `vec` (loads into stack arrays, compute, stores), then the
    remaining elements one by one with `stmt`."""
    d = len(job.shape) - 1
    n = job.shape[-1]
    whole = n - n % vec
    c = f"c{d}_"
    out_t = ctype(job.out.dtype, "cpu")
    step = f"for (int k_ = 0; k_ < {vec}; ++k_) {{ const {itype} {c} = b_ + (unsigned)k_; (void){c};"
    if job.expr is None:
        in_t = ctype(job.ins[0].dtype, "cpu")
        arrays = f"{in_t} a0_[{vec}];"
        loads = f"a0_[k_] = p.in{job.in_slots[0]}[{off(job.ins[0])}];"
        compute = f"{out_t} r_[{vec}]; for (int k_ = 0; k_ < {vec}; ++k_) r_[k_] = a0_[k_];"
    else:
        arrays = " ".join(f"float a{i}_[{vec}];" for i in range(len(job.ins)))
        loads = " ".join(f"a{i}_[k_] = fp_ld(p.in{s}[{off(v)}]);"
                         for i, (v, s) in enumerate(zip(job.ins, job.in_slots, strict=True)))
        args = " ".join(f"const float a{i} = a{i}_[k_];" for i in range(len(job.ins)))
        compute = (f"{out_t} r_[{vec}];\n#pragma GCC unroll {vec}\n{ind}  for (int k_ = 0; k_ < {vec}; ++k_) "
                   f"{{ {args} r_[k_] = fp_st<{out_t}>({job.expr}); }}")
    lines = []
    if unroll > 1:
        lines.append(f"{ind}#pragma GCC unroll {unroll}")
    lines += [f"{ind}for ({itype} b_ = 0; b_ < {whole}u; b_ += {vec}u) {{",
              f"{ind}  {arrays}", f"#pragma GCC unroll {vec}", f"{ind}  {step} {loads} }}",
              f"{ind}  {compute}", f"#pragma GCC unroll {vec}",
              f"{ind}  {step} p.out{job.out_slot}[{off(job.out)}] = r_[k_]; }}", f"{ind}}}"]
    if whole < n:
        lines.append(f"{ind}for ({itype} {c} = {whole}u; {c} < {n}u; ++{c}) {{ {stmt} }}")
    return "\n".join(lines)


# --- the templates -----------------------------------------------------------------------------------


class PointwiseTemplate(Template):
    """Shared plumbing: `plan` returns the job list; parameters are block, vec, unroll (cuda).
    Family cards get the size-generic render (`forgepack.templates.generic`): block and the widest
    vector the run-time geometry may take."""

    generic = True

    def family_plan(self, card, plan, target):
        if (card.op == "aten.gelu.default" and target == "cpu" and value(card, "approximate", "none") == "none"
                and card.outputs[0].dtype != "float16"):
            return "aten's CPU gelu is position-dependent at +inf: no size-generic kernel"
        if isinstance(self, CatTemplate):
            out = card.outputs[0]
            jobs = [generic.GenericJob(0, out.dtype, (slot,), (m.dtype,), None if m.dtype == out.dtype else "a0")
                    for slot, m in enumerate(arg(card, "tensors").tensors)]
        else:
            jobs = [generic.GenericJob(j.out_slot, j.out.dtype, j.in_slots, tuple(v.dtype for v in j.ins), j.expr,
                                       exact=isinstance(self, CopyTemplate),
                                       integer=j.out.dtype in INTEGERS and j.expr is not None) for j in plan]
        return FamilyPlan(plan, tuple(jobs))

    def family_axes(self, plan, target):
        if target == "cpu":  # the row loop's unroll hint (`generic._cpu_job`)
            return {"unroll": list(CPU_UNROLLS)}
        smallest = min(DTYPE_SIZES[d] for j in plan.info for d in (j.out_dtype, *j.in_dtypes))
        return {"block": list(BLOCKS), "vec": [v for v in (1, 2, 4, 8, 16) if v * smallest <= 16],
                "unroll": list(FAMILY_UNROLLS)}

    def family_default(self, plan, axes, target):
        if target == "cpu":
            return {"unroll": 1}
        return {**{k: v[0] for k, v in axes.items()}, "block": 256, "vec": axes["vec"][-1]}

    def family_emit(self, card, plan, target, params):
        fields, inits = _pointer_fields(card, list(plan.info), target)
        dim = value(card, "dim", 0) % len(card.outputs[0].shape) if isinstance(self, CatTemplate) else None
        return generic.render_pointwise(card, target, list(plan.info), fields, inits, params, prelude(target), dim)

    def axes(self, plan, target):
        return pointwise_axes(plan, target)

    def pick_default(self, plan, axes, target):
        return pointwise_default(plan, axes, target)

    def emit(self, card, plan, target, params):
        return render_pointwise(card, target, plan, params)


def _round_to(dtype: str, expr: str, common: str) -> str:
    """Cast an operand to the common dtype first, as TensorIterator does (rounding if narrower)."""
    if dtype == common or (common == "float32" and dtype in ("float16", "bfloat16")):
        return expr
    if common == "float32":
        return expr  # ints and float64 -> float: fp_ld already gave the float value
    return f"fp_round_{common}({expr})"


# GELU, SiLU, ... as aten computes them in opmath (float); see aten/src/ATen/native/cuda/ActivationGeluKernel.cu.
_GELU_TANH = "(0.5f * a0 * (1.0f + tanhf(0x1.988454p-1f * (a0 + 0.044715f * (a0 * a0 * a0)))))"
_GELU_ERF = "(a0 * 0.5f * (1.0f + erff(a0 * 0x1.6a09e6p-1f)))"
_UNARY = {
    "aten.silu.default": "(a0 / (1.0f + expf(-a0)))",
    "aten.relu.default": "((a0 != a0) ? a0 : (a0 > 0.0f ? a0 : 0.0f))",
    "aten.sigmoid.default": "(1.0f / (1.0f + expf(-a0)))",
    "aten.tanh.default": "tanhf(a0)",
    "aten.neg.default": "(-a0)",
    "aten.rsqrt.default": "fp_rsqrt(a0)",
    "aten.exp.default": "expf(a0)",
    "aten.sqrt.default": "sqrtf(a0)",
    "aten.sin.default": "sinf(a0)",
    "aten.cos.default": "cosf(a0)",
}


def _pow_expr(exponent: float, dtype: str, target: str) -> str:
    """pow(x, e) as aten's pow_tensor_scalar_kernel computes it on each device.

    Both special-case .5/-.5/-1 (sqrt, rsqrt, reciprocal) and 2/3/-2 (products), except CPU float16,
    which always calls pow. On float16/bfloat16 the products and the exponent are in the tensor's own
    type (`base * base * base` rounds twice), and CPU float32 calls pow in double."""
    e = float(exponent)
    narrow = dtype in ("float16", "bfloat16")

    def rnd(x: str) -> str:
        return f"fp_round_{dtype}({x})" if narrow else x

    if target == "cpu" and dtype == "float16":
        return f"powf(a0, {flit(round_to(e, dtype))})"
    special = {0.5: "sqrtf(a0)", -0.5: "fp_rsqrt(a0)", -1.0: "(1.0f / a0)", 2.0: "(a0 * a0)",
               3.0: f"({rnd('a0 * a0')} * a0)", -2.0: f"(1.0f / {rnd('a0 * a0')})"}
    if e in special:
        return special[e]
    if target == "cpu" and dtype == "float32":
        return f"(float)pow((double)a0, {float.hex(e)})"
    return f"powf(a0, {flit(round_to(e, dtype))})"


def round_to(x: float, dtype: str) -> float:
    """A Python float rounded to float32/float16/bfloat16 (nearest even), as `Scalar::to<T>` does."""
    if dtype == "float16":
        return struct.unpack("<e", struct.pack("<e", x))[0] if abs(x) < 65520 else math.copysign(math.inf, x)
    f32 = struct.unpack("<f", struct.pack("<f", x))[0] if abs(x) < 3.4028235e38 else math.copysign(math.inf, x)
    if dtype != "bfloat16" or math.isnan(f32) or math.isinf(f32):
        return f32
    u = struct.unpack("<I", struct.pack("<f", f32))[0]
    u = ((u + ((u >> 16) & 1) + 0x7FFF) >> 16) << 16
    return struct.unpack("<f", struct.pack("<I", u & 0xFFFFFFFF))[0]


@functools.cache
def _aten_cpu_gelu_inf_is_nan() -> bool:
    """Whether this torch's vectorised CPU gelu gives NaN at +inf (it differs between builds and CPUs: torch
    2.13's gave inf on one machine and NaN on another), asked of aten itself on a contiguous run long
    enough for its vector path."""
    import torch

    y = torch.nn.functional.gelu(torch.full((64,), float("inf")))
    return bool(torch.isnan(y[:32]).any())


class UnaryTemplate(PointwiseTemplate):
    def plan(self, card: Card, target: str):
        x, out = card.tensor_inputs()[0], card.outputs[0]
        if x is None or x.dtype not in FLOATS or out.dtype != x.dtype:
            return "unary templates serve float32/float16/bfloat16 in and out"
        if card.op == "aten.gelu.default":
            mode = value(card, "approximate", "none")
            if mode not in ("none", "tanh"):
                return f"unknown gelu approximation {mode!r}"
            expr = _GELU_TANH if mode == "tanh" else _GELU_ERF
            if mode == "none" and target == "cpu" and x.dtype != "float16" and _aten_cpu_gelu_inf_is_nan():
                # some torch builds' vectorised CPU erf gives NaN at +inf (their scalar path gives inf):
                # match the vectorised path, and refuse layouts where aten may take the scalar one.
                if not (x.is_contiguous() and out.is_contiguous() and x.stride == out.stride and x.numel >= 16):
                    return "aten's CPU gelu is position-dependent at +inf for this layout"
                expr = f"(a0 == FP_INF ? (0.0f / 0.0f) : {expr})"
        elif card.op == "aten.pow.Tensor_Scalar":
            e = value(card, "exponent")
            if isinstance(e, bool) or not isinstance(e, int | float):
                return "pow exponent is not a real number"
            expr = _pow_expr(e, x.dtype, target)
        else:
            expr = _UNARY[card.op]
        job = make_job(out, 0, [x], [0], expr)
        return [job] if job else "input does not broadcast to the output"


class StreamingTemplate(PointwiseTemplate):
    """Pointwise jobs whose speed hangs on several concurrent streams (binary ops, cat): the cache
    policy of their vector loads and stores, and for several jobs the block order, are searched too
    (defaults: plain accesses, jobs one after another, as before)."""

    def axes(self, plan, target):
        axes = pointwise_axes(plan, target)
        if target == "cuda":
            axes.update(ld=list(LOAD_HINTS), st=list(STORE_HINTS))
            if len(plan) > 1:
                axes["order"] = list(ORDERS)
        return axes

    def pick_default(self, plan, axes, target):
        point = pointwise_default(plan, axes, target)
        return {**point, **{k: axes[k][0] for k in ("ld", "st", "order") if k in axes}}

    def family_axes(self, plan, target):
        # Vectors per thread and the cache hints first: the search steps along the axes in this order, and
        # these are what a family's large sizes (a long KV cache's copy) may gain on; a block size matters
        # less to a streaming kernel
        axes = super().family_axes(plan, target)
        if target == "cpu":
            return axes
        return {"unroll": axes["unroll"], "ld": list(LOAD_HINTS), "st": list(STORE_HINTS), "block": axes["block"],
                "vec": axes["vec"]}


INTEGERS = ("int64", "int32")  # integer results served (size-generic family kernels only)


def _integer_literal(v: int) -> str:
    return "(uint64_t)INT64_MIN" if v == -(2**63) else f"(uint64_t)(int64_t)({v}LL)"


def integer_binary_plan(card: Card, self_arg, other_arg):
    """Integer add/sub/mul, as generate()'s bookkeeping calls them (positions, finished rows): exact in
    the result's dtype, wrapping in two's complement as aten does (computed in uint64_t, where C++
    defines the wrap). Family cards only: the exact-shape renders compute in float, and their
    integer calls are too few to be worth a kernel of their own."""
    out = card.outputs[0]
    op = card.op.split(".")[1]
    if card.family is None:
        return "integer results are served by size-generic family kernels only"
    if op not in ("add", "sub", "mul"):
        return f"integer {op} is not served (true division gives a float)"
    alpha = value(card, "alpha", 1)
    if isinstance(alpha, bool) or not isinstance(alpha, int):
        return "alpha is not an integer"
    metas, operands = [], []
    for a in (self_arg, other_arg):
        if a.kind == "tensor" and a.tensor.dtype == out.dtype:
            operands.append(f"(uint64_t)a{len(metas)}")
            metas.append(a.tensor)
        elif a.kind == "value" and isinstance(a.value, int) and not isinstance(a.value, bool):
            operands.append(_integer_literal(a.value))
        else:
            return f"operand {a.name} is not a {out.dtype} tensor or an integer"
    x, y = operands
    if op in ("add", "sub") and alpha != 1:
        y = f"({_integer_literal(alpha)} * {y})"
    expr = f"({x} {dict(add='+', sub='-', mul='*')[op]} {y})"
    job = make_job(out, 0, metas, list(range(len(metas))), expr)
    return [job] if job else "operands do not broadcast to the output"


class BinaryTemplate(StreamingTemplate):
    def plan(self, card: Card, target: str):
        out = card.outputs[0]
        self_arg, other_arg = arg(card, "self"), arg(card, "other")
        if self_arg is None or self_arg.kind != "tensor" or other_arg is None:
            return "self must be a tensor"
        if out.dtype in INTEGERS:
            return integer_binary_plan(card, self_arg, other_arg)
        if out.dtype not in FLOATS:
            return "binary templates compute float32/float16/bfloat16 (and family int64/int32) results only"
        alpha = value(card, "alpha", 1)
        if isinstance(alpha, bool) or not isinstance(alpha, int | float):
            return "alpha is not a real number"
        metas, operands = [], []
        for a in (self_arg, other_arg):
            if a.kind == "tensor":
                if a.tensor.dtype not in CAST_SOURCES or (a.tensor.dtype == "float64" and out.dtype != "float64"):
                    return f"operand dtype {a.tensor.dtype} not served"
                operands.append(_round_to(a.tensor.dtype, f"a{len(metas)}", out.dtype))
                metas.append(a.tensor)
            elif a.kind == "value" and isinstance(a.value, int | float) and not isinstance(a.value, bool):
                operands.append(flit(a.value))
            else:
                return f"operand {a.name} is neither a tensor nor a number"
        x, y = operands
        op = card.op.split(".")[1]
        scalar_other = other_arg.kind == "value"
        if op in ("add", "sub"):
            alpha = float(alpha)
            if alpha != 1.0:
                y = f"({flit(alpha)} * {y})"
            expr = f"({x} {'+' if op == 'add' else '-'} {y})"
        elif op == "mul":
            expr = f"({x} * {y})"
        elif scalar_other and target == "cuda":
            # aten's div_true_kernel_cuda multiplies by the float reciprocal of a CPU scalar.
            expr = f"({x} * (1.0f / {y}))"
        else:
            expr = f"({x} / {y})"
        job = make_job(out, 0, metas, list(range(len(metas))), expr)
        return [job] if job else "operands do not broadcast to the output"


class CopyTemplate(PointwiseTemplate):
    """`_to_copy` (dtype casts, layout changes) and `clone` (e.g. a transposed view made contiguous)."""

    def plan(self, card: Card, target: str):
        x, out = card.tensor_inputs()[0], card.outputs[0]
        if x.shape != out.shape:
            return "shape changes are not copies"
        if card.op == "aten._to_copy.default":
            if value(card, "layout") not in (None, "strided") or value(card, "pin_memory") not in (None, False):
                return "only strided, unpinned outputs"
            device = value(card, "device")
            if device not in (None, target):
                return f"copy to another device ({device})"
        if x.dtype == out.dtype:
            expr = None
        elif (x.dtype in CAST_SOURCES and out.dtype in FLOATS) or (x.dtype in FLOATS and out.dtype == "float64"):
            expr = "a0"
        elif x.dtype in CAST_SOURCES and out.dtype == "bool":  # generate()'s attention mask
            expr = "a0"  # through float, `fp_st<bool>`: != 0, which no int's float conversion changes
        else:
            return f"cast {x.dtype} -> {out.dtype} not served"
        job = make_job(out, 0, [x], [0], expr)
        return [job] if job else "input does not match the output"

    def axes(self, plan, target):
        axes = pointwise_axes(plan, target)
        if target == "cuda" and transpose_dim(plan[0]) is not None:
            # 0: the elementwise path; else a shared-memory tile of this size. `vec` is the tile's
            # vector width on both sides (the elementwise path clamps it to what its layout allows).
            axes["vec"] = transpose_vecs(plan[0])
            axes["tile"] = [0, *(t for t in TILES if t * t * plan[0].ins[0].itemsize <= SMEM_TILE_BYTES)]
            axes["group"] = list(GROUPS)
        return axes

    def pick_default(self, plan, axes, target):
        point = pointwise_default(plan, axes, target)
        if "tile" in axes:
            point.update(tile=64, group=GROUPS[1])
        return point

    def emit(self, card, plan, target, params):
        tile, group = params.pop("tile", 0), params.pop("group", 1)
        if tile:
            return render_transpose(card, plan[0], tile, params["vec"], group)
        return render_pointwise(card, target, plan, params)


TILES = [32, 64, 128]
# Tiled transpose block order: 1 walks the output's tile rows one after another; G > 1 runs G tile rows
# side by side (Triton's grouped order), so the blocks in flight read and write runs of G tiles (and
# more) along both tensors' rows instead of one tile per row of the input: longer DRAM runs.
GROUPS = [1, 8, 32]
SMEM_TILE_BYTES = 32 * 1024
TRANSPOSE_THREADS = 256


def transpose_dim(job: Job) -> int | None:
    """The dim along which the input is contiguous when the output is contiguous along the last one
    (a batched transpose), or None."""
    if len(job.shape) < 2 or job.out.strides[-1] != 1 or job.ins[0].strides[-1] == 1:
        return None
    for d in range(len(job.shape) - 1):
        if job.ins[0].strides[d] == 1:
            return d
    return None


def transpose_vecs(job: Job) -> list[int]:
    """Vector widths (elements) the tiled transpose can read along the input's contiguous dim and write
    along the output's: both extents divisible, every other stride and the offsets aligned, and one
    vector at most 16 bytes on either side. Base pointers are checked at run time."""
    p = transpose_dim(job)
    x, out = job.ins[0], job.out
    m, n = job.shape[p], job.shape[-1]
    widest = max(x.itemsize, out.itemsize)
    vecs, v = [1], 2
    while v * widest <= 16:
        ok = m % v == 0 and n % v == 0
        ok = ok and all(s % v == 0 for d, s in enumerate(x.strides) if d != p) and x.offset % v == 0
        ok = ok and all(s % v == 0 for s in out.strides[:-1]) and out.offset % v == 0
        ok = ok and all((view.storage_offset * view.itemsize) % (v * view.itemsize) == 0 for view in (x, out))
        if ok:
            vecs.append(v)
        v *= 2
    return vecs


def _tile_order(tm: int, tn: int, group: int, itype: str) -> str:
    """bx (tile along j), by (tile along i), bz (batch) of this block."""
    if group == 1 or tm == 1:
        return (f"{itype} b_ = blockIdx.x;\nconst {itype} bx = b_ % {tn}u; b_ /= {tn}u;\n"
                f"const {itype} by = b_ % {tm}u;\nconst {itype} bz = b_ / {tm}u; (void)bz;")
    return (f"const {itype} bz = blockIdx.x / {tm * tn}u; (void)bz;\n"
            f"const {itype} r_ = blockIdx.x % {tm * tn}u, g_ = r_ / {group * tn}u, q_ = r_ % {group * tn}u;\n"
            f"const {itype} first_ = g_ * {group}u, rows_ = {tm}u - first_ < {group}u ? {tm}u - first_ : {group}u;\n"
            f"const {itype} by = first_ + q_ % rows_, bx = q_ / rows_;")


def _transpose_threads(tile: int, vec: int) -> int:
    nch = tile // vec
    return nch * min(tile, TRANSPOSE_THREADS // nch)


def render_transpose(card: Card, job: Job, tile: int, vec: int = 1, group: int = 1) -> str:
    """Tiled copy through shared memory: read a tile x tile block along the input's contiguous dim
    (i), write it along the output's (j), converting the dtype on the way if asked. Both sides move
    `vec`-element vectors (16-byte accesses at the widest); the tile is kept as rows of vectors
    t_[j][i / vec], the vector column XOR-swizzled by (j / vec) so that the vector writes (a row) and
    the element reads (a column) hit distinct banks. The other dims (batch) are walked with their
    constant strides. If a base pointer is misaligned at run time, the vec = 1 instantiation runs.
    `group` > 1: consecutive blocks walk `group` tile rows (i) before the next tile column (j)."""
    p = transpose_dim(job)
    shape = job.shape
    m, n = shape[p], shape[-1]
    batch_dims = [d for d in range(len(shape) - 1) if d != p]
    tm, tn = ceil_div(m, tile), ceil_div(n, tile)
    nbatch = math.prod(shape[d] for d in batch_dims)
    itype = index_type(shape, job.views())
    x, out = job.ins[0], job.out
    in_t, out_t = ctype(x.dtype, "cuda"), ctype(out.dtype, "cuda")
    bshape = tuple(shape[d] for d in batch_dims) or (1,)
    bviews = [View(v.dtype, tuple(v.strides[d] for d in batch_dims) or (0,)) for v in (out, x)]
    boffsets = offsets_code(bshape, bviews, "bz", ["ob_", "ib_"], itype)
    ib0 = f" + {x.offset}u" if x.offset else ""
    ob0 = f" + {out.offset}u" if out.offset else ""
    conv = "v" if job.expr is None else f"fp_st<{out_t}>(fp_ld(v))"
    body = f"""
constexpr int TILE = {tile};
struct fp_args {{ const {in_t}* __restrict__ in0; {out_t}* __restrict__ out0; }};

template <int V, int THREADS>
__global__ void __launch_bounds__(THREADS) fp_transpose(const fp_args p) {{
  constexpr int NCH = TILE / V;  // vectors per tile row
  constexpr int ROWS = THREADS / NCH;  // tile rows per pass
  __shared__ fp_vec<{in_t}, V> t_[TILE][NCH];
  {_indent(_tile_order(tm, tn, group, itype), 2)}
  {_indent(boffsets, 2)}
  const int tx = threadIdx.x % NCH, ty = threadIdx.x / NCH;
  {{
    const {itype} i = by * TILE + tx * V;
#pragma unroll
    for (int q = 0; q < TILE / ROWS; ++q) {{
      const int k = ty + q * ROWS;
      const {itype} j = bx * TILE + k;
      if (i < {m}u && j < {n}u)
        t_[k][tx ^ ((k / V) % NCH)] =
            *reinterpret_cast<const fp_vec<{in_t}, V>*>(p.in0 + ib_{ib0} + i + j * {x.strides[-1]}u);
    }}
  }}
  __syncthreads();
  {{
    const {itype} j = bx * TILE + tx * V;
#pragma unroll
    for (int q = 0; q < TILE / ROWS; ++q) {{
      const int k = ty + q * ROWS;
      const {itype} i = by * TILE + k;
      if (i < {m}u && j < {n}u) {{
        fp_vec<{out_t}, V> r;
#pragma unroll
        for (int e = 0; e < V; ++e) {{
          const {in_t} v = t_[tx * V + e][(k / V) ^ tx].v[k % V];  // row tx*V+e is swizzled by tx
          r.v[e] = {conv};
        }}
        *reinterpret_cast<fp_vec<{out_t}, V>*>(p.out0 + ob_{ob0} + i * {out.strides[p]}u + j) = r;
      }}
    }}
  }}
}}
"""
    grid = tm * tn * nbatch
    t_vec, t_one = _transpose_threads(tile, vec), _transpose_threads(tile, 1)
    checks = [("p.in0", vec_bytes(x.itemsize, vec)), ("p.out0", vec_bytes(out.itemsize, vec))] if vec > 1 else []
    launch = (f"fp_args p;\n  p.in0 = (const {in_t}*)call->inputs[0].data;\n  "
              f"p.out0 = ({out_t}*)call->outputs[0].data;\n  "
              f"if ({align_check(checks)}) fp_transpose<{vec}, {t_vec}><<<{grid}u, {t_vec}, 0, stream>>>(p);\n  "
              f"else fp_transpose<1, {t_one}><<<{grid}u, {t_one}, 0, stream>>>(p);\n  " + launch_status("cuda"))
    return prelude("cuda") + body + entry(card, "cuda", launch)


class CatTemplate(StreamingTemplate):
    def plan(self, card: Card, target: str):
        out = card.outputs[0]
        tensors = arg(card, "tensors").tensors
        metas = [m for m in tensors]
        nd = len(out.shape)
        dim = value(card, "dim", 0)
        if not -nd <= dim < nd:
            return "cat dim out of range"
        dim %= nd
        if len(tensors) > 16:
            return "more than 16 inputs"
        jobs, start = [], 0
        for slot, m in enumerate(metas):
            if m.numel == 0:
                if len(m.shape) == nd:
                    continue
                if m.shape == (0,):  # legacy: 1-D empty tensors are skipped by cat
                    continue
                return "empty input of another rank"
            if len(m.shape) != nd:
                return "input ranks differ"
            if any(a != b for d, (a, b) in enumerate(zip(m.shape, out.shape, strict=True)) if d != dim):
                return "input shapes do not match the output"
            if m.dtype != out.dtype and not (m.dtype in CAST_SOURCES and out.dtype in FLOATS):
                return f"cast {m.dtype} -> {out.dtype} not served"
            expr = None if m.dtype == out.dtype else "a0"
            job = make_job(out, 0, [m], [slot], expr, out_offset=start * out.stride[dim], shape=m.shape)
            jobs.append(job)
            start += m.shape[dim]
        if start != out.shape[dim]:
            return "inputs do not fill the output"
        return jobs or "nothing to copy"


def _unary_ops() -> tuple[str, ...]:
    return ("aten.gelu.default", "aten.pow.Tensor_Scalar", *_UNARY)


TEMPLATES = (
    UnaryTemplate("elementwise.unary", "elementwise", ("cuda", "cpu"), _unary_ops()),
    BinaryTemplate("elementwise.binary", "elementwise", ("cuda", "cpu"),
                   ("aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor")),
    CopyTemplate("elementwise.copy", "elementwise", ("cuda", "cpu"), ("aten._to_copy.default", "aten.clone.default")),
    CatTemplate("elementwise.cat", "elementwise", ("cuda", "cpu"), ("aten.cat.default",)),
)
