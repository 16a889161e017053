"""Graph mode: replay a module's forward from CUDA graphs, one graph per input signature.

Shipped inside every pack wheel: imports only torch, the standard library and its sibling files:
`graphkeys` (keys, output copies), `graphcache` (the LRU cache), `graphbackends` (CUDA graphs and
pools, failed-capture recovery, the emulated backend), `transformers_hooks` (every stand-in for
transformers internals, decode arguments). `replaycheck` (build-time verification) imports this file;
a served pack never imports it.

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
import functools
import os
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from . import transformers_hooks
from .graphbackends import Captured, CudaBackend, GraphPool, make_backend
from .graphcache import DEFAULT_MAX_GRAPHS, KINDS, GraphCache, Remembered  # noqa: F401 (KINDS: serving's stats)
from .graphkeys import Scan, copy_outputs, describe, first_line, rebuild, scan_arguments, tensor_bytes, tensor_version

DEFAULT_WARMUP = 2
_DISABLE_ENV = "FORGEPACK_DISABLE"


@dataclass
class _Entry:
    captured: Captured
    statics: list[torch.Tensor]  # static input buffers, in walk order
    objects: tuple  # by-reference arguments: held so their ids stay theirs
    keep: frozenset[int]
    mutated: tuple[int, ...]  # tensor arguments the forward writes: copied back after a replay
    nbytes: int
    summary: str
    stream: Any = None  # CUDA stream the static buffers were allocated on


class _CaptureFailed(Exception):
    pass


def _dispatch_mode_active() -> bool:
    try:
        return torch._C._len_torch_dispatch_stack() > 0
    except AttributeError:  # pragma: no cover - every supported torch has it
        return False



class GraphedForward:
    """A forward that replays CUDA graphs per input signature and runs eagerly otherwise.

    `target`: an `nn.Module` (its `forward` at construction is wrapped) or any callable.
    `max_graphs` / `max_bytes`: bounds of the graph cache (least recently used evicted first); a
        `serving.Server` counts its KV caches and decode loop in the same cache, under the same bound.
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
        self._backend = make_backend(backend, pool)
        self._cache = GraphCache(max_graphs, max_bytes)
        self._seen = Remembered()
        self._failed = Remembered()
        self._mutates = Remembered()
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
            reason, key, scan = f"internal error while keying: {first_line(err)}", None, None
        if reason:
            return self._eager(args, kwargs, reason)
        with self._lock:
            entry = self._cache.get(key)
            failed = self._failed.get(key) if entry is None else None
            count = 0
            if entry is None and failed is None:
                count = self._seen.get(key, 0) + 1
                self._seen.set(key, count)
        if entry is not None:
            return self._replay(entry, scan)
        if failed is not None:
            return self._eager(args, kwargs, failed)
        if count <= self.warmup:
            return self._warm(key, scan, args, kwargs)
        return self._capture(key, scan, args, kwargs)

    def _plan(self, args: tuple, kwargs: dict) -> tuple[str, Hashable, Scan | None]:
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

    def _warm(self, key: Hashable, scan: Scan, args: tuple, kwargs: dict) -> Any:
        versions = [tensor_version(t) for t in scan.tensors]
        before = {i: t.clone() for i, (t, v) in enumerate(zip(scan.tensors, versions, strict=True)) if v is None}
        self._counts["warmups"] += 1
        out = self._eager(args, kwargs, "warm-up")
        written = set(self._mutates.get(key, ()))
        for i, (t, v) in enumerate(zip(scan.tensors, versions, strict=True)):
            changed = not torch.equal(before[i], t) if v is None else tensor_version(t) != v
            if changed:
                written.add(i)
        if written:
            self._mutates.set(key, tuple(sorted(written)))
        return out

    def _capture(self, key: Hashable, scan: Scan, args: tuple, kwargs: dict) -> Any:
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
            beside = self._cache.pinned_bytes()
            where = f" beside {beside} bytes in use" if beside else ""
            self._give_up(key, summary, f"graph holds {entry.nbytes} bytes{where}, over max_bytes={limit}",
                          warn=False, later="over max_bytes")
            return out
        # the cache it was captured with (forgepack's, in the same ledger) must outlive it
        self._cache.put(key, entry, entry.nbytes, "graph", self._cache.keys_holding(entry.objects))
        return out

    def _capture_entry(self, key, scan, args, kwargs, device, summary) -> _Entry:
        statics = [torch.empty_like(t, memory_format=torch.preserve_format).copy_(t) for t in scan.tensors]
        buffers = iter(statics)
        static_args = tuple(rebuild(v, buffers) for v in args)
        static_kwargs = {k: rebuild(v, buffers) for k, v in kwargs.items()}
        try:
            with (transformers_hooks.eager_mask_choice(static_args, static_kwargs),
                  transformers_hooks.mask_once()):
                captured = self._backend.capture(self.fn, static_args, static_kwargs, device)
        except Exception as err:
            raise _CaptureFailed(f"capture failed: {first_line(err)}") from err
        objects = tuple(scan.objects)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._counts["captures"] += 1
        return _Entry(captured, statics, objects, frozenset(id(o) for o in objects),
                      tuple(self._mutates.pop(key) or ()), captured.nbytes + tensor_bytes(statics), summary, stream)

    def _replay(self, entry: _Entry, scan: Scan) -> Any:
        with self._guard(scan.device):
            return self._run(entry, scan, copy_in=True)

    def _run(self, entry: _Entry, scan: Scan, copy_in: bool, force_copy: bool = False) -> Any:
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
        if isinstance(self._backend, CudaBackend) and device is not None and device.type == "cuda":
            pool = self._backend.pool_for(device)
            with self._lock, pool.lock:
                pool.enter()
                yield
        else:
            with self._lock:
                yield

    def _give_up(self, key: Hashable, summary: str, reason: str, warn: bool = True,
                 later: str = "capture failed earlier") -> None:
        """Run this signature eagerly from now on; warn once. `later` is the reason its later calls are
        counted under (stats()["reasons"]): one short reason per cause, the detail in `failures`."""
        self._failed.set(key, later)
        self.failures[summary] = reason
        self._counts["fallbacks"] += 1
        if warn and key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"forgepack graph mode: running eagerly for ({summary}): {reason}",
                          RuntimeWarning, stacklevel=4)

    # -- introspection and control ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters: captures, replays, eager_calls (warm-ups included), warmups, evictions (of its graphs,
        also those that went with an evicted cache), fallbacks (signatures given up), graphs and
        graph_bytes now held, and eager calls by reason."""
        counts = {name: self._counts[name] for name in ("captures", "replays", "eager_calls", "warmups", "fallbacks")}
        counts["evictions"] = self._cache.evictions["graph"]
        return {**counts, "graphs": self._cache.count("graph"), "graph_bytes": self._cache.bytes_of("graph"),
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
# Decode with a static KV cache


def cache_kwarg(model: Any) -> str:
    """The forward's cache argument: `cache` (transformers >= 5.2x) or `past_key_values` (earlier)."""
    return transformers_hooks.cache_kwarg_of(eager_forward(model))


def decode_kwargs(model: Any, input_ids: torch.Tensor, cache: Any, position: int | None = None) -> dict[str, Any]:
    """Arguments of one graph-replayable decode step: `input_ids` [batch, 1] on the device, the
    `StaticCache` object (the same one every step), `use_cache=True`. transformers 5 keeps the cache
    length on the device and advances it inside the forward, so nothing else changes between steps;
    a forward that still takes `cache_position` (transformers 4) gets it as a device tensor (copied
    into its static buffer each step, so the replay writes the right slot)."""
    return transformers_hooks.decode_kwargs_of(eager_forward(model), input_ids, cache, position)
