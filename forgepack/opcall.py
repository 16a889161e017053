"""Encode an aten call's arguments into a card, and call the stock op again from a card.

Capture encodes every schema argument (defaults filled in) so that a variant is the full signature;
the verifier, the profiler and the pack's self-test decode them to call `torch.ops.aten` again,
through the runtime's one decoder (`forgepack.runtime.stockcall`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from forgepack.cards import Arg, Card
from forgepack.runtime import stockcall

_ENUMS = (torch.dtype, torch.layout, torch.memory_format)


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


def call_args(card: Card, tensors: list[torch.Tensor | None], device: torch.device | str) -> tuple[list, dict]:
    """Positional and keyword arguments to call the card's op with these tensor inputs (ABI order)."""
    return stockcall.call_args(stockcall.resolve(card.op), recorded(card.args), tensors, torch.device(device))


def recorded(args: tuple[Arg, ...]) -> list[stockcall.Recorded]:
    """A card's arguments as the stock-call decoder reads them."""
    return [(a.kind, len(a.tensors), a.value) for a in args]


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
    func = stockcall.resolve(card.op)
    return lambda: stockcall.flatten_outputs(func(*args, **kwargs))
