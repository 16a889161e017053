"""Operator cards: one per variant (op overload + full signature), the unit of work everywhere.

A card is what capture saw, what profile measured, what the search optimises, what an LLM is shown,
and what the pack's guard checks. Cards are small frozen values that round-trip through JSON.

Argument encoding (schema order, one `Arg` per schema argument):
- ``tensor``: `TensorMeta`; an optional Tensor argument passed None: `Arg(kind="none")`
- ``tensors``: a list of `TensorMeta` (Tensor[] arguments such as `cat`'s)
- ``value``: any other argument (int, float, bool, list of ints, dtype name, None, string); a dtype
  is stored as its name ("bfloat16"), a device as its type ("cuda"), other enums as their str()

Fusion cards (module-level chains) use the same schema with `kind="fusion"`; their `op` names the
pattern, `chain` holds the aten calls they replace (`ChainEntry`, `ChainArg`) and `fusion` what the
kernel stands for (`Fusion`, `FusionSite`; see `forgepack.fusion`). Their JSON is the dict form the
chain's digest was taken over, so cards written before these were typed load unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forgepack.runtime.stockcall import frozen

# dtype names as torch spells them after "torch."; `code` is the kernel ABI's fp_dtype value.
DTYPE_CODES = {
    "float32": 0,
    "float16": 1,
    "bfloat16": 2,
    "float64": 3,
    "int64": 4,
    "int32": 5,
    "int16": 6,
    "int8": 7,
    "uint8": 8,
    "bool": 9,
}
DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
_SHORT_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}


@dataclass(frozen=True)
class ValueStats:
    """Summary of a captured tensor's values, so fresh inputs can be drawn like the real ones."""

    mean: float = 0.0
    std: float = 1.0
    min: float = -1.0
    max: float = 1.0
    nonfinite: bool = False


@dataclass(frozen=True)
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int = 0
    device: str = "cpu"  # device type only: "cpu" or "cuda"
    stats: ValueStats | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def span(self) -> int:
        """Elements of storage this view touches, from its first element (0 for an empty tensor)."""
        if self.numel == 0:
            return 0
        return 1 + sum((n - 1) * abs(s) for n, s in zip(self.shape, self.stride, strict=True))

    def is_contiguous(self) -> bool:
        expected, stride = [], 1
        for n in reversed(self.shape):
            expected.append(stride)
            stride *= n
        return all(n == 1 or s == e for n, s, e in zip(self.shape, self.stride, reversed(expected), strict=True))

    def signature(self) -> str:
        """Short human form, e.g. bf16[1,512,2048] or f32[8,8]:(1,8)."""
        text = f"{_SHORT_DTYPES.get(self.dtype, self.dtype)}[{','.join(map(str, self.shape))}]"
        if not self.is_contiguous():
            text += f":({','.join(map(str, self.stride))})"
        if self.storage_offset:
            text += f"+{self.storage_offset}"
        return text

    def key(self) -> tuple:
        return (self.dtype, self.shape, self.stride, self.storage_offset, self.device)


@dataclass(frozen=True)
class Arg:
    name: str
    kind: str  # "tensor" | "tensors" | "none" | "value"
    tensor: TensorMeta | None = None
    tensors: tuple[TensorMeta, ...] = ()
    value: Any = None

    def key(self) -> tuple:
        if self.kind == "tensor":
            return (self.name, self.tensor.key())
        if self.kind == "tensors":
            return (self.name, tuple(t.key() for t in self.tensors))
        return (self.name, self.kind, frozen(self.value))


@dataclass(frozen=True)
class Profile:
    """What `forgepack profile` measured for one card."""

    eager_us: float = 0.0  # median time of one call, in isolation
    total_us: float = 0.0  # eager_us * calls
    share: float = 0.0  # of the summed per-variant time of the whole model
    bytes: int = 0
    flops: int = 0
    roofline_us: float = 0.0
    headroom: float = 1.0  # eager_us / roofline_us
    baseline: str = "native"  # "vendor" | "native" | "view"
    kernels: tuple[str, ...] = ()  # device kernels the profiler saw for one call


