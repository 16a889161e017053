"""Size-generic renders for family cards: the sizes a family varies are read from the ABI descriptors
at run time (DESIGN.md "Serving envelope and shape families").

An exact-shape kernel bakes every size and stride in as constants (`common.abi_check` refuses any
other). A family kernel must compute every member, so it:

- checks what is fixed across the family (dtypes, ranks, the fixed sizes of `Family` layouts, the
  scalars) as constants, and refuses negative strides;
- builds its iteration geometry on the host from the descriptors (`fp_geom`: sizes and per-view
  strides, size-1 dims dropped and dims every view walks as one merged, as `common.coalesce` does at
  render time for exact shapes), then launches on it;
- takes a vector path only where the geometry allows it at run time (inner size divisible, inner
  strides 1 or broadcast, pointers aligned), else the element path: so it needs nothing of the guard
  beyond each tensor's natural element alignment (`needs`).

Row reductions keep the row length a constant (it is fixed across an LLM's serving envelope: the
hidden size, the vocabulary), so their register paths and unrolled passes are the exact-shape ones;
only the row count and the rows' strides are read at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

from forgepack.cards import DTYPE_CODES, DTYPE_SIZES, Card, Layout
from forgepack.templates.common import abi_counts_check, ctype, hint_helpers, launch_status, scalar_checks

GRID_CAP = 132 * 32  # grid-stride loops: enough blocks for every SM, whatever the size
MAX_CAT_JOBS = 16  # a cat of more inputs launches per input: one launch's geometries would crowd its parameters


def abi_check(card: Card) -> str:
    """Host code validating `call` against what the family fixes; sizes that vary are left to the kernel."""
    fam = card.family
    ins, outs = card.tensor_inputs(), card.outputs
    lines = abi_counts_check(card)
    slots = [(f"call->inputs[{i}]", m, lay) for i, (m, lay) in enumerate(zip(ins, fam.inputs, strict=True))]
    slots += [(f"call->outputs[{j}]", m, lay) for j, (m, lay) in enumerate(zip(outs, fam.outputs, strict=True))]
    for var, meta, layout in slots:
        lines += _desc_check(var, meta, layout)
    return "\n  ".join(lines + scalar_checks(card))


def _desc_check(var: str, meta, layout: Layout | None) -> list[str]:
    if meta is None:
        return [f"if ({var}.data != NULL) return FP_ERR_UNSUPPORTED;"]
    nd = len(meta.shape)
    lines = [f"if ({var}.dtype != {DTYPE_CODES[meta.dtype]} || {var}.ndim != {nd}) return FP_ERR_UNSUPPORTED;",
             f"if (!fp_desc_ok(&{var})) return FP_ERR_UNSUPPORTED;"]
    for d, size in enumerate(layout.shape):
        if isinstance(size, int):
            lines.append(f"if ({var}.sizes[{d}] != {size}LL) return FP_ERR_UNSUPPORTED;")
    return lines


HOST_HELPERS = r"""
// --- size-generic geometry (host side): sizes and strides read from the descriptors ---
#ifndef FP_GD
#define FP_GD 8
#endif
struct fp_geom { int nd; int64_t numel; int64_t n[FP_GD]; int64_t s[FP_GV][FP_GD]; int64_t base[FP_GV]; };
// What the flat fast path takes instead: the element count and each view's first element.
struct fp_flat { int64_t n; int64_t base[FP_GV]; };

// Non-negative sizes and strides, and data present when there is something to read.
__attribute__((unused)) static inline bool fp_desc_ok(const fp_tensor* t) {
  int64_t numel = 1;
  for (int d = 0; d < t->ndim; ++d) {
    if (t->sizes[d] < 0 || t->strides[d] < 0) return false;
    numel *= t->sizes[d];
  }
  return numel == 0 || t->data != NULL;
}

__attribute__((unused)) static inline int64_t fp_numel(const fp_tensor* t) {
  int64_t numel = 1;
  for (int d = 0; d < t->ndim; ++d) numel *= t->sizes[d];
  return numel;
}

