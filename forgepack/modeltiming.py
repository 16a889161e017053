"""Whole-model timing in interleaved rounds: the one loop the gate and `forgepack bench` both time with.

Each round visits every configuration (stock, the pack, the pack without one kernel, torch.compile,
...) in an order shuffled per round, and records the median of `reps` forwards after one untimed
forward (the first call after switching pays for the switch). Interleaving makes a machine's drift
hit every configuration alike, so ratios paired by round survive a noisy host.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any


def interleaved_ms(
    forwards: Mapping[str, Callable[[], Any]],
    rounds: int,
    reps: int,
    sync: Callable[[], None] = lambda: None,
    seed: int = 0,
    switch: Callable[[str], AbstractContextManager[Any]] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Per configuration, one time per round in ms (the median of its `reps` timed forwards).

    `switch(name)` is entered around a configuration's turn (a pack switched on, then off); `sync`
    waits for the device before each clock read (a CUDA synchronize); `clock` is injectable so a test
    can make the times deterministic."""
    switch = switch or (lambda _name: nullcontext())
    rng = random.Random(seed)
    order = list(forwards)
    times: dict[str, list[float]] = {name: [] for name in order}
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            with switch(name):
                times[name].append(_one_round(forwards[name], reps, sync, clock))
    return times


def _one_round(forward: Callable[[], Any], reps: int, sync: Callable[[], None], clock: Callable[[], float]) -> float:
    forward()  # untimed: the first call after switching
    samples = []
    for _ in range(reps):
        sync()
        t0 = clock()
        forward()
        sync()
        samples.append((clock() - t0) * 1e3)
    return statistics.median(samples)


def device_sync(device: Any) -> Callable[[], None]:
    """What `sync` should be on `device`: a CUDA synchronize, or nothing on cpu."""
    if getattr(device, "type", str(device)) != "cuda":
        return lambda: None
    import torch

    return lambda: torch.cuda.synchronize(device)