@dataclass(frozen=True, repr=False)
class Dim:
    """One size that varies across a shape family's members, with the range it is served over.

    A derived dim is held by no input: its value is `offset` plus the sum of the `base` dims' values
    (a cat's output length, past + new; a guard computes it once the inputs bound the base dims)."""

    name: str  # "d0", "d1", ...
    min: int
    max: int
    base: tuple[str, ...] = ()  # derived: value = sum(base dims' values) + offset
    offset: int = 0

    @property
    def derived(self) -> bool:
        return bool(self.base)

    def value(self, values: dict[str, int]) -> int:
        """A derived dim's value at these base values."""
        return sum(values[b] for b in self.base) + self.offset

    def text(self) -> str:
        """`d0 in 1..8`, or for a derived dim `d2=d1+1`."""
        if not self.derived:
            return f"{self.name} in {self.min}..{self.max}"
        offset = f"{self.offset:+d}" if self.offset else ""
        return f"{self.name}={'+'.join(self.base)}{offset}"

    def __repr__(self) -> str:  # a free dim's repr is what family ids were hashed from before derived dims
        extra = f", base={self.base!r}, offset={self.offset!r}" if self.derived else ""
        return f"Dim(name={self.name!r}, min={self.min!r}, max={self.max!r}{extra})"


FREE_STRIDE = (-1, ("*",))  # an input axis's stride that follows no rule: any non-negative stride


@dataclass(frozen=True)
class Layout:
    """A tensor's sizes and strides as functions of its family's dims.

    `shape`: per axis a fixed size (int) or a dim name. `stride`: per axis `(c, dims)`, meaning
    stride = c * product of those dims' values (contiguous, channels-last, transposed and sliced views
    of a contiguous parent all have this form). Every dim a stride names is some tensor's axis size, so
    a guard can bind each dim from the sizes it sees and then check every stride. An input's axis may
    be `FREE_STRIDE` instead: a view of a buffer whose row length is no size of the tensor (generate()'s
    last-token slice of the growing ids), served by kernels that read strides at run time. Its dims
    entry "*" is no dim, so code that treats a stride with dims as varying stays right.
    """

    shape: tuple[int | str, ...]
    stride: tuple[tuple[int, tuple[str, ...]], ...]

    def signature(self, dtype: str) -> str:
        """Short human form with dim names, e.g. f32[d0,64] or f32[64,d0]:(1,64) for a transposed view."""
        text = f"{_SHORT_DTYPES.get(dtype, dtype)}[{','.join(map(str, self.shape))}]"
        expected, stride = [], (1, ())
        for n in reversed(self.shape):  # the contiguous rule, innermost first
            expected.append(stride)
            stride = (stride[0] * n, stride[1]) if isinstance(n, int) else (stride[0], (*stride[1], n))
        contiguous = all(n == 1 or (c, set(ds)) == (e[0], set(e[1]))
                         for n, (c, ds), e in zip(self.shape, self.stride, reversed(expected), strict=True))
        if not contiguous:
            rules = ("*" if (c, ds) == FREE_STRIDE else "*".join([str(c)] * (c != 1 or not ds) + list(ds))
                     for c, ds in self.stride)
            text += ":(" + ",".join(rules) + ")"
        return text