// Every element of `t` lies within 32-bit index math of its data pointer, and so does its element count.
__attribute__((unused)) static inline bool fp_fits32(const fp_tensor* t) {
  int64_t span = 0;
  for (int d = 0; d < t->ndim; ++d) {
    if (t->sizes[d] == 0) return true;
    span += (t->sizes[d] - 1) * t->strides[d];
  }
  return span < (1LL << 31) && fp_numel(t) < (1LL << 31);
}

__attribute__((unused)) static inline void fp_geom_init(fp_geom* g, const fp_tensor* shape_of) {
  g->nd = shape_of->ndim;
  for (int d = 0; d < g->nd; ++d) g->n[d] = shape_of->sizes[d];
  for (int v = 0; v < FP_GV; ++v) { g->base[v] = 0; for (int d = 0; d < FP_GD; ++d) g->s[v][d] = 0; }
}

// View `v` walks tensor `t` broadcast to the iteration sizes (stride 0 where `t` has size 1 or no
// such dim); false if `t` does not broadcast (`exact`: its sizes must equal the iteration's).
__attribute__((unused)) static inline bool fp_geom_view(fp_geom* g, int v, const fp_tensor* t, bool exact) {
  const int lead = g->nd - t->ndim;
  if (lead < 0 || (exact && lead != 0)) return false;
  for (int d = 0; d < g->nd; ++d) {
    if (d < lead) { g->s[v][d] = 0; continue; }
    const int64_t size = t->sizes[d - lead];
    if (size == g->n[d]) g->s[v][d] = size == 1 ? 0 : t->strides[d - lead];
    else if (size == 1 && !exact) g->s[v][d] = 0;
    else return false;
  }
  return true;
}

// Drop size-1 dims, merge adjacent dims every view walks as one; numel.
__attribute__((unused)) static inline void fp_geom_coalesce(fp_geom* g) {
  int m = 0;
  int64_t numel = 1;
  for (int d = 0; d < g->nd; ++d) {
    numel *= g->n[d];
    if (g->n[d] == 1) continue;
    bool merge = m > 0;
    for (int v = 0; v < FP_GV && merge; ++v) merge = g->s[v][m - 1] == g->s[v][d] * g->n[d];
    if (merge) {
      g->n[m - 1] *= g->n[d];
      for (int v = 0; v < FP_GV; ++v) g->s[v][m - 1] = g->s[v][d];
      continue;
    }
    g->n[m] = g->n[d];
    for (int v = 0; v < FP_GV; ++v) g->s[v][m] = g->s[v][d];
    ++m;
  }
  if (m == 0) { g->n[0] = 1; for (int v = 0; v < FP_GV; ++v) g->s[v][0] = 0; m = 1; }
  for (int d = m; d < FP_GD; ++d) { g->n[d] = 1; for (int v = 0; v < FP_GV; ++v) g->s[v][d] = 0; }
  g->nd = m;
  g->numel = numel;
}

// Every offset the views reach fits 32-bit index math.
__attribute__((unused)) static inline bool fp_geom_fits32(const fp_geom* g) {
  if (g->numel >= (1LL << 31)) return false;
  for (int v = 0; v < FP_GV; ++v) {
    int64_t span = g->base[v];
    for (int d = 0; d < g->nd; ++d) span += (g->n[d] - 1) * g->s[v][d];
    if (span >= (1LL << 31)) return false;
  }
  return true;
}

