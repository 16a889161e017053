"""How much of a served decode step a pack's kernels replace, weighted by the stock time of each call.

The decode loop keeps, per bucket, the step it recorded with the pack's blocks in place
(`DecodeLoop.step_programs`): its remaining calls, and for each block `Kernel` the calls it replaced with
its hits and misses. Every call of the stock step (the remaining ones and the replaced ones) is timed on
its own, replayed on the values the recording traced (what it writes restored after), and the share is
the time of the calls a kernel took over (a block that served every step it was asked: hits and no
misses), plus calls an op-level kernel of the pack serves (its hit count moves when the call runs), over
the time of all calls. That is stock time replaced, not the time the kernels take: the question is how
much of the step is left to stock, not how fast the kernels are.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from forgepack.runtime.stepprogram import Call, Kernel, Program


def _module_of(program: Program):
    """The step-program module that recorded `program`: a pack serves with its own copy of the runtime,
    whose `Kernel` and `Val` are its own classes."""
    return sys.modules[type(program).__module__]


@dataclass(frozen=True)
class OpShare:
    name: str
    calls: int
    us: float  # the stock time of its calls in one step
    covered_us: float


@dataclass(frozen=True)
class StepCoverage:
    bucket: str
    stock_us: float
    covered_us: float
    launches_stock: int
    launches_pack: int
    blocks: tuple[str, ...]  # the kernels placed, by the chain they replace
    ops: tuple[OpShare, ...]  # by stock time, largest first

    @property
    def share(self) -> float:
        return self.covered_us / self.stock_us if self.stock_us else 0.0

    def uncovered(self, n: int = 5) -> list[OpShare]:
        """The ops with the most stock time left, largest first."""
        return sorted((o for o in self.ops if o.us > o.covered_us), key=lambda o: o.covered_us - o.us)[:n]


def stock_calls(program: Program) -> list[tuple[Call, Kernel | None]]:
    """The stock step in order: each call, with the kernel that replaced it (None: it runs as recorded)."""
    out: list[tuple[Call, Kernel | None]] = []
    kernel_type = _module_of(program).Kernel
    for step in program.steps:
        if isinstance(step, kernel_type):
            out += [(c, step) for c in step.fallback]
        else:
            out.append((step, None))
    return out


def time_call(call: Call, env: list, run, reps: int = 20, rounds: int = 5) -> float:
    """Microseconds one call takes, replayed `reps` times a round (the median round), on `env`'s values;
    the tensors it writes are put back after (`run`: its module's call runner)."""
    cuda = any(env[v] is not None and env[v].is_cuda for v in call.reads)
    per_round = []
    with _restored(call, env):
        for _ in range(rounds):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(reps):
                run(call, env)
            if cuda:
                torch.cuda.synchronize()
            per_round.append((time.perf_counter() - start) / reps * 1e6)
    return statistics.median(per_round)


@contextlib.contextmanager
def _restored(call: Call, env: list):
    kept = [(v, env[v].clone()) for v in call.writes if env[v] is not None]
    try:
        yield
    finally:
        for v, t in kept:
            env[v].copy_(t)


def op_hits(pack: Any) -> int:
    """The hits of a pack's op-level kernels so far (its decode blocks' are counted per step, not here)."""
    return sum(s["hits"] for s in pack.stats().values() if not s["op"].startswith("fusion."))


@torch.no_grad()  # as the decode loop runs it: no autograd bookkeeping in the stock times
def measure(bucket: str, program: Program, pack: Any = None) -> StepCoverage:
    """The coverage of one recorded step (`DecodeLoop.step_programs`). With `pack`, every call is timed
    with its op-level kernels off (stock time), and a call not inside a block counts as served when its
    run moves their hits."""
    calls = stock_calls(program)
    run = _module_of(program)._run_node
    env: list = list(program.values)
    by_op: dict[str, list[float]] = {}
    stock = covered = 0.0
    for call, kernel in calls:
        if pack is not None:
            pack.enable_only(set())
        us = time_call(call, env, run)
        served = kernel is not None and kernel.hits > 0 and kernel.misses == 0
        if pack is not None:
            pack.enable_only(None)
            if not served and call.launches:
                before = op_hits(pack)
                with _restored(call, env):
                    run(call, env)
                served = op_hits(pack) > before
        stock += us
        covered += us if served else 0.0
        row = by_op.setdefault(call.name, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += us
        row[2] += us if served else 0.0
    ops = tuple(sorted((OpShare(n, int(c), u, cv) for n, (c, u, cv) in by_op.items()), key=lambda o: -o.us))
    kernel_type = _module_of(program).Kernel
    blocks = tuple(s.name for s in program.steps if isinstance(s, kernel_type))
    return StepCoverage(bucket, stock, covered, sum(1 for c, _ in calls if c.launches), program.launches(), blocks,
                        ops)