@dataclass(frozen=True)
class Family:
    """Variants of one op that differ only in sizes (DESIGN.md "Serving envelope and shape families").

    `inputs` follows `Card.tensor_inputs()` (None where that is None), `outputs` follows `Card.outputs`.
    `points`: the dim values capture saw, each with its calls and (after profile) weight, the share of
    the family's envelope time that point stands for.
    """

    dims: tuple[Dim, ...]
    inputs: tuple[Layout | None, ...]
    outputs: tuple[Layout, ...]
    points: tuple[tuple[tuple[str, int], ...], ...] = ()  # each point: ((dim, value), ...)
    point_calls: tuple[int, ...] = ()
    point_weights: tuple[float, ...] = ()
    # The sub-range a kernel is kept for (`familyeval.narrowest_paying`): per free dim (name, lo, hi)
    # inside its range, where the kernel pays; its guard admits only that, stock serves the rest. The
    # kernel was verified over all of `dims`, so a served range is verified. () serves the whole range.
    served: tuple[tuple[str, int, int], ...] = ()

    def dim(self, name: str) -> Dim:
        for d in self.dims:
            if d.name == name:
                return d
        raise KeyError(name)

    def key(self) -> tuple:
        """What identifies the family (not its captured points, nor the range a kernel serves of it)."""
        return (self.dims, self.inputs, self.outputs)

    def served_range(self, name: str) -> tuple[int, int]:
        """(lo, hi) a guard admits for this dim: its served sub-range, else its range. A derived dim's
        is its range cut to what its base dims' served ranges can sum to."""
        d = self.dim(name)
        if not d.derived:
            return next(((lo, hi) for n, lo, hi in self.served if n == name), (d.min, d.max))
        ends = [self.served_range(b) for b in d.base]
        return (max(d.min, sum(lo for lo, _ in ends) + d.offset), min(d.max, sum(hi for _, hi in ends) + d.offset))


Ref = tuple  # a chain's tensor: ("in", i) the card's tensor input i, ("t", p, k) output k of chain entry p


@dataclass(frozen=True)
class ChainArg:
    """One schema argument of a chain entry: "tensor" (`ref`), "tensors" (`refs`), "none" (an optional
    tensor passed None) or "value" (`value`, encoded as a card's values are)."""

    name: str
    kind: str
    ref: Ref = ()
    refs: tuple[Ref, ...] = ()
    value: Any = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind == "tensor":
            d["ref"] = list(self.ref)
        elif self.kind == "tensors":
            d["refs"] = [list(r) for r in self.refs]
        elif self.kind == "value":
            d["value"] = self.value
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ChainArg:
        return cls(d["name"], d["kind"], tuple(d.get("ref", ())), tuple(tuple(r) for r in d.get("refs", ())),
                   d.get("value"))


