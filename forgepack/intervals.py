"""Percentile bootstrap intervals: the one place forgepack resamples measurements.

`bootstrap_ratio_ci(a, b)`: the interval of median(a)/median(b) for two unpaired samples (a kernel
against stock, `forgepack.timing.compare`). `bootstrap_median_ci(values)`: the interval of the median
of paired values (the gate's per-round ratios, `forgepack.pack.gate.Timing.ratio`). Seeded: the same
measurements give the same interval. Standard library only (the gate imports it without torch).
"""

from __future__ import annotations

import random
import statistics


def bootstrap_median_ci(values: list[float], n: int = 1000, alpha: float = 0.05, seed: int = 0
                        ) -> tuple[float, float]:
    """Percentile bootstrap interval of median(values)."""
    rng = random.Random(seed)
    medians = [statistics.median(rng.choices(values, k=len(values))) for _ in range(n)]
    return _percentiles(medians, alpha)


def bootstrap_ratio_ci(a: list[float], b: list[float], n: int = 1000, alpha: float = 0.05, seed: int = 0
                       ) -> tuple[float, float]:
    """Percentile bootstrap interval of median(a)/median(b), a and b resampled independently."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        ra = statistics.median(rng.choices(a, k=len(a)))
        rb = statistics.median(rng.choices(b, k=len(b)))
        ratios.append(ra / rb)
    return _percentiles(ratios, alpha)


def _percentiles(stats: list[float], alpha: float) -> tuple[float, float]:
    ordered = sorted(stats)
    n = len(ordered)
    return ordered[int(n * alpha / 2)], ordered[int(n * (1 - alpha / 2)) - 1]
