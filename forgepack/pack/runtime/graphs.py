"""Graph mode: replay a module's forward from CUDA graphs, one graph per input signature.

Shipped inside every pack wheel: imports only torch and the standard library.

How a call runs (`GraphedForward.__call__`):
1. The arguments are keyed (`signature`): per tensor its shape, strides, dtype, device and whether it
   needs grad; every non-tensor argument by value; an argument object that is neither (a transformers
   `StaticCache`, say) by identity plus a fingerprint of what it holds (its tensors' addresses and
   layouts, its scalar attributes). The grad/inference/autocast modes, `module.training` and an
   optional `context_key()` join the key.
2. The first `warmup` calls of a signature run eagerly (they are the caller's real calls), so lazy
   initialisation (cuBLAS handles, a static cache's buffers) happens outside any capture.
3. The next call captures the forward into a `torch.cuda.CUDAGraph` with static input buffers (copies
   of the tensor arguments), in one memory pool shared by every graph of the device, then replays it
   once: that replay is this call's execution. Later calls copy their tensor arguments into the static
   buffers and replay.
4. Outputs are copied out of the graph's static outputs (default), so they stay valid after the next
   call; `copy_outputs=False` returns the static outputs themselves, which the next replay of any graph
   in the pool overwrites. Nested outputs (tuples, lists, dicts, `ModelOutput`s, caches) are rebuilt
   with their tensors copied and their other leaves kept; an argument object that comes back in the
   output (the static cache) is returned as itself.

State contract: tensors held by argument objects (a static KV cache) and the module's parameters and
buffers are used *by reference*: the graph reads and writes them in place at the addresses it was
captured with. That is what makes decode replayable: the graph writes the new key/value into the
cache and advances the cache's device-side length, so the next replay sees the next position. Such an
object must keep its tensors (update them in place, never rebind them); if it rebinds them its
fingerprint changes and the call runs under a new signature instead of replaying a stale graph.
Tensor arguments themselves are used *by value* (copied into the static buffers); a forward that
writes into a tensor argument has the write copied back after each replay (detected during warm-up).

Safety: anything that cannot be captured runs eagerly (CPU tensors, several devices, grad mode with
tensors that need grad, an active dispatch mode, torch.compile tracing, a capture already underway).
A capture that fails (a host sync such as `.item()`, `.cpu()` or `nonzero`, an illegal allocation)
falls back to eager for that signature with one warning, never an error in the caller. Python-side
state that changes the computation (a counter, a float attribute) cannot be seen by a replay: the
build-time gate runs `verify_replay`, which compares replays against eager on fresh inputs and turns
graph mode off for a model it does not match.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import enum
import functools
import inspect
import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_MAX_GRAPHS = 8
DEFAULT_WARMUP = 2
_MAX_NODES = 4096  # arguments larger than this (nodes walked) are not keyed: eager
_MAX_DEPTH = 12
_MAX_REMEMBERED = 256  # signatures whose warm-up count or failure is remembered (LRU)
_DISABLE_ENV = "FORGEPACK_DISABLE"

# Default tolerances of `verify_replay`, per output dtype: (rtol, atol). Replay runs the same kernels as
# eager, but libraries take capture-safe paths under capture (transformers builds an explicit attention
# mask instead of `is_causal`), so low-precision outputs may differ by a few ulps; a stale or wrong
# replay differs by far more.
DEFAULT_TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (3e-2, 3e-2),
}


class CaptureError(RuntimeError):
    """The forward cannot be captured (raised inside the emulated backend; CUDA raises its own)."""


class _NotGraphable(Exception):
    """An argument that cannot be keyed; the message says why."""


# ----------------------------------------------------------------------------------------------------
# Signatures: what identifies a graph


_SCALARS = (type(None), bool, int, str, bytes, complex)
_HASHABLE = (torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum, type,
             types.FunctionType, types.BuiltinFunctionType, type(Ellipsis))


@dataclass
class _Scan:
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


def _tensor_ok(scan: _Scan, t: torch.Tensor) -> None:
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        raise _NotGraphable(f"tensor subclass {type(t).__name__}")
    if t.layout != torch.strided or t.is_meta:
        raise _NotGraphable(f"{t.layout} tensor" if t.layout != torch.strided else "meta tensor")
    scan.devices.add(t.device)
    scan.needs_grad = scan.needs_grad or t.requires_grad


def _count(scan: _Scan, depth: int) -> None:
    scan.nodes += 1
    if scan.nodes > _MAX_NODES:
        raise _NotGraphable(f"arguments hold more than {_MAX_NODES} values")
    if depth > _MAX_DEPTH:
        raise _NotGraphable(f"arguments nest deeper than {_MAX_DEPTH} levels")


def _value_key(scan: _Scan, x: Any, depth: int) -> Hashable:
    """Key of an argument used by value; tensors are collected for copying into static buffers."""
    _count(scan, depth)
    if isinstance(x, torch.Tensor):
        _tensor_ok(scan, x)
        scan.tensors.append(x)
        return ("t", x.dtype, x.device, tuple(x.shape), x.stride(), x.requires_grad)
    kind = type(x)
    if kind in _SCALARS:
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
    if isinstance(x, _HASHABLE):
        return ("h", x)
    return _object_key(scan, x, depth)


def _plain_key(k: Any) -> Hashable:
    if isinstance(k, float):
        return (float, k.hex())
    if isinstance(k, (*_SCALARS, *_HASHABLE)):
        return k
    raise _NotGraphable(f"{type(k).__name__} as a dict key or slice bound")


def _object_key(scan: _Scan, x: Any, depth: int) -> Hashable:
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


def _member_keys(scan: _Scan, values: Any, depth: int) -> tuple:
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


def _other_member_key(scan: _Scan, v: Any, kind: type, depth: int) -> Hashable:
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
    if isinstance(v, _HASHABLE):
        return ("h", v)
    if isinstance(v, torch.nn.Module):
        return ("module", id(v))
    if kind is types.MethodType:
        return ("method", id(v.__self__), v.__func__)
    return _object_key(scan, v, depth)


def scan_arguments(args: tuple, kwargs: dict[str, Any]) -> _Scan:
    """Key a call's arguments and collect its by-value tensors and by-reference objects."""
    scan = _Scan()
    try:
        a = tuple(_value_key(scan, v, 1) for v in args)
        k = tuple((name, _value_key(scan, v, 1)) for name, v in kwargs.items())
        scan.key = (a, k)
    except _NotGraphable as why:
        scan.reason = f"unsupported argument: {why}"
    except RuntimeError as err:  # e.g. a sparse tensor has no data pointer
        scan.reason = f"unsupported argument: {_first_line(err)}"
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
        if isinstance(v, (*_SCALARS, float)):
            return repr(v)
        if isinstance(v, (list, tuple)):
            return f"{type(v).__name__}[{len(v)}]"
        return type(v).__name__

    parts = [one(v) for v in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    text = ", ".join(parts)
    return text if len(text) <= 200 else text[:197] + "..."


def _rebuild(x: Any, buffers: Iterator[torch.Tensor]) -> Any:
    """`x` with its by-value tensors replaced by `buffers`, in the walk order of `_value_key`."""
    if isinstance(x, torch.Tensor):
        return next(buffers)
    kind = type(x)
    if kind is tuple or kind is list:
        return kind(_rebuild(v, buffers) for v in x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return kind(*(_rebuild(v, buffers) for v in x))
    if kind is dict:
        return {k: _rebuild(v, buffers) for k, v in x.items()}
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
    if kind in _SCALARS or kind is float or kind is torch.Size or isinstance(x, _HASHABLE) or depth > _MAX_DEPTH:
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
    if id(x) in seen or depth > _MAX_DEPTH or isinstance(x, (torch.nn.Module, *_SCALARS, float, *_HASHABLE)):
        return False
    seen.add(id(x))
    if isinstance(x, (list, tuple)):
        return any(_holds_tensor(v, depth + 1, seen) for v in x)
    if isinstance(x, dict):
        return any(_holds_tensor(v, depth + 1, seen) for v in x.values())
    attrs = _members(x)
    return bool(attrs) and any(_holds_tensor(v, depth + 1, seen) for v in attrs.values())


def _leaves(x: Any, path: str, keep, out: list, seen: set[int], depth: int = 0) -> list:
    """(path, leaf) pairs of a nested output, for comparing two outputs; kept objects are one leaf."""
    if id(x) in keep:
        out.append((path, ("kept", id(x))))
        return out
    if isinstance(x, torch.Tensor):
        out.append((path, x))
        return out
    if isinstance(x, (*_SCALARS, float, torch.Size, *_HASHABLE)) or depth > _MAX_DEPTH:
        out.append((path, x))
        return out
    if id(x) in seen or isinstance(x, torch.nn.Module):
        out.append((path, ("object", type(x).__name__)))
        return out
    seen.add(id(x))
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _leaves(v, f"{path}[{i}]", keep, out, seen, depth + 1)
    elif isinstance(x, dict):
        for k, v in x.items():
            _leaves(v, f"{path}[{k!r}]", keep, out, seen, depth + 1)
    elif _members(x) is not None:
        for k, v in _members(x).items():
            _leaves(v, f"{path}.{k}", keep, out, seen, depth + 1)
    else:
        out.append((path, ("object", type(x).__name__)))
    return out


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _output_tensors(x: Any) -> list[torch.Tensor]:
    return [leaf for _, leaf in _leaves(x, "", frozenset(), [], set()) if isinstance(leaf, torch.Tensor)]


# ----------------------------------------------------------------------------------------------------
# The graph cache: least recently used out first, bounded by count and bytes (pure, no CUDA)


class GraphCache:
    """An LRU map from signature to captured graph, bounded by count and by bytes.

    `put` inserts and evicts least recently used entries until both bounds hold again; the entry just
    inserted is never evicted by its own insertion (check `fits` first). `get` marks an entry used.
    """

    def __init__(self, max_graphs: int = DEFAULT_MAX_GRAPHS, max_bytes: int | None = None):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1, got {max_graphs}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be 0 or more, got {max_bytes}")
        self.max_graphs = max_graphs
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[Hashable, tuple[Any, int]] = collections.OrderedDict()
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def keys(self) -> list[Hashable]:
        """Least recently used first."""
        return list(self._entries)

    def fits(self, nbytes: int) -> bool:
        return self.max_bytes is None or nbytes <= self.max_bytes

    def get(self, key: Hashable) -> Any | None:
        item = self._entries.get(key)
        if item is None:
            return None
        self._entries.move_to_end(key)
        return item[0]

    def put(self, key: Hashable, entry: Any, nbytes: int) -> list[tuple[Hashable, Any]]:
        """Insert (or replace) and return the evicted (key, entry) pairs, oldest first."""
        self.pop(key)
        self._entries[key] = (entry, nbytes)
        self.total_bytes += nbytes
        evicted = []
        while len(self._entries) > 1 and (len(self._entries) > self.max_graphs or self._over_bytes()):
            old_key, (old, old_bytes) = self._entries.popitem(last=False)
            self.total_bytes -= old_bytes
            evicted.append((old_key, old))
        return evicted

    def pop(self, key: Hashable) -> Any | None:
        item = self._entries.pop(key, None)
        if item is None:
            return None
        self.total_bytes -= item[1]
        return item[0]

    def clear(self) -> None:
        self._entries.clear()
        self.total_bytes = 0

    def _over_bytes(self) -> bool:
        return self.max_bytes is not None and self.total_bytes > self.max_bytes


class _Remembered:
    """A small LRU map (warm-up counts, failure reasons) so a stream of new signatures stays bounded."""

    def __init__(self, size: int = _MAX_REMEMBERED):
        self.size = size
        self.items: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: Hashable, default: Any = None) -> Any:
        return self.items.get(key, default)

    def set(self, key: Hashable, value: Any) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def pop(self, key: Hashable) -> Any:
        return self.items.pop(key, None)

    def clear(self) -> None:
        self.items.clear()


# ----------------------------------------------------------------------------------------------------
# Backends: real CUDA graphs, and an emulation that runs the same machinery on any device


@dataclass
class _Captured:
    replay: Callable[[], None]
    outputs: Any  # the static outputs, structure included
    nbytes: int  # memory this graph holds beyond its static inputs
    handle: Any = None  # keeps the graph alive


class GraphPool:
    """One CUDA graph memory pool with its capture stream; graphs sharing it must run one at a time.

    Every graph of a device shares `shared_pool(device)` unless given its own pool (or "private"). A
    lock serialises threads, and a replay on another stream than the pool's previous one waits for
    that stream first, so graphs sharing the pool's intermediate memory never run concurrently.
    """

    def __init__(self, device: torch.device | str | int | None = None):
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.stream = torch.cuda.Stream(self.device)
        self.lock = threading.RLock()
        self.last_stream: torch.cuda.Stream | None = None
        self._retired: list = []  # (handle, keeper) of pool ids given up after a failed capture
        self.handle, self._keeper = self._new_pool()

    def _new_pool(self) -> tuple[Any, torch.cuda.CUDAGraph]:
        handle = torch.cuda.graph_pool_handle()
        # PyTorch frees a graph pool when the last graph using it is destroyed, and a later capture into
        # the same handle then trips an internal assert (`use_count > 0`, seen on torch 2.11 once every
        # graph of a first model was evicted). An empty graph kept for the pool's lifetime pins it.
        keeper = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the CUDA graph is empty"
            keeper.capture_begin(pool=handle)
            keeper.capture_end()
        return handle, keeper

    def renew(self) -> None:
        """Capture into a fresh pool id from now on (after a failed capture left this one unusable).
        Graphs already captured keep their memory in the old pool, which stays pinned."""
        self._retired.append((self.handle, self._keeper))
        self.stream = torch.cuda.Stream(self.device)  # in case the old one is still marked as capturing
        self.handle, self._keeper = self._new_pool()

    def enter(self) -> torch.cuda.Stream:
        """Order this replay after the pool's previous one; returns the stream it runs on."""
        current = torch.cuda.current_stream(self.device)
        if self.last_stream is not None and self.last_stream != current:
            current.wait_stream(self.last_stream)
        self.last_stream = current
        return current


_POOLS: dict[int, GraphPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(device: torch.device | None = None) -> GraphPool:
    """The one pool every graph of `device` shares by default."""
    device = torch.device(device or "cuda")
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _POOLS_LOCK:
        if index not in _POOLS:
            _POOLS[index] = GraphPool(index)
        return _POOLS[index]


_FAILED: list = []


def recover_failed_capture(pool: GraphPool, device: torch.device) -> None:
    """Undo what a failed capture leaves behind in PyTorch (seen on torch 2.11), so the process goes on.

    - The allocator: when `cudaStreamEndCapture` fails (a host sync invalidated the capture),
      `capture_end` raises before it tells the allocator that the pool's recording is over, and every
      later capture into that pool fails with "beginAllocateToPool: already recording to mempool_id".
      Ending that recording is not enough on torch 2.11 (seen on the H200), so the pool also moves to
      a fresh id (`GraphPool.renew`); graphs captured before keep the old one.
    - The RNG: `capture_begin` puts the CUDA generator in capture mode, and a failed capture never
      takes it out, so every later random op fails with "Offset increment outside graph capture".
    """
    with contextlib.suppress(Exception):
        torch._C._cuda_endAllocateToPool(device.index, pool.handle)
    with contextlib.suppress(Exception):
        pool.renew()
    heal_capture_state(device)


def heal_capture_state(device: torch.device) -> None:
    """Undo what a failed capture leaves behind in PyTorch (seen on torch 2.11, and reported widely).

    When a capture fails, `capture_end` raises before PyTorch's CUDA generator leaves capture mode, and
    every later random op in the process fails with "Offset increment outside graph capture encountered
    unexpectedly". An empty capture, begun and ended cleanly, takes the generator through its prologue
    and epilogue again and resets it; the caller's process keeps working.
    """
    with contextlib.suppress(Exception), torch.cuda.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scratch = torch.empty(1, device=device)
        healer = torch.cuda.CUDAGraph()
        with torch.cuda.stream(torch.cuda.Stream(device)):
            healer.capture_begin()
            scratch.uniform_()  # a random op inside a clean capture: the generator goes in and out again
            healer.capture_end()
        _FAILED.append(healer)


class _CudaBackend:
    """Real CUDA graphs."""

    needs_cuda = True

    def __init__(self, pool: GraphPool | str | None = None):
        self.pool = pool
        self._private: dict[int, GraphPool] = {}

    def pool_for(self, device: torch.device) -> GraphPool:
        if isinstance(self.pool, GraphPool):
            return self.pool
        if self.pool == "private":
            if device.index not in self._private:
                self._private[device.index] = GraphPool(device)
            return self._private[device.index]
        return shared_pool(device)

    def capture(self, fn: Callable, args: tuple, kwargs: dict, device: torch.device) -> _Captured:
        pool = self.pool_for(device)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(device)  # the static inputs were filled on the caller's stream
        reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
        # The stream context restores the caller's stream even when capture_end raises (torch.cuda.graph
        # does not). "thread_local": other threads' CUDA calls stay legal while this one captures.
        with torch.cuda.device(device), torch.cuda.stream(pool.stream):
            try:
                # capture_begin is inside the try: it puts the RNG in capture mode before it can fail
                graph.capture_begin(pool=pool.handle, capture_error_mode="thread_local")
                try:
                    outputs = fn(*args, **kwargs)
                except BaseException:  # the forward's own error is the one to report
                    with contextlib.suppress(Exception), warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        graph.capture_end()
                    raise
                graph.capture_end()
            except BaseException:
                _FAILED.append(graph)  # never destroyed: its pool bookkeeping is inconsistent after a failure
                recover_failed_capture(pool, device)
                raise
        grown = max(torch.cuda.memory_reserved(device) - reserved, torch.cuda.memory_allocated(device) - allocated)
        return _Captured(graph.replay, outputs, max(grown, 0), graph)


# Ops whose result the host must read (a sync under CUDA) or whose output shape depends on data.
_SYNC_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::nonzero",
    "aten::nonzero_numpy", "aten::argwhere", "aten::masked_select", "aten::unique", "aten::_unique",
    "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive",
    "aten::bincount", "aten::_assert_scalar",
})
_NO_KERNEL = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
                        "aten::new_empty_strided"})


