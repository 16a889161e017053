"""Capture: every aten call a model makes, grouped into variants (op overload + full signature).

A `TorchDispatchMode` sees every call whatever Python API produced it (`torch.*`, `F.*`, tensor methods,
`@`), at the level where a pack's override is registered. The model runs under `torch.no_grad()`, where
composite ops (`linear`, `layer_norm`, `softmax.int`) arrive already decomposed into ops with backend
kernels (`addmm`, `native_layer_norm`, `_softmax`); a composite that still arrives (e.g. under
`inference_mode`) is decomposed here, so cards always name ops that can be overridden. Backend-key
overrides fire under `inference_mode` too, because composites decompose below it in both modes.

Module paths come from forward pre/post hooks; layer indices are folded (`model.layers.*.mlp`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from forgepack import samples as samples_mod
from forgepack.cards import Arg, Card
from forgepack.opcall import bind, encode_value, flatten_outputs, is_tensor_list, op_key

MAX_MODULE_PATHS = 6


@dataclass
class _Variant:
    op: str
    schema: str
    args: tuple[Arg, ...]
    outputs: tuple
    calls: int = 0
    modules: Counter = field(default_factory=Counter)
    sample_sets: list = field(default_factory=list)  # [(inputs, outputs)] cloned to CPU


@dataclass
class Capture:
    """What one forward produced: cards in first-call order, their sample sets, the module call log."""

    cards: list[Card]
    samples: dict[str, list]  # card id -> [(inputs, eager outputs)]
    module_calls: list[ModuleCall]
    total_calls: int


@dataclass
class ModuleCall:
    """One module forward and the aten calls made inside it (for fusion cards)."""

    path: str
    module: torch.nn.Module
    first: int  # index of the first aten call inside it in the global call log
    last: int  # one past the last


def encode(func: torch._ops.OpOverload, args: tuple, kwargs: dict, with_stats: bool = False):
    """(op key, schema, encoded Args, tensor inputs in ABI order) for one call."""
    encoded, tensors = [], []
    for schema_arg, value in bind(func, args, kwargs):
        if isinstance(value, torch.Tensor):
            encoded.append(Arg(schema_arg.name, "tensor", tensor=samples_mod.meta_of(value, with_stats)))
            tensors.append(value)
        elif is_tensor_list(value):
            metas = tuple(samples_mod.meta_of(t, with_stats) for t in value)
            encoded.append(Arg(schema_arg.name, "tensors", tensors=metas))
            tensors.extend(value)
        elif value is None and str(schema_arg.type) == "Optional[Tensor]":
            encoded.append(Arg(schema_arg.name, "none"))
            tensors.append(None)
        else:
            encoded.append(Arg(schema_arg.name, "value", value=encode_value(value)))
    return op_key(func), str(func._schema), tuple(encoded), tensors


def card_from_call(func: torch._ops.OpOverload, args: tuple, kwargs: dict | None = None) -> tuple[Card, list, list]:
    """A card for one direct call, with its inputs and eager outputs (for tests and `forgepack check`)."""
    kwargs = kwargs or {}
    op, schema, encoded, tensors = encode(func, args, kwargs, with_stats=True)
    outputs = flatten_outputs(func(*args, **kwargs))
    card = Card(
        op=op,
        schema=schema,
        args=encoded,
        outputs=tuple(samples_mod.meta_of(t) for t in outputs),
        calls=1,
    )
    return card, tensors, outputs


def _needs_decompose(func: torch._ops.OpOverload) -> bool:
    name = func.name()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    if not has(name, "CompositeImplicitAutograd"):
        return False
    return not any(has(name, key) for key in ("CPU", "CUDA", "CompositeExplicitAutograd"))


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def fold_path(path: str) -> str:
    return _INDEX.sub("*", path) or "<model>"


class _Recorder(TorchDispatchMode):
    def __init__(self, keep_samples: bool):
        super().__init__()
        self.variants: dict[tuple, _Variant] = {}
        self.order: list[tuple] = []
        self.module_stack: list[str] = []
        self.log: list[tuple] = []  # variant key per call, in order
        self.keep_samples = keep_samples
        self.sample_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _needs_decompose(func):
            with self:  # the mode is off inside its own handler: turn it on so the parts are recorded
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        op, schema, encoded, tensors = encode(func, args, kwargs)
        key = (op, tuple(a.key() for a in encoded))
        variant = self.variants.get(key)
        kept = 0 if variant is None else len(variant.sample_sets)
        want_sample = self.keep_samples and kept < samples_mod.MAX_SAMPLES_PER_CARD
        inputs = [None if t is None else samples_mod.window(t).cpu() for t in tensors] if want_sample else None
        if variant is None:
            _, _, encoded, _ = encode(func, args, kwargs, with_stats=True)  # stats from the first call only
        result = func(*args, **kwargs)
        outputs = flatten_outputs(result)
        if variant is None:
            metas = tuple(samples_mod.meta_of(t) for t in outputs)
            variant = self.variants[key] = _Variant(op, schema, encoded, metas)
            self.order.append(key)
        variant.calls += 1
        variant.modules[fold_path(self.module_stack[-1]) if self.module_stack else "<model>"] += 1
        self.log.append(key)
        if inputs is not None:
            self._keep(variant, tensors, inputs, outputs)
        return result

    def _keep(self, variant: _Variant, tensors: list, inputs: list, outputs: list) -> None:
        size = sum(t.numel() * t.element_size() for t in inputs if t is not None)
        size += sum(samples_mod._span(o.shape, o.stride()) * o.element_size() for o in outputs)
        if size > samples_mod.MAX_BYTES_PER_CARD or self.sample_bytes + size > samples_mod.MAX_BYTES_PER_WORKSPACE:
            return
        self.sample_bytes += size
        variant.sample_sets.append((inputs, [samples_mod.window(o).cpu() for o in outputs]))


def capture(model: torch.nn.Module, run: Callable[[], Any], keep_samples: bool = True) -> Capture:
    """Run `run()` once under the recorder and return the variants as cards."""
    recorder = _Recorder(keep_samples)
    module_calls: list[ModuleCall] = []
    handles = _install_hooks(model, recorder, module_calls)
    try:
        with torch.no_grad(), recorder:
            run()
    finally:
        for h in handles:
            h.remove()
    cards, sample_map = [], {}
    for key in recorder.order:
        v = recorder.variants[key]
        card = Card(
            op=v.op,
            schema=v.schema,
            args=v.args,
            outputs=v.outputs,
            calls=v.calls,
            modules=tuple(p for p, _ in v.modules.most_common(MAX_MODULE_PATHS)),
        )
        cards.append(card)
        sample_map[card.id] = v.sample_sets
    return Capture(cards, sample_map, module_calls, len(recorder.log))


def _install_hooks(model: torch.nn.Module, recorder: _Recorder, calls: list[ModuleCall]) -> list:
    handles = []
    for name, module in model.named_modules():
        path = name or "<model>"

        def pre(mod, args, _path=path):
            recorder.module_stack.append(_path)
            calls.append(ModuleCall(_path, mod, len(recorder.log), -1))

        def post(mod, args, output, _path=path):
            recorder.module_stack.pop()
            for call in reversed(calls):
                if call.path == _path and call.last == -1:
                    call.last = len(recorder.log)
                    break

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    return handles

