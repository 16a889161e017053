"""C++ code generation of a pack's guarded dispatch shim, and its compilation.

The shim is one shared library per pack, loaded with `torch.ops.load_library` (it needs no Python
ABI). It registers control ops in its own namespace (`forgepack_<slug>::activate`, `deactivate`,
`stats`, `set_enabled`, `variants`, `active`). `activate` captures each overridden op's current kernel
at the backend key, then registers one generated override per op overload at that key; the override
checks each variant's guard in order (most called first) and either calls the variant's kernel or
the captured kernel, so that anything not verified runs exactly what stock PyTorch would.

Parameter and return types are taken from the op's own `at::_ops::<op>::schema` (the headers of the
torch the shim compiles against), so the override has the exact dispatcher signature on every torch
version; the guard for each argument is generated from the schema type and the card's value.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from forgepack import needs as needs_mod
from forgepack.cards import DTYPE_CODES, FREE_STRIDE, Arg, Card, Family, Layout, TensorMeta
from forgepack.families import MAX_STRIDE_DIMS
from forgepack.needs import Align, Needs

SHIM_DIR = Path(__file__).parent / "shim"
ABI_DIR = Path(__file__).parent.parent / "abi"
GUARD_HEADER = SHIM_DIR / "fp_guard.h"
ABI_HEADER = ABI_DIR / "forgepack_abi.h"

ALIGN_BYTES = needs_mod.LEGACY_ALIGN  # fp_guard.h kAlignBytes
MAX_DIMS = 8  # forgepack_abi.h FP_MAX_DIMS

_SCALAR_TYPES = {
    "float32": "Float",
    "float16": "Half",
    "bfloat16": "BFloat16",
    "float64": "Double",
    "int64": "Long",
    "int32": "Int",
    "int16": "Short",
    "int8": "Char",
    "uint8": "Byte",
    "bool": "Bool",
}
_LAYOUTS = {"strided": "c10::kStrided"}
_MEMORY_FORMATS = {
    "contiguous_format": "c10::MemoryFormat::Contiguous",
    "preserve_format": "c10::MemoryFormat::Preserve",
    "channels_last": "c10::MemoryFormat::ChannelsLast",
    "channels_last_3d": "c10::MemoryFormat::ChannelsLast3d",
}


@dataclass(frozen=True)
class ShimVariant:
    """One variant the shim serves: its card, its kernel's path inside the package, and what the kernel
    needs of its inputs (None: `needs.default`, the offset it was verified at)."""

    card: Card
    kernel_file: str  # e.g. "kernels/silu-243212f04a.so"
    needs: Needs | None = None

    def stated_needs(self) -> Needs:
        return self.needs if self.needs is not None else needs_mod.default(self.card)


class Unsupported(Exception):
    """A card the guarded dispatch cannot serve; the message says why (it goes in the build report)."""


# --- what the shim supports --------------------------------------------------------------------------


def _schema(card: Card):
    from torchgen.model import FunctionSchema  # ships with torch; imported lazily (it is not small)

    return FunctionSchema.parse(card.schema.split("::", 1)[-1])


def ops_struct(op: str) -> tuple[str, str, str]:
    """`aten.add.Tensor` -> (struct `add_Tensor`, header `ATen/ops/add_ops.h`, registration name `add.Tensor`)."""
    _, name, overload = op.split(".")
    if overload == "default":
        return name, f"ATen/ops/{name}_ops.h", name
    return f"{name}_{overload}", f"ATen/ops/{name}_ops.h", f"{name}.{overload}"


def check_supported(card: Card, target: str, include_dirs: list[Path] | None = None) -> None:
    """Raise `Unsupported` with the reason if the shim cannot guard and serve this card."""
    if card.kind != "op":
        raise Unsupported("fusion kernels replace a module-level chain; packs dispatch single aten ops only")
    if not card.op.startswith("aten.") or card.op.count(".") != 2:
        raise Unsupported(f"{card.op} is not an aten op overload")
    fs = _schema(card)
    if any(a.annotation is not None for a in fs.arguments.flat_all):
        raise Unsupported("the op mutates or aliases an argument (in-place/out variant)")
    if not fs.returns or any(r.annotation is not None or str(r.type) != "Tensor" for r in fs.returns):
        raise Unsupported("the op does not return fresh tensors (a view, a scalar or a list)")
    if len(fs.returns) != len(card.outputs):
        raise Unsupported("the card's outputs do not match the schema's returns")
    args = fs.arguments.flat_all
    if [a.name for a in args] != [a.name for a in card.args]:
        raise Unsupported("the card's arguments do not match the schema")
    device = "cuda" if target == "cuda" else "cpu"
    metas = [m for m in card.tensor_inputs() if m is not None]
    if not metas:
        raise Unsupported("no tensor input (factory op): nothing to guard the device on")
    for m in [*metas, *card.outputs]:
        _check_meta(m, device)
    if any(o.numel == 0 for o in card.outputs):
        raise Unsupported("an empty tensor as output (nothing to compute)")
    for schema_arg, arg in zip(args, card.args, strict=True):
        _arg_guard(schema_arg.type, arg, "x")  # raises Unsupported for anything it cannot check
    if card.family is not None:
        _check_family(card)
    if include_dirs is not None:
        struct, header, _ = ops_struct(card.op)
        found = next((d / header for d in include_dirs if (d / header).is_file()), None)
        if found is None or f"struct TORCH_API {struct} {{" not in found.read_text():
            raise Unsupported(f"this torch has no at::_ops::{struct} ({header})")


def _check_meta(m: TensorMeta, device: str) -> None:
    if m.dtype not in _SCALAR_TYPES:
        raise Unsupported(f"dtype {m.dtype} is not in the kernel ABI")
    if len(m.shape) > MAX_DIMS:
        raise Unsupported(f"{len(m.shape)} dims (the kernel ABI has {MAX_DIMS})")
    if m.device != device:
        raise Unsupported(f"a tensor on {m.device}, the pack targets {device}")


def _check_family(card: Card) -> None:
    fam = card.family
    inputs = card.tensor_inputs()
    if len(fam.inputs) != len(inputs) or len(fam.outputs) != len(card.outputs):
        raise Unsupported("the family's layouts do not match the card's tensors")
    names = {d.name for d in fam.dims}
    for layout, meta in [*zip(fam.inputs, inputs, strict=True), *zip(fam.outputs, card.outputs, strict=True)]:
        if (layout is None) != (meta is None):
            raise Unsupported("the family's layouts do not match the card's tensors")
        if layout is None:
            continue
        if len(layout.shape) != len(meta.shape) or len(layout.stride) != len(meta.shape):
            raise Unsupported("a family layout's rank is not its tensor's")
        if layout in fam.outputs and FREE_STRIDE in layout.stride:
            raise Unsupported("an output's stride follows no rule: the guard cannot allocate it")
        used = {x for x in layout.shape if isinstance(x, str)}
        used |= {d for rule in layout.stride if rule != FREE_STRIDE for d in rule[1]}
        if used - names:
            raise Unsupported(f"a family layout names unknown dims {sorted(used - names)}")
        if any(len(ds) > MAX_STRIDE_DIMS for _, ds in layout.stride):
            raise Unsupported(f"a stride rule of more than {MAX_STRIDE_DIMS} dims")
    bound = {x for lay in fam.inputs if lay is not None for x in lay.shape if isinstance(x, str)}
    free = {d.name for d in fam.dims if not d.derived}
    if free - bound:
        raise Unsupported(f"dims {sorted(free - bound)} are no input's size: the guard cannot bind them")
    held = {x for lay in fam.outputs if lay is not None for x in lay.shape if isinstance(x, str)}
    if any(d.min == 0 and d.name in held for d in fam.dims):
        raise Unsupported("an output may be empty (a dim's range includes 0): nothing to compute")
    for d in fam.dims:
        if d.derived and (set(d.base) - bound or d.name in bound):
            raise Unsupported(f"derived dim {d.name} must be held by no input and sum dims the inputs bind")


def unsupported_reason(card: Card, target: str, include_dirs: list[Path] | None = None) -> str | None:
    try:
        check_supported(card, target, include_dirs)
    except Unsupported as err:
        return str(err)
    return None


# --- C++ literals -------------------------------------------------------------------------------------


def cpp_int(v: int) -> str:
    if v == -(2**63):
        return "INT64_MIN"
    return f"int64_t({v}LL)"


def cpp_double(v: float) -> str:
    if math.isnan(v):
        return "std::numeric_limits<double>::quiet_NaN()"
    if math.isinf(v):
        return ("-" if v < 0 else "") + "std::numeric_limits<double>::infinity()"
    return float(v).hex()  # exact: a C++17 hexadecimal floating literal


def cpp_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def scalar_spec(value) -> str:
    """`fpg::ScalarSpec{kind, i, f}` for a bool/int/float the card fixed (ABI scalar kinds)."""
    if isinstance(value, bool):
        return f"fpg::ScalarSpec{{FP_SCALAR_BOOL, {int(value)}, {cpp_double(float(value))}}}"
    if isinstance(value, int):
        return f"fpg::ScalarSpec{{FP_SCALAR_INT, {cpp_int(value)}, {cpp_double(float(value))}}}"
    if isinstance(value, float):
        return f"fpg::ScalarSpec{{FP_SCALAR_FLOAT, 0, {cpp_double(value)}}}"
    raise Unsupported(f"a Scalar value {value!r} the guard cannot compare")


def fp_scalar(value) -> str:
    """An `fp_scalar` initializer, as the kernel ABI defines it (f also set for INT and BOOL)."""
    if isinstance(value, bool):
        return f"{{FP_SCALAR_BOOL, 0, {int(value)}, {cpp_double(float(value))}}}"
    if isinstance(value, int):
        return f"{{FP_SCALAR_INT, 0, {cpp_int(value)}, {cpp_double(float(value))}}}"
    return f"{{FP_SCALAR_FLOAT, 0, 0, {cpp_double(float(value))}}}"


# --- per-argument guards ------------------------------------------------------------------------------


@dataclass
class _Guard:
    checks: list[str]  # C++ boolean expressions, cheapest first
    int_lists: list[tuple[str, tuple[int, ...]]]  # (constant name, values) the checks refer to
    devices: tuple[str, ...] = ()  # Device arguments, checked against the inputs' device once that is known


def _arg_guard(t, arg: Arg, p: str, spec: str = "s", bind: str = "") -> _Guard:
    """Checks for one argument `p` of schema type `t` against the card's `arg`. With `bind` (a family
    variant's "<ranges>, <dim values>"), tensors are matched by binding the family's dims."""
    from torchgen.model import BaseTy, BaseType, ListType, OptionalType

    if isinstance(t, OptionalType):
        if arg.kind == "none" or (arg.kind == "value" and arg.value is None):
            return _Guard([f"fpg::is_none({p})"], [])
        inner = _arg_guard(t.elem, arg, f"(*{p})", spec, bind)
        return _Guard([f"{p}.has_value()", *inner.checks], inner.int_lists, inner.devices)
    if isinstance(t, ListType):
        return _list_guard(t, arg, p, spec, bind)
    if not isinstance(t, BaseType):
        raise Unsupported(f"argument type {t}")
    base = t.name
    if base == BaseTy.Tensor:
        if arg.kind == "tensor" and bind:
            return _Guard([f"fpg::bind({p}, {spec}, kDevice, {bind})"], [])
        if arg.kind == "tensor":
            return _Guard([f"fpg::match({p}, {spec}, kDevice)"], [])
        if arg.kind == "value" and isinstance(arg.value, bool | int | float):
            return _Guard([f"fpg::eq_wrapped({p}, {scalar_spec(arg.value)})"], [])
        raise Unsupported(f"argument {arg.name}: a Tensor slot holding {arg.kind}")
    if arg.kind != "value" or arg.value is None:
        raise Unsupported(f"argument {arg.name}: expected a value, the card has {arg.kind}")
    v = arg.value
    if base in (BaseTy.int, BaseTy.SymInt) and isinstance(v, int) and not isinstance(v, bool):
        return _Guard([f"fpg::eq({p}, {cpp_int(v)})"], [])
    if base == BaseTy.float and isinstance(v, int | float) and not isinstance(v, bool):
        return _Guard([f"fpg::eq({p}, {cpp_double(float(v))})"], [])
    if base == BaseTy.bool and isinstance(v, bool):
        return _Guard([f"fpg::eq({p}, {'true' if v else 'false'})"], [])
    if base == BaseTy.Scalar:
        return _Guard([f"fpg::eq({p}, {scalar_spec(v)})"], [])
    if base == BaseTy.ScalarType and v in _SCALAR_TYPES:
        return _Guard([f"fpg::eq({p}, c10::ScalarType::{_SCALAR_TYPES[v]})"], [])
    if base == BaseTy.Layout and v in _LAYOUTS:
        return _Guard([f"fpg::eq({p}, {_LAYOUTS[v]})"], [])
    if base == BaseTy.MemoryFormat and v in _MEMORY_FORMATS:
        return _Guard([f"fpg::eq({p}, {_MEMORY_FORMATS[v]})"], [])
    if base == BaseTy.str and isinstance(v, str):
        return _Guard([f"fpg::eq_str({p}, {cpp_string(v)})"], [])
    if base == BaseTy.Device and v in ("cpu", "cuda"):
        # cards keep a device's type only (`stockcall.encode_value`) and were verified with the inputs' own
        # device there: `.to(device=...)` of the tensor's device (generate()'s logits copy), no other
        return _Guard([f"fpg::is_type({p}, kDevice)"], [], (p,))
    raise Unsupported(f"argument {arg.name} of type {t} = {v!r}")


def _list_guard(t, arg: Arg, p: str, spec: str, bind: str = "") -> _Guard:
    from torchgen.model import BaseTy, BaseType

    elem = t.elem
    if isinstance(elem, BaseType) and elem.name == BaseTy.Tensor:
        if arg.kind != "tensors":
            raise Unsupported(f"argument {arg.name}: a Tensor[] the card holds as {arg.kind}")
        if bind:
            return _Guard([f"fpg::bind_list({p}, {spec}, {len(arg.tensors)}, kDevice, {bind})"], [])
        return _Guard([f"fpg::match_list({p}, {spec}, {len(arg.tensors)}, kDevice)"], [])
    if isinstance(elem, BaseType) and elem.name in (BaseTy.int, BaseTy.SymInt):
        values = arg.value
        if arg.kind != "value" or not isinstance(values, list | tuple):
            raise Unsupported(f"argument {arg.name}: an int list the card holds as {values!r}")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in values):
            raise Unsupported(f"argument {arg.name}: non-int list items {values!r}")
        if not values:
            return _Guard([f"({p}.size() == 0)"], [])
        return _Guard([f"fpg::eq_ints({p}, {spec}, {len(values)})"], [(spec, tuple(values))])
    raise Unsupported(f"argument {arg.name} of list type {t}")


# --- the generated file -------------------------------------------------------------------------------


def _meta_constants(name: str, m: TensorMeta, need: Align | None = None) -> list[str]:
    """An exact tensor's spec; `need` None (an output) or the legacy need keeps today's text."""
    legacy = needs_mod.legacy_align(m)
    need = need or legacy
    align = f"{need.offset}" if need == legacy else f"{need.offset}, {need.bytes}"
    lines = []
    if m.shape:
        lines.append(f"constexpr int64_t {name}_sizes[] = {{{', '.join(map(str, m.shape))}}};")
        lines.append(f"constexpr int64_t {name}_strides[] = {{{', '.join(map(str, m.stride))}}};")
        sizes, strides = f"{name}_sizes", f"{name}_strides"
    else:
        sizes = strides = "nullptr"
    lines.append(
        f"constexpr fpg::TensorSpec {name}{{c10::ScalarType::{_SCALAR_TYPES[m.dtype]}, {DTYPE_CODES[m.dtype]}, "
        f"{len(m.shape)}, {sizes}, {strides}, {align}}};"
    )
    return lines


def _family_constants(name: str, m: TensorMeta, layout: Layout, family: Family, need: Align) -> list[str]:
    """A family tensor's spec: per axis a dim index or a fixed size, per axis a stride rule."""
    index = {d.name: i for i, d in enumerate(family.dims)}
    lines = []
    if layout.shape:
        axes = ", ".join(f"{{{index[x]}, 0}}" if isinstance(x, str) else f"{{-1, {x}}}" for x in layout.shape)
        rules = ", ".join("{-1, 0, {}}" if (c, ds) == FREE_STRIDE  # any non-negative stride
                          else f"{{{c}, {len(ds)}, {{{', '.join(str(index[d]) for d in ds)}}}}}"
                          for c, ds in layout.stride)
        lines.append(f"constexpr fpg::AxisSize {name}_sizes[] = {{{axes}}};")
        lines.append(f"constexpr fpg::StrideRule {name}_strides[] = {{{rules}}};")
        sizes, strides = f"{name}_sizes", f"{name}_strides"
    else:
        sizes = strides = "nullptr"
    lines.append(
        f"constexpr fpg::FamilySpec {name}{{c10::ScalarType::{_SCALAR_TYPES[m.dtype]}, {DTYPE_CODES[m.dtype]}, "
        f"{len(m.shape)}, {sizes}, {strides}, {need.offset}, {need.bytes}}};"
    )
    return lines