@dataclass(frozen=True)
class ChainEntry:
    """One aten call of a fusion card's chain: the op, its arguments in schema order, and its outputs'
    layouts (which match the entry to the operator cards of the same call, `output_key`)."""

    op: str
    args: tuple[ChainArg, ...] = ()
    outs: tuple[TensorMeta, ...] = ()

    def arg(self, name: str) -> ChainArg | None:
        return next((a for a in self.args if a.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "args": [a.to_json() for a in self.args], "outs": [_layout_json(m) for m in self.outs]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ChainEntry:
        return cls(d["op"], tuple(ChainArg.from_json(a) for a in d.get("args", ())),
                   tuple(_meta(m) for m in d.get("outs", ())))


def chain_digest(chain: Iterable[ChainEntry], outputs: Iterable[tuple]) -> str:
    """Over the chain's JSON (`ChainEntry.to_json`): a card's id does not change with how it is held."""
    text = json.dumps({"chain": [e.to_json() for e in chain], "outputs": [list(r) for r in outputs]}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _layout_json(m: TensorMeta) -> dict[str, Any]:
    """A chain output as the card's JSON holds it: the layout, no value statistics."""
    return {"dtype": m.dtype, "shape": list(m.shape), "stride": list(m.stride), "storage_offset": m.storage_offset,
            "device": m.device}


@dataclass(frozen=True)
class FusionSite:
    """Where a fusion card's chain runs, as the pack's module patches guard it (a
    `forgepack.runtime.modules.Site` without its number): kind ("module", "function" or a glue kind),
    target ("package.module:Class" or ":function"), the source digest, config facts and call form."""

    kind: str
    target: str
    digest: str
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)
    form: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "digest": self.digest, "facts": self.facts,
                "form": self.form}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FusionSite:
        return cls(d["kind"], d["target"], d["digest"], dict(d.get("facts", {})), dict(d.get("form", {})))


@dataclass(frozen=True)
class Fusion:
    """What a fusion card's kernel stands for: the chain's pattern, its launches, which chain values it
    returns (`outputs`, refs), where it runs (`sites`) and the module class it came from."""

    pattern: str
    launches: int
    outputs: tuple[Ref, ...]
    sites: tuple[FusionSite, ...] = ()
    module_class: str = ""
    writes: tuple[int, ...] = ()  # inputs the chain writes in place (a decode block's KV cache)
    block: dict[str, Any] = dataclasses.field(default_factory=dict)  # a decode block's roles and constants

    def to_json(self) -> dict[str, Any]:
        d = {"pattern": self.pattern, "launches": self.launches, "outputs": [list(r) for r in self.outputs],
             "sites": [s.to_json() for s in self.sites], "module_class": self.module_class}
        if self.writes:
            d["writes"] = list(self.writes)
        if self.block:
            d["block"] = self.block
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Fusion:
        return cls(d["pattern"], d.get("launches", 0), tuple(tuple(r) for r in d.get("outputs", ())),
                   tuple(FusionSite.from_json(x) for x in d.get("sites", ())), d.get("module_class", ""),
                   tuple(d.get("writes", ())), dict(d.get("block", {})))


@dataclass(frozen=True)
class Card:
    op: str  # overload, e.g. "aten::_softmax" + "." + "default" -> "aten._softmax.default"
    schema: str  # full schema string, e.g. "aten::_softmax(Tensor self, int dim, bool half_to_float) -> Tensor"
    args: tuple[Arg, ...]
    outputs: tuple[TensorMeta, ...]
    kind: str = "op"  # "op" | "fusion"
    calls: int = 0
    modules: tuple[str, ...] = ()  # module paths that issued this call, most frequent first
    samples: int = 0  # sample input sets kept in the workspace for this card
    profile: Profile | None = None
    chain: tuple[ChainEntry, ...] = ()  # fusion cards: the aten calls the fusion replaces
    fusion: Fusion | None = None  # fusion cards: pattern, outputs, patch sites
    family: Family | None = None  # a shape family: `args`/`outputs` are one member (`forgepack.families`)

    @property
    def id(self) -> str:
        if self.family is not None:
            return family_id(self.op, self.args, self.family)
        return variant_id(self.op, self.args)

    @property
    def op_name(self) -> str:
        """The overload without namespace and default overload, e.g. `_softmax` or `add.Tensor`."""
        name = self.op.split(".", 1)[1] if self.op.startswith("aten.") else self.op
        return name.removesuffix(".default")

    def tensor_inputs(self) -> list[TensorMeta | None]:
        """Kernel ABI input order: tensor args in schema order, lists flattened, None kept as None."""
        out: list[TensorMeta | None] = []
        for a in self.args:
            if a.kind == "tensor":
                out.append(a.tensor)
            elif a.kind == "tensors":
                out.extend(a.tensors)
            elif a.kind == "none":
                out.append(None)
        return out

    def scalars(self) -> list[Any]:
        """Kernel ABI scalars: numeric/bool non-tensor args in schema order, int lists flattened."""
        out: list[Any] = []
        for a in self.args:
            if a.kind != "value":
                continue
            if isinstance(a.value, list | tuple):
                out.extend(v for v in a.value if isinstance(v, int | float | bool))
            elif isinstance(a.value, int | float | bool):
                out.append(a.value)
        return out

    def signature(self) -> str:
        """Short form for tables: tensor shapes and the non-tensor values that matter; a family's with dim
        names and its ranges, e.g. `f32[d0,64], f32[64,128] | d0 in 1..256`."""
        if self.family is not None:
            return self._family_signature()
        parts = []
        for a in self.args:
            if a.kind == "tensor":
                parts.append(a.tensor.signature())
            elif a.kind == "tensors":
                parts.append("[" + ",".join(t.signature() for t in a.tensors) + "]")
            elif a.kind == "value" and a.value is not None:
                parts.append(f"{a.name}={_short_value(a.value)}")
        return ", ".join(parts)

    def _family_signature(self) -> str:
        layouts = iter(self.family.inputs)
        parts = []
        for a in self.args:
            if a.kind == "tensor":
                parts.append(next(layouts).signature(a.tensor.dtype))
            elif a.kind == "tensors":
                parts.append("[" + ",".join(next(layouts).signature(t.dtype) for t in a.tensors) + "]")
            elif a.kind == "none":
                next(layouts)
            elif a.value is not None:
                parts.append(f"{a.name}={_short_value(a.value)}")
        return ", ".join(parts) + " | " + self.family_text()

    def family_text(self) -> str:
        """A family's dims and ranges, then the sub-range its kernel serves where one was narrowed:
        `d0 in 1..8, d1 in 16..2048 served d1 in 256..2048`."""
        text = ", ".join(d.text() for d in self.family.dims)
        if self.family.served:
            text += " served " + ", ".join(f"{n} in {lo}..{hi}" for n, lo, hi in self.family.served)
        return text

    def with_profile(self, profile: Profile) -> Card:
        return dataclasses.replace(self, profile=profile)


def _short_value(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**62:
        return "max" if value > 0 else "min"  # slice ends like sys.maxsize
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_short_value(v) for v in value) + "]"
    return str(value)


def output_key(op: str, outs: Iterable[TensorMeta]) -> tuple:
    """What identifies an operator call across a fusion chain and the operator cards: op and outputs'
    layouts (dtype, shape, stride)."""
    return op, tuple((o.dtype, tuple(o.shape), tuple(o.stride)) for o in outs)


def card_output_key(card: Card) -> tuple:
    return output_key(card.op, card.outputs)


def by_output(cards: Iterable[Card]) -> dict[tuple, list[Card]]:
    """Operator cards by `card_output_key`: where a fusion chain's entries find their operator calls."""
    index: dict[tuple, list[Card]] = {}
    for card in cards:
        if card.kind != "fusion":
            index.setdefault(card_output_key(card), []).append(card)
    return index


def family_id(op: str, args: tuple[Arg, ...], family: Family) -> str:
    """Stable short id of a family: op overload, dtypes and non-tensor values, the family's layouts."""
    fixed = tuple((a.name, a.kind, frozen(a.value)) if a.kind in ("value", "none")
                  else (a.name, a.kind, tuple(t.dtype for t in (a.tensors or (a.tensor,)))) for a in args)
    digest = hashlib.sha256(repr((op, fixed, family.key())).encode()).hexdigest()[:10]
    name = op.removeprefix("aten.").removesuffix(".default").replace(".", "_")
    return f"{name}-F{digest}"


def variant_id(op: str, args: tuple[Arg, ...]) -> str:
    """Stable short id of a variant: op overload + full signature."""
    digest = hashlib.sha256(repr((op, tuple(a.key() for a in args))).encode()).hexdigest()[:10]
    name = op.removeprefix("aten.").removesuffix(".default").replace(".", "_")
    return f"{name}-{digest}"


# --- JSON round trip -----------------------------------------------------------------------------


def to_json(card: Card) -> dict[str, Any]:
    data = dataclasses.asdict(card)
    data["id"] = card.id
    if card.family is not None and not card.family.served:
        del data["family"]["served"]  # the whole range: the JSON cards had before sub-ranges
    # the chain's JSON is the one its digest (in `args`) was taken over, and what older workspaces hold
    data["chain"] = [e.to_json() for e in card.chain]
    data["fusion"] = None if card.fusion is None else card.fusion.to_json()
    return data


def _meta(d: dict | None) -> TensorMeta | None:
    if d is None:
        return None
    stats = ValueStats(**d["stats"]) if d.get("stats") else None
    return TensorMeta(
        dtype=d["dtype"],
        shape=tuple(d["shape"]),
        stride=tuple(d["stride"]),
        storage_offset=d.get("storage_offset", 0),
        device=d.get("device", "cpu"),
        stats=stats,
    )


def from_json(data: dict[str, Any]) -> Card:
    def arg(d: dict) -> Arg:
        return Arg(
            name=d["name"],
            kind=d["kind"],
            tensor=_meta(d.get("tensor")),
            tensors=tuple(_meta(t) for t in d.get("tensors", ())),
            value=d.get("value"),
        )

    prof = data.get("profile")
    profile = Profile(**{**prof, "kernels": tuple(prof.get("kernels", ()))}) if prof else None
    card = Card(
        op=data["op"],
        schema=data["schema"],
        args=tuple(arg(a) for a in data["args"]),
        outputs=tuple(_meta(o) for o in data["outputs"]),
        kind=data.get("kind", "op"),
        calls=data.get("calls", 0),
        modules=tuple(data.get("modules", ())),
        samples=data.get("samples", 0),
        profile=profile,
        chain=tuple(ChainEntry.from_json(e) for e in data.get("chain") or ()),
        fusion=Fusion.from_json(data["fusion"]) if data.get("fusion") else None,
        family=_family(data.get("family")),
    )
    if "id" in data and data["id"] != card.id:
        raise ValueError(f"card id {data['id']} does not match its contents ({card.id}): edited by hand?")
    return card


def _family(d: dict | None) -> Family | None:
    if d is None:
        return None

    def layout(x: dict | None) -> Layout | None:
        if x is None:
            return None
        return Layout(shape=tuple(x["shape"]), stride=tuple((c, tuple(ds)) for c, ds in x["stride"]))

    return Family(
        dims=tuple(Dim(x["name"], x["min"], x["max"], tuple(x.get("base", ())), x.get("offset", 0))
                   for x in d["dims"]),
        inputs=tuple(layout(x) for x in d["inputs"]),
        outputs=tuple(layout(x) for x in d["outputs"]),
        points=tuple(tuple((n, v) for n, v in p) for p in d.get("points", ())),
        point_calls=tuple(d.get("point_calls", ())),
        point_weights=tuple(d.get("point_weights", ())),
        served=tuple((n, lo, hi) for n, lo, hi in d.get("served", ())),
    )


def save(card: Card, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_json(card), indent=1) + "\n")