// VEC consecutive inner elements are one aligned vector (or one broadcast value) in view v.
__attribute__((unused)) static inline bool fp_geom_vec_ok(const fp_geom* g, int v, const void* data, int vec,
                                                          int itemsize) {
  const int64_t inner = g->s[v][g->nd - 1];
  if (inner == 0 && v > 0) return true;  // a broadcast input: one scalar load per vector
  if (inner != 1 || g->n[g->nd - 1] % vec || g->base[v] % vec) return false;
  for (int d = 0; d + 1 < g->nd; ++d) if (g->s[v][d] % vec) return false;
  const int bytes = vec * itemsize > 16 ? 16 : vec * itemsize;
  return (uintptr_t)data % (uintptr_t)bytes == 0;
}
"""


def helpers(views: int) -> str:
    return f"\n#undef FP_GV\n#define FP_GV {views}\n" + HOST_HELPERS


def entry(card: Card, target: str, body: str) -> str:
    stream = "cudaStream_t stream = (cudaStream_t)call->stream;\n  (void)stream;\n  " if target == "cuda" else ""
    return "FP_EXPORT int32_t forgepack_kernel(const fp_call* call) {\n  " + abi_check(card) + "\n  " + stream \
        + body.strip() + "\n}\n"


# --- pointwise jobs ----------------------------------------------------------------------------------


def _cpu_job(k: int, job, unroll: int = 1) -> str:
    """Rows of the innermost (merged) dim; outer coordinates decoded per row. `unroll` > 1: the unit-stride
    row loop's `#pragma GCC unroll` (the cpu search axis)."""
    nin = len(job.in_slots)
    out_t = ctype(job.out_dtype, "cpu")
    ptrs = [f"{out_t}* y_ = p.out{job.out_slot} + o_[0];"]
    ptrs += [f"const {ctype(dt, 'cpu')}* x{i}_ = p.in{s} + o_[{i + 1}];"
             for i, (s, dt) in enumerate(zip(job.in_slots, job.in_dtypes, strict=True))]
    strides = " ".join(f"const int64_t t{v}_ = g.s[{v}][g.nd - 1];" for v in range(nin + 1))

    def stmt(idx: list[str]) -> str:
        if job.expr is None:
            return f"y_[{idx[0]}] = x0_[{idx[1]}];"
        if job.integer:
            loads = " ".join(f"const int64_t a{i} = (int64_t)x{i}_[{idx[i + 1]}];" for i in range(nin))
            return f"{loads} y_[{idx[0]}] = ({out_t})(int64_t)({job.expr});"
        loads = " ".join(f"const float a{i} = fp_ld(x{i}_[{idx[i + 1]}]);" for i in range(nin))
        return f"{loads} y_[{idx[0]}] = fp_st<{out_t}>({job.expr});"

    unit = stmt(["c_"] + [f"c_ * t{i + 1}_" for i in range(nin)])
    strided = stmt([f"c_ * t{v}_" for v in range(nin + 1)])
    all_unit = " && ".join(f"t{v}_ == 1" for v in range(nin + 1))
    hint = f"\n#pragma GCC unroll {unroll}\n     " if unroll > 1 else ""
    return f"""
static void fp_gjob{k}(const fp_args& p, const fp_geom& g) {{
  const int64_t inner = g.n[g.nd - 1], outer = g.numel / inner;
  {strides}
  for (int64_t r = 0; r < outer; ++r) {{
    int64_t q_ = r, o_[FP_GV];
    for (int v = 0; v < FP_GV; ++v) o_[v] = g.base[v];
    for (int d = g.nd - 2; d >= 0; --d) {{
      const int64_t c = q_ % g.n[d]; q_ /= g.n[d];
      for (int v = 0; v < FP_GV; ++v) o_[v] += c * g.s[v][d];
    }}
    {' '.join(ptrs)}
    if ({all_unit}) {{{hint} for (int64_t c_ = 0; c_ < inner; ++c_) {{ {unit} }} }}
    else {{ for (int64_t c_ = 0; c_ < inner; ++c_) {{ {strided} }} }}
  }}
}}
"""