def _host_sync(func: Any, args: tuple, kwargs: dict) -> str:
    """Why this aten call would need the host to read device data ('' if it would not)."""
    name = func._schema.name
    if name in _SYNC_OPS:
        return name
    if name == "aten::repeat_interleave" and kwargs.get("output_size") is None and isinstance(args[0], torch.Tensor):
        return name + " without output_size"
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
            return name + " with a boolean mask"
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.Tensor) and arg.device.type == "cpu" and arg.dim() == 0 and any(
            isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args
        ):
            return name + " with a CPU scalar tensor next to CUDA tensors"
    return ""


def _schema_tensors(values: Any) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [v for v in values if isinstance(v, torch.Tensor)]
    return []


class _Recorder:
    """Records the aten calls of one forward, then replays them on the same tensors (emulated capture).

    Like a CUDA graph: Python does not run on replay, constants and branches are baked in, every tensor
    keeps its address, in-place writes to argument and module state repeat. Calls that would sync the
    host raise `CaptureError`. Writes to tensors that existed before the capture are undone at its end,
    because a real capture executes nothing: the replay that follows is the call's execution.
    """

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
                return recorder.dispatch(func, args, kwargs or {})

        self.mode = Mode()
        self.calls: list[tuple[Any, tuple, dict, list[torch.Tensor]]] = []
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._saved_ids: set[int] = set()
        self._fresh: set[int] = set()  # storages allocated during the capture

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        why = _host_sync(func, args, kwargs)
        if why:
            raise CaptureError(f"operation not permitted when stream is capturing (emulated): {why} needs the host")
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in _schema_tensors(value):
                if id(t) not in self._saved_ids and t.untyped_storage().data_ptr() not in self._fresh:
                    self._saved_ids.add(id(t))
                    self.saved.append((t, t.detach().clone()))
        out = func(*args, **kwargs)
        returns = schema.returns
        if returns and all(r.alias_info is not None for r in returns):
            if any(r.alias_info.is_write for r in returns):  # in place / out=: replaying repeats the write
                self.calls.append((func, args, kwargs, []))
            return out  # views need no replay: they alias memory the replay updates
        results = _schema_tensors(out) if not isinstance(out, torch.Tensor) else [out]
        inputs = {t.untyped_storage().data_ptr() for v in (*args, *kwargs.values()) for t in _schema_tensors(v)}
        for t in results:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in inputs:  # _unsafe_view and friends share an input's storage without saying so
                self._fresh.add(ptr)
        if schema.name not in _NO_KERNEL:
            self.calls.append((func, args, kwargs, results))
        return out

    def undo_writes(self) -> None:
        for t, before in reversed(self.saved):
            t.copy_(before)
        self.saved.clear()

    def replay(self) -> None:
        for func, args, kwargs, results in self.calls:
            out = func(*args, **kwargs)
            if not results:  # in place or out=: the call itself wrote where it did at capture
                continue
            fresh = [out] if isinstance(out, torch.Tensor) else _schema_tensors(out)
            for old, new in zip(results, fresh, strict=True):
                if new.shape != old.shape:
                    raise CaptureError(f"emulated replay of {func}: output shape changed {old.shape} -> {new.shape}")
                old.copy_(new)


