"""Timing that can be trusted: device events, warm-up, L2 flushed, medians, interleaved A/B.

On CUDA each repetition writes a buffer larger than L2 first, so every call starts cold and the flush
kernel keeps the GPU busy while the timed call is queued: the events then time GPU work, not the
host's launch latency. On CPU a buffer larger than the last-level cache is written instead and
`perf_counter_ns` times the call (CPU kernels are synchronous).
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
def _one_thread_on_cpu(device: torch.device):
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
    with _one_thread_on_cpu(device):
        return _timed(fn, device, Flusher(device), reps, warmup)


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
) -> Comparison:
    """Time A and B in alternating order (random order within each pair), L2 flushed before each."""
    device = torch.device(device)
    flusher = Flusher(device)
    rng = random.Random(seed)
    a, b = [], []
    with _one_thread_on_cpu(device):
        for _ in range(warmup):
            fn_a()
            fn_b()
        _sync(device)
        for _ in range(reps):
            pair = [(a, fn_a), (b, fn_b)]
            rng.shuffle(pair)
            for out, fn in pair:
                out.append(time_once(fn, device, flusher))
    low, high = bootstrap_ratio_ci(a, b, seed=seed)
    med_a, med_b = statistics.median(a), statistics.median(b)
    return Comparison(med_a, med_b, med_a / med_b, low, high, reps)


def bootstrap_ratio_ci(
    a: list[float], b: list[float], n: int = 1000, alpha: float = 0.05, seed: int = 0, paired: bool = False
) -> tuple[float, float]:
    """Percentile bootstrap interval of median(a)/median(b). `paired`: a[i] and b[i] were measured
    together (one round of interleaved model timings), so they are resampled together and a slow round
    slows both sides."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        if paired:
            rows = rng.choices(range(len(a)), k=len(a))
            ra, rb = statistics.median(a[i] for i in rows), statistics.median(b[i] for i in rows)
        else:
            ra = statistics.median(rng.choices(a, k=len(a)))
            rb = statistics.median(rng.choices(b, k=len(b)))
        ratios.append(ra / rb)
    ratios.sort()
    return ratios[int(n * alpha / 2)], ratios[int(n * (1 - alpha / 2)) - 1]


def median(values: list[float]) -> float:
    return statistics.median(values)
