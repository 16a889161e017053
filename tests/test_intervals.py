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


def test_the_gate_s_ratio_is_the_medians_with_the_shared_paired_interval():
    timing = Timing(_rounds(1))
    ratio, low, high = timing.ratio("stock", "pack")
    stock, pack = timing.rounds["stock"], timing.rounds["pack"]
    assert ratio == statistics.median(stock) / statistics.median(pack)  # the ratio the times print
    assert (low, high) == intervals.bootstrap_ratio_ci(stock, pack, paired=True)
    # the numbers the gate computed before it shared the resampler: rounds resampled whole
    rng = random.Random(0)
    boots = []
    for _ in range(1000):
        rows = rng.choices(range(len(stock)), k=len(stock))
        boots.append(statistics.median(stock[i] for i in rows) / statistics.median(pack[i] for i in rows))
    boots.sort()
    assert (low, high) == (boots[25], boots[974])
    assert low <= ratio <= high
    assert intervals.bootstrap_ratio_ci(stock, pack) != (low, high)  # unpaired resampling differs


def test_the_unpaired_ratio_interval_brackets_the_ratio_of_medians():
    rounds = _rounds(2, n=40)
    low, high = intervals.bootstrap_ratio_ci(rounds["stock"], rounds["pack"])
    point = statistics.median(rounds["stock"]) / statistics.median(rounds["pack"])
    assert low < point < high
    assert intervals.bootstrap_ratio_ci(rounds["stock"], rounds["pack"]) == (low, high)  # seeded
    assert intervals.bootstrap_ratio_ci(rounds["stock"], rounds["pack"], seed=1) != (low, high)