def dim_ranges(name: str, family: Family) -> str:
    """The family's dims as the guard binds them (`fpg::DimRange`): each one's served range."""
    ranges = ", ".join("{{{}, {}}}".format(*family.served_range(d.name)) for d in family.dims)
    return f"constexpr fpg::DimRange {name}[] = {{{ranges}}};"


def _numel_expr(layout: Layout, family: Family, dv: str) -> str:
    index = {d.name: i for i, d in enumerate(family.dims)}
    fixed = math.prod(x for x in layout.shape if isinstance(x, int))
    return " * ".join([cpp_int(fixed), *(f"{dv}[{index[x]}]" for x in layout.shape if isinstance(x, str))])


def _derive_checks(fam: Family, dv: str, ranges: str) -> list[str]:
    """Each derived dim computed from its bound base dims (`families.complete`), within its range."""
    index = {d.name: i for i, d in enumerate(fam.dims)}
    return [f"fpg::derive({dv}[{index[d.name]}], {' + '.join(f'{dv}[{index[b]}]' for b in d.base)} + "
            f"{cpp_int(d.offset)}, {ranges}[{index[d.name]}])" for d in fam.dims if d.derived]


def _size_checks(card: Card, needs: Needs, dv: str) -> list[str]:
    """The needs' divisibility as C++ checks on the bound dims; for an exact card, decided here."""
    fam = card.family
    if fam is None:
        inputs = card.tensor_inputs()
        for i, k in needs.numel_multiple:
            if inputs[i].numel % k:
                raise Unsupported(f"the kernel needs input {i}'s numel a multiple of {k}; the card's is "
                                  f"{inputs[i].numel}")
        return []
    index = {d.name: i for i, d in enumerate(fam.dims)}
    checks = [f"({dv}[{index[name]}] % {k} == 0)" for name, k in needs.dim_multiple]
    checks += [f"(({_numel_expr(fam.inputs[i], fam, dv)}) % {k} == 0)" for i, k in needs.numel_multiple]
    return checks