class _EmulatedBackend:
    """Capture as a recorded trace of aten calls, replayed on the same tensors. Used by the CPU tests and
    for dry runs without a GPU; on any device it exercises the same keying, buffers, copies, eviction
    and fallbacks as CUDA graphs. Inside it `torch.cuda.is_current_stream_capturing()` reports True, as
    under a real capture, so libraries take their capture-safe paths (transformers avoids host syncs)."""

    needs_cuda = False

    def capture(self, fn: Callable, args: tuple, kwargs: dict, device: torch.device) -> _Captured:
        recorder = _Recorder()
        real = torch.cuda.is_current_stream_capturing
        torch.cuda.is_current_stream_capturing = lambda: True
        try:
            with recorder.mode:
                outputs = fn(*args, **kwargs)
        finally:
            torch.cuda.is_current_stream_capturing = real
            recorder.undo_writes()
        nbytes = _nbytes(_output_tensors(outputs))
        return _Captured(recorder.replay, outputs, nbytes, recorder)


def _make_backend(backend: str, pool: GraphPool | str | None) -> Any:
    if pool is not None and pool != "private" and not isinstance(pool, GraphPool):
        raise ValueError(f"pool must be None, 'private' or a GraphPool, got {pool!r}")
    if backend == "cuda":
        return _CudaBackend(pool)
    if backend == "emulate":
        return _EmulatedBackend()
    raise ValueError(f"backend must be 'cuda' or 'emulate', got {backend!r}")