def _element_code(job) -> tuple[str, str]:
    """(y_ type, the statement computing y_.v[j] from x0..: the inputs' vectors)."""
    out_t = ctype(job.out_dtype, "cuda")
    convs = []
    for i in range(len(job.in_slots)):
        load = f"(int64_t)x{i}.v[j]" if job.integer else f"fp_ld(x{i}.v[j])"
        convs.append(f"const {'int64_t' if job.integer else 'float'} a{i} = {load};")
    if job.expr is None:
        return out_t, "y_.v[j] = x0.v[j];"
    if job.integer:
        return out_t, " ".join(convs) + f" y_.v[j] = ({out_t})(int64_t)({job.expr});"
    return out_t, " ".join(convs) + f" y_.v[j] = fp_st<{out_t}>({job.expr});"


def _cuda_job(k: int, job) -> str:
    """Job k's kernels: the general one (any rank, broadcasts, strides: each vector's offsets decoded
    from the geometry in a grid-stride loop) and the flat fast path (one contiguous run in every view:
    as many blocks as groups of vectors, only pointers and offsets passed). A thread takes UNROLL
    vectors BLOCK apart, every load issued before the first store (more bytes in flight for the large
    copies of a long KV cache; the exact-shape kernels' `unroll`), through `fp_load`/`fp_store` (the
    searched cache policies)."""
    out_t, compute = _element_code(job)
    regs, loads, flat_loads, views = [], [], [], []
    for i, (s, dt) in enumerate(zip(job.in_slots, job.in_dtypes, strict=True)):
        t = ctype(dt, "cuda")
        vec_t = f"fp_vec<{t}, VEC>"
        regs.append(f"{vec_t} xs{i}_[UNROLL];")
        loads.append(f"if (VEC == 1 || g.s[{i + 1}][g.nd - 1] != 0) "
                     f"xs{i}_[u] = fp_load(reinterpret_cast<const {vec_t}*>(p.in{s} + o_[{i + 1}]));\n"
                     f"      else {{ const {t} b_ = p.in{s}[o_[{i + 1}]];\n#pragma unroll\n"
                     f"        for (int j = 0; j < VEC; ++j) xs{i}_[u].v[j] = b_; }}")
        flat_loads.append(f"xs{i}_[u] = fp_load(reinterpret_cast<const {vec_t}*>(p.in{s} + (I)f.base[{i + 1}] + e_));")
        views.append(f"const {vec_t}& x{i} = xs{i}_[u];")
    store = (f"fp_vec<{out_t}, VEC> y_;\n#pragma unroll\n      for (int j = 0; j < VEC; ++j) {{ {compute} }}\n"
             f"      fp_store(reinterpret_cast<fp_vec<{out_t}, VEC>*>(p.out{job.out_slot} + OUT_), y_);")
    stores = "\n".join([
        "#pragma unroll",
        "  for (int u = 0; u < UNROLL; ++u) {",
        "    if (v0 + (I)u * BLOCK < nv) {",
        f"      {' '.join(views)}",
        f"      {store}",
        "    }",
        "  }"])
    return f"""
// vectors v0, v0 + BLOCK, ... of job {k} (those below nv): offsets decoded from the geometry, all loaded,
// then computed and stored
template <typename I, int VEC>
__device__ __forceinline__ void fp_gvec{k}(const fp_args& p, const fp_geom& g, const I v0, const I nv) {{
  {' '.join(regs)}
  I oo_[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {{
    const I v_ = v0 + (I)u * BLOCK;
    if (v_ < nv) {{
      I r_ = v_ * VEC, o_[FP_GV];
#pragma unroll
      for (int v = 0; v < FP_GV; ++v) o_[v] = (I)g.base[v];
#pragma unroll
      for (int d = FP_GD - 1; d >= 0; --d) {{
        if (d < g.nd) {{
          const I n_ = (I)g.n[d], c_ = d == 0 ? r_ : r_ % n_;
          r_ = d == 0 ? r_ : r_ / n_;
#pragma unroll
          for (int v = 0; v < FP_GV; ++v) o_[v] += c_ * (I)g.s[v][d];
        }}
      }}
      oo_[u] = o_[0];
      {chr(10).join('      ' + x for x in loads).strip()}
    }}
  }}
{stores.replace("OUT_", "oo_[u]")}
}}

template <typename I, int VEC>
__global__ void __launch_bounds__(BLOCK) fp_gjob{k}(const fp_args p, const fp_geom g) {{
  const I nv = (I)(g.numel / VEC);
  for (I v0 = (I)blockIdx.x * (BLOCK * UNROLL) + threadIdx.x; v0 < nv; v0 += (I)gridDim.x * (BLOCK * UNROLL))
    fp_gvec{k}<I, VEC>(p, g, v0, nv);
}}

template <typename I, int VEC>
__global__ void __launch_bounds__(BLOCK) fp_gflat{k}(const fp_args p, const fp_flat f) {{
  const I nv = (I)(f.n / VEC), v0 = (I)blockIdx.x * (BLOCK * UNROLL) + threadIdx.x;
  {' '.join(regs)}
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {{
    const I e_ = (v0 + (I)u * BLOCK) * VEC;
    if (v0 + (I)u * BLOCK < nv) {{ {' '.join(flat_loads)} }}
  }}
{stores.replace("OUT_", "(I)f.base[0] + (v0 + (I)u * BLOCK) * VEC")}
}}
"""