def _variant_block(v: int, sv: ShimVariant, fs, struct_r: str) -> tuple[list[str], list[str]]:
    """(namespace-scope constants, statements inside the override) for variant v."""
    from torchgen.model import OptionalType

    card, needs = sv.card, sv.stated_needs()
    fam = card.family
    dv = f"dv{v}"
    bind = f"v{v}_ranges, {dv}" if fam is not None else ""
    in_layouts = list(fam.inputs) if fam is not None else []
    consts: list[str] = [f"// variant {v}: {card.id}  {card.signature()}"]
    if fam is not None:
        consts.append(f"// family: {card.family_text()}")
        consts.append(dim_ranges(f"v{v}_ranges", fam))
        if fam.served:  # the whole verified range too: a call inside it but outside the served one is counted
            verified = ", ".join(f"{{{d.min}, {d.max}}}" for d in fam.dims)
            consts.append(f"constexpr fpg::DimRange v{v}_verified[] = {{{verified}}};")
    checks: list[str] = [f"variants[{v}].enabled.load(std::memory_order_relaxed)"]
    tensor_checks: list[str] = []
    stride_checks: list[str] = []
    same: list[str] = []
    devices: list[str] = []
    grad: list[str] = []
    describe: list[str] = []
    n_in = 0

    def spec_lines(name: str, m: TensorMeta, k: int) -> list[str]:
        if fam is None:
            return _meta_constants(name, m, needs.align[k])
        return _family_constants(name, m, in_layouts[k], fam, needs.align[k])

    spec_type = "fpg::FamilySpec" if fam is not None else "fpg::TensorSpec"
    for i, (schema_arg, arg) in enumerate(zip(fs.arguments.flat_all, card.args, strict=True)):
        p = f"a{i}"
        spec = f"v{v}_a{i}"
        g = _arg_guard(schema_arg.type, arg, p, spec, bind)
        if arg.kind == "tensor":
            consts += spec_lines(spec, arg.tensor, n_in)
            tensor_checks += g.checks
            value = f"(*{p})" if isinstance(schema_arg.type, OptionalType) else p
            stride_checks.append(f"fpg::strides_ok({value}, {spec}, {dv})")
            same.append(f"same.add({p})")
            grad.append(f"fpg::needs_grad({p})")
            describe.append(f"fpg::describe(in[{n_in}], {p}, {spec}.abi_dtype);")
            n_in += 1
        elif arg.kind == "tensors":
            names = []
            for k, m in enumerate(arg.tensors):
                consts += spec_lines(f"{spec}_{k}", m, n_in + k)
                names.append(f"{spec}_{k}")
            consts.append(f"constexpr {spec_type} {spec}[] = {{{', '.join(names)}}};")
            tensor_checks += g.checks
            stride_checks.append(f"fpg::strides_ok_list({p}, {spec}, {dv})")
            same.append(f"same.add_list({p})")
            grad.append(f"fpg::list_needs_grad({p})")
            describe.append(f"{{ size_t k = {n_in}; for (const at::Tensor& t : {p}) {{ "
                            f"fpg::describe(in[k], t, {spec}[k - {n_in}].abi_dtype); ++k; }} }}")
            n_in += len(arg.tensors)
        elif arg.kind == "none":
            checks += g.checks
            describe.append(f"fpg::describe_none(in[{n_in}]);")
            n_in += 1
        else:
            for name, values in g.int_lists:
                consts.append(f"constexpr int64_t {name}[] = {{{', '.join(cpp_int(x) for x in values)}}};")
            checks += g.checks  # values are cheaper than tensors: checked first
            devices += g.devices
    same += [f"same.device_is({d})" for d in devices]  # after every tensor: `same.device` is theirs then
    if fam is not None:  # derived dims and strides once every dim is bound, then the kernel's needs
        tensor_checks += _derive_checks(fam, dv, f"v{v}_ranges")
        tensor_checks += stride_checks
    tensor_checks += _size_checks(card, needs, dv)
    outs = []
    for j, m in enumerate(card.outputs):
        if fam is None:
            consts += _meta_constants(f"v{v}_out{j}", m)
        else:
            consts += _family_constants(f"v{v}_out{j}", m, fam.outputs[j], fam, Align())
        outs.append(f"v{v}_out{j}")
    alloc_dims = f", {dv}" if fam is not None else ""
    scalars = card.scalars()
    if scalars:
        consts.append(f"constexpr fp_scalar v{v}_scalars[] = {{{', '.join(fp_scalar(s) for s in scalars)}}};")
    joined = " &&\n      ".join(checks + tensor_checks)
    unbound = [f"  int64_t {dv}[{len(fam.dims)}] = {{{', '.join(['-1'] * len(fam.dims))}}};"] if fam else []
    body = [
        f"  // variant {v}: {card.id}",
        *unbound,
        f"  if ({joined}) {{",
        "    fpg::SameDevice same;",
        f"    if ({' && '.join(same)} && control.device_ok(same.device) &&",
        f"        !(c10::GradMode::is_enabled() && ({' || '.join(grad)}))) {{",
        "      c10::OptionalDeviceGuard guard;",
        "      if constexpr (kCuda) guard.reset_device(same.device);",
    ]
    body += [f"      at::Tensor out{j} = fpg::alloc(kBackend, same.device, {o}{alloc_dims});"
             for j, o in enumerate(outs)]
    body.append(f"      fp_tensor in[{max(n_in, 1)}];")
    body += [f"      {line}" for line in describe]
    body.append(f"      fp_tensor out[{len(outs)}];")
    body += [f"      fpg::describe(out[{j}], out{j}, {o}.abi_dtype);" for j, o in enumerate(outs)]
    scalar_ptr = f"v{v}_scalars" if scalars else "nullptr"
    body += [
        f"      const fp_call call{{FP_ABI_VERSION, {n_in}, {len(outs)}, {len(scalars)}, in, out, {scalar_ptr},",
        "                         fpg::current_stream(same.device)};",
        f"      if (variants[{v}].fn.load(std::memory_order_relaxed)(&call) == FP_OK) {{",
        f"        fpg::count(variants[{v}].hits);",
        f"        return {struct_r}({', '.join(f'out{j}' for j in range(len(outs)))});",
        "      }",
        f"      fpg::count(variants[{v}].errors);  // the kernel refused: stock PyTorch serves the call",
        "    }",
        "  }",
    ]
    if fam is not None and fam.served:
        body[-1:] = _outside_count(v, joined, len(fam.dims))
    return consts, body


