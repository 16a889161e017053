"""Decode block templates: one launch for a decode block (`forgepack.blocks`) at batch 1-8.

`blocks.gemv` serves the projection blocks (`qkv`, `gate_up`, `proj_add`, `lm_head`). Its program has
three parts, each read from the card's chain, so that no model's code is written here:

1. **Prologue** (optional): the row program before the projections (RMSNorm with its casts, Gemma's
   `1 + w`): the one reduction over the row, then every element of the projections' input, through
   the chain's own elementwise ops (`fused.elementwise_expr`, rounding where the chain rounds). The
   normalised rows sit in shared memory in their dtype.
2. **Matrix-vector products** over the block's weights (one, two or three; a fused weight sliced
   later counts once): the output columns are cut into tiles; each block of threads owns one tile
   for every row, each warp a few columns, its lanes streaming 16-byte chunks of the weight with
   `unroll` loads in flight (as `gemm.mv_rows`), accumulating in fp32; each product rounds once to
   the dtype of the `mm` it replaces (its bias added first, as `addmm`'s epilogue does).
3. **Epilogue**: every output element, and every element a cache write stores, is the chain's value
   there (`fused._Emitter`'s index math through views, slices and cats: the rotary's rotate-half, the
   activation times up, the residual add), reading the products from the tile in shared memory. An
   element's products must lie in its own tile: a tile is a run of `unit` columns (a head, where the
   epilogue slices or concatenates along the row) or, for a gated activation, the same run of every
   weight (`parts`); a read outside the tile yields NaN, which the verifier rejects, never memory
   past it.

`blocks.attention` serves the `attention` block: the step's queries against the static cache, every
slot whose mask admits it (a boolean mask, or an additive one where -inf excludes), the query heads
of one key/value head sharing its loads; slots the mask excludes are never read (a cache is read
only up to its live length). One block of threads per (row, key/value head); its warps split the
slots, each keeping a running max and sum (online softmax), merged at the end. An eager attention
(`softmax(score(q @ kᵀ)) @ v`: Gemma-2's soft-capped score) runs the chain's own score maths on each
product (`fp_score`, the emitter's index math and rounding), its additive mask excluding a slot at the
dtype's lowest value as transformers' eager masks do.

The epilogue of a projection may hold one reduction over the products' row (a norm after the
projection, before the residual add, as Gemma-2 has): the CPU render keeps the whole row in one tile;
the CUDA render, whose tiles split the row over blocks, refuses it.

Numerics follow the chain: products accumulate in fp32 and round once; every elementwise op rounds
to its own output dtype; softmax runs in fp32 and the output rounds once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from forgepack.cards import Card, TensorMeta
from forgepack.needs import Needs
from forgepack.templates import fused, generic
from forgepack.templates.common import FamilyPlan, ceil_div, ctype, entry, flit, launch_status, prelude
from forgepack.templates.fused import Entry, FusedTemplate, Refused, _Emitter, entries, meta_of

KINDS = ("qkv", "attention", "proj_add", "gate_up", "lm_head", "cache_index")  # `forgepack.blocks` finds them
BLOCK_OPS = tuple(f"fusion.{k}.default" for k in KINDS)
MAX_ROWS = 8
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
_RESHAPES = ("view", "_unsafe_view", "reshape", "_reshape_alias")


@dataclass(frozen=True)
class Lin:
    """One product of the block: weight (and bias) input slots, output features, the `mm` chain entry,
    and its first column in the block's concatenated output space."""

    w: int
    b: int
    n: int
    mm: int
    off: int


@dataclass(frozen=True)
class Sink:
    """What the epilogue writes: a card output (`out`), or the source of a cache write (`write`: the
    `index_copy_` entry). Element 0 of each row reads the product at column `off` of part `part`; the
    f-th element of a row reads column `off + f` (checked by the verifier: a wrong guess reads NaN)."""

    ref: tuple
    meta: TensorMeta
    out: int
    write: int
    part: int
    off: int

    @property
    def per_row(self) -> int:
        return math.prod(self.meta.shape[1:])


@dataclass(frozen=True)
class GemvPlan:
    rows: int
    k: int
    wdtype: str
    xdtype: str
    lins: tuple[Lin, ...]
    parts: int
    width: int  # columns per part
    unit: int  # a tile's columns per part are a multiple of it
    prologue: tuple[int, ...]
    reduction: int  # the prologue's reduction entry (-1: none)
    x_ref: tuple  # the products' input as the chain holds it ([rows, 1, k] or [rows, k])
    sinks: tuple[Sink, ...]
    # the epilogue's reduction over each row of the products (-1: none); it needs the whole row in one
    # tile, which the CPU render has and the CUDA render's column-split grid does not
    epi_reduction: int = -1


def _plain(ref: Any) -> tuple:
    return tuple(ref)


def _source(e: Entry) -> tuple:
    return e.tensor_args()[0][1]


def _block_of(card: Card) -> dict:
    return card.fusion.block if card.fusion is not None else {}


# --- planning the projection blocks ---------------------------------------------------------------------------


def gemv_plan(card: Card) -> GemvPlan:
    block = _block_of(card)
    if block.get("kind") not in ("qkv", "gate_up", "proj_add", "lm_head"):
        raise Refused("not a projection block")
    chain = entries(card)
    ins = card.tensor_inputs()
    lins, off = [], 0
    for (w, b, n), mm in zip(block["linears"], block["mm"], strict=True):
        lins.append(Lin(w, b, n, mm, off))
        off += n
    x_refs = {_product_input(chain, chain[lin.mm]) for lin in lins}
    if len(x_refs) != 1:
        raise Refused("the products read different inputs")
    x_ref = x_refs.pop()
    for lin in lins:
        wmeta = ins[lin.w]
        if len(wmeta.shape) != 2 or wmeta.stride[1] != 1:
            raise Refused("a weight whose rows are not contiguous")
    xmeta = meta_of(card, chain, x_ref)
    k = xmeta.shape[-1]
    rows = math.prod(xmeta.shape[:-1])
    if rows != xmeta.shape[0] or rows > MAX_ROWS:
        raise Refused(f"{rows} rows of one token each: at most {MAX_ROWS}")
    if xmeta.stride[-1] != 1:
        raise Refused("the products' input is not contiguous along its rows")
    wdtype = ins[lins[0].w].dtype
    if wdtype not in FLOAT_DTYPES or any(ins[lin.w].dtype != wdtype for lin in lins):
        raise Refused("weights of another or mixed dtype")
    if xmeta.dtype != wdtype:
        raise Refused("the products' input has another dtype than the weights")
    prologue = tuple(block.get("prologue", ()))
    reduction = -1
    if prologue:
        reductions = [i for i in prologue if chain[i].op in ("mean", "sum")]
        if len(reductions) != 1:
            raise Refused("a prologue with other than one reduction")
        reduction = reductions[0]
        _check_reduction(card, chain[reduction])
        if x_ref[0] != "t" or x_ref[1] not in prologue:
            raise Refused("the prologue does not make the products' input")
    elif x_ref[0] != "in":
        raise Refused("the products' input is made inside the block without a prologue")
    parts = 2 if block["kind"] == "gate_up" else 1
    total = sum(lin.n for lin in lins)
    if total % parts:
        raise Refused("the gated products do not split into two halves")
    width = total // parts
    unit = _unit(chain)
    if width % unit:
        raise Refused(f"a part of {width} columns is no multiple of the head size {unit}")
    sinks = tuple(_sinks(card, chain, lins, width))
    epi = _epilogue_reduction(card, chain, prologue, parts, width)
    return GemvPlan(rows, k, wdtype, xmeta.dtype, tuple(lins), parts, width, unit, prologue, reduction, x_ref, sinks,
                    epi)


def _epilogue_reduction(card: Card, chain: list[Entry], prologue: tuple[int, ...], parts: int, width: int) -> int:
    """The epilogue's one reduction over a row of the products (a norm after the projection), or -1."""
    found = [e for e in chain if e.op in ("mean", "sum") and e.index not in prologue]
    if not found:
        return -1
    if len(found) > 1 or parts != 1:
        raise Refused("an epilogue with more than one reduction, or one over gated halves")
    _check_reduction(card, found[0])
    if meta_of(card, chain, _source(found[0])).shape[-1] != width:
        raise Refused("an epilogue reduction over other than the products' row")
    return found[0].index


def _product_input(chain: list[Entry], e: Entry) -> tuple:
    """What an `mm`/`addmm` multiplies, before the 2-D view of it."""
    x2d = _plain(e.tensor("mat1" if e.op == "addmm" else "self"))
    if x2d[0] == "t" and chain[x2d[1]].op in _RESHAPES:
        return _plain(_source(chain[x2d[1]]))
    return x2d


def _check_reduction(card: Card, e: Entry) -> None:
    dims = e.value("dim")
    src = meta_of(card, entries(card), _source(e))
    if not isinstance(dims, list) or len(dims) != 1 or dims[0] % len(src.shape) != len(src.shape) - 1:
        raise Refused("the prologue's reduction is not over the last dim")
    if not e.value("keepdim", False):
        raise Refused("the prologue's reduction does not keep its dim")
    if e.value("dtype") is not None:
        raise Refused("a reduction with a dtype")


def _unit(chain: list[Entry]) -> int:
    """The columns an epilogue element may reach across: the last dim of the views the products are cut
    into when the epilogue slices or concatenates (rotate-half within a head), else 1."""
    if not any(e.op in ("cat",) for e in chain):
        return 1
    dims = [e.outs[0].shape[-1] for e in chain if e.op in ("view", "_unsafe_view", "reshape")
            and len(e.outs[0].shape) == 4]
    return max(dims) if dims else 1


def _sinks(card: Card, chain: list[Entry], lins: list[Lin], width: int) -> list[Sink]:
    sinks = []
    for j, (ref, meta) in enumerate(zip(card.fusion.outputs, card.outputs, strict=True)):
        sinks.append(_sink(card, chain, lins, width, _plain(ref), meta, j, -1))
    for e in chain:
        if e.op == "index_copy_":
            src = e.tensor("source")
            sinks.append(_sink(card, chain, lins, width, src, meta_of(card, chain, src), -1, e.index))
        elif e.op.endswith("_") and e.op not in ("index_copy_",):
            raise Refused(f"an in-place {e.op} the epilogue does not write")
    return sinks


