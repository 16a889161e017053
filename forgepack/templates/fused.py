"""Fused templates: one kernel for a module-level chain of aten calls (fusion cards, `forgepack.fusion`).

A fusion card's `chain` is the list of aten calls it replaces, with tensor arguments as refs to the
card's inputs or to earlier calls. Three programs cover the chains the reference models make:

- `fused.pointwise`: elementwise ops (unary, binary with broadcasting, casts, pow, eval batch norm) on
  inputs seen through strided views (unsqueeze, expand, view...): GPT-2's tanh GELU, act(gate) * up,
  BN + ReLU, add + ReLU. One pointwise job (`elementwise.render_pointwise`) whose expression is the
  whole chain: 16-byte vector loads where the layout allows, one store.
- `fused.rows`: elementwise ops and reductions over the last dim with keepdim (mean, sum, amax):
  HF RMSNorm with its casts, Gemma's (1 + w), LayerNorm or softmax written as chains. A row program
  (`rowreduce.render_rows`): the row is read once into registers when it fits.
- `fused.indexed`: any chain of elementwise ops, views (slice, unsqueeze, expand, transpose, view) and
  cats: rotary embedding of q and k (rotate_half is slice, neg, cat) in one launch for both outputs,
  rotary cos/sin tables. Every output element evaluates the chain through index math; scalar loads.
  On the cpu the search chooses how the elements are walked (`_cpu_walks`: one flat loop decoding each
  index, or nested loops split where a cat switches inputs), whether outputs of one shape share a walk
  (`_cpu_functions`: the cos and sin tables then cost one sincosf an element) and the loops' unroll hint.

Family fusion cards (the same chain at several sizes, `forgepack.families`): `fused.rows` renders the
row program with the row length fixed and the rows read at run time; `fused.pointwise` the size-generic
pointwise job where the chain reads its inputs directly; `fused.indexed` a family of the outermost
axis alone (a decode step's rotary at any batch) as the batch-1 member's kernel once per batch index,
and any other family (a prefill's rotary over batch and tokens) with the dims and strides read at run
time (`IndexedFusion`).

Numerics: each op computes in float as aten's opmath does and rounds to its own output dtype, so the
kernel rounds exactly where the chain rounds (HF Llama casts back to the input dtype before the weight
multiply; GPT-2's GELU rounds to fp16 after each of its eight ops). Transcendentals are the same
functions aten calls (tanhf, expf, ...), reductions accumulate in float.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

from forgepack import families
from forgepack.cards import DTYPE_SIZES, Card, ChainArg, TensorMeta
from forgepack.templates import elementwise as ew
from forgepack.templates import generic
from forgepack.templates.common import (
    FLOATS,
    TARGETS,
    FamilyPlan,
    Template,
    View,
    ceil_div,
    coalesce,
    ctype,
    decode_lines,
    device_mismatch,
    entry,
    flit,
    index_type,
    itype_for,
    launch_status,
    layout_refusal,
    memory_order,
    prelude,
)
from forgepack.templates.rowreduce import Param, RowProgram, RowTemplate, Step, build_rows

PATTERNS = ("rmsnorm", "layernorm", "softmax", "rotary", "gated_act", "bn_act", "add_act", "gelu_tanh", "chain")
FUSION_OPS = tuple(f"fusion.{p}.default" for p in PATTERNS)
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")

_BINARY = {"add", "sub", "mul", "div", "add_", "sub_", "mul_", "div_"}
_IDENTITY = {"_to_copy", "clone", "contiguous", "alias", "detach", "lift_fresh", "to"}
_BN = {"native_batch_norm": "eps", "_native_batch_norm_legit_no_training": "eps", "cudnn_batch_norm": "epsilon"}
_VIEWS = {"unsqueeze", "squeeze", "slice", "select", "expand", "transpose", "t", "permute", "view", "_unsafe_view",
          "reshape", "alias", "detach", "_reshape_alias", "expand_as", "view_as", "flatten"}
_REDUCE = {"mean": "sum", "sum": "sum", "amax": "max"}


class Refused(Exception):
    """The chain holds something this template cannot compute exactly; the message says what."""


# --- the chain ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    index: int
    op: str  # base name, e.g. "mul"
    overload: str
    args: dict[str, ChainArg]  # by name, from the card's chain entry
    order: tuple[str, ...]  # argument names in schema order
    outs: tuple[TensorMeta, ...]

    def value(self, name: str, default=None):
        a = self.args.get(name)
        return default if a is None or a.kind != "value" else a.value

    def tensor(self, name: str) -> tuple | None:
        a = self.args.get(name)
        return a.ref if a is not None and a.kind == "tensor" else None

    def tensor_args(self) -> list[tuple[str, tuple]]:
        return [(n, self.args[n].ref) for n in self.order if self.args[n].kind == "tensor"]


def entries(card: Card) -> list[Entry]:
    out = []
    for i, e in enumerate(card.chain):
        _, op, overload = e.op.split(".")
        out.append(Entry(i, op, overload, {a.name: a for a in e.args}, tuple(a.name for a in e.args), e.outs))
    return out


def meta_of(card: Card, chain: list[Entry], ref: tuple) -> TensorMeta:
    if ref[0] == "in":
        return card.tensor_inputs()[ref[1]]
    return chain[ref[1]].outs[ref[2]]


def _used(card: Card, chain: list[Entry]) -> set[int]:
    """Chain entries an output depends on (an unused `empty`, BN's saved statistics, are not)."""
    need, todo = set(), [r for r in card.fusion.outputs if r[0] == "t"]
    while todo:
        r = todo.pop()
        if r[1] in need:
            continue
        need.add(r[1])
        for a in chain[r[1]].args.values():
            refs = [a.ref] if a.kind == "tensor" else a.refs
            todo.extend(x for x in refs if x[0] == "t")
    return need


# --- elementwise semantics (shared by all three programs) ------------------------------------------------


def _sub(expr: str, operand: str) -> str:
    """An elementwise template expression of `a0` applied to `operand`."""
    return re.sub(r"\ba0\b", f"({operand})", expr)


def _round(expr: str, dtype: str) -> str:
    if dtype not in COMPUTE_DTYPES:
        raise Refused(f"an intermediate of dtype {dtype}")
    return expr if dtype == "float32" else f"fp_round_{dtype}({expr})"


def elementwise_expr(e: Entry, operands: dict[str, tuple[str, str]], target: str, bn_form: str | None = None) -> str:
    """Float expression of `e`'s first output, rounded to its dtype; `operands`: tensor argument name ->
    (float expression, dtype). Raises `Refused` for an op it does not know exactly."""
    out = e.outs[0].dtype if e.outs else None
    if out not in COMPUTE_DTYPES:
        raise Refused(f"{e.op} gives {out}")
    op = e.op
    if op in _IDENTITY:
        (x, _), = [operands[n] for n, _ in e.tensor_args()]
        return _round(x, out)
    if op == "gelu":
        x, dt = operands["self"]
        mode = e.value("approximate", "none")
        if mode not in ("none", "tanh"):
            raise Refused(f"gelu approximation {mode!r}")
        expr = ew._GELU_TANH if mode == "tanh" else ew._GELU_ERF
        if mode == "none" and target == "cpu" and dt != "float16":
            raise Refused("aten's CPU erf GELU is position-dependent at +inf")
        return _round(_sub(expr, x), out)
    if op == "pow" and e.overload == "Tensor_Scalar":
        x, dt = operands["self"]
        exponent = e.value("exponent")
        if isinstance(exponent, bool) or not isinstance(exponent, int | float):
            raise Refused("pow exponent is not a real number")
        return _round(_sub(ew._pow_expr(exponent, dt, target), x), out)
    key = f"aten.{op}.default"
    if key in ew._UNARY:
        x, _ = operands["self"]
        return _round(_sub(ew._UNARY[key], x), out)
    if op in _BINARY:
        return _round(_binary(e, operands, out, target), out)
    if op in _BN:
        # aten's CUDA kernels and cuDNN compute (x - mean) * invstd * w + b, the CPU kernel x * scale + shift:
        # they differ where a statistic or parameter is not finite (inf - inf): follow the target's formula
        form = bn_form or ("sub_mul" if target == "cuda" else "scale_shift")
        return _round(_batch_norm(e, operands, form), out)
    raise Refused(f"{op}.{e.overload} is not served by the fused templates")


def _binary(e: Entry, operands: dict[str, tuple[str, str]], out: str, target: str) -> str:
    terms = []
    for name in ("self", "other"):
        a = e.args.get(name)
        if a is None:
            raise Refused(f"{e.op} without {name}")
        if a.kind == "tensor":
            x, dt = operands[name]
            terms.append(ew._round_to(dt, x, out))
        elif a.kind == "value" and isinstance(a.value, int | float) and not isinstance(a.value, bool):
            if name == "self":
                raise Refused("a scalar self")
            terms.append(flit(a.value))
        else:
            raise Refused(f"{e.op} operand {name} is {a.kind}")
    x, y = terms
    base = e.op.rstrip("_")
    alpha = e.value("alpha", 1)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise Refused("alpha is not a real number")
    exact = target == "cuda" and out == "float32"
    if base in ("add", "sub"):
        if float(alpha) != 1.0:
            return f"({x} {'+' if base == 'add' else '-'} ({flit(alpha)} * {y}))"  # one aten kernel: as it is
        return _arith("+" if base == "add" else "-", x, y, exact)
    if base == "mul":
        return _arith("*", x, y, exact)
    if e.value("rounding_mode") is not None:
        raise Refused("div with a rounding mode")
    if e.args["other"].kind == "value" and target == "cuda":
        return _arith("*", x, f"(1.0f / {y})", exact)  # aten's div_true_kernel_cuda multiplies by the reciprocal
    return _arith("/", x, y, exact)


_INTRINSICS = {"+": "__fadd_rn", "-": "__fsub_rn", "*": "__fmul_rn", "/": "__fdiv_rn"}


def _arith(op: str, x: str, y: str, exact: bool) -> str:
    """`x op y`; on CUDA with a float32 result through the round-to-nearest intrinsics, which nvcc never
    contracts into an FMA with a neighbouring op: each aten op rounds its own result."""
    return f"{_INTRINSICS[op]}({x}, {y})" if exact else f"({x} {op} {y})"


def _batch_norm(e: Entry, operands: dict[str, tuple[str, str]], form: str) -> str:
    training = e.value("training", False)
    if training is not False:
        raise Refused("training-mode batch norm")
    if "running_mean" not in operands or "running_var" not in operands:
        raise Refused("batch norm without running statistics")
    eps = e.value(_BN[e.op])
    if isinstance(eps, bool) or not isinstance(eps, int | float):
        raise Refused("batch norm eps is not a number")
    x = operands["input"][0]
    m, v = operands["running_mean"][0], operands["running_var"][0]
    w = operands["weight"][0] if "weight" in operands else "1.0f"
    b = operands["bias"][0] if "bias" in operands else "0.0f"
    invstd = f"(1.0f / sqrtf({v} + {flit(eps)}))"
    if form == "sub_mul":
        return f"((({x} - {m}) * {invstd}) * {w} + {b})"
    return f"({x} * ({invstd} * {w}) + ({b} - {m} * ({invstd} * {w})))"


# --- the template base --------------------------------------------------------------------------------


class FusedTemplate(Template):
    """Serves fusion cards (which the operator templates refuse) on both targets."""

    def _checked_plan(self, card: Card, target: str):
        if target not in self.targets or target not in TARGETS:
            return f"{self.name} has no {target} kernel"
        if card.kind != "fusion" or not card.chain or not card.fusion:
            return f"{self.name} serves fusion cards"
        reason = device_mismatch(card, target)
        if reason:
            return reason
        if not card.outputs or any(o.numel == 0 for o in card.outputs):
            return "empty output"
        reason = layout_refusal(card)
        if reason:
            return reason
        if card.scalars():
            return "fusion cards take no scalars"
        if card.family is not None and not self.generic:
            return f"{self.name} has no size-generic kernel for a shape family"
        try:
            plan = self.plan(card, target)
        except Refused as err:
            return str(err)
        # a family: the representative member's plan, checked to hold for every member
        return plan if card.family is None else self.family_plan(card, plan, target)


# --- fused.pointwise -----------------------------------------------------------------------------------


def _leaf_view(card: Card, chain: list[Entry], ref: list, shape: tuple[int, ...]) -> tuple[int, View]:
    """(input slot, its view over `shape`) for an input seen directly or through view ops."""
    offset = 0
    meta = meta_of(card, chain, ref)
    while ref[0] == "t":
        e = chain[ref[1]]
        if e.op not in _VIEWS:
            raise Refused(f"a {e.op} result used as an input")
        (_, src), = e.tensor_args()
        offset += meta.storage_offset - meta_of(card, chain, src).storage_offset
        ref = src
    base = card.tensor_inputs()[ref[1]]
    if offset < 0:
        raise Refused("a view starting before its input")
    lo, hi = _extent(meta, offset)
    if hi >= base.span() and base.span() > 0 and not (lo == 0 and hi == 0):
        raise Refused("a view reaching outside its input")
    view = ew.broadcast_view(meta, shape)
    if view is None:
        raise Refused(f"an input of shape {meta.shape} does not broadcast to {shape}")
    return ref[1], View(meta.dtype, view.strides, offset, base.storage_offset)


def _extent(meta: TensorMeta, offset: int) -> tuple[int, int]:
    hi = offset + sum((n - 1) * s for n, s in zip(meta.shape, meta.stride, strict=True) if n > 0)
    return offset, hi


def _channel_view(card: Card, chain: list[Entry], ref: list, shape: tuple[int, ...]) -> tuple[int, View]:
    """A [C] batch-norm parameter seen along dim 1 of the iteration shape."""
    meta = meta_of(card, chain, ref)
    if ref[0] != "in" or len(meta.shape) != 1 or len(shape) < 2 or meta.shape[0] != shape[1]:
        raise Refused("batch norm parameters are not [C] inputs")
    strides = tuple(meta.stride[0] if d == 1 and shape[1] != 1 else 0 for d in range(len(shape)))
    return ref[1], View(meta.dtype, strides, 0, meta.storage_offset)


class PointwiseFusion(FusedTemplate):
    """The chain as one expression over the output's elements (see the module docstring). A family
    whose chain reads its inputs directly (no view between an input and its use, no batch norm) gets
    the size-generic pointwise render: each input broadcast to the output's run-time sizes."""

    generic = True

    def family_plan(self, card, plan, target):
        chain = entries(card)
        used = _used(card, chain)
        if any(e.op in _VIEWS or e.op in _BN for e in chain if e.index in used):
            return "a family chain with views or batch norm (its index math is the captured sizes')"
        job = next(iter(plan.values()))[0]
        ins = card.tensor_inputs()
        generic_job = generic.GenericJob(0, card.outputs[0].dtype, job.in_slots,
                                         tuple(ins[s].dtype for s in job.in_slots), job.expr)
        return FamilyPlan(plan, (generic_job,))

    family_axes = ew.PointwiseTemplate.family_axes
    family_default = ew.PointwiseTemplate.family_default
    family_emit = ew.PointwiseTemplate.family_emit

    def plan(self, card: Card, target: str):
        if len(card.outputs) != 1:
            raise Refused("pointwise fusion has one output")
        chain = entries(card)
        if card.outputs[0].dtype not in COMPUTE_DTYPES:
            raise Refused(f"output dtype {card.outputs[0].dtype}")
        forms = ("sub_mul", "scale_shift") if target == "cuda" else ("scale_shift",)
        if not any(e.op in _BN for e in chain):
            forms = forms[:1]
        return {form: [_pointwise_job(card, chain, target, form)] for form in forms}

    def axes(self, plan, target):  # on the cpu: the elementwise loops' `unroll` and strips (`vec`)
        first = next(iter(plan.values()))
        axes = ew.pointwise_axes(first, target)
        return {"form": list(plan), **axes} if len(plan) > 1 else axes

    def pick_default(self, plan, axes, target):
        first = next(iter(plan.values()))
        params = ew.pointwise_default(first, {k: v for k, v in axes.items() if k != "form"}, target)
        return {"form": next(iter(plan)), **params} if len(plan) > 1 else params

    def emit(self, card, plan, target, params):
        jobs = plan[params.pop("form", next(iter(plan)))]
        return ew.render_pointwise(card, target, jobs, params)


def _pointwise_job(card: Card, chain: list[Entry], target: str, form: str) -> ew.Job:
    """The chain as one job over the output's elements: each input view a job input `a<k>`, each op
    a statement of one lambda that is the job's expression."""
    out = card.outputs[0]
    shape = out.shape
    leaves: dict[tuple[int, View], int] = {}

    def leaf(slot_view: tuple[int, View]) -> str:
        if slot_view not in leaves:
            leaves[slot_view] = len(leaves)
        return f"a{leaves[slot_view]}"

    stmts, names = [], {}
    used = _used(card, chain)
    for e in chain:
        if e.index not in used or e.op in _VIEWS:
            continue
        operands = {}
        for name, ref in e.tensor_args():
            dtype = meta_of(card, chain, ref).dtype
            if dtype not in COMPUTE_DTYPES and not (e.op in _IDENTITY and dtype in ew.CAST_SOURCES):
                raise Refused(f"a {dtype} operand")
            if ref[0] == "t" and ref[1] in names and ref[2] == 0:
                operands[name] = (names[ref[1]], dtype)
            elif ref[0] == "t" and chain[ref[1]].op not in _VIEWS:
                raise Refused(f"{chain[ref[1]].op}'s output {ref[2]} is used")
            elif e.op in _BN and name != "input":
                operands[name] = (leaf(_channel_view(card, chain, ref, shape)), dtype)
            else:
                operands[name] = (leaf(_leaf_view(card, chain, ref, shape)), dtype)
        stmts.append(f"const float t{e.index} = {elementwise_expr(e, operands, target, form)};")
        names[e.index] = f"t{e.index}"
    result = card.fusion.outputs[0]
    if result[0] != "t" or result[1] not in names or result[2] != 0:
        raise Refused("the output is not computed by the chain")
    expr = "([&]() -> float { " + " ".join(stmts) + f" return {names[result[1]]}; }}())"
    out_view = View(out.dtype, tuple(0 if n == 1 else s for n, s in zip(shape, out.stride, strict=True)), 0,
                    out.storage_offset)
    views = sorted(leaves, key=leaves.get)
    cshape, cviews = coalesce(shape, [out_view, *[v for _, v in views]], reorder=True)
    return ew.Job(cshape, cviews[0], 0, tuple(cviews[1:]), tuple(s for s, _ in views), expr)


# --- fused.rows --------------------------------------------------------------------------------------------


class RowsFusion(FusedTemplate, RowTemplate):  # the row engine's axes, defaults and renderer
    """Elementwise ops and last-dim reductions as a row program (see the module docstring)."""

    def plan(self, card: Card, target: str):
        chain = entries(card)
        used = _used(card, chain)
        out0 = card.outputs[0]
        if len(out0.shape) == 0:
            raise Refused("a 0-dim output")
        n = out0.shape[-1]
        rows_shape = out0.shape[:-1]
        ins = card.tensor_inputs()
        full = [i for i, m in enumerate(ins) if m.shape == out0.shape]
        if len(full) != 1:
            raise Refused("row fusion needs exactly one input of the output's shape")
        x_slot = full[0]
        params: list[Param] = []
        param_of: dict[int, str] = {}
        elem: dict[tuple, str] = {}  # ("in", slot) or ("t", index) -> per-element float expression
        row: dict[int, str] = {}  # entry index -> per-row scalar name
        steps: list[Step] = []

        def input_expr(slot: int) -> str:
            if slot == x_slot:
                return "x"
            if slot not in param_of:
                m = ins[slot]
                cols = [(size, s) for size, s in zip(m.shape, m.stride, strict=True) if size != 1]
                if m.numel != n or len(cols) != 1 or len(m.shape) > len(out0.shape) or m.shape[-1] != n:
                    raise Refused("a second input that is not per column")
                stride = cols[0][1]
                index = None if stride == 1 else f"col * {stride}u"
                params.append(Param(slot, m.dtype, index, m.storage_offset))
                param_of[slot] = f"w{len(params) - 1}"
            return param_of[slot]

        def operand(ref: list) -> tuple[str, str, bool]:
            """(expression, dtype, per-row?)"""
            dtype = meta_of(card, chain, ref).dtype
            if ref[0] == "in":
                return input_expr(ref[1]), dtype, False
            if ref[2] != 0:
                raise Refused(f"output {ref[2]} of {chain[ref[1]].op} is used")
            if ref[1] in row:
                return row[ref[1]], dtype, True
            if ("t", ref[1]) in elem:
                return elem[("t", ref[1])], dtype, False
            raise Refused(f"{chain[ref[1]].op} is not computable per element or per row")

        for e in chain:
            if e.index not in used:
                continue
            shape = e.outs[0].shape if e.outs else ()
            if e.op in _REDUCE:
                self._reduce(e, n, out0, operand, steps, row, target)
                continue
            if e.op in _VIEWS:
                (_, src), = e.tensor_args()
                expr, _, per_row = operand(src)
                if e.outs[0].shape != meta_of(card, chain, src).shape:
                    raise Refused(f"a {e.op} that changes the shape")
                if per_row:
                    row[e.index] = expr
                else:
                    elem[("t", e.index)] = expr
                continue
            operands, per_row = {}, True
            for name, ref in e.tensor_args():
                expr, dtype, is_row = operand(ref)
                operands[name] = (expr, dtype)
                per_row = per_row and is_row
            expr = elementwise_expr(e, operands, target)
            if per_row and shape and shape[-1] == 1:
                name = f"r{e.index}_"
                steps.append(Step("let", name, expr))
                row[e.index] = name
            elif shape and shape[-1] == n:
                elem[("t", e.index)] = expr
            else:
                raise Refused(f"{e.op} of shape {shape} is neither per row nor per element")
        outs, writes = [], []
        for j, (ref, meta) in enumerate(zip(card.fusion.outputs, card.outputs, strict=True)):
            if meta.shape != out0.shape:
                raise Refused("row fusion writes outputs of the input's shape")
            expr, _, per_row = operand(ref)
            if per_row:
                raise Refused("a per-row output")
            outs.append((j, meta))
            writes.append(Step("write", expr=expr, slot=j))
        built = build_rows(ins[x_slot], x_slot, 1, outs, [])
        if isinstance(built, str):
            raise Refused(built)
        outer, xv, out_views, _, size, rows = built
        if size != n or math.prod(rows_shape) != rows:
            raise Refused("rows do not match")
        if not any(s.kind == "reduce" for s in steps):
            raise Refused("no reduction: a pointwise chain")
        return RowProgram(rows, n, outer, xv, x_slot, out_views, (), tuple(params), tuple(steps + writes))

    @staticmethod
    def _reduce(e: Entry, n: int, out0: TensorMeta, operand, steps: list[Step], row: dict, target: str) -> None:
        nd = len(out0.shape)
        dims = e.value("dim")
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        if [d % nd for d in dims] != [nd - 1] or not e.value("keepdim", False):
            raise Refused(f"{e.op} over dims {dims} (keepdim={e.value('keepdim')}): only the last dim, keepdim")
        if e.value("dtype") is not None:
            raise Refused(f"{e.op} with a dtype")
        (_, src), = e.tensor_args()
        expr, _, per_row = operand(src)
        if per_row:
            raise Refused(f"{e.op} of a per-row value")
        acc = f"s{e.index}_"
        steps.append(Step("reduce", acc, expr, _REDUCE[e.op]))
        value = acc
        if e.op == "mean":
            # aten's CUDA mean multiplies by a float 1/n; its CPU mean divides by n.
            value = f"__fmul_rn({acc}, {flit(1.0 / n)})" if target == "cuda" else f"{acc} / {flit(n)}"
        name = f"r{e.index}_"
        steps.append(Step("let", name, _round(value, e.outs[0].dtype)))
        row[e.index] = name


# --- fused.indexed -------------------------------------------------------------------------------------


def _fixed(n: int | str, what: str) -> int:
    """A size the index math needs as a constant: a family dim there is refused."""
    if not isinstance(n, int):
        raise Refused(f"{what} along a varying axis")
    return n


class _Emitter:
    """Statements computing a chain value at an index, through views and cats (index math).

    Sizes come from `shape` (an exact card's: ints; `_FamilyEmitter`'s: an int or a dim name per axis)
    and an input's element offset from `load_offset`, so the same index math serves both."""

    def __init__(self, card: Card, chain: list[Entry], target: str, itype: str):
        self.card, self.chain, self.target, self.itype = card, chain, target, itype
        self.count = 0
        self.cuts: dict[int, set[int]] = {}  # dim -> where a cat switches inputs along its bare coordinate

    def fresh(self) -> str:
        self.count += 1
        return f"v{self.count}_"

    def shape(self, ref) -> tuple:
        return meta_of(self.card, self.chain, ref).shape

    def load_offset(self, slot: int, idx: list[str]) -> str:
        meta = self.card.tensor_inputs()[slot]
        return " + ".join(f"({i}) * {s}u" for i, s, n in zip(idx, meta.stride, meta.shape, strict=True)
                          if n != 1 and s != 0) or "0u"

    def value(self, ref: list, idx: list[str], out: list[str], memo: dict) -> tuple[str, str]:
        """(float variable holding the value of `ref` at index `idx`, dtype); statements go to `out`."""
        key = (tuple(ref), tuple(idx))
        meta = meta_of(self.card, self.chain, ref)
        if key in memo:
            return memo[key], meta.dtype
        if ref[0] == "in":
            name = self.fresh()
            out.append(f"const float {name} = fp_ld(p.in{ref[1]}[{self.load_offset(ref[1], idx)}]);")
            memo[key] = name
            return name, meta.dtype
        e = self.chain[ref[1]]
        if ref[2] != 0:
            raise Refused(f"output {ref[2]} of {e.op} is used")
        if e.op in _VIEWS:
            (_, src), = e.tensor_args()
            name, dt = self.value(src, self._view_index(e, self.shape(ref), self.shape(src), idx), out, memo)
        elif e.op == "cat":
            name = self._cat(e, self.shape(ref), idx, out, memo)
            dt = meta.dtype
        else:
            operands = {}
            for arg_name, src in e.tensor_args():
                operands[arg_name] = self.value(src, self._broadcast_index(e, self.shape(src), self.shape(ref),
                                                                           arg_name, idx), out, memo)
            name = self.fresh()
            out.append(f"const float {name} = {elementwise_expr(e, operands, self.target)};")
            dt = meta.dtype
        memo[key] = name
        return name, dt

    @staticmethod
    def _broadcast_index(e: Entry, src: tuple, out: tuple, arg_name: str, idx: list[str]) -> list[str]:
        if e.op in _BN and arg_name != "input":
            if len(src) != 1 or len(out) < 2:
                raise Refused("batch norm parameters are not [C]")
            return [idx[1]]
        lead = len(out) - len(src)
        if lead < 0:
            raise Refused(f"{e.op} operand of higher rank than its output")
        return ["0" if n == 1 else idx[lead + d] for d, n in enumerate(src)]

    def _view_index(self, e: Entry, out: tuple, src: tuple, idx: list[str]) -> list[str]:
        nd_in, nd_out = len(src), len(out)
        op = e.op
        if out == src and op not in ("transpose", "permute", "t", "slice", "select"):
            return idx
        if op == "unsqueeze":
            d = e.value("dim") % nd_out
            return idx[:d] + idx[d + 1:]
        if op == "slice":
            d = e.value("dim", 0) % nd_in
            size, step = _fixed(src[d], "a slice"), e.value("step", 1)
            start = e.value("start")
            start = 0 if start is None else start
            start = max(0, min(size, start + size if start < 0 else start))
            if step != 1:
                raise Refused("a strided slice")
            return [f"({i} + {start}u)" if k == d and start else i for k, i in enumerate(idx)]
        if op == "select":
            d = e.value("dim") % nd_in
            index = e.value("index") % _fixed(src[d], "a select")
            return [*idx[:d], f"{index}u", *idx[d:]]
        if op == "expand":
            lead = nd_out - nd_in
            return ["0" if n == 1 else idx[lead + k] for k, n in enumerate(src)]
        if op in ("transpose", "t"):
            d0, d1 = (0, 1) if op == "t" else (e.value("dim0") % nd_in, e.value("dim1") % nd_in)
            out_idx = list(idx)
            out_idx[d0], out_idx[d1] = idx[d1], idx[d0]
            return out_idx
        if op == "permute":
            dims = [d % nd_in for d in e.value("dims")]
            src_idx = [""] * nd_in
            for k, d in enumerate(dims):
                src_idx[d] = idx[k]
            return src_idx
        if op in ("view", "_unsafe_view", "reshape", "_reshape_alias", "flatten", "squeeze"):
            return self._relinearise(out, src, idx)
        if op in ("alias", "detach"):
            return idx
        raise Refused(f"view {op}")

    def _relinearise(self, out_shape, in_shape, idx: list[str]) -> list[str]:
        """Row-major element order is what view/reshape keep: linear index, then the input's coords."""
        if [n for n in out_shape if n != 1] == [n for n in in_shape if n != 1]:
            kept = [i for i, n in zip(idx, out_shape, strict=True) if n != 1]
            it = iter(kept)
            return ["0" if n == 1 else next(it) for n in in_shape]
        terms, stride = [], 1
        for i, n in reversed(list(zip(idx, out_shape, strict=True))):
            if n != 1:
                terms.append(f"({i}) * {stride}u" if stride != 1 else f"({i})")
            stride *= _fixed(n, "a reshape")
        lin = " + ".join(reversed(terms)) or "0u"
        coords, rest = [], f"({self.itype})({lin})"
        for n in reversed(in_shape):
            coords.append("0" if n == 1 else f"(({rest}) % {_fixed(n, 'a reshape')}u)")
            rest = f"(({rest}) / {n}u)"
        return list(reversed(coords))

    def _cat(self, e: Entry, shape: tuple, idx: list[str], out: list[str], memo: dict) -> str:
        refs = e.args["tensors"].refs
        nd = len(shape)
        d = e.value("dim", 0) % nd
        name = self.fresh()
        out.append(f"float {name};")
        start, branches = 0, []
        for ref in refs:
            part = self.shape(ref)
            if 0 in part:
                continue
            if len(part) != nd:
                raise Refused("cat of inputs of another rank")
            sub = list(idx)
            sub[d] = f"({idx[d]} - {start}u)" if start else idx[d]
            body: list[str] = []
            value, _ = self.value(ref, sub, body, dict(memo))  # names made inside a branch stay there
            cond = f"{idx[d]} < {start + _fixed(part[d], 'a cat')}u"
            bare = re.fullmatch(r"c(\d+)_", idx[d])
            if bare:  # the cpu's nested loops split there, and each piece loses the branch (`_cpu_walks`)
                self.cuts.setdefault(int(bare[1]), set()).add(start + part[d])
            branches.append((cond, [*body, f"{name} = {value};"]))
            start += part[d]
        if start != _fixed(shape[d], "a cat"):
            raise Refused("cat inputs do not fill the output")
        for k, (cond, body) in enumerate(branches):
            if k == 0:
                out.append(f"if ({cond}) {{" if len(branches) > 1 else "{")
            elif k == len(branches) - 1:
                out.append("} else {")
            else:
                out.append(f"}} else if ({cond}) {{")
            out += ["  " + s for s in body]
        out.append("}")
        return name


# `#pragma GCC unroll N` on the innermost loops. 0: a flat loop gets no hint (-O3 does not unroll it), a
# nested one `unroll 1`: left to itself the compiler peels a short loop (half a head's 16 elements)
# completely, after which it vectorises neither the loop nor the peeled copies; kept a loop, the
# vectoriser takes it whole.
CPU_UNROLLS = (0, 2, 4, 8)
# one flat loop per output, no hint (and `merge` 0 where outputs share a walk: `IndexedFusion.axes`)
CPU_INDEXED_DEFAULT = {"nest": 0, "unroll": 0}


@dataclass(frozen=True)
class Walk:
    """How the cpu render walks one output: its dims outermost first in memory (`order`), its sizes (an
    int, or a family dim's name read at run time), how many statements of its body decode the
    element's coordinates from its index (`head`: left out where loops supply the coordinates), where
    a cat in the chain switches inputs along a bare coordinate (`cuts`), the variable holding the
    element's value at the end of the body and the store of it."""

    order: tuple[int, ...]
    shape: tuple
    head: int
    cuts: tuple[tuple[int, tuple[int, ...]], ...]  # (dim, positions)
    value: str
    store: str  # the element written: "p.out<j>[offset]"
    ctype: str

    @property
    def depth(self) -> int:
        """Dims a nested walk can loop over (size-1 dims have the one coordinate 0)."""
        return sum(1 for n in self.shape if n != 1)


def _cpu_plain(params: dict) -> bool:
    """Whether a cpu point is the render from before the cpu axes: one flat loop per output, no hint."""
    return not params.get("merge") and not params.get("nest") and not params.get("unroll")


def _cpu_groups(walks: list[Walk], merge: int) -> list[list[int]]:
    """The outputs each cpu walk computes: one each, or (`merge`) all that walk the same shape in the
    same order together (RoPE's cos and sin tables)."""
    groups: dict = {}
    for j, w in enumerate(walks):
        groups.setdefault((w.order, w.shape) if merge else j, []).append(j)
    return list(groups.values())


def _cpu_functions(plan: dict, params: dict) -> str:
    """`fp_walk<g>` per group of outputs (`_cpu_groups`), taking the element's index (`nest` 0) or its
    coordinates. A merged group computes every output's value first, each in its own block, then
    stores them all: no store comes between the loads the outputs share (the compiler then loads and
    computes them once, and turns a sinf and a cosf of one value into one sincosf)."""
    itype, nest, walks = plan["itype"], params["nest"], plan["walks"]
    out = []
    for g, members in enumerate(_cpu_groups(walks, params.get("merge", 0))):
        first = walks[members[0]]
        if nest:
            sig = "".join(f", {itype} c{d}_" for d in range(len(first.shape)))
            lines = []
        else:
            sig = f", {itype} e_"
            lines = list(plan["bodies"][members[0]][1][:first.head])
        if len(members) == 1:
            lines += plan["bodies"][members[0]][1][first.head:]
        else:
            for j in members:
                w, stmts = walks[j], plan["bodies"][j][1]
                lines += [f"float r{j}_;", "{", *("  " + st for st in stmts[w.head:-1]), f"  r{j}_ = {w.value};", "}"]
            lines += [f"{walks[j].store} = fp_st<{walks[j].ctype}>(r{j}_);" for j in members]
        body = "\n  ".join(lines)
        out.append(f"\nFP_FN void fp_walk{g}(const fp_args& p{sig}) {{\n  {body}\n}}\n")
    return "".join(out)


def _cpu_walks(plan: dict, params: dict, arg: str, totals: list[str]) -> list[str]:
    """Statements calling `fp_walk<g>(arg, ...)` (`_cpu_functions`) at every element of each group of
    outputs, in memory order. `totals`: each output's element count (a C expression).

    `nest` = 0: one flat loop over the element index, each call decoding its coordinates (a division
    and a modulo per dim). `nest` = k: the k innermost dims (in memory order, size-1 dims skipped) are
    loops whose counters are the coordinates, the rest one flat loop decoded once per inner run: the
    index math leaves the inner loops, where the compiler sees constant trip counts and unit-stride
    accesses. A looped dim a cat splits (rotate_half's halves) is walked as one loop per piece, so
    the compiler drops the cat's branch in each (it knows the coordinate's range there) and can
    vectorise what is left. `unroll`: `#pragma GCC unroll` on the innermost loops (`CPU_UNROLLS`)."""
    itype, nest, unroll = plan["itype"], params["nest"], params["unroll"]
    hint = [f"#pragma GCC unroll {unroll or 1}"] if unroll or nest else []
    out = []
    for g, members in enumerate(_cpu_groups(plan["walks"], params.get("merge", 0))):
        walk = plan["walks"][members[0]]
        if nest == 0:
            out += [*hint, f"for ({itype} e_ = 0; e_ < {totals[members[0]]}; ++e_) fp_walk{g}({arg}, e_);"]
            continue
        cuts: dict[int, set[int]] = {}
        for j in members:
            for d, at in plan["walks"][j].cuts:
                cuts.setdefault(d, set()).update(at)

        def size(d: int, walk: Walk = walk) -> str:
            n = walk.shape[d]
            return f"{n}u" if isinstance(n, int) else f"{arg}.n_{n}"

        def loops(dims: list[int], ind: str, g: int = g, walk: Walk = walk, cuts: dict = cuts) -> list[str]:
            if not dims:
                coords = "".join(f", c{d}_" if n != 1 else ", 0u" for d, n in enumerate(walk.shape))
                return [f"{ind}fp_walk{g}({arg}{coords});"]
            d, n = dims[0], walk.shape[dims[0]]
            bounds = [0, *sorted(b for b in cuts.get(d, ()) if isinstance(n, int) and 0 < b < n), n]
            lines = []
            for lo, hi in itertools.pairwise(bounds):
                if len(dims) == 1:
                    lines += [ind + h for h in hint]
                end = size(d) if hi == n else f"{hi}u"
                lines.append(f"{ind}for ({itype} c{d}_ = {lo}u; c{d}_ < {end}; ++c{d}_) {{")
                lines += loops(dims[1:], ind + "  ")
                lines.append(f"{ind}}}")
            return lines

        live = [d for d in walk.order if walk.shape[d] != 1]
        k = min(nest, len(live))
        outer, inner = live[:len(live) - k], live[len(live) - k:]
        if not outer:
            out.append("\n  ".join(loops(inner, "")))
            continue
        sizes = [walk.shape[d] for d in outer]
        total = f"{math.prod(sizes)}u" if all(isinstance(n, int) for n in sizes) else " * ".join(map(size, outer))
        lines = [f"for ({itype} o_ = 0; o_ < {total}; ++o_) {{", f"  {itype} r_ = o_;"]
        lines += [f"  const {itype} c{d}_ = r_ % {size(d)}; r_ /= {size(d)};" for d in reversed(outer[1:])]
        lines += [f"  const {itype} c{outer[0]}_ = r_;", *loops(inner, "  "), "}"]
        out.append("\n  ".join(lines))
    return out


def _bodies(card: Card, target: str, emitter, coords, store,
            layout) -> tuple[list[tuple[TensorMeta, list[str]]], list[Walk]]:
    """Per output: its meta and the statements of `fp_out<j>`: `coords(j, meta)` (c<d>_ from e_), the
    chain's value there (a fresh `emitter()` per output), the store at offset `store(j, meta)`; and
    how the cpu render may walk it (`layout(j, meta)`: its dims outermost first, its sizes)."""
    bodies, walks = [], []
    for j, (ref, meta) in enumerate(zip(card.fusion.outputs, card.outputs, strict=True)):
        if meta.dtype not in COMPUTE_DTYPES:
            raise Refused(f"output dtype {meta.dtype}")
        stmts = list(coords(j, meta))
        head = len(stmts)
        em = emitter()
        value, _ = em.value(ref, [f"c{d}_" for d in range(len(meta.shape))], stmts, {})
        element, ct = f"p.out{j}[{store(j, meta)}]", ctype(meta.dtype, target)
        stmts.append(f"{element} = fp_st<{ct}>({value});")
        bodies.append((meta, stmts))
        order, shape = layout(j, meta)
        cuts = tuple(sorted((d, tuple(sorted(at))) for d, at in em.cuts.items()))
        walks.append(Walk(tuple(order), tuple(shape), head, cuts, value, element, ct))
    return bodies, walks


# --- fused.indexed over a family's dims: sizes and strides read at run time ------------------------------


@dataclass(frozen=True)
class _Sized:
    """A family chain as the size-generic indexed render reads it: every chain value's sizes (per axis a
    fixed int or a dim name), where each dim's run-time value is read (an input slot and axis), the
    outputs' walking order (dims outermost first in memory, as at the family's largest member) and the
    index type that member needs."""

    shapes: dict[tuple, tuple]
    binds: tuple[tuple[str, int, int], ...]  # (dim, input slot, axis)
    orders: tuple[tuple[int, ...], ...]
    itype: str


def _probe_points(dims) -> list[dict[str, int]] | None:
    """Three points of the family, the first with every dim at its largest, at which no two dims take the
    same three values and no dim the same value thrice: an axis whose sizes at the three are one dim's
    values is that dim's (a fixed axis keeps one size; a size no single dim gives matches none)."""
    picks: dict[str, tuple[int, int, int]] = {}
    for d in dims:
        values = families.candidate_sizes(d)
        triples = [(d.max, b, c) for b in values for c in values if len({d.max, b, c}) > 1]
        triple = next((t for t in triples if t not in picks.values()), None)
        if triple is None:
            return None
        picks[d.name] = triple
    return [{name: t[k] for name, t in picks.items()} for k in range(3)]


def _axis_size(sizes: tuple[int, ...], points: list[dict[str, int]]) -> int | str | None:
    """An axis's size as a family sees it: fixed (the same at every probe point), a dim's name (that dim's
    values at every point), or None (no single dim: a product of dims, say)."""
    if len(set(sizes)) == 1:
        return sizes[0]
    names = [name for name in points[0] if tuple(p[name] for p in points) == sizes]
    return names[0] if len(names) == 1 else None


def _sized(card: Card) -> _Sized | str:
    """What the size-generic indexed render needs of a family card (`_Sized`), or why it cannot serve it."""
    fam = card.family
    if any(d.derived for d in fam.dims):
        return "an indexed family binds every dim from an input (a derived dim is a cat's length)"
    points = _probe_points(fam.dims)
    if points is None:
        return "the family's dims cannot be told apart at three points of their ranges"
    try:
        members = [families.member(card, values) for values in points]
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:  # the chain's meta replay
        return f"the chain does not replay over the family: {err}"
    shapes: dict[tuple, tuple] = {("in", i): (lay.shape if lay is not None else ())
                                  for i, lay in enumerate(fam.inputs)}
    for k, e in enumerate(card.chain):
        for j in range(len(e.outs)):
            axes = zip(*(m.chain[k].outs[j].shape for m in members), strict=True)
            shape = tuple(_axis_size(sizes, points) for sizes in axes)
            if None in shape:
                return f"the chain's {e.op} has a size no single dim gives (a reshape across dims)"
            shapes[("t", k, j)] = shape
    for ref, layout in zip(card.fusion.outputs, fam.outputs, strict=True):
        if shapes[tuple(ref)] != layout.shape:
            return "the chain's outputs are not the family's"
    binds = []
    for d in fam.dims:
        held = next(((i, a) for i, lay in enumerate(fam.inputs) if lay is not None
                     for a, n in enumerate(lay.shape) if n == d.name), None)
        if held is None:
            return f"no input holds dim {d.name}"
        binds.append((d.name, *held))
    big = members[0]
    spans = [o.numel for o in big.outputs] + [m.span() for m in big.tensor_inputs() if m is not None]
    itype = itype_for(max(spans))
    orders = tuple(tuple(memory_order(o.shape, o.stride)) for o in big.outputs)
    return _Sized(shapes, tuple(binds), orders, itype)


class _FamilyEmitter(_Emitter):
    """`_Emitter` over a family: sizes from `_Sized` (a dim's value is `p.n_<dim>`), an input's element
    offset from its strides as the descriptors give them (`p.s<slot>_<axis>`)."""

    def __init__(self, card: Card, chain: list[Entry], target: str, sized: _Sized):
        super().__init__(card, chain, target, sized.itype)
        self.sized = sized

    def shape(self, ref) -> tuple:
        return self.sized.shapes[tuple(ref)]

    def load_offset(self, slot: int, idx: list[str]) -> str:
        return " + ".join(f"({i}) * p.s{slot}_{a}" for a, (i, n) in enumerate(zip(idx, self.shape(("in", slot)),
                                                                                   strict=True)) if n != 1) or "0u"


def _family_coords(shape: tuple, order: tuple[int, ...], itype: str) -> list[str]:
    """`_coords` with sizes read at run time where the family varies them (`p.n_<dim>`)."""
    if not shape:
        return []
    lines = [f"{itype} r_ = e_;"]
    for d in reversed(order[1:]):
        n = shape[d]
        if n == 1:
            lines.append(f"const {itype} c{d}_ = 0;")
            continue
        size = f"{n}u" if isinstance(n, int) else f"p.n_{n}"
        lines.append(f"const {itype} c{d}_ = r_ % {size}; r_ /= {size};")
    lines.append(f"const {itype} c{order[0]}_ = r_;")
    return lines


class IndexedFusion(FusedTemplate):
    """Every output element evaluates the chain through index math (see the module docstring).

    A family with one dim, the outermost axis of every tensor (a decode step's rotary at any batch), is
    the batch-1 member's kernel run once per batch index: each tensor's pointer moved by its own
    outermost stride, read at run time. Its other sizes and strides are the member's constants, so
    the chain's index math holds only if no chain value mixes that axis with another (checked at two
    batch sizes).

    Any other family (a prefill's rotary over batch and tokens) gets the size-generic render: every
    chain value's sizes are known per axis as fixed or one dim's (`_sized`, from the chain replayed at
    three points), the index math reads the dims' values and the inputs' and outputs' strides at run
    time, and only what index math needs as a constant (a slice's, select's or cat's axis, a reshape)
    must be fixed; a family that varies one of those is refused."""

    generic = True

    def family_plan(self, card, plan, target):
        batch = self._batch_plan(card, target)
        if isinstance(batch, FamilyPlan):
            return batch
        sized = _sized(card)
        if isinstance(sized, str):
            return sized
        chain, outs = entries(card), card.family.outputs

        def store(j: int, meta: TensorMeta) -> str:
            return " + ".join(f"c{d}_ * p.o{j}_{d}" for d, n in enumerate(outs[j].shape) if n != 1) or "0u"

        try:
            bodies, walks = _bodies(card, target, lambda: _FamilyEmitter(card, chain, target, sized),
                                    lambda j, meta: _family_coords(outs[j].shape, sized.orders[j], sized.itype), store,
                                    lambda j, meta: (sized.orders[j], outs[j].shape))
        except Refused as err:
            return str(err)
        return FamilyPlan({"itype": sized.itype, "bodies": bodies, "walks": walks}, sized)

    def _batch_plan(self, card, target):
        """The batch-1 member's plan where the family varies the outermost axis alone (else a reason)."""
        fam = card.family
        if len(fam.dims) != 1 or fam.dims[0].derived:
            return "an indexed family varies only the outermost (batch) axis"
        name = fam.dims[0].name
        for layout in (*fam.inputs, *fam.outputs):
            if layout is None or not layout.shape or layout.shape[0] != name:
                return "an indexed family needs the varying dim outermost in every tensor"
            if any(isinstance(n, str) for n in layout.shape[1:]) or any(ds for _, ds in layout.stride[1:]):
                return "an indexed family varies only the outermost (batch) axis"
        if fam.dims[0].min > 1 or fam.dims[0].max < 2:
            return "an indexed family is checked at batch 1 and 2: its range must hold both"
        try:
            one, two = (families.member(card, {name: n}) for n in (1, 2))
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:  # the chain's meta replay
            return f"the chain does not replay at batch 1 and 2: {err}"
        for a, b in zip(one.chain, two.chain, strict=True):
            for x, y in zip(a.outs, b.outs, strict=True):
                if not x.shape or (x.shape[0], y.shape[0]) != (1, 2) or x.shape[1:] != y.shape[1:] \
                        or x.stride[1:] != y.stride[1:]:
                    return f"the chain's {a.op} mixes the batch axis with another"
        try:
            return FamilyPlan(self.plan(one, target), one)
        except Refused as err:
            return str(err)

    def family_axes(self, plan, target):
        return self.axes(plan.base, target)

    def family_default(self, plan, axes, target):
        return self.pick_default(plan.base, axes, target)

    def plan(self, card: Card, target: str):
        chain = entries(card)
        if any(e.op in _REDUCE for e in chain if e.index in _used(card, chain)):
            raise Refused("a reduction (fused.rows serves those)")
        outs = card.outputs
        biggest = max([o.numel for o in outs] + [m.span() for m in card.tensor_inputs() if m is not None])
        itype = itype_for(biggest)

        def store(j: int, meta: TensorMeta) -> str:
            return " + ".join(f"c{d}_ * {s}u" for d, (n, s) in enumerate(zip(meta.shape, meta.stride, strict=True))
                              if n != 1) or "0u"

        bodies, walks = _bodies(card, target, lambda: _Emitter(card, chain, target, itype),
                                lambda j, meta: _coords(meta, itype), store,
                                lambda j, meta: (memory_order(meta.shape, meta.stride), meta.shape))
        return {"itype": itype, "bodies": bodies, "walks": walks}

    def axes(self, plan, target):
        if target == "cpu":
            # `merge` where outputs share a walk (`_cpu_functions`); `nest` in search order: the flat loop,
            # every dim a loop, then fewer of them (`_cpu_walks`)
            walks = plan["walks"]
            merge = {"merge": [0, 1]} if len(_cpu_groups(walks, 1)) < len(walks) else {}
            deepest = max(w.depth for w in walks)
            return {**merge, "nest": [0, *range(deepest, 0, -1)], "unroll": list(CPU_UNROLLS)}
        return {"block": [64, 128, 256, 512]}

    def pick_default(self, plan, axes, target):
        if target == "cpu":
            return {**{k: 0 for k in axes if k == "merge"}, **CPU_INDEXED_DEFAULT}
        return {"block": 256}

    def emit(self, card, plan, target, params):
        code, inits, sizes = self._functions(card, plan, target, cpu=params)
        if target == "cpu":
            if _cpu_plain(params):
                loops = " ".join(f"for ({plan['itype']} e_ = 0; e_ < {n}u; ++e_) fp_out{j}(p, e_);"
                                 for j, n in enumerate(sizes))
            else:
                loops = "\n  ".join(_cpu_walks(plan, params, "p", [f"{n}u" for n in sizes]))
            return code + entry(card, target, "fp_args p;\n  " + "\n  ".join(inits) + f"\n  {loops}\n  "
                                + launch_status(target))
        kernel, total = self._kernel(plan, sizes, params["block"])
        launch = ("fp_args p;\n  " + "\n  ".join(inits)
                  + f"\n  fp_indexed<<<{total}u, {params['block']}, 0, stream>>>(p);\n  " + launch_status(target))
        return code + kernel + entry(card, target, launch)

    def family_emit(self, card, plan, target, params):
        """The batch-1 member's functions; each batch index moves every pointer by its tensor's outermost
        stride (2-D grid on cuda: blockIdx.y is the batch index). A family over other dims: `_sized_emit`."""
        if isinstance(plan.info, _Sized):
            return self._sized_emit(card, plan, target, params)
        one = plan.info
        code, inits, sizes = self._functions(one, plan.base, target, generic.helpers(1), batched=True, cpu=params)
        ins, outs = one.tensor_inputs(), one.outputs
        descs = [(f"call->inputs[{i}]", f"in{i}", m) for i, m in enumerate(ins)]
        descs += [(f"call->outputs[{j}]", f"out{j}", m) for j, m in enumerate(outs)]
        body = ["fp_args p;", *inits, f"const int64_t nb_ = {descs[0][0]}.sizes[0];"]
        for var, _, m in descs:  # the member's constants hold for every batch index
            body.append(f"if ({var}.sizes[0] != nb_ || {var}.strides[0] < 0) return FP_ERR_UNSUPPORTED;")
            body += [f"if ({var}.strides[{a}] != {m.stride[a]}LL) return FP_ERR_UNSUPPORTED;"
                     for a in range(1, len(m.shape)) if m.shape[a] != 1]
        body.append("if (nb_ == 0) return FP_OK;")
        moves = " ".join(f"q.{f} += bt * {var}.strides[0];" for var, f, _ in descs)
        if target == "cpu":
            if _cpu_plain(params):
                loops = " ".join(f"for ({plan.base['itype']} e_ = 0; e_ < {n}u; ++e_) fp_out{j}(q, e_);"
                                 for j, n in enumerate(sizes))
            else:  # on lines of their own (an unroll hint is a line)
                walks = _cpu_walks(plan.base, params, "q", [f"{n}u" for n in sizes])
                loops = "".join("\n    " + w.replace("\n", "\n  ") for w in walks) + "\n "
            body.append(f"for (int64_t bt = 0; bt < nb_; ++bt) {{ fp_args q = p; {moves} {loops} }}")
            return code + generic.entry(card, target, "\n  ".join([*body, launch_status(target)]))
        block = params["block"]
        kernel, total = self._kernel(plan.base, sizes, block, batched=True)
        strides = ", ".join(f"{var}.strides[0]" for var, _, _ in descs)
        body += ["if (nb_ > 65535) return FP_ERR_UNSUPPORTED;", f"const fp_batch s_ = {{{{{strides}}}}};",
                 f"fp_indexed<<<dim3({total}u, (unsigned)nb_), {block}, 0, stream>>>(p, s_);", launch_status(target)]
        return code + kernel + generic.entry(card, target, "\n  ".join(body))

    def _sized_emit(self, card, plan, target, params):
        """Every size the family varies and every stride from the descriptors: each dim bound from one input
        (`_Sized.binds`) and checked on every other tensor; one launch, its blocks split between the
        outputs by their run-time element counts."""
        sized, fam, n_out = plan.info, card.family, len(card.outputs)
        tensors = [(f"call->inputs[{i}]", f"s{i}", lay) for i, lay in enumerate(fam.inputs) if lay is not None]
        tensors += [(f"call->outputs[{j}]", f"o{j}", lay) for j, lay in enumerate(fam.outputs)]
        fields = [f"fp_idx n_{d.name};" for d in fam.dims]
        fields += [f"fp_idx {pre}_{a};" for _, pre, lay in tensors for a, n in enumerate(lay.shape) if n != 1]
        fields += [f"fp_idx t{j}; fp_idx nb{j};" for j in range(n_out)]
        code, inits, _ = self._functions(card, plan.base, target, generic.helpers(1), extra_fields=tuple(fields),
                                         cpu=params)
        body = ["fp_args p;", *inits]
        body += [f"const int64_t n_{name}_ = call->inputs[{slot}].sizes[{axis}];" for name, slot, axis in sized.binds]
        for var, pre, lay in tensors:
            body += [f"if ({var}.sizes[{a}] != n_{n}_) return FP_ERR_UNSUPPORTED;"
                     for a, n in enumerate(lay.shape) if isinstance(n, str)]
            if sized.itype == "uint32_t":
                body.append(f"if (!fp_fits32(&{var})) return FP_ERR_UNSUPPORTED;")
            body += [f"p.{pre}_{a} = (fp_idx){var}.strides[{a}];" for a, n in enumerate(lay.shape) if n != 1]
        body += [f"p.n_{d.name} = (fp_idx)n_{d.name}_;" for d in fam.dims]
        body += [f"p.t{j} = (fp_idx)fp_numel(&call->outputs[{j}]);" for j in range(n_out)]
        if target == "cpu":
            if _cpu_plain(params):
                body += [f"for (fp_idx e_ = 0; e_ < p.t{j}; ++e_) fp_out{j}(p, e_);" for j in range(n_out)]
            else:
                body += _cpu_walks(plan.base, params, "p", [f"p.t{j}" for j in range(n_out)])
            return code + generic.entry(card, target, "\n  ".join([*body, launch_status(target)]))
        block = params["block"]
        body += [f"p.nb{j} = (p.t{j} + {block - 1}u) / {block}u;" for j in range(n_out)]
        body += ["const int64_t blocks_ = " + " + ".join(f"(int64_t)p.nb{j}" for j in range(n_out)) + ";",
                 "if (blocks_ == 0) return FP_OK;", "if (blocks_ > 2147483647LL) return FP_ERR_UNSUPPORTED;",
                 f"fp_indexed<<<(unsigned)blocks_, {block}, 0, stream>>>(p);", launch_status(target)]
        dispatch = [f"  if (b < p.nb{j}) {{ const fp_idx e_ = b * {block}u + threadIdx.x; "
                    f"if (e_ < p.t{j}) fp_out{j}(p, e_); return; }} b -= p.nb{j};" for j in range(n_out)]
        kernel = (f"\n__global__ void __launch_bounds__({block}) fp_indexed(const fp_args p) {{\n"
                  "  fp_idx b = blockIdx.x;\n" + "\n".join(dispatch) + "\n}\n")
        return code + kernel + generic.entry(card, target, "\n  ".join(body))

    @staticmethod
    def _kernel(plan, sizes: list[int], block: int, batched: bool = False) -> tuple[str, int]:
        """The cuda kernel, its blocks split between the outputs; `batched`: blockIdx.y is a batch index,
        every pointer moved to it first (`fp_move`)."""
        itype = plan["itype"]
        dispatch, total = [], 0
        for j, n in enumerate(sizes):
            blocks = ceil_div(n, block)
            dispatch.append(f"  if (b < {blocks}u) {{ const {itype} e_ = b * {block}u + threadIdx.x; "
                            f"if (e_ < {n}u) fp_out{j}(p, e_); return; }} b -= {blocks}u;")
            total += blocks
        params, move = "const fp_args p", ""
        if batched:
            params, move = "fp_args p, const fp_batch st", "  fp_move(p, st, blockIdx.y);\n"
        return (f"\n__global__ void __launch_bounds__({block}) fp_indexed({params}) {{\n{move}"
                f"  {itype} b = blockIdx.x;\n" + "\n".join(dispatch) + "\n}\n"), total

    def _functions(self, card, plan, target, helpers: str = "", batched: bool = False,
                   extra_fields: tuple[str, ...] = (), cpu: dict | None = None) -> tuple[str, list[str], list[int]]:
        """The prelude (then `helpers`), `fp_args` (then `extra_fields`), one `fp_out<j>` per output
        (`batched` on cuda: and `fp_move`, which moves every pointer to a batch index), the host
        initialisers, each output's element count. `cpu`: the cpu point; past the plain one, the
        functions are `_cpu_functions`' instead."""
        itype = plan["itype"]
        ins, outs = card.tensor_inputs(), card.outputs
        fields, inits = [], []
        restrict = " __restrict__" if target == "cuda" else ""
        for i, m in enumerate(ins):
            t = ctype(m.dtype, target)
            fields.append(f"const {t}*{restrict} in{i};")
            inits.append(f"p.in{i} = (const {t}*)call->inputs[{i}].data;")
        for j, m in enumerate(outs):
            t = ctype(m.dtype, target)
            fields.append(f"{t}*{restrict} out{j};")
            inits.append(f"p.out{j} = ({t}*)call->outputs[{j}].data;")
        fields += extra_fields
        head = prelude(target) + helpers + f"\ntypedef {itype} fp_idx;\nstruct fp_args {{ {' '.join(fields)} }};\n"
        funcs = []
        if target == "cpu" and cpu and not _cpu_plain(cpu):
            funcs.append(_cpu_functions(plan, cpu))
        else:
            for j, (_, stmts) in enumerate(plan["bodies"]):
                body = "\n  ".join(stmts)
                funcs.append(f"\nFP_FN void fp_out{j}(const fp_args& p, {itype} e_) {{\n  {body}\n}}\n")
        names = [f"in{i}" for i in range(len(ins))] + [f"out{j}" for j in range(len(outs))]
        moves = " ".join(f"p.{n} += bt * st.s[{k}];" for k, n in enumerate(names))
        if batched and target == "cuda":
            funcs.append(f"\nstruct fp_batch {{ int64_t s[{len(names)}]; }};\n"
                         f"__device__ __forceinline__ void fp_move(fp_args& p, const fp_batch& st, int64_t bt) "
                         f"{{ {moves} }}\n")
        return head + "".join(funcs), inits, [m.numel for m, _ in plan["bodies"]]


def _coords(meta: TensorMeta, itype: str) -> list[str]:
    """Statements defining c<d>_, the coordinates of the e_-th element of the output in memory order.

    Consecutive threads then write consecutive addresses whatever the layout: a channels-last output
    is walked n, h, w, c (as TensorIterator walks it), not n, c, h, w with a stride-C store per thread.
    """
    if not meta.shape:
        return []
    names = [f"c{d}_" for d in range(len(meta.shape))]
    return decode_lines("e_", meta.shape, memory_order(meta.shape, meta.stride), names, itype)


TEMPLATES = (
    PointwiseFusion("fused.pointwise", "fused", ("cuda", "cpu"), FUSION_OPS),
    RowsFusion("fused.rows", "fused", ("cuda", "cpu"), FUSION_OPS),
    IndexedFusion("fused.indexed", "fused", ("cuda", "cpu"), FUSION_OPS),
)

__all__ = ["DTYPE_SIZES", "FLOATS", "FUSION_OPS", "TEMPLATES", "elementwise_expr", "entries", "index_type"]
