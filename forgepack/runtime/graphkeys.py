"""Graph mode's keys and output copies: what identifies a graph (`signature`, `scan_arguments`), and
outputs copied out of a graph's static buffers (`copy_outputs`), with the walks they share.

The key is described in `graphs.py`'s docstring. Part of the pack runtime: torch and the standard
library only.
"""

from __future__ import annotations

import copy
import enum
import types
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

_MAX_NODES = 4096  # arguments larger than this (nodes walked) are not keyed: eager
MAX_DEPTH = 12


class _NotGraphable(Exception):
    """An argument that cannot be keyed; the message says why."""



# ----------------------------------------------------------------------------------------------------
# Signatures: what identifies a graph


SCALARS = (type(None), bool, int, str, bytes, complex)
HASHABLE = (torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum, type,
             types.FunctionType, types.BuiltinFunctionType, type(Ellipsis))


@dataclass
class Scan:
    """One walk over a call's arguments."""

    key: tuple | None = None
    reason: str = ""  # why the call is not graphable ('' when it is)
    tensors: list[torch.Tensor] = field(default_factory=list)  # by value, in walk order
    objects: list[Any] = field(default_factory=list)  # by reference (held by a graph)
    devices: set = field(default_factory=set)
    needs_grad: bool = False
    nodes: int = 0
    seen: dict = field(default_factory=dict)  # id -> True for objects already fingerprinted

    @property
    def device(self) -> torch.device | None:
        return next(iter(self.devices)) if len(self.devices) == 1 else None


def _tensor_ok(scan: Scan, t: torch.Tensor) -> None:
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        raise _NotGraphable(f"tensor subclass {type(t).__name__}")
    if t.layout != torch.strided or t.is_meta:
        raise _NotGraphable(f"{t.layout} tensor" if t.layout != torch.strided else "meta tensor")
    scan.devices.add(t.device)
    scan.needs_grad = scan.needs_grad or t.requires_grad


def _count(scan: Scan, depth: int) -> None:
    scan.nodes += 1
    if scan.nodes > _MAX_NODES:
        raise _NotGraphable(f"arguments hold more than {_MAX_NODES} values")
    if depth > MAX_DEPTH:
        raise _NotGraphable(f"arguments nest deeper than {MAX_DEPTH} levels")


def _value_key(scan: Scan, x: Any, depth: int) -> Hashable:
    """Key of an argument used by value; tensors are collected for copying into static buffers."""
    _count(scan, depth)
    if isinstance(x, torch.Tensor):
        _tensor_ok(scan, x)
        scan.tensors.append(x)
        return ("t", x.dtype, x.device, tuple(x.shape), x.stride(), x.requires_grad)
    kind = type(x)
    if kind in SCALARS:
        return (kind, x)
    if kind is float:
        return (float, x.hex())  # exact: tells -0.0 from 0.0, and nan equals itself
    if kind is torch.Size:
        return ("size", tuple(x))
    if kind is slice:
        return ("slice", _plain_key(x.start), _plain_key(x.stop), _plain_key(x.step))
    if kind in (tuple, list) or (isinstance(x, tuple) and hasattr(x, "_fields")):
        return (kind, tuple(_value_key(scan, v, depth + 1) for v in x))
    if kind is dict:
        return (dict, tuple((_plain_key(k), _value_key(scan, v, depth + 1)) for k, v in x.items()))
    if isinstance(x, HASHABLE):
        return ("h", x)
    return _object_key(scan, x, depth)


def _plain_key(k: Any) -> Hashable:
    if isinstance(k, float):
        return (float, k.hex())
    if isinstance(k, (*SCALARS, *HASHABLE)):
        return k
    raise _NotGraphable(f"{type(k).__name__} as a dict key or slice bound")


def _object_key(scan: Scan, x: Any, depth: int) -> Hashable:
    """An argument object used by reference: identity plus a fingerprint of what it holds.

    Walked on every call (a 16-layer static cache is ~200 attributes), so the common members take a
    short path (`_member_keys`): scalars are their own key, a tensor is its address and layout.
    """
    oid = id(x)
    if oid in scan.seen:
        return ("seen", oid)
    scan.seen[oid] = True
    scan.objects.append(x)
    if isinstance(x, torch.nn.Module):
        return ("module", oid)  # parameters are baked in by address: see the module docstring
    attrs = _members(x)
    if attrs is None:
        return ("opaque", type(x), oid)  # nothing visible inside (a generator, a lock)
    _count(scan, depth)
    scan.nodes += len(attrs)
    return (type(x), oid, tuple(attrs), _member_keys(scan, attrs.values(), depth + 1))