def _sink(card, chain, lins, width, ref, meta, out, write) -> Sink:
    if meta.dtype not in FLOAT_DTYPES:
        raise Refused(f"an output of dtype {meta.dtype}")
    idx = [0] * len(meta.shape)
    hit = _first_product(card, chain, lins, ref, idx)
    if hit is None:
        raise Refused("an output that reads no product")
    col = hit
    return Sink(ref, meta, out, write, col // width, col % width)


def _first_product(card: Card, chain: list[Entry], lins: list[Lin], ref: tuple, idx: list[int]) -> int | None:
    """The concatenated column the value at `idx` reads first (following views exactly and each op's
    first operand that reaches a product)."""
    by_mm = {lin.mm: lin for lin in lins}
    if ref[0] == "in":
        return None
    e = chain[ref[1]]
    if e.index in by_mm:
        return by_mm[e.index].off + idx[-1]
    shape = meta_of(card, chain, ref).shape
    if e.op in _SPLITS:
        src, sub = _split_index(e, ref[2], idx, lambda i, n: i + n)
        return _first_product(card, chain, lins, src, sub)
    if e.op in fused._VIEWS:
        src = _source(e)
        return _first_product(card, chain, lins, src, _py_view_index(e, shape, meta_of(card, chain, src).shape, idx))
    if e.op == "cat":
        d = e.value("dim", 0) % len(shape)
        start = 0
        for part in e.args["tensors"].refs:
            size = meta_of(card, chain, part).shape[d]
            if idx[d] < start + size:
                sub = list(idx)
                sub[d] -= start
                return _first_product(card, chain, lins, part, sub)
            start += size
        return None
    for _, src in e.tensor_args():
        sshape = meta_of(card, chain, src).shape
        lead = len(shape) - len(sshape)
        sub = [0 if n == 1 else idx[lead + d] for d, n in enumerate(sshape)]
        hit = _first_product(card, chain, lins, src, sub)
        if hit is not None:
            return hit
    return None


def _py_view_index(e: Entry, out: tuple, src: tuple, idx: list[int]) -> list[int]:
    """`_Emitter._view_index` on integers."""
    nd_in, nd_out, op = len(src), len(out), e.op
    if op == "unsqueeze":
        d = e.value("dim") % nd_out
        return idx[:d] + idx[d + 1:]
    if op == "slice":
        d = e.value("dim", 0) % nd_in
        start = e.value("start") or 0
        start = max(0, min(src[d], start + src[d] if start < 0 else start))
        return [i + start if k == d else i for k, i in enumerate(idx)]
    if op == "select":
        d = e.value("dim") % nd_in
        return [*idx[:d], e.value("index") % src[d], *idx[d:]]
    if op == "expand":
        lead = nd_out - nd_in
        return [0 if n == 1 else idx[lead + k] for k, n in enumerate(src)]
    if op in ("transpose", "t"):
        d0, d1 = (0, 1) if op == "t" else (e.value("dim0") % nd_in, e.value("dim1") % nd_in)
        out_idx = list(idx)
        out_idx[d0], out_idx[d1] = idx[d1], idx[d0]
        return out_idx
    if op == "permute":
        dims = [d % nd_in for d in e.value("dims")]
        src_idx = [0] * nd_in
        for k, d in enumerate(dims):
            src_idx[d] = idx[k]
        return src_idx
    if op in ("alias", "detach", "lift_fresh"):
        return list(idx)
    flat = 0
    for i, n in zip(idx, out, strict=True):
        flat = flat * n + i
    coords = []
    for n in reversed(src):
        coords.append(flat % n if n else 0)
        flat //= max(n, 1)
    return list(reversed(coords))


# --- the epilogue's and the prologue's index math ------------------------------------------------------------


_SPLITS = ("split", "split_with_sizes", "chunk", "unbind")


def _split_index(e: Entry, k: int, idx: list, shift) -> tuple[tuple, list]:
    """Output `k` of a split is a slice of its source: the source and the index there."""
    src = _source(e)
    if e.op == "unbind":
        d = e.value("dim", 0) % (len(e.outs[0].shape) + 1)
        return src, [*idx[:d], k, *idx[d:]]
    d = e.value("dim", 0) % len(e.outs[0].shape)
    start = sum(o.shape[d] for o in e.outs[:k])
    return src, [shift(i, start) if a == d and start else i for a, i in enumerate(idx)]


class _BlockEmitter(_Emitter):
    """The chain's index math with the block's own sources: a product's value is read from the tile
    (`fp_y(row, column)`), the prologue's reduction from `red`."""

    def __init__(self, card: Card, chain: list[Entry], target: str, plan: GemvPlan):
        super().__init__(card, chain, target, "int64_t")
        self.plan = plan
        self.by_mm = {lin.mm: lin for lin in plan.lins}

    def load_offset(self, slot: int, idx: list[str]) -> str:
        meta = self.card.tensor_inputs()[slot]
        return " + ".join(f"({i}) * {s}" for i, s, n in zip(idx, meta.stride, meta.shape, strict=True)
                          if n != 1 and s != 0) or "0"

    def value(self, ref, idx, out, memo):
        ref = _plain(ref)
        if ref[0] == "t" and ref[1] in self.by_mm:
            lin = self.by_mm[ref[1]]
            name = self.fresh()
            out.append(f"const float {name} = fp_y({idx[0]}, {lin.off} + ({idx[-1]}));")
            return name, self.chain[ref[1]].outs[0].dtype
        if ref[0] == "t" and ref[1] == self.plan.reduction:
            return "red", self.chain[ref[1]].outs[0].dtype
        if ref[0] == "t" and ref[1] == self.plan.epi_reduction:
            return "ered", self.chain[ref[1]].outs[0].dtype
        if ref[0] == "t" and self.chain[ref[1]].op in _SPLITS:
            src, sub = _split_index(self.chain[ref[1]], ref[2], idx, lambda i, n: f"({i} + {n})")
            return self.value(src, sub, out, memo)
        return super().value(ref, idx, out, memo)


def _reduction_term(card: Card, chain: list[Entry], target: str, plan: GemvPlan,
                    at: int | None = None) -> tuple[list[str], str]:
    """Statements and the float expression of the reduction's operand at row `b`, element `k` (the
    prologue's, or the one at chain entry `at`)."""
    e = chain[plan.reduction if at is None else at]
    src = _source(e)
    shape = meta_of(card, chain, src).shape
    idx = ["b"] + ["0"] * (len(shape) - 2) + ["k"]
    stmts: list[str] = []
    value, _ = _BlockEmitter(card, chain, target, plan).value(src, idx, stmts, {})
    return stmts, value


def _x_value(card: Card, chain: list[Entry], target: str, plan: GemvPlan) -> tuple[list[str], str]:
    """Statements and the float expression of the products' input at row `b`, element `k` (uses `red`)."""
    shape = meta_of(card, chain, plan.x_ref).shape
    idx = ["b"] + ["0"] * (len(shape) - 2) + ["k"]
    stmts: list[str] = []
    value, _ = _BlockEmitter(card, chain, target, plan).value(plan.x_ref, idx, stmts, {})
    return stmts, value


def _mean_scale(card: Card, chain: list[Entry], plan: GemvPlan, at: int | None = None) -> str:
    e = chain[plan.reduction if at is None else at]
    n = meta_of(card, chain, _source(e)).shape[-1]
    return f" / {flit(float(n))}" if e.op == "mean" else ""


def _epilogue_stage(card: Card, chain: list[Entry], plan: GemvPlan) -> str:
    """CPU: `ered`, the epilogue's reduction over the row's products (the tile is the whole row)."""
    if plan.epi_reduction < 0:
        return "      const float ered = 0.0f;"
    stmts, value = _reduction_term(card, chain, "cpu", plan, plan.epi_reduction)
    dtype = chain[plan.epi_reduction].outs[0].dtype
    scale = _mean_scale(card, chain, plan, plan.epi_reduction)
    return f"""      float eacc = 0.0f;
      for (int64_t k = 0; k < {plan.width}; ++k) {{
        {' '.join(stmts)}
        eacc += {value};
      }}
      const float ered = fp_round_{dtype}(eacc{scale});"""


def _sink_body(card: Card, chain: list[Entry], target: str, plan: GemvPlan, s: Sink, j: int) -> str:
    """`fp_sink<j>(p, ys, b, f, ...)`: the sink's f-th element of row b, stored."""
    shape = s.meta.shape
    lines = []
    rest = "f"
    names = ["b"] + [f"c{d}_" for d in range(1, len(shape))]
    for d in range(len(shape) - 1, 0, -1):
        lines.append(f"[[maybe_unused]] const int64_t c{d}_ = {rest} % {shape[d]};")
        rest = f"({rest} / {shape[d]})"
    value, _ = _BlockEmitter(card, chain, target, plan).value(s.ref, names, lines, {})
    t = ctype(s.meta.dtype, target)
    if s.out >= 0:
        store = " + ".join(f"{c} * {st}" for c, n, st in zip(names, shape, s.meta.stride, strict=True) if n != 1) or "0"
        lines.append(f"p.out{s.out}[{store}] = fp_st<{t}>({value});")
    else:
        e = chain[s.write]
        slot = e.tensor("self")
        index = e.tensor("index")
        if slot[0] != "in" or index[0] != "in":
            raise Refused("a cache write into a tensor the block made")
        cache = card.tensor_inputs()[slot[1]]
        dim = e.value("dim") % len(cache.shape)
        if len(cache.shape) != len(shape):
            raise Refused("a cache write of another rank")
        c, x = slot[1], index[1]
        lines.append(f"const int64_t slot_ = (int64_t)p.in{x}[({names[dim]}) * p.s{x}[0]];")
        coords = [("slot_" if d == dim else names[d]) for d in range(len(shape))]
        store = " + ".join(f"({co}) * p.s{c}[{d}]" for d, co in enumerate(coords))
        ct = ctype(cache.dtype, target)
        lines.append(f"if (slot_ >= 0 && slot_ < p.n{c}[{dim}]) (({ct}*)p.in{c})[{store}] = fp_st<{ct}>({value});")
    body = "\n  ".join(lines)
    head = f"FP_FN void fp_sink{j}(const fp_args& p, const float* ys, int64_t b, int64_t f, int64_t lo, float ered)"
    return f"\n{head} {{\n  {body}\n}}\n"


def _fields(card: Card, target: str) -> tuple[str, list[str]]:
    """The kernel's argument struct: every input's pointer, sizes (`n<i>`) and strides (`s<i>`) as the
    call's descriptors give them (a cache's length varies across a family: its sizes and strides are read
    at run time), every output's pointer."""
    restrict = " __restrict__" if target == "cuda" else ""
    fields, inits = [], []
    for i, m in enumerate(card.tensor_inputs()):
        t = ctype(m.dtype, target)
        nd = len(m.shape)
        fields.append(f"const {t}* in{i}; int64_t n{i}[{max(nd, 1)}]; int64_t s{i}[{max(nd, 1)}];")
        inits.append(f"p.in{i} = (const {t}*)call->inputs[{i}].data;")  # a written cache is cast at its store
        inits += [f"p.n{i}[{d}] = call->inputs[{i}].sizes[{d}]; p.s{i}[{d}] = call->inputs[{i}].strides[{d}];"
                  for d in range(nd)]
    for j, m in enumerate(card.outputs):
        t = ctype(m.dtype, target)
        fields.append(f"{t}*{restrict} out{j};")
        inits.append(f"p.out{j} = ({t}*)call->outputs[{j}].data;")
    return f"struct fp_args {{ {' '.join(fields)} }};\n", inits


def _y_reader(plan: GemvPlan, tc: int) -> str:
    """`fp_y(b, col)`: the product at row b, concatenated column col, from the tile (NaN off the tile)."""
    cols = plan.parts * tc
    return (f"#define fp_y(row, col) fp_tile(ys, (row), (col), lo)\n"
            f"FP_FN float fp_tile(const float* ys, int64_t row, int64_t col, int64_t lo) {{\n"
            f"  const int64_t part = col / {plan.width}, q = col % {plan.width} - lo;\n"
            f"  return (q >= 0 && q < {tc}) ? ys[row * {cols} + part * {tc} + q] : (0.0f / 0.0f);\n}}\n")


def _unpack(dtype: str) -> str:
    """`fp_unpack(v, f)`: the elements of one 16-byte chunk of `dtype`, as floats (CUDA)."""
    if dtype == "float32":
        return """FP_FN void fp_unpack(const uint4& v, float* f) {
  const float* q = reinterpret_cast<const float*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) f[i] = q[i];
}"""
    pairs = {"bfloat16": ("__nv_bfloat162", "__bfloat1622float2"), "float16": ("__half2", "__half22float2")}
    ptype, conv = pairs[dtype]
    return f"""FP_FN void fp_unpack(const uint4& v, float* f) {{
  const {ptype}* q = reinterpret_cast<const {ptype}*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {{ const float2 two = {conv}(q[i]); f[2 * i] = two.x; f[2 * i + 1] = two.y; }}
}}"""


def _weight_fn(card: Card, plan: GemvPlan, target: str) -> str:
    """`fp_weight(p, col, &bias)`: the weight row of concatenated column `col` (the linears' rows in
    order), its bias (0 without one); `fp_round_mm(v, col)` rounds as that column's `mm` does."""
    chain = entries(card)
    ins = card.tensor_inputs()
    wt = ctype(plan.wdtype, target)
    rows, rounds = [], []
    for lin in plan.lins:
        bias = f"fp_ld(p.in{lin.b}[col - {lin.off}])" if lin.b >= 0 else "0.0f"
        rows.append(f"  if (col < {lin.off + lin.n}) {{ *bias = {bias}; "
                    f"return p.in{lin.w} + (col - {lin.off}) * {ins[lin.w].stride[0]}; }}")
        rounds.append(f"  if (col < {lin.off + lin.n}) return fp_round_{chain[lin.mm].outs[0].dtype}(v);")
    head = f"FP_FN const {wt}* fp_weight(const fp_args& p, int64_t col, float* bias) {{\n"
    tail = "\n  *bias = 0.0f;\n  return 0;\n}\n"
    rnd = "FP_FN float fp_round_mm(float v, int64_t col) {\n" + "\n".join(rounds) + "\n  return v;\n}\n"
    return head + "\n".join(rows) + tail + rnd


# --- CPU render ---------------------------------------------------------------------------------------------


def _render_cpu(card: Card, plan: GemvPlan, tc: int) -> str:
    chain = entries(card)
    struct, inits = _fields(card, "cpu")
    sinks = "".join(_sink_body(card, chain, "cpu", plan, s, j) for j, s in enumerate(plan.sinks))
    ins = card.tensor_inputs()
    wt = ctype(plan.wdtype, "cpu")
    if plan.prologue:
        red_stmts, red_value = _reduction_term(card, chain, "cpu", plan)
        x_stmts, x_value = _x_value(card, chain, "cpu", plan)
        red_dtype = chain[plan.reduction].outs[0].dtype
        stage = f"""    float acc = 0.0f;
    for (int64_t k = 0; k < {plan.k}; ++k) {{
      {' '.join(red_stmts)}
      acc += {red_value};
    }}
    const float red = fp_round_{red_dtype}(acc{_mean_scale(card, chain, plan)});
    (void)red;
    for (int64_t k = 0; k < {plan.k}; ++k) {{
      {' '.join(x_stmts)}
      xs[k] = fp_round_{plan.xdtype}({x_value});
    }}"""
    else:
        xmeta = ins[plan.x_ref[1]]
        rs = xmeta.stride[0]
        stage = f"""    for (int64_t k = 0; k < {plan.k}; ++k) xs[k] = fp_ld(p.in{plan.x_ref[1]}[b * {rs} + k]);"""
    tiles = plan.width // tc
    epilogue = []
    for j, s in enumerate(plan.sinks):
        epilogue.append(f"""        {{ const int64_t f = lo + q - {s.off};
          if (pt == {s.part} && f >= 0 && f < {s.per_row}) fp_sink{j}(p, ys, b, f, lo, ered); }}""")
    code = prelude("cpu") + struct + _weight_fn(card, plan, "cpu") + _y_reader_cpu(plan, tc) + sinks
    body = "\n  ".join(["fp_args p;", *inits]) + f"""
  for (int64_t b = 0; b < {plan.rows}; ++b) {{
    float xs[{plan.k}];
{stage}
    for (int64_t t = 0; t < {tiles}; ++t) {{
      const int64_t lo = t * {tc};
      float ys[{plan.parts * tc}];
      for (int64_t pt = 0; pt < {plan.parts}; ++pt)
        for (int64_t q = 0; q < {tc}; ++q) {{
          const int64_t col = pt * {plan.width} + lo + q;
          float bias = 0.0f;
          const {wt}* w = fp_weight(p, col, &bias);
          float acc = 0.0f;
          for (int64_t k = 0; k < {plan.k}; ++k) acc += xs[k] * fp_ld(w[k]);
          ys[pt * {tc} + q] = fp_round_mm(acc + bias, col);
        }}
{_epilogue_stage(card, chain, plan)}
      (void)ered;
      for (int64_t pt = 0; pt < {plan.parts}; ++pt)
        for (int64_t q = 0; q < {tc}; ++q) {{
{chr(10).join(epilogue)}
        }}
    }}
  }}
  {launch_status("cpu")}"""
    return code + _entry(card, "cpu", body)


def _y_reader_cpu(plan: GemvPlan, tc: int) -> str:
    """On the CPU the tile holds one row: `fp_y` ignores the row (the loop is over one row at a time)."""
    return (f"#define fp_y(row, col) fp_tile(ys, (col), lo)\n"
            f"FP_FN float fp_tile(const float* ys, int64_t col, int64_t lo) {{\n"
            f"  const int64_t part = col / {plan.width}, q = col % {plan.width} - lo;\n"
            f"  return (q >= 0 && q < {tc}) ? ys[part * {tc} + q] : (0.0f / 0.0f);\n}}\n")


# --- CUDA render --------------------------------------------------------------------------------------------


def _render_cuda(card: Card, plan: GemvPlan, params: dict) -> str:
    chain = entries(card)
    tc, warps, cols, unroll = params["tile"], params["warps"], params["cols"], params["unroll"]
    split, ahead = params.get("split", 1), params.get("prefetch", 0)
    name = f"fp_{card.op.split('.')[1]}"  # fp_qkv, fp_gate_up, ...: a profile of the step tells the blocks apart
    struct, inits = _fields(card, "cuda")
    sinks = "".join(_sink_body(card, chain, "cuda", plan, s, j) for j, s in enumerate(plan.sinks))
    ins = card.tensor_inputs()
    wt = ctype(plan.wdtype, "cuda")
    vec = 16 // ins[plan.lins[0].w].itemsize
    threads = warps * 32
    rows = plan.rows
    tile_cols = plan.parts * tc
    tiles = plan.width // tc
    if plan.prologue:
        red_stmts, red_value = _reduction_term(card, chain, "cuda", plan)
        x_stmts, x_value = _x_value(card, chain, "cuda", plan)
        red_dtype = chain[plan.reduction].outs[0].dtype
        stage = f"""  // the prologue: each row's reduction, then the normalised row into shared memory
  for (int b = 0; b < {rows}; ++b) {{
    float acc = 0.0f;
    // unrolled: a block's loads of the row go out together (one round trip, not one per pass)
#pragma unroll 8
    for (int64_t k = threadIdx.x; k < {plan.k}; k += {threads}) {{
      {' '.join(red_stmts)}
      acc += {red_value};
    }}
    acc = fp_block_sum(acc, scratch);
    const float red = fp_round_{red_dtype}(acc{_mean_scale(card, chain, plan)});
    (void)red;
#pragma unroll 8
    for (int64_t k = threadIdx.x; k < {plan.k}; k += {threads}) {{
      {' '.join(x_stmts)}
      xs[b * {plan.k} + k] = fp_st<{wt}>({x_value});
    }}
  }}
  __syncthreads();"""
        x_row = f"xs + b * {plan.k}"
        smem_x = rows * plan.k * ins[plan.lins[0].w].itemsize
    else:
        rs = ins[plan.x_ref[1]].stride[0]
        stage = ""
        x_row = f"p.in{plan.x_ref[1]} + (size_t)b * {rs}"
        smem_x = 0
    unpack = _unpack(plan.wdtype)
    epilogue = []
    for j, s in enumerate(plan.sinks):
        epilogue.append(f"""    {{ const int64_t f = lo + q - {s.off};
      if ({s.part} == part && f >= 0 && f < {s.per_row}) fp_sink{j}(p, ys, b, f, lo, 0.0f); }}""")
    step = 32 * vec * unroll
    # split > 1: a cluster of `split` blocks per tile, block r the r-th slice of K (whole 32-lane chunks);
    # the first folds the others' partial products through distributed shared memory, then rounds.
    per = ceil_div(ceil_div(plan.k, split), 32 * vec) * 32 * vec
    k_lo, k_hi = ("0", str(plan.k)) if split == 1 else (f"rank * {per}", f"min((int64_t){plan.k}, (rank + 1) * {per})")
    partial = "fp_round_mm(acc[j][b] + bias[j], wcol[j])" if split == 1 else "acc[j][b]"
    fold = "" if split == 1 else f"""  cluster.sync();  // every block's partial products in its shared memory
  if (rank == 0) {{
    for (int e = threadIdx.x; e < {rows * tile_cols}; e += {threads}) {{
      float total = 0.0f;
#pragma unroll
      for (int q = 0; q < {split}; ++q) total += *cluster.map_shared_rank(&ys[e], q);
      const int64_t col = fp_col(e % {tile_cols}, lo);
      float bias;
      (void)fp_weight(p, col, &bias);
      ys[e] = fp_round_mm(total + bias, col);
    }}
  }}
  cluster.sync();  // no block leaves while the first reads its shared memory
  if (rank != 0) return;"""
    cluster_head = "" if split == 1 else f"__cluster_dims__({split}, 1, 1) "
    rank_stmt = "" if split == 1 else (
        "  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();\n"
        "  const int64_t rank = cluster.block_rank();")
    kernel = f"""
{"#include <cooperative_groups.h>" if split > 1 else ""}
{unpack}

// the concatenated weight column of the tile's column lc (tile columns run part by part)
FP_FN int64_t fp_col(int lc, int64_t lo) {{ return (int64_t)(lc / {tc}) * {plan.width} + lo + lc % {tc}; }}

FP_FN float fp_block_sum(float v, float* scratch) {{
  v = fp_warp_sum<32>(v);
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < {warps}; ++i) total += scratch[i];
  return total;
}}

__global__ void {cluster_head}__launch_bounds__({threads}) {name}(const fp_args p) {{
  extern __shared__ __align__(16) unsigned char smem_[];
  float* ys = reinterpret_cast<float*>(smem_);
  float* scratch = ys + {rows * tile_cols};
  [[maybe_unused]] {wt}* xs = reinterpret_cast<{wt}*>(scratch + 32);
  const int64_t lo = (int64_t)(blockIdx.x / {split}) * {tc};
{rank_stmt}
  const int64_t k_lo = {k_lo}, k_hi = {k_hi};
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
{_prefetch(plan, tile_cols, cols, vec, unroll, ahead)}{stage}
  // the products: warp `warp` takes columns warp*{cols} + i*{warps * cols} of the tile
  for (int c0 = warp * {cols}; c0 < {tile_cols}; c0 += {warps * cols}) {{
    const {wt}* wrow[{cols}];
    float bias[{cols}];
    int64_t wcol[{cols}];
#pragma unroll
    for (int j = 0; j < {cols}; ++j) {{
      const int lc = min(c0 + j, {tile_cols - 1});  // a column past the tile reads a real row, never stored
      wcol[j] = fp_col(lc, lo);
      wrow[j] = fp_weight(p, wcol[j], &bias[j]);
    }}
    float acc[{cols}][{rows}];
#pragma unroll
    for (int j = 0; j < {cols}; ++j)
#pragma unroll
      for (int b = 0; b < {rows}; ++b) acc[j][b] = 0.0f;
    for (int64_t k0 = k_lo + lane * {vec}; k0 < k_hi; k0 += {step}) {{
      uint4 wv[{unroll}][{cols}];
#pragma unroll
      for (int u = 0; u < {unroll}; ++u)
#pragma unroll
        for (int j = 0; j < {cols}; ++j) {{
          const int64_t kk = k0 + u * {32 * vec};
          wv[u][j] = kk < k_hi ? __ldcs(reinterpret_cast<const uint4*>(wrow[j] + kk)) : make_uint4(0u, 0u, 0u, 0u);
        }}
#pragma unroll
      for (int u = 0; u < {unroll}; ++u) {{
        const int64_t kk = k0 + u * {32 * vec};
        if (kk >= k_hi) break;
#pragma unroll
        for (int b = 0; b < {rows}; ++b) {{
          float x[{vec}];
          fp_unpack(*reinterpret_cast<const uint4*>({x_row} + kk), x);
#pragma unroll
          for (int j = 0; j < {cols}; ++j) {{
            float wf[{vec}];
            fp_unpack(wv[u][j], wf);
#pragma unroll
            for (int e = 0; e < {vec}; ++e) acc[j][b] = fmaf(x[e], wf[e], acc[j][b]);
          }}
        }}
      }}
    }}
#pragma unroll
    for (int j = 0; j < {cols}; ++j)
#pragma unroll
      for (int b = 0; b < {rows}; ++b) acc[j][b] = fp_warp_sum<32>(acc[j][b]);
    if (lane == 0) {{
#pragma unroll
      for (int j = 0; j < {cols}; ++j)
        if (c0 + j < {tile_cols})
#pragma unroll
          for (int b = 0; b < {rows}; ++b) {{
            ys[b * {tile_cols} + c0 + j] = {partial};
          }}
    }}
  }}
  __syncthreads();
{fold}
  // the epilogue: every element whose products lie in this tile
  for (int e = threadIdx.x; e < {rows * tile_cols}; e += {threads}) {{
    const int64_t b = e / {tile_cols}, lc = e % {tile_cols}, part = lc / {tc}, q = lc % {tc};
{chr(10).join(epilogue)}
  }}
}}
"""
    smem = rows * tile_cols * 4 + 32 * 4 + smem_x
    launch = "\n  ".join([
        "fp_args p;", *inits,
        f"if (((uintptr_t)p.in{plan.lins[0].w}) % 16u != 0) return FP_ERR_UNSUPPORTED;",
        *([] if plan.prologue else [f"if (((uintptr_t)p.in{plan.x_ref[1]}) % 16u != 0) return FP_ERR_UNSUPPORTED;"]),
        f"if ({smem} > 48 * 1024 && cudaFuncSetAttribute({name}, cudaFuncAttributeMaxDynamicSharedMemorySize, "
        f"{smem}) != cudaSuccess) return FP_ERR_UNSUPPORTED;",
        f"{name}<<<{tiles * split}u, {threads}, {smem}, stream>>>(p);",
        launch_status("cuda"),
    ])
    code = prelude("cuda") + struct + _weight_fn(card, plan, "cuda") + _y_reader(plan, tc) + sinks + kernel
    return code + _entry(card, "cuda", launch)


def _prefetch(plan: GemvPlan, tile_cols: int, cols: int, vec: int, unroll: int, ahead: int) -> str:
    """The weight chunks of a warp's first `ahead` passes of its first columns, asked of L2 before the
    prologue: they need no x, so DRAM streams them while the prologue reduces the row (a block otherwise
    waits a prologue's round trips before its first weight load goes out)."""
    if not (ahead and plan.prologue):
        return ""
    return f"""  // the weights of this warp's first {ahead} pass(es), fetched into L2 while the prologue runs
  if (warp * {cols} < {tile_cols}) {{
#pragma unroll
    for (int j = 0; j < {cols}; ++j) {{
      float bias_;
      const auto* w = fp_weight(p, fp_col(min(warp * {cols} + j, {tile_cols - 1}), lo), &bias_);
#pragma unroll
      for (int u = 0; u < {ahead * unroll}; ++u) {{
        const int64_t kk = k_lo + lane * {vec} + u * {32 * vec};
        if (kk < k_hi) asm volatile("prefetch.global.L2 [%0];" :: "l"(w + kk));
      }}
    }}
  }}
"""


def _entry(card: Card, target: str, body: str) -> str:
    """The exported entry: an exact card's ABI checks, or a family's (the cache's length read at run time)."""
    if card.family is None:
        return entry(card, target, body)
    return generic.helpers(1) + generic.entry(card, target, body)


# --- the template ---------------------------------------------------------------------------------------------


GEMV_SPLITS = [1, 2, 4, 8]  # blocks of a cluster over K (8: the portable cluster size)
# axes added after GEMV points were first recorded, at the value the kernels had before them
AXES_BEFORE = {"split": 1, "prefetch": 0}


def _tiles(plan: GemvPlan) -> list[int]:
    """Tile widths (columns per part): multiples of the unit that divide a part, at most 512 (a tile's
    products sit in shared memory), at most 8 spread over that range (each about twice the last)."""
    out = [c for c in range(plan.unit, min(plan.width, 512) + 1, plan.unit) if plan.width % c == 0] or [plan.width]
    spread: list[int] = []
    for c in out:
        if not spread or c >= 2 * spread[-1]:
            spread.append(c)
    if out[-1] not in spread:
        spread.append(out[-1])
    return spread[-8:]


class _BlockTemplate(FusedTemplate):
    """A decode block's family varies only its cache's length (and the mask's, over the same slots): every
    render reads the cache's and the mask's sizes and strides from the call, so the member's plan holds
    for the whole family."""

    generic = True

    def family_plan(self, card: Card, plan: Any, target: str):
        fam = card.family
        varying = {i for i, lay in enumerate(fam.inputs) if lay is not None and (
            any(isinstance(n, str) for n in lay.shape) or any(dims for _, dims in lay.stride))}
        cached = set(_cache_slots(card))
        if not varying <= cached:
            return "a block family may vary only its cache's length"
        if any(any(isinstance(n, str) for n in lay.shape) for lay in fam.outputs):
            return "a block family's outputs keep their sizes"
        return FamilyPlan(plan)

    def family_axes(self, plan: FamilyPlan, target: str) -> dict[str, list]:
        return self.axes(plan.base, target)

    def family_default(self, plan: FamilyPlan, axes: dict[str, list], target: str) -> dict:
        return self.pick_default(plan.base, axes, target)

    def family_emit(self, card: Card, plan: FamilyPlan, target: str, params: dict) -> str:
        return self.emit(card, plan.base, target, params)


def _cache_slots(card: Card) -> list[int]:
    """Inputs whose sizes follow the cache's length: the written caches, an attention's keys, values and
    mask."""
    block = _block_of(card)
    slots = list(card.fusion.writes)
    rule = block.get("masked_reads")
    if rule:
        slots += [rule["mask"], *rule["inputs"]]
    return slots


class GemvBlockTemplate(_BlockTemplate):
    """The projection blocks (module docstring): prologue, products, epilogue in one launch."""

    def plan(self, card: Card, target: str):
        if card.op not in BLOCK_OPS:
            raise Refused("not a decode block")
        return gemv_plan(card)

    def axes(self, plan: GemvPlan, target: str) -> dict[str, list]:
        tiles = _tiles(plan)
        if target == "cpu":
            return {"tile": [plan.width] if plan.epi_reduction >= 0 else tiles}
        if plan.epi_reduction >= 0:
            return {}
        vec = 16 // {"float32": 4, "float16": 2, "bfloat16": 2}[plan.wdtype]
        if plan.k % vec:
            return {}
        # split: blocks of a cluster over K (a projection of few columns and a long K, such as the down
        # projection, otherwise streams each column through one warp)
        # ascending, so that a point's neighbours (`templates.neighbours`) lie on both sides of it
        axes = {"tile": tiles, "warps": [4, 8, 16], "cols": [1, 2, 4], "unroll": [2, 4, 8], "split": GEMV_SPLITS}
        # prefetch: passes of weights asked of L2 before the prologue (a block with one; `_prefetch`)
        return {**axes, "prefetch": [0, 1, 2]} if plan.prologue else axes

    def pick_default(self, plan: GemvPlan, axes: dict[str, list], target: str) -> dict:
        tiles = axes["tile"]
        # enough tiles to cover the SMs of a large GPU a few times, each at least a few columns wide
        want = max(plan.unit, plan.width // 256) if target == "cuda" else tiles[-1]
        tile = min(tiles, key=lambda c: abs(c - want))
        if target == "cpu":
            return {"tile": tile}
        # 8 warps, each a few columns of the tile per pass (the warps of a narrow tile one column each)
        slots = tile * plan.parts
        cols = 4 if slots >= 64 else 2 if slots >= 16 else 1
        point = {"tile": tile, "warps": 8, "cols": cols, "unroll": 4, "split": 1}
        return {**point, "prefetch": 1} if "prefetch" in axes else point

    def render(self, card: Card, target: str, params: dict) -> str:
        # a point recorded before an axis existed (a resumed workspace's parent) renders as the kernel it
        # named then: the axis at the value that kernel had
        if target == "cuda" and params:
            space = self.space(card, target)
            params = {**{k: v for k, v in AXES_BEFORE.items() if k in space}, **params}
        return super().render(card, target, params)

    def emit(self, card: Card, plan: GemvPlan, target: str, params: dict) -> str:
        if target == "cpu":
            return _render_cpu(card, plan, params["tile"])
        return _render_cuda(card, plan, params)

    def supports(self, card: Card, target: str, arch: str | None = None) -> str | None:
        reason = super().supports(card, target, arch)
        if reason is None and target == "cuda" and not self._cuda_axes(card):
            return "a norm over the products' row (one tile per row) or K no multiple of a 16-byte chunk"
        return reason

    def _cuda_axes(self, card: Card) -> dict:
        try:
            return self.axes(gemv_plan(card), "cuda")
        except Refused:
            return {}

    def needs(self, card: Card, target: str, params: dict) -> Needs:
        return super().needs(card, target, params)


TEMPLATES = (
    GemvBlockTemplate("blocks.gemv", "blocks", ("cuda", "cpu"), BLOCK_OPS),
)


# --- attention over the static cache ----------------------------------------------------------------------------

# The attention calls a block may hold, and the name of each one's mask argument.
_SDPA_MASK = {"_scaled_dot_product_flash_attention_for_cpu": "attn_mask", "scaled_dot_product_attention": "attn_mask",
              "_scaled_dot_product_efficient_attention": "attn_bias",
              "_scaled_dot_product_cudnn_attention": "attn_bias", "_scaled_dot_product_flash_attention": None}


@dataclass(frozen=True)
class AttentionPlan:
    rows: int
    heads: int  # query heads as the attention call sees them (dim 1 of its query)
    queries: int  # query positions per head (dim 2)
    kv_heads: int
    slots: int  # cache length
    dim: int  # head size
    scale: float
    q_slot: int
    k_slot: int
    v_slot: int
    mask_slot: int  # -1: no mask
    mask_bool: bool
    dtype: str  # of the attention's output
    out_dtype: str  # of the block's output
    # an eager attention (`softmax(score(q @ kᵀ)) @ v`): the softmax's input, whose score maths the kernel
    # runs on each product; the view of the first product read as that product; the queries as the first
    # product reads them ([rows * heads, queries, dim]); the mask's value that excludes a slot
    score_ref: tuple = ()
    dot_at: int = -1
    q_ref: tuple = ()
    dead: float = -math.inf
    # a boolean mask converted inside the block: the values it becomes where true and where false. PyTorch's
    # cuDNN attention excludes with -65504 (in bf16 -65536), not -inf: a slot so excluded still counts where
    # the scores are larger than that, so the kernel reads it as stock does; only -inf is never read
    mask_values: tuple[float, float] = (0.0, -math.inf)


def attention_plan(card: Card) -> AttentionPlan:
    block = _block_of(card)
    if block.get("kind") != "attention":
        raise Refused("not an attention block")
    chain = entries(card)
    if block.get("eager"):
        return _eager_plan(card, chain, block)
    calls = [e for e in chain if e.op in _SDPA_MASK]
    if len(calls) != 1:
        raise Refused("not one attention call")
    e = calls[0]
    if e.value("dropout_p", 0.0) not in (0, 0.0) or e.value("is_causal", False):
        raise Refused("dropout or a causal flag")
    q, k, v = (e.tensor(n) for n in ("query", "key", "value"))
    (k_slot, k_rep), (v_slot, v_rep) = (_kv_input(card, chain, r) for r in (k, v))
    mask_name = _SDPA_MASK[e.op]
    mask = e.tensor(mask_name) if mask_name else None
    converted = mask is not None and mask[0] == "t"
    values = (0.0, -math.inf)
    if converted:
        values = _mask_values(chain, mask)
        mask = _boolean_mask(chain, mask)
    ins = card.tensor_inputs()
    qmeta, kmeta, vmeta = meta_of(card, chain, q), ins[k_slot], ins[v_slot]
    rows, heads, queries, dim = qmeta.shape
    _, kv_heads, slots, kdim = kmeta.shape
    if kdim != dim or tuple(vmeta.shape) != tuple(kmeta.shape) or heads % kv_heads or k_rep != v_rep:
        raise Refused("keys, values and queries of unmatched shapes")
    seen = meta_of(card, chain, k).shape[1]  # the key heads the attention call is given
    if seen != kv_heads * k_rep or (heads != seen and not e.value("enable_gqa", True)):
        raise Refused("grouped queries the call does not group (no enable_gqa, no repeat)")
    q_slot = _identity_input(card, chain, q)
    out_ref = _plain(card.fusion.outputs[0])
    if len(card.outputs) != 1 or _identity_source(card, chain, out_ref) != (e.index, 0):
        raise Refused("an output that is not the attention's result in its own order")
    mask_slot, mask_bool = -1, False
    if mask is not None:
        mmeta = ins[mask[1]]
        if len(mmeta.shape) != 4 or mmeta.shape[-1] != slots:
            raise Refused("a mask not over the cache's slots")
        mask_slot, mask_bool = mask[1], mmeta.dtype == "bool"
        if converted != mask_bool:
            raise Refused("a boolean mask used as it is, or a float one converted")
    scale = e.value("scale")
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    dtype = e.outs[0].dtype
    if dtype not in FLOAT_DTYPES or card.outputs[0].dtype != dtype:
        raise Refused("an attention of another dtype")
    return AttentionPlan(rows, heads, queries, kv_heads, slots, dim, scale, q_slot, k_slot, v_slot, mask_slot,
                         mask_bool, dtype, card.outputs[0].dtype, mask_values=values)


def _eager_plan(card: Card, chain: list[Entry], block: dict) -> AttentionPlan:
    """An eager attention: two `bmm`s around one softmax over the slots; keys and values from the cache
    (through `repeat_kv`), the keys transposed for the first product."""
    bmms = [e for e in chain if e.op == "bmm"]
    softmax = [e for e in chain if e.op in ("_softmax", "softmax")]
    if len(bmms) != 2 or len(softmax) != 1:
        raise Refused("not two products around one softmax")
    first, second = bmms
    sm = softmax[0]
    score_ref = _plain(_source(sm))
    rows4 = meta_of(card, chain, score_ref).shape
    if len(rows4) != 4 or sm.value("dim") % 4 != 3:
        raise Refused("a softmax not over the slots of [rows, heads, queries, slots]")
    dot_at = _merged_view(chain, (("t", first.index, 0)), rows4)
    k_slot, k_rep = _kv_input(card, chain, _unbatched(card, chain, first.tensor("mat2"), True))
    v_slot, v_rep = _kv_input(card, chain, _unbatched(card, chain, second.tensor("mat2"), False))
    probs = _unbatched(card, chain, second.tensor("self"), False, casts=True)
    if probs != ("t", sm.index, 0):
        raise Refused("the second product does not read the softmax's probabilities")
    ins = card.tensor_inputs()
    rows, heads, queries, slots = rows4
    q_ref = _plain(first.tensor("self"))
    dim = meta_of(card, chain, q_ref).shape[-1]
    kmeta, vmeta = ins[k_slot], ins[v_slot]
    kv_heads = kmeta.shape[1]
    if tuple(kmeta.shape) != (rows, kv_heads, slots, dim) or tuple(vmeta.shape) != tuple(kmeta.shape) \
            or heads != kv_heads * k_rep or k_rep != v_rep:
        raise Refused("keys, values and queries of unmatched shapes")
    out_at = _merged_view(chain, ("t", second.index, 0), (rows, heads, queries, dim))
    if len(card.outputs) != 1 or _identity_source(card, chain, _plain(card.fusion.outputs[0]), out_at) != (out_at, 0):
        raise Refused("an output that is not the attention's result in its own order")
    mask_slot, dead = -1, -math.inf
    rule = block.get("masked_reads")
    if rule:
        mask_slot = rule["mask"]
        dead = _lowest(ins[mask_slot].dtype)
    dtype = second.outs[0].dtype
    if dtype not in FLOAT_DTYPES or card.outputs[0].dtype not in FLOAT_DTYPES:
        raise Refused("an attention of another dtype")
    return AttentionPlan(rows, heads, queries, kv_heads, slots, dim, 1.0, _q_input(card, chain, q_ref), k_slot, v_slot,
                         mask_slot, False, dtype, card.outputs[0].dtype, score_ref, dot_at, q_ref, dead)


def _lowest(dtype: str) -> float:
    """The lowest finite value of a float dtype: the additive mask's "excluded" (transformers' eager masks)."""
    return {"float32": -3.4028234663852886e38, "float16": -65504.0, "bfloat16": -3.3895313892515355e38}[dtype]


def _merged_view(chain: list[Entry], ref: tuple, shape4: tuple) -> int:
    """The one view of a `bmm`'s [a * b, m, n] output as [a, b, m, n] (its only reader): its entry."""
    readers = [e for e in chain if any(_plain(r) == ref for _, r in e.tensor_args())]
    if len(readers) != 1 or readers[0].op not in _RESHAPES or tuple(readers[0].outs[0].shape) != tuple(shape4):
        raise Refused("a product not read as [rows, heads, ...] alone")
    return readers[0].index


def _unbatched(card: Card, chain: list[Entry], ref: tuple, transposed: bool, casts: bool = False) -> tuple:
    """What a `bmm` operand [rows * heads, m, n] is a batched view of: the [rows, heads, m, n] value before
    its merge, a same-shape expand, (`transposed`) one transpose of the last two dims, and (`casts`)
    dtype casts."""
    ref = _plain(ref)
    e = chain[ref[1]] if ref[0] == "t" else None
    if e is None or e.op not in _RESHAPES:
        raise Refused("a product's operand that is not a merge of [rows, heads]")
    ref = _plain(_source(e))
    src = meta_of(card, chain, ref).shape
    if len(src) != 4 or tuple(e.outs[0].shape) != (src[0] * src[1], src[2], src[3]):
        raise Refused("a product's operand that is not a merge of [rows, heads]")
    while ref[0] == "t":
        e = chain[ref[1]]
        same = e.op == "expand" and tuple(meta_of(card, chain, _source(e)).shape) == tuple(e.outs[0].shape)
        if same or (casts and e.op in ("_to_copy", "to")):
            ref = _plain(_source(e))
        elif transposed and e.op == "transpose" and {e.value("dim0") % 4, e.value("dim1") % 4} == {2, 3}:
            ref, transposed = _plain(_source(e)), False
        else:
            break
    if transposed:
        raise Refused("keys not transposed for the product")
    return ref


def _q_input(card: Card, chain: list[Entry], ref: tuple) -> int:
    """The input the queries come from (through the views of the first product's operand)."""
    while ref[0] == "t":
        e = chain[ref[1]]
        if e.op not in fused._VIEWS:
            raise Refused(f"the queries reach the block through a {e.op}")
        ref = _plain(_source(e))
    return ref[1]


def _kv_input(card: Card, chain: list[Entry], ref: tuple) -> tuple[int, int]:
    """(input slot, times each head is repeated): keys or values as the cache holds them, given to the
    attention directly or through `repeat_kv` (unsqueeze, expand, a copy, a reshape to heads x repeats),
    which the kernel does not copy: query head h reads the cache's head h // (query heads per key head)."""
    ref = _plain(ref)
    rep = 1
    while ref[0] == "t":
        e = chain[ref[1]]
        if e.op == "expand":
            src = meta_of(card, chain, _source(e)).shape
            out = e.outs[0].shape
            if len(out) != 5 or src[2] != 1:
                raise Refused("keys or values expanded otherwise than repeat_kv does")
            rep *= out[2]
        elif e.op not in ("unsqueeze", "clone", "contiguous", "view", "_unsafe_view", "reshape", "alias", "detach"):
            raise Refused(f"keys or values made by {e.op}")
        ref = _plain(_source(e))
    return ref[1], rep


def _boolean_mask(chain: list[Entry], ref: tuple) -> tuple:
    """The boolean input behind the mask SDPA is given, converted inside the block (`where(mask, 0, -inf)`
    as SDPA converts a boolean mask, or its backends' variants): the kernel reads the boolean as "attend
    where true", and the verifier holds it to what the conversion really computes."""
    todo, seen = [_plain(ref)], set()
    while todo:
        r = todo.pop()
        if r in seen:
            continue
        seen.add(r)
        if r[0] == "in":
            continue
        e = chain[r[1]]
        if e.op not in ("where", "logical_not", "masked_fill", "masked_fill_", "zeros_like", "full_like", "zeros",
                        "scalar_tensor", "_to_copy", "to", "expand", "view", "unsqueeze", "alias", "detach"):
            raise Refused(f"a mask made by {e.op}")
        todo.extend(_plain(x) for _, x in e.tensor_args())
    bools = [r for r in seen if r[0] == "in"]
    if len(bools) != 1:
        raise Refused("a mask made from other than one boolean input")
    return bools[0]


def _mask_values(chain: list[Entry], ref: tuple) -> tuple[float, float]:
    """(where true, where false): the values a boolean mask becomes in the conversion SDPA is given, read from
    its `where(mask, a, b)` of two scalar constants, each rounded to its dtype as the chain makes it."""
    import torch

    ref = _plain(ref)
    e = chain[ref[1]]
    while e.op in ("expand", "view", "unsqueeze", "alias", "detach") and _plain(_source(e))[0] == "t":
        e = chain[_plain(_source(e))[1]]
    if e.op != "where":
        raise Refused(f"a boolean mask converted by {e.op}, not by a where of two constants")
    values = []
    for name in ("self", "other"):
        src = _plain(e.tensor(name))
        made = chain[src[1]] if src[0] == "t" else None
        if made is None or made.op != "scalar_tensor":
            raise Refused("a boolean mask converted by a where of other than two constants")
        dtype = getattr(torch, made.value("dtype") or "float32")
        values.append(float(torch.tensor(float(made.value("s")), dtype=dtype).item()))
    return values[0], values[1]


def _row_flat(meta: TensorMeta) -> bool:
    """Whether a row's elements lie contiguously in row-major order (the batch stride aside)."""
    expect = 1
    for n, st in zip(reversed(meta.shape[1:]), reversed(meta.stride[1:]), strict=True):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


def _identity_input(card: Card, chain: list[Entry], ref: tuple) -> int:
    """The input slot a value is, through views that keep every row's element order; else refuse."""
    ref = _plain(ref)
    while ref[0] == "t":
        e = chain[ref[1]]
        if e.op not in ("view", "_unsafe_view", "reshape", "alias", "detach", "expand") or ref[2] != 0:
            raise Refused(f"the query reaches the block through a {e.op}")
        ref = _plain(_source(e))
    meta = card.tensor_inputs()[ref[1]]
    if not _row_flat(meta):
        raise Refused("a query not contiguous within its row")
    return ref[1]


def _identity_source(card: Card, chain: list[Entry], ref: tuple, stop: int = -1) -> tuple[int, int] | None:
    """(entry, output) an output is, through views that keep each row's element order (transposes of a
    size-1 axis included), up to entry `stop`: checked on every index of one row."""
    meta = meta_of(card, chain, ref)
    per_row = math.prod(meta.shape[1:])
    for f in range(per_row):
        idx, rest = [], f
        for n in reversed(meta.shape[1:]):
            idx.append(rest % n)
            rest //= n
        idx = [0, *reversed(idx)]
        r, at = _plain(ref), idx
        while r[0] == "t" and chain[r[1]].op in fused._VIEWS and r[1] != stop:
            e = chain[r[1]]
            src = _plain(_source(e))
            at = _py_view_index(e, meta_of(card, chain, r).shape, meta_of(card, chain, src).shape, at)
            r = src
        if r[0] != "t":
            return None
        shape = meta_of(card, chain, r).shape
        flat = 0
        for i, n in zip(at[1:], shape[1:], strict=True):
            flat = flat * n + i
        if flat != f:
            return None
    return r[1], r[2]


def _mask_term(card: Card, plan: AttentionPlan, b: str, head: str, query: str, slot: str) -> str:
    """The additive mask term of (row, head, query, slot) as a float expression (0 without a mask)."""
    if plan.mask_slot < 0:
        return "0.0f"
    m = plan.mask_slot
    meta = card.tensor_inputs()[m]
    coords = [(b, 0), (head, 1), (query, 2), (slot, 3)]
    off = " + ".join(f"({c}) * p.s{m}[{d}]" for c, d in coords if meta.shape[d] != 1 or d == 3)
    read = f"p.in{m}[{off}]"
    attend, excluded = plan.mask_values
    return f"({read} ? {flit(attend)} : {flit(excluded)})" if plan.mask_bool else f"fp_ld({read})"


class _AttentionEmitter(_Emitter):
    """The eager attention's score maths and query views: the first product's value is the kernel's
    `dot`, rounded as the `bmm` rounds; inputs are read with the call's strides (a mask's length follows the
    cache's across a family)."""

    def __init__(self, card: Card, chain: list[Entry], target: str, plan: AttentionPlan):
        super().__init__(card, chain, target, "int64_t")
        self.plan = plan

    def load_offset(self, slot: int, idx: list[str]) -> str:
        meta = self.card.tensor_inputs()[slot]
        return " + ".join(f"({i}) * p.s{slot}[{d}]" for d, (i, n) in enumerate(zip(idx, meta.shape, strict=True))
                          if n != 1) or "0"

    def value(self, ref, idx, out, memo):
        ref = _plain(ref)
        if ref == ("t", self.plan.dot_at, 0):
            dtype = self.chain[ref[1]].outs[0].dtype
            return f"fp_round_{dtype}(dot)", dtype
        return super().value(ref, idx, out, memo)


def _attention_fns(card: Card, plan: AttentionPlan, target: str) -> str:
    """`fp_q` (a query element), `fp_dead` (whether the mask excludes a slot: never read) and `fp_score`
    (the softmax's input from a product `dot`) at (row, head, query, slot or dim)."""
    args = "const fp_args& p, int64_t b, int64_t h, int64_t l"
    if not plan.score_ref:
        q = plan.q_slot
        mask = _mask_term(card, plan, "b", "h", "l", "s")
        q_body = f"return fp_ld(p.in{q}[b * p.s{q}[0] + (h * {plan.queries} + l) * {plan.dim} + d]);"
        dead_body = f"return {mask} == -FP_INF;" if plan.mask_slot >= 0 else "return false;"
        score_body = f"return dot * {flit(plan.scale)} + {mask};"
    else:
        chain = entries(card)
        stmts: list[str] = []
        name, _ = _AttentionEmitter(card, chain, target, plan).value(
            plan.q_ref, [f"(b * {plan.heads} + h)", "l", "d"], stmts, {})
        q_body = " ".join([*stmts, f"return {name};"])
        stmts = []
        name, _ = _AttentionEmitter(card, chain, target, plan).value(plan.score_ref, ["b", "h", "l", "s"], stmts, {})
        score_body = " ".join([*stmts, f"return {name};"])
        dead_body = "return false;"
        if plan.mask_slot >= 0:
            dead_body = f"return {_mask_term(card, plan, 'b', 'h', 'l', 's')} <= {flit(plan.dead)};"
    return (f"FP_FN float fp_q({args}, int64_t d) {{ {q_body} }}\n"
            f"FP_FN bool fp_dead({args}, int64_t s) {{ {dead_body} }}\n"
            f"FP_FN float fp_score({args}, int64_t s, float dot) {{ {score_body} }}\n")


def _attention_cpu(card: Card, plan: AttentionPlan) -> str:
    """Each query row: one pass over the live slots with a running max (as the CUDA render)."""
    ins = card.tensor_inputs()
    k, v = plan.k_slot, plan.v_slot
    kt, ot = (ctype(m.dtype, "cpu") for m in (ins[k], card.outputs[0]))
    group = plan.heads // plan.kv_heads
    struct, inits = _fields(card, "cpu")
    out = card.outputs[0]
    body = "\n  ".join(["fp_args p;", *inits]) + f"""
  const int64_t slots = p.n{k}[2];
  for (int64_t b = 0; b < {plan.rows}; ++b)
  for (int64_t h = 0; h < {plan.heads}; ++h)
  for (int64_t l = 0; l < {plan.queries}; ++l) {{
    const int64_t kh = h / {group};
    float qv[{plan.dim}];
    for (int64_t d = 0; d < {plan.dim}; ++d) qv[d] = fp_q(p, b, h, l, d);
    float top = -FP_INF, total = 0.0f, acc[{plan.dim}];
    for (int64_t d = 0; d < {plan.dim}; ++d) acc[d] = 0.0f;
    for (int64_t s = 0; s < slots; ++s) {{
      if (fp_dead(p, b, h, l, s)) continue;  // a slot the mask excludes is never read
      const {kt}* kr = p.in{k} + b * p.s{k}[0] + kh * p.s{k}[1] + s * p.s{k}[2];
      float dot = 0.0f;
      for (int64_t d = 0; d < {plan.dim}; ++d) dot += qv[d] * fp_ld(kr[d * p.s{k}[3]]);
      const float x = fp_score(p, b, h, l, s, dot);
      const float next = fp_max_nan(top, x);
      const float keep = top == -FP_INF ? 0.0f : std::exp(top - next), pj = std::exp(x - next);
      const {kt}* vr = p.in{v} + b * p.s{v}[0] + kh * p.s{v}[1] + s * p.s{v}[2];
      for (int64_t d = 0; d < {plan.dim}; ++d) acc[d] = acc[d] * keep + pj * fp_ld(vr[d * p.s{v}[3]]);
      total = total * keep + pj;
      top = next;
    }}
    {ot}* o = p.out0 + b * {out.stride[0]} + (h * {plan.queries} + l) * {plan.dim};
    // no live slot: 0, as the flash kernels give (the math path would give NaN; a served step always
    // has one, its own)
    for (int64_t d = 0; d < {plan.dim}; ++d) o[d] = fp_st<{ot}>(total > 0.0f ? acc[d] / total : 0.0f);
  }}
  {launch_status("cpu")}"""
    return prelude("cpu") + struct + _attention_fns(card, plan, "cpu") + _entry(card, "cpu", body)


def _attention_cuda(card: Card, plan: AttentionPlan, params: dict) -> str:
    ins = card.tensor_inputs()
    k, v = plan.k_slot, plan.v_slot
    kt, ot = (ctype(m.dtype, "cuda") for m in (ins[k], card.outputs[0]))
    warps, splits = params["warps"], params.get("splits", 1)
    threads = warps * 32
    group = plan.heads // plan.kv_heads
    nq = group * plan.queries  # query rows sharing one key/value head
    per_lane = ceil_div(plan.dim, 32)
    if plan.mask_slot >= 0 and any(ins[plan.mask_slot].shape[d] != 1 for d in (1, 2)):
        raise Refused("a mask that differs between heads or queries")
    struct, inits = _fields(card, "cuda")
    head = f"kh * {group} + r / {plan.queries}", f"r % {plan.queries}"  # query row r's head and position
    out = card.outputs[0]
    size = ins[k].itemsize
    vec = 16 // size if plan.dim * size % 16 == 0 else 0
    kchunks = plan.dim // vec if vec else 1
    kernel = "#include <cooperative_groups.h>\n" + _unpack(ins[k].dtype) + f"""
// 0 where slot s (of `slots`) is read for key/value head kh; -inf where the mask excludes it or it lies past
FP_FN float fp_open(const fp_args& p, int64_t b, int64_t kh, int64_t s, int64_t slots) {{
  return s < slots && !fp_dead(p, b, kh * {group}, 0, s) ? 0.0f : -FP_INF;
}}

// One cluster of {splits} blocks per (row, key/value head), each block a {splits}th of the cache's slots (the
// split of flash-decoding: at batch 1 a model's few key/value heads alone would leave most SMs idle);
// warp w of a block takes its slots w*32.., stepping by {threads}. Lane j of a warp scores slot base+j
// against every query row of the group, then the warp folds the 32 slots into each row's running max, sum
// and output (lane j keeps output dims j, j+32, ...). A chunk of 32 slots the mask excludes is skipped
// whole: its keys and values are never read. The warps' partial results fold into the block's, and the
// cluster's first block folds the blocks' through distributed shared memory: one launch, no workspace.
__global__ void __cluster_dims__({splits}, 1, 1) __launch_bounds__({threads}) fp_attention(const fp_args p) {{
  __shared__ float qs[{nq}][{plan.dim}];
  __shared__ float wm[{warps}][{nq}], wl[{warps}][{nq}];
  __shared__ float wo[{warps}][{nq}][{plan.dim}];
  __shared__ float bm[{nq}], bl[{nq}], bo[{nq}][{plan.dim}];
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const int64_t split = cluster.block_rank(), unit = blockIdx.x / {splits};
  const int64_t b = unit / {plan.kv_heads}, kh = unit % {plan.kv_heads};
  const int64_t per = ((p.n{k}[2] + {splits - 1}) / {splits} + 31) / 32 * 32;
  const int64_t first = split * per, slots = p.n{k}[2] < first + per ? p.n{k}[2] : first + per;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int64_t base = first + warp * 32;
  // the mask of a warp's next chunk is read a chunk ahead: the first one's read goes out before the queries
  // are staged, so neither waits for the other
  float next = fp_open(p, b, kh, base + lane, slots);
  for (int i = threadIdx.x; i < {nq * plan.dim}; i += {threads}) {{
    const int r = i / {plan.dim}, d = i % {plan.dim};
    qs[r][d] = fp_q(p, b, {head[0]}, {head[1]}, d);
  }}
  __syncthreads();
  float m[{nq}], l[{nq}], o[{nq}][{per_lane}];
#pragma unroll
  for (int r = 0; r < {nq}; ++r) {{
    m[r] = -FP_INF; l[r] = 0.0f;
#pragma unroll
    for (int e = 0; e < {per_lane}; ++e) o[r][e] = 0.0f;
  }}
  const {kt}* kb = p.in{k} + b * p.s{k}[0] + kh * p.s{k}[1];
  const {kt}* vb = p.in{v} + b * p.s{v}[0] + kh * p.s{v}[1];
  const bool kvec = {"true" if vec else "false"} && p.s{k}[3] == 1 && (p.s{k}[2] * (int64_t)sizeof({kt})) % 16 == 0
                    && reinterpret_cast<uintptr_t>(kb) % 16 == 0;
  for (; base < slots; base += {threads}) {{
    const int64_t s = base + lane;
    const float add = next;  // 0: the slot is read; -inf: the mask excludes it (the same for every head and query)
    next = fp_open(p, b, kh, base + {threads} + lane, slots);
    if (__all_sync(0xffffffffu, add == -FP_INF)) continue;
    const {kt}* kr = kb + s * p.s{k}[2];
    // the slot's key row (16-byte chunks) and the chunk's value rows are loaded before any is used: one round
    // trip for the chunk; a slot the mask excludes, or past the live length, is not read (its weight is 0,
    // its value 0, never NaN)
    uint4 kc[{kchunks}];
#pragma unroll
    for (int c = 0; c < {kchunks}; ++c)
      kc[c] = kvec && add != -FP_INF ? reinterpret_cast<const uint4*>(kr)[c] : make_uint4(0u, 0u, 0u, 0u);
    float vv[32][{per_lane}];
#pragma unroll
    for (int j = 0; j < 32; ++j) {{
      const bool live = __shfl_sync(0xffffffffu, add, j) != -FP_INF;
      const {kt}* vr = vb + (base + j) * p.s{v}[2];
#pragma unroll
      for (int e = 0; e < {per_lane}; ++e) {{
        const int d = lane + 32 * e;
        vv[j][e] = live && d < {plan.dim} ? fp_ld(vr[d * p.s{v}[3]]) : 0.0f;
      }}
    }}
    float sc[{nq}];
#pragma unroll
    for (int r = 0; r < {nq}; ++r) sc[r] = 0.0f;
    if (add != -FP_INF) {{
      if (kvec) {{
#pragma unroll
        for (int c = 0; c < {kchunks}; ++c) {{
          float kf[{vec or 1}];
          fp_unpack(kc[c], kf);
#pragma unroll
          for (int e = 0; e < {vec or 1}; ++e)
#pragma unroll
            for (int r = 0; r < {nq}; ++r) sc[r] = fmaf(qs[r][c * {vec or 1} + e], kf[e], sc[r]);
        }}
      }} else {{
        for (int d = 0; d < {plan.dim}; ++d) {{
          const float kd = fp_ld(kr[d * p.s{k}[3]]);
#pragma unroll
          for (int r = 0; r < {nq}; ++r) sc[r] = fmaf(qs[r][d], kd, sc[r]);
        }}
      }}
    }}
#pragma unroll
    for (int r = 0; r < {nq}; ++r) {{
      const float x = add == -FP_INF ? -FP_INF : fp_score(p, b, {head[0]}, {head[1]}, s, sc[r]);
      const float top = fmaxf(m[r], fp_warp_max<32>(x));
      const float pj = x == -FP_INF ? 0.0f : __expf(x - top);
      const float keep = m[r] == -FP_INF ? 0.0f : __expf(m[r] - top);
      l[r] = l[r] * keep + fp_warp_sum<32>(pj);
#pragma unroll
      for (int e = 0; e < {per_lane}; ++e) o[r][e] *= keep;
      m[r] = top;
      sc[r] = pj;
    }}
#pragma unroll
    for (int j = 0; j < 32; ++j)
#pragma unroll
      for (int r = 0; r < {nq}; ++r) {{
        const float pj = __shfl_sync(0xffffffffu, sc[r], j);
#pragma unroll
        for (int e = 0; e < {per_lane}; ++e) o[r][e] = fmaf(pj, vv[j][e], o[r][e]);
      }}
  }}
#pragma unroll
  for (int r = 0; r < {nq}; ++r) {{
    if (lane == 0) {{ wm[warp][r] = m[r]; wl[warp][r] = l[r]; }}
#pragma unroll
    for (int e = 0; e < {per_lane}; ++e) {{
      const int d = lane + 32 * e;
      if (d < {plan.dim}) wo[warp][r][d] = o[r][e];
    }}
  }}
  __syncthreads();
  for (int i = threadIdx.x; i < {nq * plan.dim}; i += {threads}) {{
    const int r = i / {plan.dim}, d = i % {plan.dim};
    float top = -FP_INF;
    for (int w = 0; w < {warps}; ++w) top = fmaxf(top, wm[w][r]);
    float total = 0.0f, acc = 0.0f;
    for (int w = 0; w < {warps}; ++w) {{
      if (wm[w][r] == -FP_INF) continue;
      const float f = __expf(wm[w][r] - top);
      total += wl[w][r] * f;
      acc += wo[w][r][d] * f;
    }}
    bo[r][d] = acc;
    if (d == 0) {{ bm[r] = top; bl[r] = total; }}
  }}
  cluster.sync();  // every block's partial result in its shared memory
  if (split == 0) {{
    for (int i = threadIdx.x; i < {nq * plan.dim}; i += {threads}) {{
      const int r = i / {plan.dim}, d = i % {plan.dim};
      float top = -FP_INF;
      for (int q = 0; q < {splits}; ++q) top = fmaxf(top, *cluster.map_shared_rank(&bm[r], q));
      float total = 0.0f, acc = 0.0f;
      for (int q = 0; q < {splits}; ++q) {{
        const float mq = *cluster.map_shared_rank(&bm[r], q);
        if (mq == -FP_INF) continue;
        const float f = __expf(mq - top);
        total += *cluster.map_shared_rank(&bl[r], q) * f;
        acc += *cluster.map_shared_rank(&bo[r][d], q) * f;
      }}
      p.out0[b * {out.stride[0]} + (kh * {nq} + r) * {plan.dim} + d] = fp_st<{ot}>(total > 0.0f ? acc / total : 0.0f);
    }}
  }}
  cluster.sync();  // no block leaves while the first reads its shared memory
}}
"""
    launch = "\n  ".join(["fp_args p;", *inits,
                          f"fp_attention<<<{plan.rows * plan.kv_heads * splits}u, {threads}, 0, stream>>>(p);",
                          launch_status("cuda")])
    return prelude("cuda") + struct + _attention_fns(card, plan, "cuda") + kernel + _entry(card, "cuda", launch)


CACHE_SPLITS = [1, 2, 4, 8]  # blocks of a cluster over the cache's slots (8: the portable cluster size)


class AttentionBlockTemplate(_BlockTemplate):
    """The attention block (module docstring)."""

    def plan(self, card: Card, target: str):
        if card.op not in BLOCK_OPS:
            raise Refused("not a decode block")
        plan = attention_plan(card)
        if target == "cuda":
            nq = plan.heads // plan.kv_heads * plan.queries
            if (nq * plan.dim * 4) * (1 + 16 + 1) + 2 * 17 * nq * 4 > 96 * 1024:
                raise Refused("too many query rows per key/value head for shared memory")
        return plan

    def axes(self, plan: AttentionPlan, target: str) -> dict[str, list]:
        return {} if target == "cpu" else {"warps": [4, 8, 16], "splits": CACHE_SPLITS}

    def pick_default(self, plan, axes, target):
        if target == "cpu":
            return {}
        # enough clusters to reach about half of a large GPU's SMs; a split of a short cache has few slots
        # (a family's cache reaches thousands), and an empty split only folds nothing in
        units = plan.rows * plan.kv_heads
        splits = next((n for n in CACHE_SPLITS if units * n >= 64), CACHE_SPLITS[-1])
        return {"warps": 4, "splits": splits}

    def emit(self, card: Card, plan: AttentionPlan, target: str, params: dict) -> str:
        if target == "cpu":
            return _attention_cpu(card, plan)
        return _attention_cuda(card, plan, params)


TEMPLATES = (*TEMPLATES, AttentionBlockTemplate("blocks.attention", "blocks", ("cuda", "cpu"), BLOCK_OPS))


# --- the cache's write slot ------------------------------------------------------------------------------------


def index_plan(card: Card) -> tuple[int, int]:
    """(slots written, counter bump) of a cache_index block: `arange(n) + counter`, `counter.add_(m)`."""
    if _block_of(card).get("kind") != "cache_index":
        raise Refused("not a cache_index block")
    chain = [e for e in entries(card) if e.op not in ("detach", "alias")]
    if [e.op for e in chain] != ["arange", "add", "add_"]:
        raise Refused("not arange, add, add_")
    arange, add, bump = chain
    made = {chain[0].index}
    for e in entries(card):
        if e.op in ("detach", "alias") and _plain(_source(e)) == ("t", next(iter(made)), 0):
            made = {e.index}
    n, m = arange.value("end"), bump.value("other")
    if not isinstance(n, int) or not isinstance(m, int) or add.value("alpha", 1) != 1 or bump.value("alpha", 1) != 1:
        raise Refused("a bump or length that is not an integer")
    if _plain(add.tensor("self")) != ("t", next(iter(made)), 0) or _plain(add.tensor("other")) != ("in", 0) \
            or _plain(bump.tensor("self")) != ("in", 0):
        raise Refused("not the counter's own slot and bump")
    if card.tensor_inputs()[0].dtype != "int64" or card.outputs[0].dtype != "int64" or card.outputs[0].shape != (n,):
        raise Refused("not an int64 counter")
    return n, m


class IndexBlockTemplate(_BlockTemplate):
    """The slots a step's cache write takes, and the counter bumped, in one launch (one thread each)."""

    def plan(self, card: Card, target: str):
        if card.op not in BLOCK_OPS:
            raise Refused("not a decode block")
        return index_plan(card)

    def axes(self, plan, target):
        return {}

    def emit(self, card: Card, plan, target: str, params: dict) -> str:
        n, m = plan
        struct, inits = _fields(card, target)
        if target == "cpu":
            body = "\n  ".join(["fp_args p;", *inits,
                                 "const int64_t c = p.in0[0];",
                                 f"for (int64_t i = 0; i < {n}; ++i) p.out0[i * {card.outputs[0].stride[0]}] = c + i;",
                                 f"((int64_t*)p.in0)[0] = c + {m};", launch_status("cpu")])
            return prelude("cpu") + struct + _entry(card, "cpu", body)
        kernel = f"""
__global__ void fp_index(const fp_args p) {{
  const int64_t c = p.in0[0];
  __syncthreads();  // every thread has read the counter before one of them bumps it
  for (int64_t i = threadIdx.x; i < {n}; i += blockDim.x) p.out0[i * {card.outputs[0].stride[0]}] = c + i;
  if (threadIdx.x == 0) ((int64_t*)p.in0)[0] = c + {m};
}}
"""
        body = "\n  ".join(["fp_args p;", *inits, "fp_index<<<1, 32, 0, stream>>>(p);", launch_status("cuda")])
        return prelude("cuda") + struct + kernel + _entry(card, "cuda", body)


TEMPLATES = (*TEMPLATES, IndexBlockTemplate("blocks.index", "blocks", ("cuda", "cpu"), BLOCK_OPS))
