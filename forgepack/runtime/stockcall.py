"""Calling a stock aten op again from its recorded arguments: the one decoder of recorded values.

A recorded argument is (kind, number of tensors, value): "tensor", "tensors" (a list of that many),
"none" (an absent tensor) or "value" (anything else, as `encode_value` wrote it).
Cards (`forgepack.opcall`), fusion chains and the pack's self-test (manifest variants) all call
through here. Part of the pack runtime: torch and the standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

Recorded = tuple[str, int, Any]  # (kind, number of tensors, value)
_ENUMS = (torch.dtype, torch.layout, torch.memory_format)


def op_key(func: torch._ops.OpOverload) -> str:
    """The OpOverload's name as cards hold it: `aten._softmax.default`."""
    return f"{func.namespace}.{func._schema.name.split('::')[1]}.{func._overloadname}"


def bind(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """(schema argument, value) for every schema argument, defaults filled in."""
    bound = []
    for i, a in enumerate(func._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            bound.append((a, args[i]))
        elif a.name in kwargs:
            bound.append((a, kwargs[a.name]))
        elif a.has_default_value():
            bound.append((a, a.default_value))
        else:
            bound.append((a, None))
    return bound


def frozen(value: Any) -> Any:
    """A recorded value with its lists as tuples: comparable and hashable."""
    return tuple(frozen(v) for v in value) if isinstance(value, list | tuple) else value


def encode_value(value: Any) -> Any:
    """A non-tensor argument as cards record it (JSON-able): dtypes, layouts and memory formats by name,
    a device by its type, symbolic sizes by their hint, sequences as lists."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.device):
        return value.type
    if isinstance(value, _ENUMS):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return value.node.hint if hasattr(value, "node") else int(value)
    if isinstance(value, list | tuple):
        return [encode_value(v) for v in value]
    return value


def resolve(op: str) -> torch._ops.OpOverload:
    """`aten._softmax.default` -> the OpOverload."""
    ns, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


def decode_value(schema_arg: Any, value: Any, device: torch.device) -> Any:
    """A recorded non-tensor value as the op takes it: dtype, layout and memory format names become
    torch objects, a device the call's device."""
    type_str = str(getattr(schema_arg, "real_type", schema_arg.type))  # `.type` spells ScalarType as int
    if value is None:
        return None
    if "ScalarType" in type_str or "Layout" in type_str or "MemoryFormat" in type_str:
        return getattr(torch, value)
    if "Device" in type_str:
        return device
    return value


def call_args(func: torch._ops.OpOverload, recorded: Iterable[Recorded], tensors: list[torch.Tensor | None],
              device: torch.device) -> tuple[list, dict]:
    """Positional and keyword arguments calling `func` with these tensor inputs (ABI order: schema
    order, lists flattened, None kept) and the recorded values."""
    feed = iter(tensors)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for schema_arg, arg in zip(func._schema.arguments, recorded, strict=True):
        value = _decode(schema_arg, arg, feed, device)
        if schema_arg.kwarg_only:
            kwargs[schema_arg.name] = value
        else:
            args.append(value)
    return args, kwargs


def _decode(schema_arg: Any, arg: Recorded, feed: Iterator, device: torch.device) -> Any:
    kind, count, value = arg
    if kind == "tensor":
        return next(feed)
    if kind == "tensors":
        return [next(feed) for _ in range(count)]
    if kind == "none":
        next(feed)
        return None
    return decode_value(schema_arg, value, device)


def flatten_outputs(result: Any) -> list[torch.Tensor]:
    """An op's result as a flat list of tensors (ABI output order)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, list | tuple):
        return [t for r in result for t in flatten_outputs(r)]
    return []