def _members(x: Any) -> dict[str, Any] | None:
    """What an object holds: its __dict__, else its __slots__ values, else a tuple subclass's items."""
    attrs = getattr(x, "__dict__", None)
    if attrs is not None:
        return attrs
    slots = [name for cls in type(x).__mro__ for name in getattr(cls, "__slots__", ()) if name != "__weakref__"]
    if slots:
        return {name: getattr(x, name, None) for name in slots}
    if isinstance(x, tuple):
        return {str(i): v for i, v in enumerate(x)}
    return None


_PLAIN = frozenset({type(None), bool, int, str, bytes, complex})


def _member_keys(scan: Scan, values: Any, depth: int) -> tuple:
    """The keys of an object's members. This loop runs for every attribute of a static cache on every
    call, before the replay can be launched, so the commonest members (scalars, tensors, dtypes,
    devices) are keyed inline and only the rest take a call."""
    keys = []
    for v in values:
        kind = type(v)
        if kind in _PLAIN:
            keys.append(v)
        elif kind is torch.Tensor or kind is torch.nn.Parameter:
            device = v.device
            scan.devices.add(device)
            keys.append((v.data_ptr(), v.dtype, device, v.shape, v.stride()))
        elif kind is torch.dtype or kind is torch.device:
            keys.append(("h", v))
        else:
            keys.append(_other_member_key(scan, v, kind, depth))
    return tuple(keys)


def _other_member_key(scan: Scan, v: Any, kind: type, depth: int) -> Hashable:
    if kind is float:
        return ("float", v.hex())
    _count(scan, depth)
    if kind is tuple or kind is list or kind is torch.Size:
        scan.nodes += len(v)
        return (kind, _member_keys(scan, v, depth + 1))
    if kind is dict:
        scan.nodes += len(v)
        return (dict, tuple([(_plain_key(k), *_member_keys(scan, (i,), depth + 1)) for k, i in v.items()]))
    if isinstance(v, torch.Tensor):
        raise _NotGraphable(f"tensor subclass {kind.__name__} inside {type(v).__name__}")
    if isinstance(v, HASHABLE):
        return ("h", v)
    if isinstance(v, torch.nn.Module):
        return ("module", id(v))
    if kind is types.MethodType:
        return ("method", id(v.__self__), v.__func__)
    return _object_key(scan, v, depth)


def scan_arguments(args: tuple, kwargs: dict[str, Any]) -> Scan:
    """Key a call's arguments and collect its by-value tensors and by-reference objects."""
    scan = Scan()
    try:
        a = tuple(_value_key(scan, v, 1) for v in args)
        k = tuple((name, _value_key(scan, v, 1)) for name, v in kwargs.items())
        scan.key = (a, k)
    except _NotGraphable as why:
        scan.reason = f"unsupported argument: {why}"
    except RuntimeError as err:  # e.g. a sparse tensor has no data pointer
        scan.reason = f"unsupported argument: {first_line(err)}"
    return scan


def signature(args: tuple, kwargs: dict[str, Any]) -> tuple | None:
    """The graph key of a call's arguments, or None when they cannot be graphed (the reason is in
    `scan_arguments(args, kwargs).reason`)."""
    return scan_arguments(args, kwargs).key


