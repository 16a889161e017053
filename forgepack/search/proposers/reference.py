"""The computation a card stands for, as a short PyTorch program a model can read (and a test can run).

An operator card is one aten call; a fusion card is its chain of aten calls with the data flow between
them (which entry's output feeds which argument) and every constant (an RMSNorm's eps, a rotary's
slices). Both become

    def reference(in0, in1, ...):  # call->inputs, in ABI order
        t0 = torch.ops.aten.pow.Tensor_Scalar(in0, 2)
        ...
        return (t3,)               # call->outputs, in order

Values are written as the stock-call decoder reads them (`forgepack.runtime.stockcall.decode_value`):
dtype, layout and memory-format names as `torch.<name>`, a device as the inputs' device. The program is
what the verifier compares a kernel against, so a prompt that shows it specifies the kernel exactly.
"""

from __future__ import annotations

import math
from typing import Any

from forgepack.cards import Card, ChainArg
from forgepack.runtime import stockcall

_TORCH_NAMED = ("ScalarType", "Layout", "MemoryFormat")


def _literal(schema_arg: Any, value: Any) -> str:
    type_str = str(getattr(schema_arg, "real_type", schema_arg.type))
    if value is None:
        return "None"
    if any(t in type_str for t in _TORCH_NAMED):
        return f"torch.{value}"
    if "Device" in type_str:
        return "DEVICE"
    return _number(value)


def _number(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_number(v) for v in value) + "]"
    return repr(value)


def _ref(ref: tuple, single: dict[int, bool]) -> str:
    if ref[0] == "in":
        return f"in{ref[1]}"
    return f"t{ref[1]}" if single.get(ref[1], False) else f"t{ref[1]}[{ref[2]}]"


def _call(op: str, rendered: list[tuple[Any, str]]) -> str:
    positional = [text for arg, text in rendered if not arg.kwarg_only]
    keyword = [f"{arg.name}={text}" for arg, text in rendered if arg.kwarg_only]
    return f"torch.ops.{op}({', '.join(positional + keyword)})"


def _op_lines(card: Card) -> list[str]:
    schema = stockcall.resolve(card.op)._schema.arguments
    index, rendered = 0, []
    for schema_arg, arg in zip(schema, card.args, strict=True):
        if arg.kind == "tensor":
            text, index = f"in{index}", index + 1
        elif arg.kind == "tensors":
            text = "[" + ", ".join(f"in{index + k}" for k in range(len(arg.tensors))) + "]"
            index += len(arg.tensors)
        elif arg.kind == "none":
            text, index = "None", index + 1
        else:
            text = _literal(schema_arg, arg.value)
        rendered.append((schema_arg, text))
    call = _call(card.op, rendered)
    return [f"    return ({call},)" if len(card.outputs) == 1 else f"    return tuple({call})"]


def _chain_arg(schema_arg: Any, arg: ChainArg, single: dict[int, bool]) -> str:
    if arg.kind == "tensor":
        return _ref(arg.ref, single)
    if arg.kind == "tensors":
        return "[" + ", ".join(_ref(r, single) for r in arg.refs) + "]"
    if arg.kind == "none":
        return "None"
    return _literal(schema_arg, arg.value)


def _chain_lines(card: Card) -> list[str]:
    single = {p: len(entry.outs) == 1 for p, entry in enumerate(card.chain)}
    lines = []
    for p, entry in enumerate(card.chain):
        schema = stockcall.resolve(entry.op)._schema.arguments
        by_name = {a.name: a for a in entry.args}
        rendered = [(s, _chain_arg(s, by_name[s.name], single)) for s in schema if s.name in by_name]
        lines.append(f"    t{p} = {_call(entry.op, rendered)}")
    outputs = ", ".join(_ref(r, single) for r in card.fusion.outputs)
    lines.append(f"    return ({outputs},)")
    return lines


def reference_program(card: Card) -> str:
    """A runnable module defining `reference(in0, ...) -> tuple of outputs` for `card`."""
    n = len(card.tensor_inputs())
    params = ", ".join(f"in{i}" for i in range(n))
    first = next((f"in{i}" for i, m in enumerate(card.tensor_inputs()) if m is not None), None)
    body = _chain_lines(card) if card.kind == "fusion" else _op_lines(card)
    device = f"    DEVICE = {first}.device" if first else "    DEVICE = torch.device('cpu')"
    header = f"def reference({params}):  # call->inputs in ABI order; returns call->outputs in order"
    uses_device = any("DEVICE" in line for line in body)
    return "\n".join(["import torch", "", "", header, *([device] if uses_device else []), *body]) + "\n"


def family_lines(card: Card) -> list[str]:
    """A family card's free dims with their ranges and each tensor's sizes in them: the kernel reads
    these sizes from its descriptors at run time, and is verified over the whole range."""
    family = card.family
    if family is None:
        return []
    lines = [f"Shape family: {card.family_text()}. The sizes below are one member only; the kernel must read "
             "every size named by a dim from call->inputs/outputs at run time (verified at the corners, "
             "interior, odd and prime sizes of each range)."]
    dtypes = [m.dtype if m is not None else None for m in card.tensor_inputs()]
    for i, layout in enumerate(family.inputs):
        if layout is not None:
            lines.append(f"  in[{i}]: {layout.signature(dtypes[i])}")
    for j, layout in enumerate(family.outputs):
        lines.append(f"  out[{j}]: {layout.signature(card.outputs[j].dtype)}")
    return lines
