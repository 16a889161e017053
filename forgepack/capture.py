"""Capture: every aten call a model makes, grouped into variants (op overload + full signature).

A `TorchDispatchMode` sees every call whatever Python API produced it (`torch.*`, `F.*`, tensor methods,
`@`), at the level where a pack's override is registered. The model runs under `torch.no_grad()`, where
composite ops (`linear`, `layer_norm`, `softmax.int`) arrive already decomposed into ops with backend
kernels (`addmm`, `native_layer_norm`, `_softmax`); a composite that still arrives (e.g. under
`inference_mode`) is decomposed here, so cards always name ops that can be overridden. Backend-key
overrides fire under `inference_mode` too, because composites decompose below it in both modes.

Module paths come from forward pre/post hooks; layer indices are folded (`model.layers.*.mlp`).

Dataflow (for fusion cards, `forgepack.fusion`): every call's tensor arguments are traced to where
they came from, as a *ref*: ``("call", j, k)`` (output k of call j of the log), ``("param", name)`` (a
parameter or buffer of the model) or ``("ext", n)`` (any other tensor, e.g. the model's inputs). The
per-call log is `Capture.calls`; module calls (and calls of the free functions passed as `functions`)
record the refs (and metadata) of their tensor arguments and the refs of what they returned.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from forgepack import samples as samples_mod
from forgepack.cards import Arg, Card
from forgepack.opcall import is_tensor_list
from forgepack.runtime.fresh import span
from forgepack.runtime.opclasses import needs_decompose
from forgepack.runtime.stockcall import bind, encode_value, flatten_outputs, op_key

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
    calls: list[CallRecord] = field(default_factory=list)  # the global call log, with dataflow


@dataclass(frozen=True)
class CallRecord:
    """One aten call of the log: its op and encoded arguments, where each tensor input came from."""

    op: str
    schema: str
    args: tuple[Arg, ...]  # encoded as in cards (tensor metas without value statistics)
    inputs: tuple  # a ref (see the module docstring) per tensor input in ABI order; None for a None
    outputs: tuple  # TensorMeta of each output tensor, in order
    module: str  # folded path of the innermost module that issued it


@dataclass
class ModuleCall:
    """One module forward (or wrapped free function call) and the aten calls made inside it."""

    path: str  # module path, or "fn:<python module>.<name>" for a free function
    module: Any  # the torch.nn.Module, or the original function
    first: int  # index of the first aten call inside it in the global call log
    last: int  # one past the last
    args: tuple = ()  # per positional argument: ("t", ref, TensorMeta), ("v", value) or ("o", type name)
    kwargs: dict = field(default_factory=dict)  # the same per keyword argument
    outputs: tuple = ()  # refs of the returned tensors, in order (tuples and lists flattened)
    kind: str = "module"  # "module" | "function"
    parent: int = -1  # index (in `Capture.module_calls`) of the innermost call it ran inside; -1: none
    returns: str = ""  # "tensor" | "tuple" (of tensors) | "other": what the call returned


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
        self.sources = WeakTensorKeyDictionary()  # tensor -> ref (see the module docstring)
        self.records: list[CallRecord] = []
        self.externals = 0
        self.open_calls: list[int] = []  # indices of the module/function calls still running

    def ref(self, t: torch.Tensor | None) -> tuple | None:
        """Where a tensor came from; a tensor not seen before is a new external input."""
        if t is None:
            return None
        found = self.sources.get(t)
        if found is None:
            found = self.sources[t] = ("ext", self.externals)
            self.externals += 1
        return found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if needs_decompose(func):
            with self:  # the mode is off inside its own handler: turn it on so the parts are recorded
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        op, schema, encoded, tensors = encode(func, args, kwargs)
        key = (op, tuple(a.key() for a in encoded))
        variant = self.variants.get(key)
        inputs = None
        if self._wants(variant, tensors):
            inputs = [None if t is None else samples_mod.window(t).cpu() for t in tensors]
        if variant is None:
            _, _, encoded, _ = encode(func, args, kwargs, with_stats=True)  # stats from the first call only
        refs = tuple(self.ref(t) for t in tensors)  # before the call: an in-place op rebinds its output
        result = func(*args, **kwargs)
        outputs = flatten_outputs(result)
        index = len(self.log)
        for k, o in enumerate(outputs):
            self.sources[o] = ("call", index, k)
        path = fold_path(self.module_stack[-1]) if self.module_stack else "<model>"
        metas = tuple(samples_mod.meta_of(o) for o in outputs)
        self.records.append(CallRecord(op, schema, encoded, refs, metas, path))
        if variant is None:
            variant = self.variants[key] = _Variant(op, schema, encoded, metas)
            self.order.append(key)
        variant.calls += 1
        variant.modules[path] += 1
        self.log.append(key)
        if inputs is not None:
            self._keep(variant, tensors, inputs, outputs)
        return result

    def _wants(self, variant: _Variant | None, tensors: list) -> bool:
        """Whether this call's inputs may become a sample, judged from metadata before anything is copied
        (an embedding weight or logits can be hundreds of MB: copying them to the host only to drop
        them cost more than the capture itself)."""
        kept = 0 if variant is None else len(variant.sample_sets)
        if not self.keep_samples or kept >= samples_mod.MAX_SAMPLES_PER_CARD:
            return False
        size = sum(span(tuple(t.shape), t.stride()) * t.element_size() for t in tensors if t is not None)
        room = samples_mod.MAX_BYTES_PER_WORKSPACE - self.sample_bytes
        return size <= samples_mod.MAX_BYTES_PER_CARD and size <= room

    def _keep(self, variant: _Variant, tensors: list, inputs: list, outputs: list) -> None:
        size = sum(t.numel() * t.element_size() for t in inputs if t is not None)
        size += sum(span(tuple(o.shape), o.stride()) * o.element_size() for o in outputs)
        if size > samples_mod.MAX_BYTES_PER_CARD or self.sample_bytes + size > samples_mod.MAX_BYTES_PER_WORKSPACE:
            return
        self.sample_bytes += size
        variant.sample_sets.append((inputs, [samples_mod.window(o).cpu() for o in outputs]))


def capture(model: torch.nn.Module, run: Callable[[], Any], keep_samples: bool = True,
            functions: tuple[tuple[Any, str], ...] = ()) -> Capture:
    """Run `run()` once under the recorder and return the variants as cards.

    `functions`: (owner, attribute name) pairs of free functions (e.g. a transformers modeling module
    and "apply_rotary_pos_emb") whose calls are recorded like module calls, for fusion cards.
    """
    recorder = _Recorder(keep_samples)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        recorder.sources[t] = ("param", name)
    module_calls: list[ModuleCall] = []
    handles = _install_hooks(model, recorder, module_calls)
    wrapped = [(owner, name, getattr(owner, name)) for owner, name in functions]
    for owner, name, original in wrapped:
        setattr(owner, name, _wrap_function(owner, name, original, recorder, module_calls))
    try:
        with torch.no_grad(), recorder:
            run()
    finally:
        for h in handles:
            h.remove()
        for owner, name, original in reversed(wrapped):
            setattr(owner, name, original)
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
    return Capture(cards, sample_map, module_calls, len(recorder.log), recorder.records)


def _arg_ref(recorder: _Recorder, value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("t", recorder.ref(value), samples_mod.meta_of(value))
    if value is None or isinstance(value, bool | int | float | str):
        return ("v", value)
    return ("o", type(value).__name__)


def _output_refs(recorder: _Recorder, output: Any) -> tuple:
    return tuple(recorder.ref(t) for t in flatten_outputs(output))


def _returns(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return "tensor"
    if isinstance(output, tuple) and output and all(isinstance(t, torch.Tensor) for t in output):
        return "tuple"
    return "other"


def _enter(recorder: _Recorder, calls: list[ModuleCall], call: ModuleCall) -> None:
    call.parent = recorder.open_calls[-1] if recorder.open_calls else -1
    recorder.open_calls.append(len(calls))
    calls.append(call)


def _leave(recorder: _Recorder, call: ModuleCall, output: Any) -> None:
    recorder.open_calls.pop()
    call.last = len(recorder.log)
    call.outputs = _output_refs(recorder, output)
    call.returns = _returns(output)


def _wrap_function(owner: Any, name: str, original: Callable, recorder: _Recorder, calls: list[ModuleCall]):
    path = f"fn:{getattr(owner, '__name__', type(owner).__name__)}.{name}"

    def wrapper(*args, **kwargs):
        call = ModuleCall(path, original, len(recorder.log), -1, tuple(_arg_ref(recorder, a) for a in args),
                          {k: _arg_ref(recorder, v) for k, v in kwargs.items()}, kind="function")
        _enter(recorder, calls, call)
        out = original(*args, **kwargs)
        _leave(recorder, call, out)
        return out

    wrapper.__wrapped__ = original
    return wrapper


def _install_hooks(model: torch.nn.Module, recorder: _Recorder, calls: list[ModuleCall]) -> list:
    handles = []
    for name, module in model.named_modules():
        path = name or "<model>"

        def pre(mod, args, kwargs, _path=path):
            recorder.module_stack.append(_path)
            _enter(recorder, calls, ModuleCall(_path, mod, len(recorder.log), -1,
                                               tuple(_arg_ref(recorder, a) for a in args),
                                               {k: _arg_ref(recorder, v) for k, v in kwargs.items()}))

        def post(mod, args, kwargs, output, _path=path):
            recorder.module_stack.pop()
            if recorder.open_calls and calls[recorder.open_calls[-1]].path == _path:
                _leave(recorder, calls[recorder.open_calls[-1]], output)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    return handles



def merge(captures: list[Capture]) -> Capture:
    """Several captures (a serving envelope's points) as one: a variant seen at several points is one card
    with its calls summed and its first sample sets kept. The per-call logs are not merged (their indices
    are per run), so a merged capture has no dataflow: fusion cards come from single-shape captures."""
    cards: dict[str, Card] = {}
    sample_map: dict[str, list] = {}
    for cap in captures:
        for card in cap.cards:
            seen = cards.get(card.id)
            if seen is None:
                cards[card.id] = card
                sample_map[card.id] = list(cap.samples.get(card.id, ()))
                continue
            modules = tuple(dict.fromkeys((*seen.modules, *card.modules)))[:MAX_MODULE_PATHS]
            cards[card.id] = dataclasses.replace(seen, calls=seen.calls + card.calls, modules=modules)
            room = samples_mod.MAX_SAMPLES_PER_CARD - len(sample_map[card.id])
            sample_map[card.id].extend(cap.samples.get(card.id, ())[:max(0, room)])
    return Capture(list(cards.values()), sample_map, [], sum(c.total_calls for c in captures))