def _outside_count(v: int, joined: str, n_dims: int) -> list[str]:
    """For a variant served over a sub-range only: on a miss, the same guard over the whole verified
    range, marking the calls it would have taken there; those stock serves (no later variant did) count
    as `outside` in stats(): stock serves them because the kernel does not pay there. Only a miss of such
    a variant pays for the second check."""
    dv, again = f"dv{v}", f"dv{v}w"
    whole = re.sub(rf"\b{dv}\b", again, joined.replace(f"v{v}_ranges", f"v{v}_verified"))
    return [
        f"  }} else {{  // variant {v}'s guard missed: outside its sub-range, or no member at all?",
        f"    int64_t {again}[{n_dims}] = {{{', '.join(['-1'] * n_dims)}}};",
        f"    outside{v} = {whole};",
        "  }",
    ]


def _narrowed(members: list[tuple[int, ShimVariant]]) -> list[int]:
    """The variants kept for a sub-range of their family (`_outside_count`)."""
    return [v for v, sv in members if sv.card.family is not None and sv.card.family.served]


def generate(variants: list[ShimVariant], namespace: str, target: str, title: str = "") -> str:
    """The shim's C++ source for these variants (in guard order), control ops in `namespace`."""
    for sv in variants:
        check_supported(sv.card, target)
        needs_mod.validate(sv.stated_needs(), sv.card)
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", namespace):
        raise ValueError(f"bad op namespace {namespace!r}")
    cuda = target == "cuda"
    ops: list[str] = []
    for sv in variants:
        if sv.card.op not in ops:
            ops.append(sv.card.op)
    headers = sorted({ops_struct(op)[1] for op in ops})
    out = [
        f"// Guarded dispatch shim{' for ' + title if title else ''}: generated by forgepack.pack.shimgen.",
        "// Each override checks its variants' guards in order; a miss calls the stock kernel captured",
        "// at activate.",
        '#include "fp_guard.h"',
        "",
        "#include <dlfcn.h>",
        "#include <limits>",
        "#include <memory>",
        "#include <mutex>",
        "#include <string>",
        "#include <vector>",
        "",
        *[f"#include <{h}>" for h in headers],
        "",
        "namespace {",
        "",
        f"constexpr bool kCuda = {'true' if cuda else 'false'};",
        f"constexpr c10::DispatchKey kBackend = c10::DispatchKey::{'CUDA' if cuda else 'CPU'};",
        f"constexpr c10::DeviceType kDevice = c10::DeviceType::{'CUDA' if cuda else 'CPU'};",
        "",
        "fpg::OpSlot ops[] = {",
        *[f"    {{{cpp_string('aten::' + op.split('.')[1])}, "
          f"{cpp_string('' if op.endswith('.default') else op.split('.')[2])}}}," for op in ops],
        "};",
        "fpg::VariantSlot variants[] = {",
        *[f"    {{{cpp_string(sv.card.id)}, {cpp_string(sv.kernel_file)}}}," for sv in variants],
        "};",
        "void register_overrides(torch::Library& lib);",
        "fpg::Control control{ops, std::size(ops), variants, std::size(variants), kBackend, kCuda,",
        "                     register_overrides};",
        "",
    ]
    for k, op in enumerate(ops):
        out += _override(k, op, [(v, sv) for v, sv in enumerate(variants) if sv.card.op == op])
    out += [
        "void register_overrides(torch::Library& lib) {",
        *[f"  lib.impl({cpp_string(ops_struct(op)[2])}, TORCH_FN(override_{k}));" for k, op in enumerate(ops)],
        "}",
        "",
        "}  // namespace",
        "",
        f"TORCH_LIBRARY({namespace}, m) {{",
        '  m.def("activate(str root, int[] devices) -> int",',
        "        [](const std::string& root, std::vector<int64_t> devices) {",
        "          return control.activate(root, devices);",
        "        });",
        '  m.def("deactivate() -> int", []() { return control.deactivate(); });',
        '  m.def("active() -> bool", []() { return control.active(); });',
        '  m.def("stats() -> int[]", []() { return control.stats(); });',
        '  m.def("set_enabled(int[] flags) -> int",',
        "        [](std::vector<int64_t> flags) { return control.set_enabled(flags); });",
        '  m.def("variants() -> str[]", []() { return control.variant_ids(); });',
        "}",
        "",
    ]
    return "\n".join(out)