def _cuda_launch(k: int, job, vec: int) -> str:
    """Host statements launching job k on geometry `g` (built just before): the flat fast path where every
    view walks one contiguous run (a residual add, a cast, an activation of a whole tensor), else the
    general kernel."""
    items = [DTYPE_SIZES[job.out_dtype]] + [DTYPE_SIZES[d] for d in job.in_dtypes]
    ok = [f"fp_geom_vec_ok(&g, 0, p.out{job.out_slot}, {vec}, {items[0]})"]
    ok += [f"fp_geom_vec_ok(&g, {i + 1}, p.in{s}, {vec}, {items[i + 1]})" for i, s in enumerate(job.in_slots)]
    cond = " && ".join(ok) if vec > 1 else "false"
    flat = " && ".join(f"g.s[{v}][0] == 1" for v in range(len(job.in_slots) + 1))
    return (f"{{ const bool vec_ = {cond}; const int64_t nv_ = g.numel / (vec_ ? {vec} : 1);\n"
            f"    const int64_t blocks_ = (nv_ + BLOCK * UNROLL - 1) / (BLOCK * UNROLL);\n"
            f"    if (g.nd == 1 && {flat} && blocks_ < (1LL << 31)) {{\n"
            f"      fp_flat f; f.n = g.numel; for (int v = 0; v < FP_GV; ++v) f.base[v] = g.base[v];\n"
            f"      const unsigned fgrid_ = (unsigned)blocks_;\n"
            f"      {_typed_launches(f'fp_gflat{k}', vec, 'fgrid_', 'f')}\n"
            f"    }} else {{\n"
            f"      const unsigned grid_ = (unsigned)(blocks_ < {GRID_CAP} ? blocks_ : {GRID_CAP});\n"
            f"      {_typed_launches(f'fp_gjob{k}', vec, 'grid_', 'g')}\n"
            f"    }} }}")


def _typed_launches(kernel: str, vec: int, grid: str, geometry: str, fits: str = "fp_geom_fits32(&g)") -> str:
    """`kernel` launched with 32-bit index math where `fits` (the geometry fits it), vectors where `vec_`
    allows."""
    def one(itype: str) -> str:
        launch = f"<<<{grid}, BLOCK, 0, stream>>>(p, {geometry});"
        return f"if (vec_) {kernel}<{itype}, {vec}>{launch} else {kernel}<{itype}, 1>{launch}"
    return f"if ({fits}) {{ {one('uint32_t')} }} else {{ {one('uint64_t')} }}"