# ----------------------------------------------------------------------------------------------------
# GraphedForward


@dataclass
class _Entry:
    captured: _Captured
    statics: list[torch.Tensor]  # static input buffers, in walk order
    objects: tuple  # by-reference arguments: held so their ids stay theirs
    keep: frozenset[int]
    mutated: tuple[int, ...]  # tensor arguments the forward writes: copied back after a replay
    nbytes: int
    summary: str
    stream: Any = None  # CUDA stream the static buffers were allocated on


class _CaptureFailed(Exception):
    pass


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _dispatch_mode_active() -> bool:
    try:
        return torch._C._len_torch_dispatch_stack() > 0
    except AttributeError:  # pragma: no cover - every supported torch has it
        return False


# Keyword arguments after which an HF model's attention mask depends on nothing but the shapes: no
# padding mask, no positions, no cache from the caller (the model numbers the positions 0..n-1 itself).
_SHAPE_ONLY_MASK_KWARGS = frozenset({"input_ids", "inputs_embeds", "pixel_values", "use_cache", "return_dict",
                                     "output_attentions", "output_hidden_states", "logits_to_keep"})


class _CaptureHooks:
    """Stand-ins transformers sees while any thread captures: installed when the first capture begins,
    undone when the last ends. Each stand-in answers differently only in the threads in `threads`."""

    def __init__(self):
        self.threads: collections.Counter[int] = collections.Counter()  # thread -> captures inside
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []

    @contextlib.contextmanager
    def held(self, install: Callable[[], list[Callable[[], None]]]) -> Iterator[None]:
        """`install()` (first capture only) puts the stand-ins in place and returns how to undo each."""
        me = threading.get_ident()
        with self._lock:
            if not self.threads:
                self._undo = install()
            self.threads[me] += 1
        try:
            yield
        finally:
            with self._lock:
                self.threads[me] -= 1
                if not self.threads[me]:
                    del self.threads[me]
                if not self.threads:
                    for undo in reversed(self._undo):
                        undo()
                    self._undo = []


_MASK_HOOKS = _CaptureHooks()  # transformers' host checks of the mask, answered as in eager mode


@contextlib.contextmanager
def _eager_mask_choice(args: tuple, kwargs: dict) -> Iterator[bool]:
    """Lets transformers choose the attention mask under capture as it does in eager mode.

    In eager mode transformers checks on the host that no token is padded and that the positions it
    numbered are consecutive (not packed sequences), and then lets SDPA apply causality itself
    (`is_causal`, no mask). Under stream capture it cannot read the device, so it builds the full mask,
    and every layer's SDPA converts it (two fills and a `where`) and runs its slower masked kernel:
    on GPT-2 (b4 s256, H200) 66 µs of conversions and 30 µs of attention per forward.
    When the caller passes no mask, no positions and no cache (`_SHAPE_ONLY_MASK_KWARGS`), both checks
    pass by construction: the positions are the model's own arange. Then, in this thread and for the
    capture only, `masking_utils` is answered as in eager mode (its `is_tracing` does not count the
    stream capture, the packed-sequence probe finds none), so the graph runs what an eager call runs.
    Other threads, and transformers outside `masking_utils`, see no change. Yields whether it applied."""
    mu = sys.modules.get("transformers.masking_utils")
    iu = sys.modules.get("transformers.utils.import_utils")
    shape_only = len(args) <= 1 and all(v is None or k in _SHAPE_ONLY_MASK_KWARGS for k, v in kwargs.items())
    hooks = (mu is not None and iu is not None and hasattr(iu, "is_cuda_stream_capturing")
             and all(hasattr(mu, n) for n in ("is_tracing", "find_packed_sequence_indices")))
    if not (shape_only and hooks):
        yield False
        return
    with _MASK_HOOKS.held(lambda: _install_mask_hooks(mu, iu)):
        yield True


def _install_mask_hooks(mu: Any, iu: Any) -> list[Callable[[], None]]:
    """Thread-aware stand-ins for the three transformers functions; returns their undoing."""
    real_tracing, real_packed, real_capturing = (mu.is_tracing, mu.find_packed_sequence_indices,
                                                 iu.is_cuda_stream_capturing)
    hide = threading.local()

    def is_cuda_stream_capturing():
        return False if getattr(hide, "on", False) else real_capturing()

    def is_tracing(tensor=None):
        if threading.get_ident() not in _MASK_HOOKS.threads:
            return real_tracing(tensor)
        hide.on = True
        try:
            return real_tracing(tensor)
        finally:
            hide.on = False

    def find_packed_sequence_indices(position_ids):
        return None if threading.get_ident() in _MASK_HOOKS.threads else real_packed(position_ids)

    undo = []
    for module, name, stand_in in ((iu, "is_cuda_stream_capturing", is_cuda_stream_capturing),
                                   (mu, "is_tracing", is_tracing),
                                   (mu, "find_packed_sequence_indices", find_packed_sequence_indices)):
        undo.append(functools.partial(setattr, module, name, getattr(module, name)))
        setattr(module, name, stand_in)
    return undo


# --- one mask conversion per captured forward ---------------------------------------------------------
#
# With a data-dependent mask (a static cache's decode step, with or without a caller's padding mask)
# transformers builds one boolean mask per forward and passes it to every layer's `sdpa_attention_forward`,
# and SDPA converts it to an additive mask in every layer: two fills and a `where`, 48 kernels per Llama-1B decode step
# (H200, `benchmarks/2026-11-30-h200-session6`). For a capture, and only in the capturing thread, the
# "sdpa" entry of transformers' attention registry converts a boolean mask once (per mask object and
# version) and hands the additive mask to transformers' own function, which then runs as before.
# Only calls of one query token are converted: that row always has an unmasked position (the token
# itself), where any large negative value gives the same bits. A prompt with padding has rows with
# nothing to attend to, whose result depends on the value SDPA picks per backend: those calls, and calls
# with a position bias (transformers combines the two itself), keep their boolean mask.
# Session 6 also tried running decode attention with a group's query heads as query rows (no repeated
# key/value heads): cuDNN then took a 64-row wgmma kernel, 13 µs per layer against 7 µs, so no.

_ROUTE_HOOKS = _CaptureHooks()  # transformers' "sdpa" registry entry, converting the mask once
_ROUTE_LOCAL = threading.local()  # .masks: {id(bool mask): (mask, version, additive)} for this capture
# The additive value of a masked position: what SDPA's cuDNN path gives it in half types (finite, so an
# all-masked row cannot turn into NaN), and SDPA's own -inf otherwise. A row with an unmasked position
# comes out the same either way: the masked terms' exponentials are exactly zero.
_MASKED = {torch.float16: -65504.0, torch.bfloat16: -65504.0}


