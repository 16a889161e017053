"""Bootstrap intervals (`forgepack.intervals`): one resampler for kernel timing and the gate."""

from __future__ import annotations

import random
import statistics

from forgepack import intervals
from forgepack.pack.gate import Timing


def _rounds(seed: int, n: int = 7) -> dict[str, list[float]]:
    rng = random.Random(seed)
    stock = [10.0 + rng.random() for _ in range(n)]
    return {"stock": stock, "pack": [s / (1.2 + 0.05 * rng.random()) for s in stock]}


def test_the_gate_s_paired_ratio_interval_is_the_shared_median_interval():
    timing = Timing(_rounds(1))
    ratio, low, high = timing.ratio("stock", "pack")
    ratios = [x / y for x, y in zip(timing.rounds["stock"], timing.rounds["pack"], strict=True)]
    assert ratio == statistics.median(ratios)
    assert (low, high) == intervals.bootstrap_median_ci(ratios, seed=0)
    # the numbers the gate computed inline before it shared the resampler
    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(1000))
    assert (low, high) == (boots[25], boots[974])
    assert min(ratios) <= low <= ratio <= high <= max(ratios)


def test_the_unpaired_ratio_interval_brackets_the_ratio_of_medians():
    rounds = _rounds(2, n=40)
    low, high = intervals.bootstrap_ratio_ci(rounds["stock"], rounds["pack"])
    point = statistics.median(rounds["stock"]) / statistics.median(rounds["pack"])
    assert low < point < high
    assert intervals.bootstrap_ratio_ci(rounds["stock"], rounds["pack"]) == (low, high)  # seeded
    assert intervals.bootstrap_ratio_ci(rounds["stock"], rounds["pack"], seed=1) != (low, high)