def render_pointwise(card: Card, target: str, jobs: list, fields: list[str], inits: list[str], params: dict,
                     prelude: str, cat_dim: int | None = None) -> str:
    """One source for the family: job k computes `jobs[k]` (a `GenericJob`) over its run-time geometry.
    Plain jobs walk the output's sizes, inputs broadcast to them (`exact`: equal sizes); cat jobs walk
    input k's sizes into the output slice after the inputs before it."""
    views = 1 + max(len(j.in_slots) for j in jobs)
    head = prelude + helpers(views) + f"struct fp_args {{ {' '.join(fields)} }};\n"
    if target == "cuda":
        head += f"constexpr int BLOCK = {params['block']};\nconstexpr int UNROLL = {params.get('unroll', 1)};\n"
        head += hint_helpers(params.get("ld", "plain"), params.get("st", "plain"))
        kernels = "".join(_cuda_job(k, j) for k, j in enumerate(jobs))
        if cat_dim is not None and len(jobs) <= MAX_CAT_JOBS:
            kernels += _cuda_cat_kernel(jobs)
    else:
        kernels = "".join(_cpu_job(k, j, params.get("unroll", 1)) for k, j in enumerate(jobs))
    body = ["fp_args p;", *inits]
    if cat_dim is None:
        job = jobs[0]
        body += ["fp_geom g;", f"fp_geom_init(&g, &call->outputs[{job.out_slot}]);",
                 f"if (!fp_geom_view(&g, 0, &call->outputs[{job.out_slot}], true)) return FP_ERR_UNSUPPORTED;"]
        body += [f"if (!fp_geom_view(&g, {i + 1}, &call->inputs[{s}], {'true' if job.exact else 'false'})) "
                 "return FP_ERR_UNSUPPORTED;" for i, s in enumerate(job.in_slots)]
        body += ["fp_geom_coalesce(&g);", "if (g.numel == 0) return FP_OK;", _launch(0, job, target, params)]
    else:
        body += _cat_body(card, jobs, target, params, cat_dim)
    body.append(launch_status(target))
    return head + kernels + entry(card, target, "\n  ".join(body))


def _launch(k: int, job, target: str, params: dict) -> str:
    return _cuda_launch(k, job, params["vec"]) if target == "cuda" else f"fp_gjob{k}(p, g);"


def _cat_body(card: Card, jobs: list, target: str, params: dict, dim: int) -> list[str]:
    """Every input checked before anything is written (a refusal must leave the output untouched). On
    cuda one launch writes every slice (`fp_gcat`), as aten's cat does (up to `MAX_CAT_JOBS` inputs); else
    the jobs run in turn."""
    out = "call->outputs[0]"
    nd = len(card.outputs[0].shape)
    lines = ["int64_t total_ = 0, onumel_ = 1;", f"for (int d = 0; d < {nd}; ++d) onumel_ *= {out}.sizes[d];",
             "if (onumel_ == 0) return FP_OK;"]
    for job in jobs:
        t = f"call->inputs[{job.in_slots[0]}]"
        same = " || ".join(f"{t}.sizes[{d}] != {out}.sizes[{d}]" for d in range(nd) if d != dim) or "false"
        lines.append(f"if (fp_numel(&{t}) != 0) {{ if ({t}.ndim != {nd} || {same}) return FP_ERR_UNSUPPORTED; "
                     f"total_ += {t}.sizes[{dim}]; }}")
    lines.append(f"if (total_ != {out}.sizes[{dim}]) return FP_ERR_UNSUPPORTED;")
    lines.append("int64_t start_ = 0;")
    one_launch = target == "cuda" and len(jobs) <= MAX_CAT_JOBS
    if one_launch:
        lines.append("fp_cat c_;")
    for k, job in enumerate(jobs):
        t = f"call->inputs[{job.in_slots[0]}]"
        geometry = (f"fp_geom_init(&g, &{t});\n"
                    f"    for (int d = 0; d < {nd}; ++d) g.s[0][d] = g.n[d] == 1 ? 0 : {out}.strides[d];\n"
                    f"    g.base[0] = start_ * {out}.strides[{dim}];\n"
                    f"    if (!fp_geom_view(&g, 1, &{t}, true)) return FP_ERR_UNSUPPORTED;\n"
                    f"    start_ += {t}.sizes[{dim}];\n"
                    f"    fp_geom_coalesce(&g);")
        if one_launch:
            lines.append(f"{{ fp_geom& g = c_.g[{k}]; g.nd = 1; g.numel = 0;\n"
                         f"  if (fp_numel(&{t}) != 0) {{ {geometry} }} }}")
        else:
            launch = _launch(k, job, target, params)
            lines.append(f"if (fp_numel(&{t}) != 0) {{ fp_geom g; {geometry}\n    {launch}\n  }}")
    if one_launch:
        lines.append(_cuda_cat_launch(jobs, params["vec"]))
    return lines


