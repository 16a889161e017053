"""Percentile bootstrap intervals: the one place forgepack resamples measurements.

`bootstrap_ratio_ci(a, b)`: the interval of median(a)/median(b) for two unpaired samples (a kernel
against stock, `forgepack.timing.compare`). With `paired=True`, a[i] and b[i] are resampled
together (the gate's interleaved rounds, `forgepack.pack.gate.Timing.ratio`). `statistic` replaces
the median (`statistics.fmean`: the ratio of mean per-candidate times, `tools/bench_executor.py`).
Seeded: the same measurements give the same interval. Standard library only (the gate imports it
without torch).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterable


def bootstrap_ratio_ci(a: list[float], b: list[float], n: int = 1000, alpha: float = 0.05, seed: int = 0,
                       paired: bool = False,
                       statistic: Callable[[Iterable[float]], float] = statistics.median) -> tuple[float, float]:
    """Percentile bootstrap interval of median(a)/median(b), a and b resampled independently. `paired`:
    a[i] and b[i] were measured together (one round of the gate's interleaved model timings), so they
    are resampled together and a slow round slows both sides."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        if paired:
            rows = rng.choices(range(len(a)), k=len(a))
            ra, rb = statistic([a[i] for i in rows]), statistic([b[i] for i in rows])
        else:
            ra = statistic(rng.choices(a, k=len(a)))
            rb = statistic(rng.choices(b, k=len(b)))
        ratios.append(ra / rb)
    return _percentiles(ratios, alpha)


def _percentiles(stats: list[float], alpha: float) -> tuple[float, float]:
    ordered = sorted(stats)
    n = len(ordered)
    return ordered[int(n * alpha / 2)], ordered[int(n * (1 - alpha / 2)) - 1]