def describe(args: tuple, kwargs: dict[str, Any]) -> str:
    """A short human-readable signature for messages: `input_ids=int64[1, 1] cuda:0, use_cache=True`."""

    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)} {v.device}"
        if isinstance(v, (*SCALARS, float)):
            return repr(v)
        if isinstance(v, (list, tuple)):
            return f"{type(v).__name__}[{len(v)}]"
        return type(v).__name__

    parts = [one(v) for v in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    text = ", ".join(parts)
    return text if len(text) <= 200 else text[:197] + "..."


def rebuild(x: Any, buffers: Iterator[torch.Tensor]) -> Any:
    """`x` with its by-value tensors replaced by `buffers`, in the walk order of `_value_key`."""
    if isinstance(x, torch.Tensor):
        return next(buffers)
    kind = type(x)
    if kind is tuple or kind is list:
        return kind(rebuild(v, buffers) for v in x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return kind(*(rebuild(v, buffers) for v in x))
    if kind is dict:
        return {k: rebuild(v, buffers) for k, v in x.items()}
    return x  # scalars, hashables, slices (no tensors inside) and by-reference objects



# ----------------------------------------------------------------------------------------------------
# Outputs: copied out of the static buffers


def copy_outputs(x: Any, keep: frozenset[int] | set[int] = frozenset()) -> Any:
    """`x` with every tensor inside replaced by a copy; containers, `ModelOutput`s and plain objects
    (e.g. a cache built inside the forward) are rebuilt, other leaves kept. Objects whose id is in
    `keep` (the call's by-reference arguments) are returned as themselves."""
    return _map_tensors(x, lambda t: t.clone(), keep, {}, 0)


def _map_tensors(x: Any, fn: Callable, keep, memo: dict[int, Any], depth: int) -> Any:
    oid = id(x)
    if oid in keep:
        return x
    if oid in memo:
        return memo[oid]
    if isinstance(x, torch.Tensor):
        memo[oid] = fn(x)
        return memo[oid]
    kind = type(x)
    if kind in SCALARS or kind is float or kind is torch.Size or isinstance(x, HASHABLE) or depth > MAX_DEPTH:
        return x
    if isinstance(x, torch.nn.Module):
        return x
    if isinstance(x, (list, tuple)):
        items = [_map_tensors(v, fn, keep, memo, depth + 1) for v in x]
        if all(a is b for a, b in zip(items, x, strict=True)):
            return x
        memo[oid] = _same_sequence(x, items)
        return memo[oid]
    if isinstance(x, dict):
        items = {k: _map_tensors(v, fn, keep, memo, depth + 1) for k, v in x.items()}
        if all(items[k] is v for k, v in x.items()):
            return x
        if kind is dict:
            memo[oid] = items
            return items
        new = copy.copy(x)  # ModelOutput: its __setitem__ keeps the attribute in step
        for k, v in items.items():
            if v is not x[k]:
                new[k] = v
        memo[oid] = new
        return new
    attrs = _members(x)
    if not attrs or not _holds_tensor(x, depth, set()):
        return x
    new = copy.copy(x)
    memo[oid] = new  # before recursing: objects may refer back to themselves
    for name, v in attrs.items():
        mapped = _map_tensors(v, fn, keep, memo, depth + 1)
        if mapped is not v:
            if hasattr(new, "__dict__"):
                new.__dict__[name] = mapped
            else:
                object.__setattr__(new, name, mapped)
    return new


def _same_sequence(x: list | tuple, items: list) -> list | tuple:
    kind = type(x)
    if kind is list or kind is tuple:
        return kind(items)
    if hasattr(x, "_fields"):  # namedtuple
        return kind(*items)
    try:  # torch.return_types and other tuple subclasses built from one sequence
        return kind(items)
    except TypeError:
        return tuple(items)


def _holds_tensor(x: Any, depth: int, seen: set[int]) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if id(x) in seen or depth > MAX_DEPTH or isinstance(x, (torch.nn.Module, *SCALARS, float, *HASHABLE)):
        return False
    seen.add(id(x))
    if isinstance(x, (list, tuple)):
        return any(_holds_tensor(v, depth + 1, seen) for v in x)
    if isinstance(x, dict):
        return any(_holds_tensor(v, depth + 1, seen) for v in x.values())
    attrs = _members(x)
    return bool(attrs) and any(_holds_tensor(v, depth + 1, seen) for v in attrs.values())


def leaves(x: Any, path: str, keep, out: list, seen: set[int], depth: int = 0) -> list:
    """(path, leaf) pairs of a nested output, for comparing two outputs; kept objects are one leaf."""
    if id(x) in keep:
        out.append((path, ("kept", id(x))))
        return out
    if isinstance(x, torch.Tensor):
        out.append((path, x))
        return out
    if isinstance(x, (*SCALARS, float, torch.Size, *HASHABLE)) or depth > MAX_DEPTH:
        out.append((path, x))
        return out
    if id(x) in seen or isinstance(x, torch.nn.Module):
        out.append((path, ("object", type(x).__name__)))
        return out
    seen.add(id(x))
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            leaves(v, f"{path}[{i}]", keep, out, seen, depth + 1)
    elif isinstance(x, dict):
        for k, v in x.items():
            leaves(v, f"{path}[{k!r}]", keep, out, seen, depth + 1)
    elif _members(x) is not None:
        for k, v in _members(x).items():
            leaves(v, f"{path}.{k}", keep, out, seen, depth + 1)
    else:
        out.append((path, ("object", type(x).__name__)))
    return out


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def output_tensors(x: Any) -> list[torch.Tensor]:
    return [leaf for _, leaf in leaves(x, "", frozenset(), [], set()) if isinstance(leaf, torch.Tensor)]


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def tensor_version(t: torch.Tensor) -> int | None:
    """The tensor's version counter, or None for an inference tensor (which keeps none)."""
    try:
        return t._version
    except RuntimeError:
        return None