def _sdpa_registry() -> dict | None:
    mu = sys.modules.get("transformers.modeling_utils")
    mapping = getattr(getattr(mu, "AttentionInterface", None), "_global_mapping", None)
    return mapping if isinstance(mapping, dict) and callable(mapping.get("sdpa")) else None


@contextlib.contextmanager
def _mask_once() -> Iterator[bool]:
    """For the capture inside, this thread's transformers SDPA calls share one conversion of each
    boolean mask. Yields whether the route is installed (transformers loaded with an "sdpa" entry)."""
    mapping = _sdpa_registry()
    if mapping is None:
        yield False
        return
    outer = getattr(_ROUTE_LOCAL, "masks", None)
    with _ROUTE_HOOKS.held(lambda: _install_converting_sdpa(mapping)):
        _ROUTE_LOCAL.masks = {}
        try:
            yield True
        finally:
            _ROUTE_LOCAL.masks = outer


def _install_converting_sdpa(mapping: dict) -> list[Callable[[], None]]:
    original = mapping["sdpa"]
    mapping["sdpa"] = _converting_sdpa(original)
    return [functools.partial(mapping.__setitem__, "sdpa", original)]


def _converting_sdpa(original: Callable) -> Callable:
    @functools.wraps(original)
    def sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
        masks = getattr(_ROUTE_LOCAL, "masks", None)
        if (masks is not None and isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
                and isinstance(query, torch.Tensor) and query.dim() == 4 and query.shape[2] == 1
                and query.device.type in ("cuda", "cpu") and kwargs.get("position_bias") is None):
            attention_mask = _additive_mask(masks, attention_mask, query.dtype)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    return sdpa_attention_forward


