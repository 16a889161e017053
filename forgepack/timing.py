"""Timing that can be trusted: device events, warm-up, L2 flushed, medians, interleaved A/B.

On CUDA each repetition writes a buffer larger than L2 first, so every call starts cold and the flush
kernel keeps the GPU busy while the timed call is queued: the events then time GPU work, not the
host's launch latency. On CPU `perf_counter_ns` times the call (CPU kernels are synchronous) and
nothing is flushed: in the model an op runs warm, its dispatcher code and data in cache, and a
32 MB flush before each call made stock chains look many times dearer than in the model (`add.Tensor`
61 us isolated vs 3.8 us in the model), so a candidate that won isolated lost in the model.
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from forgepack.intervals import bootstrap_ratio_ci

CUDA_FLUSH_BYTES = 256 << 20  # well over the H200's 60 MB L2
CPU_FLUSH_BYTES = 32 << 20


class Flusher:
    """Evicts the caches between timed calls.

    On CPU a single-threaded `memset` is used: a torch fill would wake the intra-op thread pool, whose
    spinning threads then distort the next (timed) call.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        size = CUDA_FLUSH_BYTES if self.device.type == "cuda" else CPU_FLUSH_BYTES
        self.buf = torch.empty(size, dtype=torch.uint8, device=self.device)

    def __call__(self) -> None:
        if self.device.type == "cuda":
            self.buf.fill_(1)
        else:
            ctypes.memset(self.buf.data_ptr(), 1, self.buf.numel())


@contextlib.contextmanager
def one_thread_on_cpu(device: torch.device):
    """Isolated CPU timings run on one intra-op thread.

    Between cache flushes a multi-threaded pool goes to sleep, and waking it (or waiting for a thread
    another process has descheduled) can cost milliseconds, more than a small op itself; candidate CPU
    kernels are single-threaded too, so both sides of a comparison run alike.
    """
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def flusher_for(device: torch.device) -> Flusher | None:
    """The flush that makes isolated timings match the model's cache state: cold L2 on CUDA, warm on CPU."""
    return Flusher(device) if device.type == "cuda" else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device, flush: Flusher | None) -> float:
    """One timed call in microseconds."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if flush:
            flush()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3
    if flush:
        flush()
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e3


def time_us(
    fn: Callable[[], object],
    device: torch.device | str,
    reps: int = 30,
    warmup: int = 3,
    flush: bool = True,
) -> list[float]:
    """`reps` timings of `fn` in microseconds, after `warmup` untimed calls."""
    device = torch.device(device)
    if not flush:  # end-to-end timings: the model as it runs, thread pool and all
        return _timed(fn, device, None, reps, warmup)
    with one_thread_on_cpu(device):
        return _timed(fn, device, flusher_for(device), reps, warmup)


def _timed(fn, device: torch.device, flusher: Flusher | None, reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    return [time_once(fn, device, flusher) for _ in range(reps)]


@dataclass(frozen=True)
class Comparison:
    """A against B, measured interleaved. `speedup` = median(A) / median(B), B being the candidate."""

    a_us: float
    b_us: float
    speedup: float
    ci_low: float
    ci_high: float
    reps: int


def compare(
    fn_a: Callable[[], object],
    fn_b: Callable[[], object],
    device: torch.device | str,
    reps: int = 40,
    warmup: int = 3,
    seed: int = 0,
    before_b: Callable[[], object] | None = None,
    after_b: Callable[..., object] | None = None,
    before_a: Callable[[], object] | None = None,
    b_added_us: float = 0.0,
) -> Comparison:
    """Time A and B in alternating order (random order within each pair), L2 flushed before each on CUDA.

    `before_b` runs before every call of B (warm-up included) and `after_b` after it, both outside the
    timed region: the verifier refills B's output buffers and checks every call's result there.
    `after_b` gets the call's time in microseconds (None for a warm-up call); `before_a` runs before each
    timed call of A (the verifier gives both sides the same surroundings). `b_added_us` is added to each
    of B's times before the medians and the interval: what B costs where it runs beyond the call timed
    here (a fused kernel's serving through its patch site, `forgepack.servecost`)."""
    device = torch.device(device)
    flusher = flusher_for(device)
    rng = random.Random(seed)
    a, b = [], []
    before, after = before_b or (lambda: None), after_b or (lambda _us=None: None)
    before_stock = before_a or (lambda: None)
    with one_thread_on_cpu(device):
        for _ in range(warmup):
            fn_a()
            before()
            fn_b()
            _sync(device)
            after(None)
        _sync(device)
        for _ in range(reps):
            pair = [(a, fn_a), (b, fn_b)]
            rng.shuffle(pair)
            for out, fn in pair:
                (before if out is b else before_stock)()
                out.append(time_once(fn, device, flusher))
                if out is b:
                    after(out[-1])
    b = [t + b_added_us for t in b]
    low, high = bootstrap_ratio_ci(a, b, seed=seed)
    med_a, med_b = statistics.median(a), statistics.median(b)
    return Comparison(med_a, med_b, med_a / med_b, low, high, reps)


def median(values: list[float]) -> float:
    return statistics.median(values)
