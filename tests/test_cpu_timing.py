"""CPU isolated timings read what the model sees: warm calls, not a cache flushed before each."""

from __future__ import annotations

import statistics
import time

import torch

from forgepack import timing


def _warm_loop_us(fn, calls: int = 200) -> float:
    """A plain back-to-back loop's cost per call: the cache state of an op inside the model."""
    for _ in range(20):
        fn()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter_ns() - t0) / 1e3 / calls)
    return statistics.median(runs)


def test_cpu_timer_reads_a_cheap_op_as_a_warm_loop_does():
    x, y, out = torch.randn(65536), torch.randn(65536), torch.empty(65536)  # 768 KB: stays in a warm cache
    fn = lambda: torch.add(x, y, out=out)  # noqa: E731
    torch.set_num_threads(1)
    loop = _warm_loop_us(fn)
    timed = statistics.median(timing.time_us(fn, "cpu", reps=60, warmup=10))
    # a call after a 32 MB flush reads ~1.6x the loop's cost here (its operands come back from DRAM);
    # a warm timed call reads within a few percent of it, the timer's own overhead included
    assert timed < 1.3 * loop + 0.5, (timed, loop)
    cmp = timing.compare(fn, fn, "cpu", reps=60, warmup=10)
    assert cmp.a_us < 1.3 * loop + 0.5 and cmp.b_us < 1.3 * loop + 0.5, (cmp, loop)


def test_cuda_keeps_its_l2_flush_and_cpu_has_none():
    assert timing.flusher_for(torch.device("cpu")) is None