def _additive_mask(masks: dict, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA would convert it, converted once per capture (every layer gets the same
    mask object from the model)."""
    # An inference tensor (a capture under torch.inference_mode()) keeps no version counter: reading
    # `_version` raises, and failed every such capture on the H200. Its version reads as None, and one
    # mask object is not written between the layers of one forward.
    hit = masks.get(id(mask))
    if hit is not None and hit[0] is mask and hit[1] == _version(mask):
        return hit[2]
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        mask.logical_not(), _MASKED.get(dtype, float("-inf")))
    masks[id(mask)] = (mask, _version(mask), additive)  # holds the mask: its id stays its own
    return additive


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


class GraphedForward:
    """A forward that replays CUDA graphs per input signature and runs eagerly otherwise.

    `target`: an `nn.Module` (its `forward` at construction is wrapped) or any callable.
    `max_graphs` / `max_bytes`: bounds of the graph cache (least recently used evicted first).
    `warmup`: eager calls per signature before it is captured (at least 1: lazy initialisation).
    `pool`: a `GraphPool`, "private" (a pool of its own per device), or None: the one pool shared by
        every graph of the device.
    `copy_outputs`: True (default) returns copies that stay valid; False returns the static outputs,
        overwritten by the next replay of any graph in the same pool.
    `context_key`: a callable whose hashable result joins every key (e.g. which kernels are active),
        so a graph captured in one context is never replayed in another.
    `backend`: "cuda" (real graphs) or "emulate" (recorded aten trace, any device: tests, dry runs).
    """

    def __init__(
        self,
        target: Callable,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        max_bytes: int | None = None,
        warmup: int = DEFAULT_WARMUP,
        pool: GraphPool | str | None = None,
        copy_outputs: bool = True,
        context_key: Callable[[], Hashable] | None = None,
        backend: str = "cuda",
    ):
        if warmup < 1:
            raise ValueError(f"warmup must be at least 1 (lazy initialisation must not be captured), got {warmup}")
        module = target if isinstance(target, torch.nn.Module) else getattr(target, "__self__", None)
        self.fn = eager_forward(target) if isinstance(target, torch.nn.Module) else target
        self.module = module if isinstance(module, torch.nn.Module) else None
        self._restore: tuple[bool, Any] = (False, None)  # set by enable(): the instance's own forward
        self.warmup = warmup
        self.copy_outputs = copy_outputs
        self.context_key = context_key
        self.options = dict(max_graphs=max_graphs, max_bytes=max_bytes, warmup=warmup, pool=pool,
                            copy_outputs=copy_outputs, context_key=context_key, backend=backend)
        self._backend = _make_backend(backend, pool)
        self._cache = GraphCache(max_graphs, max_bytes)
        self._seen = _Remembered()
        self._failed = _Remembered()
        self._mutates = _Remembered()
        self._warned: set = set()
        self._lock = threading.RLock()
        self._module_needs_grad: bool | None = None
        self._counts = collections.Counter()
        self._reasons: collections.Counter = collections.Counter()
        self.failures: dict[str, str] = {}  # signature summary -> why its capture was given up
        # inspect.signature(model.forward) must still show the real parameters (transformers reads them).
        self.__wrapped__ = self.fn
        for name in ("__name__", "__qualname__", "__doc__"):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(self, name, getattr(self.fn, name))

    # -- the call ------------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            reason, key, scan = self._plan(args, kwargs)
        except Exception as err:  # a bug in keying must never become the caller's error
            reason, key, scan = f"internal error while keying: {_first_line(err)}", None, None
        if reason:
            return self._eager(args, kwargs, reason)
        with self._lock:
            entry = self._cache.get(key)
            failed = entry is None and self._failed.get(key) is not None
            count = 0
            if entry is None and not failed:
                count = self._seen.get(key, 0) + 1
                self._seen.set(key, count)
        if entry is not None:
            return self._replay(entry, scan)
        if failed:
            return self._eager(args, kwargs, "capture failed earlier")
        if count <= self.warmup:
            return self._warm(key, scan, args, kwargs)
        return self._capture(key, scan, args, kwargs)

    def _plan(self, args: tuple, kwargs: dict) -> tuple[str, Hashable, _Scan | None]:
        """Why this call runs eagerly ('' if it can be graphed), its key and its scan."""
        if torch.compiler.is_compiling():
            return "torch.compile is tracing", None, None
        if self._backend.needs_cuda and not torch.cuda.is_available():
            return "CUDA is not available", None, None
        if _dispatch_mode_active():
            return "a TorchDispatchMode is active", None, None
        scan = scan_arguments(args, kwargs)
        if scan.reason:
            return scan.reason, None, None
        if len(scan.devices) > 1:
            return "tensors on several devices", None, None
        if self._backend.needs_cuda:
            if not scan.devices:
                return "no tensor argument", None, None
            if scan.device.type != "cuda":
                return f"tensors on {scan.device.type} (graphs need CUDA)", None, None
            if torch.cuda.is_current_stream_capturing():
                return "inside another CUDA graph capture", None, None
        if torch.is_grad_enabled() and (scan.needs_grad or self._needs_grad()):
            return "grad mode is on (graph mode serves inference: use torch.no_grad())", None, None
        return "", (scan.key, self._context()), scan

    def _needs_grad(self) -> bool:
        if self._module_needs_grad is None:
            params = self.module.parameters() if self.module is not None else ()
            self._module_needs_grad = any(p.requires_grad for p in params)
        return self._module_needs_grad

    def _context(self) -> Hashable:
        autocast = tuple(
            (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in ("cuda", "cpu")
        )
        training = self.module.training if self.module is not None else None
        extra = self.context_key() if self.context_key is not None else None
        return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, training, extra)

    def _eager(self, args: tuple, kwargs: dict, reason: str) -> Any:
        self._counts["eager_calls"] += 1
        self._reasons[reason] += 1
        if reason.startswith("grad mode") and "grad" not in self._warned:
            self._warned.add("grad")
            warnings.warn(f"forgepack graph mode: {reason}; running eagerly", RuntimeWarning, stacklevel=3)
        return self.fn(*args, **kwargs)

    def _warm(self, key: Hashable, scan: _Scan, args: tuple, kwargs: dict) -> Any:
        versions = [_version(t) for t in scan.tensors]
        before = {i: t.clone() for i, (t, v) in enumerate(zip(scan.tensors, versions, strict=True)) if v is None}
        self._counts["warmups"] += 1
        out = self._eager(args, kwargs, "warm-up")
        written = set(self._mutates.get(key, ()))
        for i, (t, v) in enumerate(zip(scan.tensors, versions, strict=True)):
            changed = not torch.equal(before[i], t) if v is None else _version(t) != v
            if changed:
                written.add(i)
        if written:
            self._mutates.set(key, tuple(sorted(written)))
        return out

    def _capture(self, key: Hashable, scan: _Scan, args: tuple, kwargs: dict) -> Any:
        summary = describe(args, kwargs)
        device = scan.device or torch.device("cpu")
        try:
            with self._guard(device):
                entry = self._capture_entry(key, scan, args, kwargs, device, summary)
                fits = self._cache.fits(entry.nbytes)
                out = self._run(entry, scan, copy_in=False, force_copy=not fits)
        except _CaptureFailed as failed:
            self._give_up(key, summary, str(failed))
            return self._eager(args, kwargs, "capture failed")
        if not fits:
            limit = self._cache.max_bytes
            self._give_up(key, summary, f"graph holds {entry.nbytes} bytes, over max_bytes={limit}", warn=False)
            return out
        self._counts["evictions"] += len(self._cache.put(key, entry, entry.nbytes))
        return out

    def _capture_entry(self, key, scan, args, kwargs, device, summary) -> _Entry:
        statics = [torch.empty_like(t, memory_format=torch.preserve_format).copy_(t) for t in scan.tensors]
        buffers = iter(statics)
        static_args = tuple(_rebuild(v, buffers) for v in args)
        static_kwargs = {k: _rebuild(v, buffers) for k, v in kwargs.items()}
        try:
            with _eager_mask_choice(static_args, static_kwargs), _mask_once():
                captured = self._backend.capture(self.fn, static_args, static_kwargs, device)
        except Exception as err:
            raise _CaptureFailed(f"capture failed: {_first_line(err)}") from err
        objects = tuple(scan.objects)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._counts["captures"] += 1
        return _Entry(captured, statics, objects, frozenset(id(o) for o in objects),
                      tuple(self._mutates.pop(key) or ()), captured.nbytes + _nbytes(statics), summary, stream)

    def _replay(self, entry: _Entry, scan: _Scan) -> Any:
        with self._guard(scan.device):
            return self._run(entry, scan, copy_in=True)

    def _run(self, entry: _Entry, scan: _Scan, copy_in: bool, force_copy: bool = False) -> Any:
        if entry.stream is not None and torch.cuda.current_stream(entry.stream.device) != entry.stream:
            for t in entry.statics:  # the allocator must not hand them out before this stream is done
                t.record_stream(torch.cuda.current_stream(entry.stream.device))
        if copy_in and entry.statics:
            torch._foreach_copy_(entry.statics, scan.tensors)
        entry.captured.replay()
        for i in entry.mutated:
            scan.tensors[i].copy_(entry.statics[i])
        self._counts["replays"] += 1
        if self.copy_outputs or force_copy:
            return copy_outputs(entry.captured.outputs, entry.keep)
        return entry.captured.outputs

    @contextlib.contextmanager
    def _guard(self, device: torch.device | None):
        """Serialise graph work: per forward, and per pool for CUDA (graphs share intermediate memory)."""
        if isinstance(self._backend, _CudaBackend) and device is not None and device.type == "cuda":
            pool = self._backend.pool_for(device)
            with self._lock, pool.lock:
                pool.enter()
                yield
        else:
            with self._lock:
                yield

    def _give_up(self, key: Hashable, summary: str, reason: str, warn: bool = True) -> None:
        """Run this signature eagerly from now on; warn once."""
        self._failed.set(key, reason)
        self.failures[summary] = reason
        self._counts["fallbacks"] += 1
        if warn and key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"forgepack graph mode: running eagerly for ({summary}): {reason}",
                          RuntimeWarning, stacklevel=4)

    # -- introspection and control ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters: captures, replays, eager_calls (warm-ups included), warmups, evictions, fallbacks
        (signatures given up), graphs and graph_bytes now held, and eager calls by reason."""
        counts = {name: self._counts[name] for name in
                  ("captures", "replays", "eager_calls", "warmups", "evictions", "fallbacks")}
        return {**counts, "graphs": len(self._cache), "graph_bytes": self._cache.total_bytes,
                "reasons": dict(self._reasons), "failures": dict(self.failures)}

    def reset(self) -> None:
        """Drop every graph, warm-up count and failure (e.g. after replacing weights or a cache)."""
        with self._lock:
            self._cache.clear()
            self._seen.clear()
            self._failed.clear()
            self._mutates.clear()
            self._warned.clear()
            self.failures.clear()
            self._module_needs_grad = None

    def __deepcopy__(self, memo: dict) -> GraphedForward:
        """A copied module gets a fresh wrapper around its own forward (graphs are not copied)."""
        new = GraphedForward(copy.deepcopy(self.fn, memo), **self.options)
        new._restore = (self._restore[0], copy.deepcopy(self._restore[1], memo))
        if self.module is not None and self.module in _ENABLED_INSTANCES and new.module is not None:
            _ENABLED_INSTANCES.add(new.module)
        return new

    def __repr__(self) -> str:
        return f"GraphedForward({getattr(self.fn, '__qualname__', self.fn)!r}, graphs={len(self._cache)})"


# ----------------------------------------------------------------------------------------------------
# enable / disable: patch a module's (or a class's) forward, restore it exactly


_CLASS_MARK = "_forgepack_graph_patch"
_INSTANCE_ATTR = "_forgepack_graphed"
_ENABLED_INSTANCES: weakref.WeakSet = weakref.WeakSet()
_ENABLED_CLASSES: set[type] = set()


@dataclass
class _ClassPatch:
    original: Any  # the class's own `forward` before patching, or _MISSING when it was inherited
    options: dict
    instances: weakref.WeakSet


_MISSING = object()


def enable(target: Any, **options: Any) -> GraphedForward | None:
    """Graph mode for one module (its `forward` becomes a `GraphedForward`, returned) or for a class
    (every instance gets its own `GraphedForward` on first call; returns None). Enabling twice keeps
    the first. `FORGEPACK_DISABLE=1` makes this a no-op. Options: those of `GraphedForward`."""
    if os.environ.get(_DISABLE_ENV) == "1":
        return None
    if isinstance(target, type):
        _enable_class(target, options)
        return None
    current = vars(target).get("forward")
    if isinstance(current, GraphedForward):
        return current
    graphed = GraphedForward(eager_forward(target), **options)
    graphed._restore = ("forward" in vars(target), current)
    vars(target)["forward"] = graphed
    _ENABLED_INSTANCES.add(target)
    return graphed


def _enable_class(cls: type, options: dict) -> None:
    own = cls.__dict__.get("forward", _MISSING)
    if isinstance(getattr(own, _CLASS_MARK, None), _ClassPatch):
        return
    base = cls.forward
    patch = _ClassPatch(own, dict(options), weakref.WeakSet())

    @functools.wraps(base)
    def forward(self, *args, **kwargs):
        graphed = self.__dict__.get(_INSTANCE_ATTR)
        if graphed is None:
            graphed = GraphedForward(types.MethodType(base, self), **patch.options)
            self.__dict__[_INSTANCE_ATTR] = graphed
            patch.instances.add(self)
        return graphed(*args, **kwargs)

    setattr(forward, _CLASS_MARK, patch)
    cls.forward = forward
    _ENABLED_CLASSES.add(cls)


def disable(target: Any) -> bool:
    """Undo `enable` exactly (the original `forward` object is back); graphs are dropped. Returns
    whether graph mode was enabled on `target`."""
    if isinstance(target, type):
        own = target.__dict__.get("forward")
        patch = getattr(own, _CLASS_MARK, None)
        if not isinstance(patch, _ClassPatch):
            return False
        for instance in list(patch.instances):
            graphed = instance.__dict__.pop(_INSTANCE_ATTR, None)
            if graphed is not None:
                graphed.reset()
        if patch.original is _MISSING:
            delattr(target, "forward")
        else:
            target.forward = patch.original
        _ENABLED_CLASSES.discard(target)
        return True
    current = vars(target).get("forward")
    if not isinstance(current, GraphedForward):
        return False
    current.reset()
    had, previous = getattr(current, "_restore", (False, None))
    if had:
        vars(target)["forward"] = previous
    else:
        del vars(target)["forward"]
    _ENABLED_INSTANCES.discard(target)
    return True


def disable_all() -> int:
    """Disable graph mode everywhere it was enabled (the pack's `deactivate()` calls this first)."""
    targets = [*list(_ENABLED_INSTANCES), *list(_ENABLED_CLASSES)]
    return sum(disable(t) for t in targets)


def graphed(module: Any) -> GraphedForward | None:
    """The `GraphedForward` serving `module` (instance- or class-level), if any."""
    current = vars(module).get("forward") if hasattr(module, "__dict__") else None
    if isinstance(current, GraphedForward):
        return current
    return getattr(module, "__dict__", {}).get(_INSTANCE_ATTR)


def eager_forward(module: Any) -> Callable:
    """The forward without graph mode: the wrapped original when enabled, else `module.forward` (or
    `module` itself for a plain callable)."""
    if isinstance(module, GraphedForward):
        return module.fn
    current = graphed(module)
    if current is not None:
        return current.fn
    forward = getattr(module, "forward", None)
    patch = getattr(forward, _CLASS_MARK, None)
    if isinstance(patch, _ClassPatch):
        return types.MethodType(forward.__wrapped__, module)
    return forward if forward is not None else module


# ----------------------------------------------------------------------------------------------------
# Verification: graph replay against eager, on fresh inputs


def _as_call(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict):
        return tuple(inputs[0]), dict(inputs[1])
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


class _StateSnapshot:
    """Every tensor a call can write (its arguments, tensors held by argument objects, the module's
    buffers) and the attributes of argument objects, saved so that a call can be undone in place."""

    def __init__(self, args: tuple, kwargs: dict, module: torch.nn.Module | None):
        found: dict[int, torch.Tensor] = {}
        self.objects: dict[int, tuple[Any, dict]] = {}
        self._collect((args, kwargs), found, 0)
        if module is not None:
            for b in module.buffers():
                found.setdefault(id(b), b)
        self.tensors = list(found.values())
        self.saved = [t.detach().clone() for t in self.tensors]

    def _collect(self, x: Any, found: dict, depth: int) -> None:
        if depth > _MAX_DEPTH or isinstance(x, torch.nn.Module):
            return
        if isinstance(x, torch.Tensor):
            found.setdefault(id(x), x)
        elif isinstance(x, (list, tuple)):
            for v in x:
                self._collect(v, found, depth + 1)
        elif isinstance(x, dict):
            for v in x.values():
                self._collect(v, found, depth + 1)
        elif getattr(x, "__dict__", None) is not None and not isinstance(x, (type, *_HASHABLE)):
            if id(x) in self.objects:
                return
            self.objects[id(x)] = (x, dict(vars(x)))
            for v in vars(x).values():
                self._collect(v, found, depth + 1)

    def rebound(self) -> str:
        """Which argument object replaced a tensor it holds ('' if none did)."""
        for obj, attrs in self.objects.values():
            for name, value in attrs.items():
                if isinstance(value, torch.Tensor) and vars(obj).get(name) is not value:
                    return f"{type(obj).__name__}.{name}"
        return ""

    def current(self) -> list[torch.Tensor]:
        return [t.detach().clone() for t in self.tensors]

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in zip(self.tensors, self.saved, strict=True):
                t.copy_(saved)
        for obj, attrs in self.objects.values():
            state = vars(obj)
            state.clear()
            state.update(attrs)


def _tolerance(dtype: torch.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    default = DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))  # integer and bool outputs: exact
    return (default[0] if rtol is None else rtol, default[1] if atol is None else atol)