def load(path: str | Path) -> Card:
    return from_json(json.loads(Path(path).read_text()))


# Ops that pass a tensor's values through unchanged (a view, a copy of the same dtype).
_PASS_THROUGH = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.t.default",
                 "aten.transpose.int", "aten.permute.default", "aten.expand.default", "aten.squeeze.dim",
                 "aten.unsqueeze.default", "aten.alias.default", "aten.clone.default", "aten.contiguous.default"}
_UPCASTS = {"aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout"}
_PRECISION = {"bfloat16": 0, "float16": 1, "float32": 2, "float64": 3}


def judged_dtypes(card: Card) -> tuple[str, ...]:
    """The dtype whose tolerance judges each output: its own, except where a fusion's output is a
    narrower float's value widened (Gemma-2's residual, summed in bf16, handed to the next layer's norm
    as fp32). Widening adds no digits: stock's fp32 value is a bf16 sum's rounding, and a kernel that
    sums in another order lands an ulp of bf16 away, which fp32's tolerance would call wrong."""
    if card.fusion is None:
        return tuple(o.dtype for o in card.outputs)
    return tuple(_narrowest_source(card, ref, o.dtype) for ref, o in zip(card.fusion.outputs, card.outputs,
                                                                           strict=True))


def _narrowest_source(card: Card, ref: tuple, dtype: str) -> str:
    while ref and ref[0] == "t":
        entry = card.chain[ref[1]]
        source = entry.args[0].ref if entry.args and entry.args[0].kind == "tensor" else ()
        if entry.op not in _PASS_THROUGH | _UPCASTS or not source:
            break
        ref = source
        if source[0] == "t":
            narrower = card.chain[source[1]].outs[source[2]].dtype
        else:
            narrower = card.tensor_inputs()[source[1]].dtype
        if entry.op in _UPCASTS and _PRECISION.get(narrower, 99) < _PRECISION.get(dtype, -1):
            dtype = narrower
    return dtype
