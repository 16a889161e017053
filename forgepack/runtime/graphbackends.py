"""Graph mode's backends: real CUDA graphs in shared memory pools (with the recovery a failed capture
needs), and an emulation that runs the same machinery on any device.

Part of the pack runtime: torch and the standard library only.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .graphkeys import output_tensors, tensor_bytes
from .opclasses import NO_KERNEL_OPS, host_sync


class CaptureError(RuntimeError):
    """The forward cannot be captured (raised inside the emulated backend; CUDA raises its own)."""


@dataclass
class Captured:
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


class CudaBackend:
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

    def capture(self, fn: Callable, args: tuple, kwargs: dict, device: torch.device) -> Captured:
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
        return Captured(graph.replay, outputs, max(grown, 0), graph)


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
        why = host_sync(func, args, kwargs)
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
        results = _schema_tensors(out) if not isinstance(out, torch.Tensor) else [out]
        inputs = {t.untyped_storage().data_ptr() for v in (*args, *kwargs.values()) for t in _schema_tensors(v)}
        if returns and all(r.alias_info is not None for r in returns):
            if any(r.alias_info.is_write for r in returns):  # in place / out=: replaying repeats the write
                self.calls.append((func, args, kwargs, []))
                return out
            # Views need no replay: they alias memory the replay updates. An op that only may alias (`to`,
            # `reshape`: seen undecomposed under inference_mode) and made a new tensor is a computation.
            if all(t.untyped_storage().data_ptr() in inputs for t in results):
                return out
        for t in results:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in inputs:  # _unsafe_view and friends share an input's storage without saying so
                self._fresh.add(ptr)
        if schema.name not in NO_KERNEL_OPS:
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


class EmulatedBackend:
    """Capture as a recorded trace of aten calls, replayed on the same tensors. Used by the CPU tests and
    for dry runs without a GPU; on any device it exercises the same keying, buffers, copies, eviction
    and fallbacks as CUDA graphs. Inside it `torch.cuda.is_current_stream_capturing()` reports True, as
    under a real capture, so libraries take their capture-safe paths (transformers avoids host syncs)."""

    needs_cuda = False

    def capture(self, fn: Callable, args: tuple, kwargs: dict, device: torch.device) -> Captured:
        recorder = _Recorder()
        real = torch.cuda.is_current_stream_capturing
        torch.cuda.is_current_stream_capturing = lambda: True
        try:
            with recorder.mode:
                outputs = fn(*args, **kwargs)
        finally:
            torch.cuda.is_current_stream_capturing = real
            recorder.undo_writes()
        nbytes = tensor_bytes(output_tensors(outputs))
        return Captured(recorder.replay, outputs, nbytes, recorder)


def make_backend(backend: str, pool: GraphPool | str | None) -> Any:
    if pool is not None and pool != "private" and not isinstance(pool, GraphPool):
        raise ValueError(f"pool must be None, 'private' or a GraphPool, got {pool!r}")
    if backend == "cuda":
        return CudaBackend(pool)
    if backend == "emulate":
        return EmulatedBackend()
    raise ValueError(f"backend must be 'cuda' or 'emulate', got {backend!r}")