def tensor_mismatch(expected: torch.Tensor, got: torch.Tensor, rtol: float | None = None,
                    atol: float | None = None, scale_rtol: float | None = None) -> str:
    """'' when `got` matches `expected` (allclose, NaN and Inf in the same places), else why not.
    With `scale_rtol`, floating tensors are compared as the gate compares a model's outputs: the largest
    difference over the largest magnitude of `expected` (Inf in the same places, the same values)."""
    if expected.shape != got.shape or expected.dtype != got.dtype:
        return f"{got.dtype}{list(got.shape)} instead of {expected.dtype}{list(expected.shape)}"
    if expected.numel() == 0:
        return ""
    r, a = _tolerance(expected.dtype, rtol, atol)
    if not expected.is_floating_point() and not expected.is_complex():
        bad = int((expected != got).sum())
        return f"{bad} of {expected.numel()} elements differ" if bad else ""
    e, g = expected.detach().float(), got.detach().float().to(expected.device)
    if not torch.equal(torch.isnan(e), torch.isnan(g)):
        return "NaN in different places"
    if scale_rtol is not None:
        return _scale_mismatch(e, g, scale_rtol)
    close = torch.isclose(e, g, rtol=r, atol=a, equal_nan=True)
    if bool(close.all()):
        return ""
    finite = torch.isfinite(e) & torch.isfinite(g)
    worst = float((e - g).abs()[finite].max()) if bool(finite.any()) else float("inf")
    bad = int((~close).sum())
    return f"{bad} of {e.numel()} elements differ (max abs diff {worst:.3g}, rtol={r}, atol={a})"


def scale_error(expected: torch.Tensor, got: torch.Tensor) -> float:
    """The largest difference over the largest magnitude of `expected`, where both are finite (0.0
    when nowhere is): how the pack gate measures a model's outputs against stock."""
    finite = torch.isfinite(expected) & torch.isfinite(got)
    if not bool(finite.any()):
        return 0.0
    scale = float(expected[finite].abs().max())
    return float((expected - got)[finite].abs().max()) / max(scale, 1e-30)