def _cuda_cat_kernel(jobs: list) -> str:
    """One kernel for every slice of a cat: the blocks split between the jobs by `first` (job j's first
    block), each block's job found by comparison, its vectors computed by job j's `fp_gvec`."""
    cases = " ".join(f"case {k}: fp_gvec{k}<I, VEC>(p, c.g[{k}], v0, (I)(c.g[{k}].numel / VEC)); break;"
                     for k in range(len(jobs)))
    return f"""
struct fp_cat {{ fp_geom g[{len(jobs)}]; int64_t first[{len(jobs) + 1}]; }};

template <typename I, int VEC>
__global__ void __launch_bounds__(BLOCK) fp_gcat(const fp_args p, const fp_cat c) {{
  const int64_t b = blockIdx.x;
  int j = 0;
#pragma unroll
  for (int q = 1; q < {len(jobs)}; ++q) j += b >= c.first[q];
  const I v0 = (I)(b - c.first[j]) * (BLOCK * UNROLL) + threadIdx.x;
  switch (j) {{ {cases} default: break; }}
}}
"""


def _cuda_cat_launch(jobs: list, vec: int) -> str:
    """Host statements: every job's vector test and 32-bit test, the blocks each takes, one launch."""
    tests = []
    for k, job in enumerate(jobs):
        items = [DTYPE_SIZES[job.out_dtype], DTYPE_SIZES[job.in_dtypes[0]]]
        tests.append(f"if (c_.g[{k}].numel != 0) {{ const fp_geom& g = c_.g[{k}]; "
                     f"vec_ = vec_ && fp_geom_vec_ok(&g, 0, p.out{job.out_slot}, {vec}, {items[0]}) && "
                     f"fp_geom_vec_ok(&g, 1, p.in{job.in_slots[0]}, {vec}, {items[1]}); "
                     f"fits_ = fits_ && fp_geom_fits32(&g); }}")
    n = len(jobs)
    launch = _typed_launches("fp_gcat", vec, f"(unsigned)c_.first[{n}]", "c_", fits="fits_")
    return ("{ " + f"bool vec_ = {'true' if vec > 1 else 'false'}, fits_ = true;\n  " + "\n  ".join(tests) + "\n  "
            f"c_.first[0] = 0;\n  for (int k = 0; k < {n}; ++k) c_.first[k + 1] = c_.first[k] + "
            f"(c_.g[k].numel / (vec_ ? {vec} : 1) + BLOCK * UNROLL - 1) / (BLOCK * UNROLL);\n  "
            f"if (c_.first[{n}] >= (1LL << 31)) return FP_ERR_UNSUPPORTED;\n  if (c_.first[{n}] == 0) return FP_OK;\n  "
            f"{launch} }}")


@dataclass(frozen=True)
class GenericJob:
    """What a size-generic pointwise job computes: out[slot] = expr(a0, ...) (None: a raw copy)."""

    out_slot: int
    out_dtype: str
    in_slots: tuple[int, ...]
    in_dtypes: tuple[str, ...]
    expr: str | None
    exact: bool = False  # inputs must have the output's sizes (copies), not merely broadcast to them
    integer: bool = False  # expr in integers (operands loaded as int64_t, uint64_t arithmetic), not in float