def _override(k: int, op: str, members: list[tuple[int, ShimVariant]]) -> list[str]:
    struct, _, _ = ops_struct(op)
    fs = _schema(members[0][1].card)
    n_args = len(fs.arguments.flat_all)
    traits = f"c10::guts::infer_function_traits_t<at::_ops::{struct}::schema>"
    lines = [
        f"// ---- {op}: {members[0][1].card.schema}",
        f"using P{k} = {traits}::parameter_types;",
        f"using R{k} = {traits}::return_type;",
        f"template <size_t I> using A{k} = c10::guts::typelist::element_t<I, P{k}>;",
    ]
    bodies: list[str] = []
    for v, sv in members:
        consts, body = _variant_block(v, sv, fs, f"R{k}")
        lines += consts
        bodies += body
    params = ", ".join(f"A{k}<{i}> a{i}" for i in range(n_args))
    arg_types = ", ".join(f"A{k}<{i}>" for i in range(n_args))
    args = ", ".join(f"a{i}" for i in range(n_args))
    lines += [
        "",
        f"R{k} override_{k}(c10::DispatchKeySet ks, {params}) {{",
        f"  fpg::count(ops[{k}].calls);",
        *[f"  bool outside{v} = false;" for v in _narrowed(members)],
        *bodies,
        *[f"  if (outside{v}) fpg::count(variants[{v}].outside);  // stock serves it: no variant did"
          for v in _narrowed(members)],
        f"  return fpg::call_original<R{k}, {arg_types}>(*ops[{k}].original.load(std::memory_order_acquire),",
        f"                                           *ops[{k}].handle, ks, {args});",
        "}",
        "",
    ]
    return lines


# --- compilation ----------------------------------------------------------------------------------------


def torch_include_dirs() -> list[Path]:
    from torch.utils import cpp_extension

    return [Path(p) for p in cpp_extension.include_paths()]


def compile_command(source: Path, output: Path, include_dirs: list[Path] | None = None) -> list[str]:
    """The g++ command for a shim: the few torch headers it needs, the torch libraries it links."""
    import torch
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "g++")
    incs = [*(include_dirs or []), *torch_include_dirs()]
    libs = [Path(p) for p in cpp_extension.library_paths()]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        cxx, "-O2", "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w",
        *[f"-I{d}" for d in incs],
        str(source), "-o", str(output),
        *[f"-L{d}" for d in libs], "-lc10", "-ltorch_cpu",
    ]


def compile_shim(source: Path, output: Path, include_dirs: list[Path]) -> Path:
    """Compile the shim; raises RuntimeError with the compiler's first errors."""
    cmd = compile_command(source, output, include_dirs)
    env = dict(os.environ)
    env.setdefault("LC_ALL", "C")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "error" in line][:8] or proc.stderr.splitlines()[-8:]
        raise RuntimeError("shim compilation failed:\n" + "\n".join(errors))
    return output


def platform_tag() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", sysconfig.get_platform())