def _scale_mismatch(e: torch.Tensor, g: torch.Tensor, scale_rtol: float) -> str:
    inf = torch.isinf(e)
    if not torch.equal(inf, torch.isinf(g)) or not torch.equal(e[inf], g[inf]):
        return "Inf in different places"
    err = scale_error(e, g)
    return f"differs by {err:.2e} of its scale (tolerance {scale_rtol:g})" if err > scale_rtol else ""


def outputs_mismatch(expected: Any, got: Any, keep=frozenset(), rtol: float | None = None,
                     atol: float | None = None, scale_rtol: float | None = None) -> str:
    """'' when two nested outputs have the same structure and matching leaves, else the first difference."""
    a, b = _leaves(expected, "out", keep, [], set()), _leaves(got, "out", keep, [], set())
    if [p for p, _ in a] != [p for p, _ in b]:
        return f"output structure differs: {[p for p, _ in a][:6]} vs {[p for p, _ in b][:6]}"
    for (path, x), (_, y) in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return f"{path}: tensor on one side only"
            why = tensor_mismatch(x, y, rtol, atol, scale_rtol)
            if why:
                return f"{path}: {why}"
        elif x != y and not (isinstance(x, float) and x != x and y != y):
            return f"{path}: {y!r} instead of {x!r}"
    return ""


def verify_replay(
    module: Any,
    make_inputs: Callable[[int], Any],
    n: int = 3,
    rtol: float | None = None,
    atol: float | None = None,
    *,
    warmup: int = DEFAULT_WARMUP,
    restore_state: bool = True,
    backend: str = "cuda",
    scale_rtol: float | None = None,
) -> tuple[bool, str]:
    """Replay against eager on fresh inputs: (ok, reason).

    `make_inputs(step)` gives step `step`'s arguments: a kwargs dict, an (args, kwargs) pair, or an args
    tuple; every step must have the same signature (same shapes; the same argument objects, e.g. one
    static cache). Steps 0..warmup-1 warm up, step `warmup` captures, and `n` more steps replay. In each
    step the eager forward runs first, then the call is undone in place (argument tensors, tensors of
    argument objects, the module's buffers, argument objects' attributes) and the graphed forward runs
    on the same state; outputs and resulting state must match (`rtol`/`atol`, defaults per dtype in
    `DEFAULT_TOLERANCES`; with `scale_rtol`, floating tensors within that fraction of their largest
    magnitude: the pack gate's model tolerance). With `restore_state` (default) every step starts from the state
    `make_inputs` left (decode: the same position every step); without it the graphed call's state
    carries into the next step (decode: positions advance; the cache needs room). Graphs are built in
    a private pool and freed; the module and its state are left as found.
    """
    fn = eager_forward(module)
    owner = module if isinstance(module, torch.nn.Module) else getattr(fn, "__self__", None)
    owner = owner if isinstance(owner, torch.nn.Module) else None
    pool = "private" if backend == "cuda" else None
    trial = GraphedForward(fn, max_graphs=1, warmup=warmup, pool=pool, backend=backend)
    first: _StateSnapshot | None = None
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="forgepack graph mode")  # the reason says it
            for step in range(warmup + 1 + n):
                args, kwargs = _as_call(make_inputs(step))
                snap = _StateSnapshot(args, kwargs, owner)
                first = first or snap
                why = _verify_step(fn, trial, args, kwargs, snap, step, restore_state,
                                   {"rtol": rtol, "atol": atol, "scale_rtol": scale_rtol})
                if why:
                    return False, why
        return True, f"replay matched eager on {n} fresh inputs after capture (warm-up {warmup})"
    except Exception as err:
        return False, f"error during verification: {_first_line(err)}"
    finally:
        if first is not None:
            first.restore()
        trial.reset()
        if backend == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()  # the private pool's memory goes back


def _verify_step(fn, trial, args, kwargs, snap, step, restore_state, tol: dict) -> str:
    """One step of `verify_replay`: '' when graphed and eager agree, else why not."""
    keep = frozenset(snap.objects)
    expected = copy_outputs(fn(*args, **kwargs), keep)
    rebound = snap.rebound()
    if rebound:
        return f"the forward replaces tensors its arguments hold ({rebound}): not replayable"
    expected_state = snap.current()
    snap.restore()
    replays = trial.stats()["replays"]
    got = trial(*args, **kwargs)
    got_state = snap.current()
    if restore_state:
        snap.restore()
    phase = "warm-up" if step < trial.warmup else ("capture" if step == trial.warmup else "replay")
    if step >= trial.warmup and trial.stats()["replays"] == replays:
        return f"not graphed at step {step}: {_why_not_graphed(trial.stats())}"
    diff = outputs_mismatch(expected, got, keep, **tol)
    if diff:
        hint = " (two eager calls disagree: Python-side state?)" if phase == "warm-up" else ""
        return f"{phase} step {step}: {diff}{hint}"
    for i, (e, g) in enumerate(zip(expected_state, got_state, strict=True)):
        why = tensor_mismatch(e, g, **tol)
        if why:
            return f"{phase} step {step}: state tensor {i} {list(e.shape)} after the call: {why}"
    return ""


def _why_not_graphed(stats: dict) -> str:
    failures = list(stats["failures"].values())
    if failures:
        return failures[-1]
    reasons = [r for r in stats["reasons"] if r != "warm-up"]
    return reasons[-1] if reasons else "the signature changed between steps (a new argument object each step?)"


def capture_safe_check(fn: Any, args: tuple = (), kwargs: dict | None = None, n: int = 2,
                       rtol: float | None = None, atol: float | None = None,
                       backend: str = "cuda") -> tuple[bool, str]:
    """Build-time check: trial capture and replays of `fn(*args, **kwargs)` compared with eager on the
    same inputs. (False, reason) for host syncs, data-dependent control flow, illegal allocations, CPU
    tensors or any replay mismatch; the pack builder records the reason in the manifest."""
    kwargs = kwargs or {}
    return verify_replay(fn, lambda step: (args, kwargs), n=n, rtol=rtol, atol=atol, backend=backend)


# ----------------------------------------------------------------------------------------------------
# Decode with a static KV cache


def cache_kwarg(model: Any) -> str:
    """The forward's cache argument: `cache` (transformers >= 5.2x) or `past_key_values` (earlier)."""
    params = inspect.signature(eager_forward(model)).parameters
    return "cache" if "cache" in params else "past_key_values"


def decode_kwargs(model: Any, input_ids: torch.Tensor, cache: Any, position: int | None = None) -> dict[str, Any]:
    """Arguments of one graph-replayable decode step: `input_ids` [batch, 1] on the device, the
    `StaticCache` object (the same one every step), `use_cache=True`. transformers 5 keeps the cache
    length on the device and advances it inside the forward, so nothing else changes between steps;
    a forward that still takes `cache_position` (transformers 4) gets it as a device tensor (copied
    into its static buffer each step, so the replay writes the right slot)."""
    kwargs = {"input_ids": input_ids, cache_kwarg(model): cache, "use_cache": True}
    params = inspect.signature(eager_forward(model)).parameters
    takes = "cache_position" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    # transformers 5.17 reads the cache length back to the host when `cache_position` is missing (a sync
    # that fails capture; seen on the H200); 5.2x ignores it. Always give it where it can be passed.
    if takes and position is not None:
        steps = input_ids.shape[-1]
        kwargs["cache_position"] = torch.arange(position, position + steps, device=input_ids.device)
    return kwargs
