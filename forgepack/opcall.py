"""Encode an aten call's arguments into a card, and call the stock op again from a card.

Capture encodes every schema argument (defaults filled in) so that a variant is the full signature;
the verifier, the profiler and the pack's self-test decode them to call `torch.ops.aten` again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from forgepack.cards import Arg, Card

_ENUMS = (torch.dtype, torch.layout, torch.memory_format)


def resolve(op: str) -> torch._ops.OpOverload:
    """`aten._softmax.default` -> the OpOverload."""
    ns, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


def op_key(func: torch._ops.OpOverload) -> str:
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


def encode_value(value: Any) -> Any:
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


def is_tensor_list(value: Any) -> bool:
    return isinstance(value, list | tuple) and len(value) > 0 and all(isinstance(v, torch.Tensor) for v in value)


def decode_value(schema_arg: Any, value: Any, device: torch.device) -> Any:
    type_str = str(getattr(schema_arg, "real_type", schema_arg.type))  # `.type` spells ScalarType as int
    if value is None:
        return None
    if "ScalarType" in type_str or "Layout" in type_str or "MemoryFormat" in type_str:
        return getattr(torch, value)
    if "Device" in type_str:
        return device
    return value


def call_args(card: Card, tensors: list[torch.Tensor | None], device: torch.device | str) -> tuple[list, dict]:
    """Positional and keyword arguments to call the card's op with these tensor inputs (ABI order)."""
    device = torch.device(device)
    func = resolve(card.op)
    feed = iter(tensors)
    args, kwargs = [], {}
    for schema_arg, a in zip(func._schema.arguments, card.args, strict=True):
        value = _decode_arg(a, schema_arg, feed, device)
        if schema_arg.kwarg_only:
            kwargs[schema_arg.name] = value
        else:
            args.append(value)
    return args, kwargs


def _decode_arg(a: Arg, schema_arg: Any, feed, device: torch.device) -> Any:
    if a.kind == "tensor":
        return next(feed)
    if a.kind == "tensors":
        return [next(feed) for _ in a.tensors]
    if a.kind == "none":
        next(feed)
        return None
    return decode_value(schema_arg, a.value, device)


def run_stock(card: Card, tensors: list[torch.Tensor | None], device: torch.device | str) -> list[torch.Tensor]:
    """Call the stock aten op; outputs as a flat list of tensors (ABI output order). A fusion card's
    stock is its chain of aten calls, replayed (`forgepack.fusion.run_chain`)."""
    return stock_call(card, tensors, device)()


def stock_call(card: Card, tensors: list[torch.Tensor | None], device: torch.device | str
               ) -> Callable[[], list[torch.Tensor]]:
    """A zero-argument callable running the card's stock computation on these inputs (arguments decoded
    once, outside the call: for timing); it returns the outputs as `run_stock` does."""
    if card.kind == "fusion":
        from forgepack import fusion  # lazily: fusion imports this module

        plan = fusion.chain_plan(card, torch.device(device))
        return lambda: plan(tensors)
    args, kwargs = call_args(card, tensors, device)
    func = resolve(card.op)
    return lambda: flatten_outputs(func(*args, **kwargs))


def flatten_outputs(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, list | tuple):
        return [t for r in result for t in flatten_outputs(r)]
    return []
